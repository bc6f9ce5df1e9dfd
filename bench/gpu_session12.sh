#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 10, "Next"). Run from the project root on the GPU
# host with .commit carried; output under $2 (default $OUT). Order, back to back (each call within the ~30 s
# warm window: an edit between calls lets the machine go cold and costs a start and the bundle again):
# 1 (probe + MK_NT2_FULL A/B, ~5 min), 3 (MK_DIAG decomposition, ~4 min), 11 and 12 (bundle parts 0 and 1),
# 13 (part 2 + .gpuhost/unpack.sh, unpacks), 15 (tbt 8B, ~9 min), 16 (one-layer profile, ~4 min); make the
# A/B's winner the default while 15 and 16 run (one commit, SASS checked), then 2 (gpu tests and both
# paths at that commit, ~4 min); 17 (serve 1B, ~8 min) and 18 (soak) as the time allows.
# A/B tables: python bench/ab_table.py LOG.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # Where batch 16's chunk loop loses (NOTES session 10), first the copy engine's cost per bulk copy (the
     # probe: bytes per copy, ring depth, one copy per pre-tiled chunk, the consumer's MMA pattern), then
     # MK_NT2_FULL (full-width chunks at batch 9..16, consumed in two halves): its gpu tests, then the A/B
     # at 1B batch 8 (the control: NT = 1), 12, 16 and 8B batch 16
     timeout 90 python3 bench/bulk_probe.py --out "$out/bulk_probe.md" 2>&1 | tail -28
     timeout 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step or watchdog or merge_in_partial" --mk-define MK_NT2_FULL=1 2>&1 | tail -1
     timeout 120 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 8 12 16 --rounds 3 \
       --build default --build MK_NT2_FULL=1
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 16 --rounds 3 \
       --build default --build MK_NT2_FULL=1 ;;
  3) # the kernel with its weight copies (MK_DIAG=2), its MMAs (4), both (6) or its counter waits (1) taken
     # out (timing only: wrong results), batch 1, 8, 16 (1B) and 8, 16 (8B), in one process per model
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 2 \
       --build default --build MK_DIAG=2 --build MK_DIAG=4 --build MK_DIAG=6 --build MK_DIAG=1
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 8 16 --rounds 2 \
       --build default --build MK_DIAG=2 --build MK_DIAG=4 --build MK_DIAG=6 ;;
  2) # the default after call 1 (ATT_AU = 5 since eb6a10b): the gpu tests, then both paths at one commit
     # (README table, paths table for MK_MODE=auto), ctx 512 and 4096
     timeout 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -1
     T=150 step --model bench/models/llama-3.2-1b --batch 1 4 8 16
     T=200 step --model bench/models/llama-3.1-8b --batch 1 8 16
     T=120 step --model bench/models/llama-3.2-1b --batch 1 8 --ctx 4096
     T=150 step --model bench/models/llama-3.1-8b --batch 1 8 --ctx 4096 ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  13) vllm_env && echo "vLLM bundle unpacked" ;;
  15) vllm_env   # issues 11/12: 8B TBT of both plugin paths against stock; auto picks Triton at 8B batch 1 from
     # kernel timings 1% apart, while inside vLLM the megakernel measured 0.89x stock (session 9)
     timeout 580 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 \
       --modes triton,megakernel --rounds 2 --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  16) vllm_env   # issue 12's host cost: a profiled one-layer run, stock and Triton (the plugin path auto ran
     # there, ~0.2 ms above stock in session 10's medians), GPU busy vs period per step (host_gap.py)
     timeout 400 python3 bench/tbt.py --models llama-3.2-1b-1layer --batches 1,8 --prompts 512 --modes triton \
       --rounds 1 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -12
     find "$out/profiles" -name "*.json*" | head -4 | while read -r f; do
       echo "== $f"; timeout 60 python3 bench/host_gap.py "$f" | tail -8; done ;;
  17) vllm_env && serve_1b_auto ;;
  18) vllm_env && soak_megakernel ;;
  *) echo "no call $n" ;;
esac
} 2>&1 | tee "$out/gpu_s12_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
