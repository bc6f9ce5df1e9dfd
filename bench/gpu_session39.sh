#!/usr/bin/env bash
# Session 32's GPU calls (bench/NOTES.md session 31, "Next"), beside bench/gpu_session38.sh's (not run in session 31:
# no machine was lent). `bash bench/gpu_session39.sh N $OUT` from the project root, .commit carried. Order: 39's 1
# (instead of 38's 1), 10 (added in session 32, no machine lent then either), 6, 38's 2, 36's 1, then the vLLM calls
# 38's 11 / 12 (bundle parts), 39's 7 (with the third part and unpack.sh), 8, then 39's 9 (ncu), 38's 5 (sanitizers),
# 38's 3 / 4 (serve) as the budget allows.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11, kernel A/B (replaces gpu_session38.sh 1; 2 alternated rounds, every build on the table's tunings):
     # MK_NW_L1 (session 31: norm weights prefetched into L1 at a norm-fused task's start) at b1 / 8 / 12 / 16, then
     # MK_WGA_X=2 (session 30: x staged per warpgroup) alone and with MK_NW_L1 at b12 / 16. Since session 31 a build's
     # own wga_x is kept over the table entry's (before, the 8B / 1B b16 entries' wga_x 1 replaced the build's 2).
     # mk_ab's check lines: MK_NW_L1 computes the same values (max_abs 0 against the default build expected)
     W=MK_W_TMA=1,MK_WGMMA_A=4
     for m in llama-3.1-8b llama-3.2-1b; do
       timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/$m --group "$m" \
         --batch 1 8 12 16 --rounds 2 --build default --build MK_NW_L1=1
       timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/$m --group "$m" \
         --batch 12 16 --rounds 2 --build default --build $W,MK_WGA_X=2 --build $W,MK_WGA_X=2,MK_NW_L1=1
     done ;;
  6) # issue 11: MK_LM_HEAD, kernel-only: the step with the megakernel's LM head against the step without it followed by
     # vLLM's bf16 LM-head GEMM (mk_step --lm-head: rows megakernel and megakernel+torch_lm_head, one graph each)
     T=200 step --model bench/models/llama-3.1-8b --batch 1 8 16 --lm-head --no-triton
     T=120 step --model bench/models/llama-3.2-1b --batch 1 8 16 --lm-head --no-triton ;;
  7) vllm_env   # issue 11 in vLLM: 8B, stock alternated with the megakernel and the megakernel with its LM head
     timeout 590 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 \
       --modes megakernel,megakernel+MK_LM_HEAD=megakernel --rounds 2 --runs 1 --outdir "$out" 2>&1 \
       | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -30
     rm -rf "$out/logs" ;;
  8) vllm_env   # MK_LM_HEAD=megakernel's correctness in vLLM: (b) greedy tokens with CUDA graphs (replays hand out the
     # megakernel's logits) against stock, (c) eager steps against the fp32 truth; 1B
     timeout 580 python3 bench/vllm_correctness.py --parts b,c --models llama-3.2-1b --mode megakernel \
       --mk-env MK_LM_HEAD=megakernel --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  9) # issue 11, 1B batch 1 (1.01x Triton against the 0.80 bar): where the chain's resident chunks go (session 29's "Next":
     # 0.9-1.2 us a chunk in the loop for 0.26-0.56 of MMA instructions). Nsight Compute's stall samples of one step on
     # the table's program, built with line info (MK_LINEINFO) so the samples map to csrc lines this time; then 8B b1.
     # NCU_DEFINE=MK_FALLTHROUGH=1 (session 32) samples that build instead: the fetch stalls (--fetch) with and without
     for m in llama-3.2-1b llama-3.1-8b; do
       timeout 240 ncu --clock-control none -k regex:mk_decode -s 4 -c 1 --section WarpStateStats \
         --section SourceCounters -o "$out/ncu_${m}_b1" -f python3 bench/mk_step.py --model bench/models/$m \
         --batch 1 --reps 3 --no-triton --define MK_LINEINFO=1 ${NCU_DEFINE:+--define $NCU_DEFINE} --csv /dev/null \
         > "$out/ncu_${m}_b1_run.log" 2>&1
       echo "ncu $m rc $?"
       for v in sass cuda; do
         timeout 120 ncu --import "$out/ncu_${m}_b1.ncu-rep" --page source --csv --print-source $v \
           > "$out/ncu_${m}_b1_$v.csv" 2>&1
         gzip -f "$out/ncu_${m}_b1_$v.csv"
       done
       python3 bench/ncu_stalls.py "$out/ncu_${m}_b1_sass.csv.gz" --top 30 --context 3 --fetch \
         --out "$out/ncu_${m}_b1_stalls.md" \
         | head -40
       rm -f "$out/ncu_${m}_b1.ncu-rep"
     done ;;
  10) # issue 11: MK_FALLTHROUGH (session 32: the chunk loops without jumps over the M-tiles a pass lacks and over the
     # ring wait's slow path; the fetch stalls of session 13's samples). Its GPU tests first (bitwise the build without
     # it on the table's programs and the default path's two n-tiles; the watchdog test through the out-of-line wait),
     # then the A/B on the table's tunings, 2 alternated rounds (mk_ab's check: max_abs 0 against the default expected)
     timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fallthrough_gpu.py 2>&1 | tail -4
     timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py -k watchdog \
       --mk-define MK_FALLTHROUGH=1 2>&1 | tail -2
     for m in llama-3.2-1b llama-3.1-8b; do
       timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/$m --group "$m" \
         --batch 1 4 8 16 --rounds 2 --build default --build MK_FALLTHROUGH=1
     done ;;
  11) vllm_env   # issue 11 in vLLM, if call 10's kernel A/B won: 8B, stock alternated with the megakernel and the
     # megakernel built with MK_FALLTHROUGH (MK_AB, bench only; mk_status reports the build), 2 rounds, b1 and b8
     timeout 590 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 \
       --modes megakernel,megakernel+MK_AB=MK_FALLTHROUGH=1 --rounds 2 --runs 1 --outdir "$out" 2>&1 \
       | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -30
     rm -rf "$out/logs" ;;
  12) # issue 11 in vLLM needs ~-57 / -53 us at 8B b1 / b8: the release gate after qkv / o_proj too (masks 50 = qkv,
     # o_proj, gate_up; 48 = o_proj, gate_up; default 32 = gate_up), measured -86 us (-2%) at 8B b1 in session 8 but left
     # then (a per-batch knob, 2% bar); the kernel has had the in-flight cap since (the fences wait for fewer copies).
     # No code: -D builds on the table's tunings, 2 alternated rounds
     for m in llama-3.1-8b llama-3.2-1b; do
       timeout 240 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/$m --group "$m" \
         --batch 1 8 --rounds 2 --build default --build MK_RELEASE_GATE=50 --build MK_RELEASE_GATE=48
     done ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s39_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
