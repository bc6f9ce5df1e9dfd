#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 11, "Next"). Run from the project root on the GPU
# host with .commit carried; output under $2 (default $OUT). Order, back to back, no edits and no helper
# sessions started between calls (the machine goes cold after ~30 s idle and loses the vLLM bundle):
# 1 (chain L2 prefetch: gpu tests + A/B, ~5 min), 2 (MK_DIAG at the full-width kernel + phase traces,
# ~4 min), 3 (all gpu tests, ~2 min), 11, 12 (bundle parts 0 and 1), 13 (part 2 + .gpuhost/unpack.sh),
# 15 (8B tbt with both plugin paths profiled, ~6 min), 16 (one-layer model, 3 rounds, ~8 min); 17, 18
# as the time allows. A/B tables: python bench/ab_table.py LOG; phase tables:
# python -m mk_plugin.persistent.trace_phases RECORDS.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11, the 1B batch-1 chain: SMs without qkv/attention/o_proj/down tasks prefetch the other SMs'
     # gate_up bytes beyond their rings into L2 while the chain runs (MK_CHAIN_PREFETCH=<KB per task>;
     # NOTES session 11, predicted -50..-100 us at 1B batch 1); its gpu tests first
     timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step" --mk-define MK_CHAIN_PREFETCH=128 2>&1 | tail -1
     # (1B only: at 8B o_proj and down have 132 tasks, no SM is idle on the chain and the program is the default's)
     timeout 240 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 3 \
       --build default --build MK_CHAIN_PREFETCH=64 --build MK_CHAIN_PREFETCH=128 --build MK_CHAIN_PREFETCH=256
     # the phase trace of the 128 KB build: gate_up's chunk time (11.7 us per task at batch 1 today) and the
     # prefetch tasks' own duration
     timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --define MK_CHAIN_PREFETCH=128 --records-dir "$out" --model bench/models/llama-3.2-1b --batch 1 2>&1 | tail -12 ;;
  2) # where the full-width kernel's time goes: MK_DIAG 2/4/6 and 7 (the skeleton without counter waits) at
     # batch 16 and 1B batch 1, then phase-traced steps (default and MK_DIAG=6) at batch 16 into $out
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 16 --rounds 2 \
       --build default --build MK_DIAG=2 --build MK_DIAG=4 --build MK_DIAG=6 --build MK_DIAG=7
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 16 --rounds 2 \
       --build default --build MK_DIAG=2 --build MK_DIAG=4 --build MK_DIAG=6
     for d in "" "--define MK_DIAG=6"; do
       timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 $d \
         --records-dir "$out" --model bench/models/llama-3.2-1b --batch 16 2>&1 | tail -12; done ;;
  3) # every gpu test on the default build (the tuned-program tests did not run on the full-width kernel)
     timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ 2>&1 | tail -3 ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  13) vllm_env && echo "vLLM bundle unpacked" ;;
  15) vllm_env   # issues 11/12: 8B, both plugin paths against stock, profiled: inside vLLM the megakernel is
     # 7.5% faster than Triton at batch 1 while the kernel-only steps differ by 1% (NOTES session 11)
     timeout 560 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 \
       --modes triton,megakernel --rounds 1 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -14
     find "$out/profiles" -name "*.json*" | sort | while read -r f; do
       echo "== $f"; timeout 60 python3 bench/host_gap.py "$f" | tail -2; done ;;
  16) vllm_env   # issue 12's host cost: the one-layer model, stock vs Triton over 3 rounds (session 11: batch 8
     # 1.795 vs 2.475 ms in one round), the profiles named per batch now
     timeout 560 python3 bench/tbt.py --models llama-3.2-1b-1layer --batches 1,8 --prompts 512 --modes triton \
       --rounds 3 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -14 ;;
  17) vllm_env && serve_1b_auto ;;
  18) vllm_env && soak_megakernel ;;
  *) echo "no call $n" ;;
esac
} 2>&1 | tee "$out/gpu_s13_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
