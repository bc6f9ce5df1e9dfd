#!/usr/bin/env bash
# Session 22's GPU calls (bench/NOTES.md session 21, "Next"). Run from the project root on the GPU host with
# .commit carried: `bash bench/gpu_session29.sh N $OUT` (out must be set: records written elsewhere do not come
# back), in the order 1, 11, 12, 3, 4, 5, 6, then if time is left 9, 2, 7. Calls 1, 9 and 2 need no vLLM; 11 and
# 12 carry the bundle parts (move bench/results/**/*.gz aside first), 3 the third part and unpack.sh; 4-7 reuse the
# unpacked tree while the machine stays warm (the autotuner calls 9 and 2 are ~10 min each).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env(), soak_megakernel()
{
case $n in
  1) # issue 11: what a data-as-flag hand-off costs against the kernel's release + flag + load (release_probe modes
     # 5-7, session 21), idle and under streaming, uncapped and at 2 chunks in flight. Predicted (NOTES session
     # 21): mode 6 (4 KB, data as flag) idle ~0.8-1.0 us against mode 7's ~1.4-1.6; under streaming at 6 chunks
     # ~2-6 us against mode 7's ~16 (mode 0: 16.1); at 2 chunks ~1.1 against ~2.8
     timeout 150 python3 bench/release_probe.py --modes 0,3,5,6,7 --stream 0,1 --inflight 6,2 --reps 5 \
       --csv "$out/release_probe_v2.csv" --out "$out/release_probe_data_flag.md" 2>&1 | tail -16
     # why the tensor-map copies and the cap pay together at 8B (-194 us at b1, each alone ~-55): the phase trace of
     # the new b1 entry, against session 21's default-build trace (session21/mk_step_llama-3.1-8b_b1_...): which
     # phases fell (the releases' 2.1 us? the stages?)
     timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --records-dir "$out" --model bench/models/llama-3.1-8b --batch 1 2>&1 | tail -4
     ;;
  9) # the knobs the autotuner gained in sessions 20-21 (w_tma, inflight, the pair), where the table has no measured
     # winner with them: 8B b16 here, 1B b1 / b16 in call 2 (candidates checked against the default's output first; no
     # --write-tuned: the session decides from the report)
     timeout 560 python3 bench/autotune.py --models 8b --batch 16 --lm-head off --rounds 2 --reps 100 \
       --outdir "$out" 2>&1 | tail -12 ;;
  2) timeout 560 python3 bench/autotune.py --models 1b --batch 1 16 --lm-head off --rounds 2 --reps 100 \
       --outdir "$out" 2>&1 | tail -12 ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  3) vllm_env   # issue 12: the 8B entries of session 21 inside vLLM (GPU-bound there): stock alternated with
     # both plugin paths, 3 rounds; the paths table's 8B b1/b8 in-vLLM rows are from 05dd972 (before the entries)
     timeout 580 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 --modes megakernel,triton \
       --rounds 3 --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  4) vllm_env   # issue 12: MK_MODE=auto against stock, 8B batch 1/4/8/16 at prompt 512, 2 alternated rounds
     timeout 580 python3 bench/tbt.py --models llama-3.1-8b --batches 1,4,8,16 --prompts 512 --modes auto \
       --rounds 2 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  5) vllm_env   # issue 11's done-when (the vLLM checks on the new kernel): the megakernel's soak, engines first ...
     soak_megakernel --engines-only ;;
  6) vllm_env   # ... then the fp32 verdict over the same engines' outputs (stock control included)
     soak_megakernel ;;
  7) vllm_env   # issue 12 (if device time is left): the batch x context sweep at 1B, stock against auto
     timeout 580 python3 bench/tbt.py --sweep --models llama-3.2-1b --modes auto --rounds 1 --outdir "$out" 2>&1 \
       | grep -v "^(EngineCore" | tail -16 ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s29_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
