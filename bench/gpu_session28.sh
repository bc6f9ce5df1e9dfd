#!/usr/bin/env bash
# Session 21's GPU calls (bench/NOTES.md session 20, "Next"). Run from the project root on the GPU host with
# .commit carried: `bash bench/gpu_session28.sh N $OUT` (out must be set: records written elsewhere do not come
# back), in the order 1, 6, 2, 11, 12, 3, 4, 5 (7 if time is left). Calls 1, 6 and 2 need no vLLM; 11, 12 carry the bundle parts (move bench/results/**/*.gz aside first), 3 the
# third part and unpack.sh; 4 and 5 reuse the unpacked tree while the machine stays warm.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env(), soak_triton()
{
case $n in
  1) # the tuning knobs of session 20 (ScheduleTuning.w_tma / .inflight; weight maps built on demand) first: bitwise
     timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "tunings_weight_maps or piece_deps" 2>&1 | tail -3
     # issue 11: the release gate was measured (session 8) when 6 x 32 KB were in flight per SM and gate_up's
     # release waited 3.3 us for them; with MK_INFLIGHT = 2 a release waits for <= 64 KB (the probe: 16.1 -> 2.8
     # us under streaming), so the gate's cost (down's weights held until gate_up's release: no prefetch in
     # gate_up's tail) may now buy nothing. Predicted (NOTES session 20): INFLIGHT=2,GATE=0 against INFLIGHT=2
     # 1B b1 -10..-30 us, 8B b1/b8 -30..-100; GATE=0 alone slower than default (session 8's result). And at 8B the
     # two ~1% switches together (MK_W_TMA -67 at b1, MK_INFLIGHT=2 -46): additive if independent.
     B="--build default --build MK_RELEASE_GATE=0 --build MK_INFLIGHT=2 --build MK_INFLIGHT=2,MK_RELEASE_GATE=0"
     B="$B --build MK_INFLIGHT=3,MK_RELEASE_GATE=0"
     timeout 250 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 2 $B
     # (session 21: the 8B half moved to call 8: one call's 600 s could not hold both)
     timeout 120 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b --batch 8 16 --rounds 2 \
       --build ksplit.down=4 --build ksplit.down=4,piece_deps ;;
  8) # call 1's 8B half (MK_RELEASE_GATE=0 alone and INFLIGHT=3 are 1B-only), then call 6's 8B half
     B="--build default --build MK_INFLIGHT=2 --build MK_INFLIGHT=2,MK_RELEASE_GATE=0"
     timeout 330 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 $B \
       --build MK_W_TMA=1 --build MK_W_TMA=1,MK_INFLIGHT=2
     timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b --batch 16 --rounds 2 \
       --build ksplit.down=2 --build ksplit.down=2,piece_deps ;;
  10) # MK_PASS_PREFETCH (session 21, built after call 9): a matvec task's later passes find x ready (bit 1: the next
     # pass's first column group copied during the last group; bit 2: a staged x kept). Bitwise first, then the A/B.
     # Predicted (NOTES session 21): bit 1 8B b16 -150..-220 us, 8B b8 -60..-110, 1B b8/b16 -5..-15; bit 2 8B b1
     # -60..-100, 1B b1 -5..-10; both: the sum
     timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py -k "pass_prefetch" 2>&1 | tail -3
     B="--build default --build MK_PASS_PREFETCH=1 --build MK_PASS_PREFETCH=2 --build MK_PASS_PREFETCH=3"
     timeout 100 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 2 $B
     timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 $B
     timeout 60 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 --define MK_PASS_PREFETCH=3 \
       --records-dir "$out" --model bench/models/llama-3.1-8b --batch 16 2>&1 | tail -4 ;;
  9) # (session 21, after calls 1, 8, 2, 3, 4) the 8B table now sets w_tma + inflight 2 at b1/b8 (call 8: -194 / -163 us).
     # 1B: is the pair super-additive there too (alone: W_TMA +31, INFLIGHT=2 +10 at b1)? Predicted -20..+40 us (the 8B
     # result is not understood: no firm sign). 8B, on the new entries: the release gate after down (96) and after every
     # matvec op (114): qkv / o_proj / down releases are 2.1-2.2 us at 8B b1 (call 2's trace: the next weights in
     # flight), gate_up's 0.5 with the gate; predicted 114: -50..-150 us at b1 if the held copies cost less than the
     # fence waits (session 8 measured the gate after down slower at 1B, without the cap)
     timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 2 \
       --build default --build MK_W_TMA=1,MK_INFLIGHT=2 --build MK_W_TMA=1,MK_INFLIGHT=3
     timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 \
       --build default --build MK_RELEASE_GATE=96 --build MK_RELEASE_GATE=114
     # the new entries at ctx 512 and 4096 (the b8 entry's att_tma was chosen at ctx 4096), both paths in one job
     T=120 step --model bench/models/llama-3.1-8b --batch 1 8
     T=150 step --model bench/models/llama-3.1-8b --batch 1 8 --ctx 4096 ;;
  2) # issue 11's per-layer budget at 8B (none traced so far): the phase trace of 8B and 1B batch 1, default build;
     # then both paths at the table's tunings in one job (issue 11's rows at one commit)
     for m in llama-3.1-8b llama-3.2-1b; do
       timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
         --records-dir "$out" --model bench/models/$m --batch 1 2>&1 | tail -9
     done
     # MK_W_TMA's unexplained +409 us at 8B batch 16 (session 19): the phase traces with and without it
     for d in "" "--define MK_W_TMA=1"; do
       timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 $d \
         --records-dir "$out" --model bench/models/llama-3.1-8b --batch 16 2>&1 | tail -9
     done
     T=120 step --model bench/models/llama-3.2-1b --batch 1 4 8 16
     T=200 step --model bench/models/llama-3.1-8b --batch 1 8 16 ;;
  6) # (run second, after call 1)
     # tuning.piece_deps (down's K part p waits for gate_up's piece p only; built in session 20, a program change):
     # predicted 1B b8/b16 -5..-25 us, 8B b16 -20..-60 (the gate_up spread behind its slowest task: 1.3 us per
     # layer at 1B b16, layer_budget_2026-12-03.md), against the same forced K-split
     timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b --batch 8 16 --rounds 2 \
       --build ksplit.down=4 --build ksplit.down=4,piece_deps
     timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b --batch 16 --rounds 2 \
       --build ksplit.down=2 --build ksplit.down=2,piece_deps ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  3) vllm_env   # issue 13: the Triton mode's soak again (session 20's record was lost), engines first ...
     soak_triton --engines-only ;;
  4) vllm_env   # ... then the fp32 verdict over the same engines' outputs (stock control included)
     soak_triton ;;
  5) vllm_env   # issue 12: MK_MODE=auto against stock, 8B batch 1/4/8/16 at prompt 512, 2 alternated rounds
     timeout 580 python3 bench/tbt.py --models llama-3.1-8b --batches 1,4,8,16 --prompts 512 --modes auto \
       --rounds 2 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  7) vllm_env   # issue 12 (if device time is left): the batch x context sweep at 1B, stock against auto
     timeout 580 python3 bench/tbt.py --sweep --models llama-3.2-1b --modes auto --rounds 1 --outdir "$out" 2>&1 \
       | grep -v "^(EngineCore" | tail -16 ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s28_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
