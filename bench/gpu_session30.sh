#!/usr/bin/env bash
# Session 23's GPU calls (bench/NOTES.md session 22, "Next"). Run from the project root on the GPU host with
# .commit carried: `bash bench/gpu_session30.sh N $OUT` (out must be set: records written elsewhere do not come
# back), in the order 1, 2, 11, 12, 3, 4, then 5, 6 if time is left. Calls 1 and 2 need no vLLM; 11 and 12 carry
# the bundle parts (move bench/results/**/*.gz aside first: the 64 MiB carry limit), 3 the third part and
# unpack.sh; 4-6 reuse the unpacked tree while the machine stays warm.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env(), soak_megakernel()
{
case $n in
  1) # issue 11: the ceiling of the later passes' x (MK_DIAG=8: a matvec task's activations reach shared memory for
     # its first pass only; wrong results, timing only). Predicted (NOTES session 22): 8B b16 -250..-350 us
     # (gate_up's stage 8.0 -> ~1 us a task, qkv's 4.7 -> ~2.5), 8B b8 -100..-160, 8B b1 -100..-150 (gate_up's 7
     # restages of a staged x, 2.85 us a task; down's 2.2), 1B b1 -20..-40, 1B b8 / b16 -20..-60. The build's chunk
     # loops are 1-5% longer (bench/sass.py): a gain under ~2% is not a gain. Above ~5% at 8B b16, x resident
     # across passes is the next design; below it, the passes are not what batch 16 pays for.
     B="--build default --build MK_DIAG=8"
     timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 2 $B
     timeout 250 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 $B ;;
  2) # issue 11's done-when (every gpu test of the kernels as they stand; none of these files needs vLLM)
     timeout 500 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_decode_step.py \
       tests/test_tensormap.py tests/test_weight_tma.py tests/test_linear.py tests/test_lm_head.py \
       tests/test_paged_attention.py tests/test_rms_norm.py tests/test_rope_kv_append.py 2>&1 | tail -5 ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  3) vllm_env   # issue 12: 1B at batch 1 / 8 with MK_MODE=auto against stock, 2 alternated rounds (call 5 of
     # session 22 ran out of time after the one-layer model), before auto becomes the default
     timeout 560 python3 bench/tbt.py --models llama-3.2-1b --batches 1,8 --prompts 512 --modes auto \
       --rounds 2 --outdir "$out" 2>&1 | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -16
     rm -f "$out"/logs/*payload* ;;
  4) vllm_env   # issue 12: the real client, 8B, stock against auto at concurrency 1 / 8 / 16 (the serve rows are from
     # 2026-12-01, before the session-21 entries)
     timeout 580 python3 bench/serve.py --models llama-3.1-8b --modes auto --concurrency 1,8,16 \
       --prompts 32 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -16 ;;
  5) vllm_env   # issue 11's done-when (the vLLM checks on the kernel as it stands): the megakernel's soak, engines
     soak_megakernel --engines-only ;;
  6) vllm_env   # ... then the fp32 verdict over the same engines' outputs (stock control included)
     soak_megakernel ;;
  7) vllm_env   # issue 12: is 1B TBT in vLLM G + h (no overlap of host and GPU) rather than max(G, h)? Stock's GPU
     # step at 1B was never profiled. 1 round, profiled, stock against auto (b1: Triton, b8: megakernel)
     timeout 420 python3 bench/tbt.py --models llama-3.2-1b --batches 1,8 --prompts 512 --modes auto \
       --rounds 1 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -22
     for f in "$out"/profiles/*.gz; do timeout 60 python3 bench/host_gap.py "$f" 2>&1 | tail -3; done
     rm -rf "$out"/profiles "$out"/logs/*payload* ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s30_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
