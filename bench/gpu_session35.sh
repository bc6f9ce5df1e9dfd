#!/usr/bin/env bash
# Sessions 27-28's GPU calls (bench/NOTES.md sessions 26-28, "Next"). `bash bench/gpu_session35.sh N $OUT` from the
# project root, .commit carried; calls 11, 12 carry the vLLM bundle parts (move bench/results/**/*.gz aside first: the
# 64 MiB limit; one part a call), 3 the third part and unpack.sh; later vLLM calls reuse the unpacked tree while the
# machine stays warm. Order: 10, 13, 14, 1, 7, then 11, 12, 3, 4, 5, 6, 8, 2 and 16 if time is left (sessions 27
# and 28 had no GPU: session 26's plan moved here with call 10, the consumer probe, and calls 13-14 and 16, MK_WGMMA_A's,
# added; calls 9 and 15, the A/Bs of MK_WGMMA_B and MK_WARP_ARRIVE, ran on 2026-12-05: both measured slower and the
# switches were removed).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env(), serve_1b_auto(), tbt_1layer_profiled()
{
case $n in
  1) # issue 11: the ring's op-by-op GPU-vs-VM test (written in session 26, not yet run: the VM now rounds P as the
     # tensor cores do) with the rest of the ring tests, MK_RSTD_EPI's test, then every other kernel GPU test module
     timeout 270 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ring_mma_gpu.py tests/test_rstd_epi_gpu.py \
       2>&1 | tail -6
     timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -5 ;;
  8) # the other kernel GPU test modules (session 23: the whole kernel suite took 478 s)
     timeout 500 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_step.py \
       tests/test_tensormap.py tests/test_weight_tma.py tests/test_linear.py tests/test_lm_head.py \
       tests/test_paged_attention.py tests/test_rms_norm.py tests/test_rope_kv_append.py 2>&1 | tail -5 ;;
  2) # issue 11: where 8B batch 16 goes on the new attention (phase trace, then trace_phases on the CPU) and the 1B
     # batch-16 one; both paths' rows are session 26's (mk_step_2026-12-04_381bb02.md)
     for m in llama-3.1-8b llama-3.2-1b; do
       timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
         --records-dir "$out" --model bench/models/$m --batch 16 2>&1 | tail -2
     done
     for f in "$out"/*.records.json.gz; do python3 -m mk_plugin.persistent.trace_phases "$f" 2>&1 | sed -n 1,14p; done ;;
  7) # issue 11: MK_RSTD_EPI (built in session 26; prediction and rule in bench/NOTES.md session 26) against the
     # default where it applies (unstaged norm-fused ops: 1B batch >= 7, 8B >= 3), ctx 512, 2 alternated rounds
     timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b \
       --batch 1 8 16 --rounds 2 --build default --build MK_RSTD_EPI=1
     timeout 300 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b \
       --batch 3 8 16 --rounds 2 --build default --build MK_RSTD_EPI=1 ;;
  10) # issue 11: the consumers' own cost per 32 KB chunk, mma.sync against wgmma (bench/wgmma_probe.py, written in
      # session 27; prediction and rule in bench/NOTES.md session 27): 28 configs, one compile each, launches at two sizes
      timeout 150 python3 bench/wgmma_probe.py --csv "$out/wgmma_probe.csv" \
        --out "$out/wgmma_probe_$(date -u +%Y-%m-%d)_${commit}.md" 2>&1 | tail -38 ;;
  # 9) (MK_WGMMA_B's tests and A/B): the switch measured 25% slower and was removed (bench/NOTES.md)
  13) # issue 11: MK_WGMMA_A's GPU tests (built in session 28; bench/NOTES.md session 28): reference, Triton, bitwise
      # repeatable, the tables' K-splits with the ring-fed attention, a 5-slot ring, op by op against the VM
      timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_wgmma_a_gpu.py 2>&1 | tail -8 ;;
  14) # issue 11: MK_WGMMA_A's A/B against the tables' builds at batch 9 / 12 / 16 (every matvec task takes it there:
      # tests/test_wgmma_a.py), R = 1 and 4, 2 alternated rounds (prediction and rule in NOTES session 28). Batch <= 8
      # would run MK_W_TMA's copies in these builds: not this switch's question (a win is a knob for batch 9..16 only).
      timeout 260 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b \
        --batch 9 12 16 --rounds 2 --build default --build MK_W_TMA=1,MK_WGMMA_A=1 --build MK_W_TMA=1,MK_WGMMA_A=4
      timeout 320 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b \
        --batch 9 16 --rounds 2 --build default --build MK_W_TMA=1,MK_WGMMA_A=1 --build MK_W_TMA=1,MK_WGMMA_A=4 ;;
  # 15) (MK_WARP_ARRIVE's A/B): the switch measured 1% slower and was removed (bench/NOTES.md)
  16) # issue 11, after call 14 if MK_WGMMA_A missed its prediction (or won, for the next budget): its phase traces at
      # batch 16 (R = 4, both models), then against call 2's default traces (trace_phases --compare, on the CPU)
      for m in llama-3.1-8b llama-3.2-1b; do
        timeout 120 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
          --define MK_W_TMA=1 --define MK_WGMMA_A=4 --records-dir "$out" --model bench/models/$m --batch 16 2>&1 | tail -2
      done
      for f in "$out"/*WGMMA_A*.records.json.gz; do python3 -m mk_plugin.persistent.trace_phases "$f" 2>&1 | sed -n 1,14p; done ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  3) vllm_env   # issues 11 and 12: 8B, stock alternated with auto and the megakernel, 2 rounds, batch 1 / 4 / 8 / 16
     # at prompt 512 (issue 11: megakernel <= 0.85x stock at b1 and b8; issue 12: auto <= stock at every batch)
     timeout 590 python3 bench/tbt.py --models llama-3.1-8b --batches 1,4,8,16 --prompts 512 \
       --modes auto,megakernel --rounds 2 --runs 1 --outdir "$out" 2>&1 | grep -v "^(EngineCore" \
       | grep -v "^\[tbt\]   worker" | tail -30
     rm -rf "$out/logs" ;;
  4) vllm_env && tbt_1layer_profiled call4 ;;   # issue 12: the one-layer model's row and 1B, 3 alternated rounds
  5) vllm_env && serve_1b_auto --rounds 2 && tar czf "$out/logs_call5.tgz" -C "$out" logs && rm -rf "$out/logs" ;;
  6) vllm_env   # issue 11's vLLM correctness on the new attention: part (c) at 8B with the megakernel (batch 4's
     # contexts take the ring), against the fp32 truth
     timeout 580 python3 bench/vllm_correctness.py --parts c --models llama-3.1-8b --mode megakernel --outdir "$out" \
       2>&1 | grep -v "^(EngineCore" | tail -12 ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s35_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
