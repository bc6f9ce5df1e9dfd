#!/usr/bin/env bash
# Session 26's GPU calls (bench/NOTES.md session 25, "Next"). `bash bench/gpu_session34.sh N $OUT` from the project
# root, .commit carried; calls 11, 12 carry the vLLM bundle parts (move bench/results/**/*.gz aside first: the 64 MiB
# limit), 4 the third part and unpack.sh; later vLLM calls reuse the unpacked tree while the machine stays warm.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: MK_RING_MMA (the ring-fed attention's consumers on the tensor cores). Its GPU test against the
     # reference first (NaN past every length, att_tma 1, 3 chunks), then the A/B at 8B ctx 8192, batch 8 and 16 on
     # their tuned entries (ring-fed attention for tasks of >= 128 tokens). Predictions and the rule: NOTES session 25.
     # (Each build compiles once per batch variant, ~20-30 s at 8B: four here.)
     timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ring_mma_gpu.py 2>&1 | tail -4
     timeout 330 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b_ctx8192 \
       --ctx 8192 --batch 8 16 --rounds 2 --reps 30 --build default --build MK_RING_MMA=1 ;;
  2) # the rest of MK_RING_MMA's A/B: short contexts must not lose (8B ctx 512 b8 / b16, whose 512-token tasks go
     # through the ring), 1B ctx 4096, and 8B b2 at ctx 8192 with the ring turned on (its entry has none)
     timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b_ctx512 \
       --batch 8 16 --rounds 2 --build default --build MK_RING_MMA=1
     timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b_ctx4096 \
       --ctx 4096 --batch 8 16 --rounds 2 --build default --build MK_RING_MMA=1
     timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b_ctx8192 \
       --ctx 8192 --batch 2 --rounds 2 --reps 30 --build default --build MK_ATT_TMA=128 --build MK_ATT_TMA=128,MK_RING_MMA=1 ;;
  3) # issue 11, MK_RING_MMA won (call 1/2) and is the ring's code: the GPU tests of everything that runs the ring
     # (the tensor-core attention against the reference and the default loop, tunings with att_tma against the
     # default program, block-32 caches turning it off, the op-by-op VM check), then whether batch sizes whose
     # entries have no ring should take it now: default vs MK_ATT_TMA=128 at ctx 512 and 4096 (1B b1/b4/b8, 8B b1/b2/b4)
     timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ring_mma_gpu.py tests/test_persistent_gpu.py \
       -k "tensor_core or tuned_programs or ring_path or vm_op_by_op" 2>&1 | tail -4
     for c in 512 4096; do
       timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b_ctx$c \
         --ctx $c --batch 1 4 8 --rounds 2 --build default --build MK_ATT_TMA=128
       timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b_ctx$c \
         --ctx $c --batch 1 2 4 --rounds 2 --reps 50 --build default --build MK_ATT_TMA=128
     done ;;
  7) # issue 11's rows: both paths at one commit, ctx 512 and 4096, the ring's tensor-core consumers the code
     T=120 step --model bench/models/llama-3.2-1b --batch 1 4 8 16
     T=120 step --model bench/models/llama-3.2-1b --batch 1 8 16 --ctx 4096
     T=170 step --model bench/models/llama-3.1-8b --batch 1 8 16
     T=170 step --model bench/models/llama-3.1-8b --batch 1 8 16 --ctx 4096 ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  4) vllm_env   # issue 12: 8B long contexts, stock alternated with auto (batch 16 runs stock now; the Triton path's
     # attention splits per batch) and the megakernel / Triton paths; one round (4 engines, ~110 s each: 8B engines of
     # one mode agreed within 0.5% in session 22), the steady-state table separates decode from the prefill ramp
     timeout 590 python3 bench/tbt.py --models llama-3.1-8b --batches 2,8,16 --prompts 2048,8192 \
       --modes auto,triton,megakernel --rounds 1 --runs 1 --outdir "$out" 2>&1 | grep -v "^(EngineCore" \
       | grep -v "^\[tbt\]   worker" | tail -30
     rm -rf "$out/logs" ;;
  8) vllm_env   # issues 11 and 12 on the ring's tensor-core attention: 8B in vLLM, stock alternated with auto and the
     # megakernel, batch 1 / 8 / 16 at prompt 512 (issue 11's <= 0.85x) and 8192 (the long-context loss), one round
     timeout 590 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8,16 --prompts 512,8192 \
       --modes auto,megakernel --rounds 1 --runs 1 --outdir "$out" 2>&1 | grep -v "^(EngineCore" \
       | grep -v "^\[tbt\]   worker" | tail -30
     rm -rf "$out/logs" ;;
  9) # issue 11: the sanitizers on the ring's tensor-core attention (every task through the ring: MK_ATT_TMA=1), 2 layers,
     # batch 1 and 16 (memcheck, racecheck, synccheck; bench/sanitize.py checks the step against the Triton path)
     MK_SAN_DEFINES="MK_ATT_TMA=1" MK_SAN_BATCHES="1 16" MK_SAN_TIMEOUT=90 timeout 560 bash bench/sanitize.sh "$out" 2 \
       2>&1 | grep -E "SUMMARY|exit code|sanitize-run" ;;
  5) vllm_env   # issue 12: the one-layer model's row (vLLM's host floor) and 1B, 3 alternated rounds, with profiles
     timeout 590 python3 bench/tbt.py --models llama-3.2-1b-1layer --batches 1,8 --prompts 512 --modes auto \
       --rounds 3 --runs 3 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -20
     rm -f "$out"/logs/*payload*; tar czf "$out/logs_call5.tgz" -C "$out" logs && rm -rf "$out/logs" "$out/profiles" ;;
  6) vllm_env   # issue 12: serve 1B, stock against auto, 2 alternated rounds
     timeout 590 python3 bench/serve.py --models llama-3.2-1b --modes auto --concurrency 1,8,16 --prompts 32 \
       --rounds 2 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -20
     tar czf "$out/logs_call6.tgz" -C "$out" logs && rm -rf "$out/logs" ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s34_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
