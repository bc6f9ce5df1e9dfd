#!/usr/bin/env bash
# Session 18's GPU calls after call 1 of gpu_session23.sh (bench/NOTES.md session 18). Run from the project root on
# the GPU host with .commit carried; output under $2 (default $OUT).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: MK_ATT_TMA=N, the ring path for attention tasks of >= N tokens only (per task at run time).
     # Correctness first, at thresholds that mix both paths in one launch: the GPU tests at 300 (batch 8's
     # 258..320-token chunks on both sides), the race detector at 19 (batch 1 ctx 300: 15 tasks of 19 tokens
     # through the ring, the last one of 15 by the default loop; batch 3 and 16 all through the ring)
     timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_tensormap.py \
       -k "vs_vm or whole_step or graph or driver_encodes" --mk-define MK_ATT_TMA=300 2>&1 \
       | grep -E "^E .*(assert not|: \{)|passed|failed|FAILED" | cut -c1-400 | head -12
     timeout 100 python3 bench/race_stress.py --batch 1 3 16 --replays 500 --define MK_ATT_TMA=19 2>&1 \
       | grep -E "^llama|Error|error" | head -4
     # the A/B. Predicted for MK_ATT_TMA=128 (tasks of 32 tokens at batch 1 ctx 512 keep the default loop):
     # 1B ctx 512 b1 = default (MK_ATT_TMA=1: +10), b4/b8/b16 = MK_ATT_TMA=1 (-5 / +1 / -6, noise);
     # ctx 4096 = MK_ATT_TMA=1 (1B b1 -12, b16 -202; 8B b1 -72, b16 -624)
     B="--build default --build MK_ATT_TMA=1 --build MK_ATT_TMA=128"
     timeout 170 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 4 8 16 --rounds 2 $B
     ;;
  4) # call 1 again after 9f450e8 (attn_partial_tma not inlined, the producer's lengths loaded once): call 1 measured
     # MK_ATT_TMA=128 at 1B ctx 512 b1/b4/b8/b16 +15/+30/+11/-10 over the default, 8B b1/b8 +31/-45. Predicted now:
     # b1 within +-3 of default (its 32-token tasks take the default loop and the producer no longer loads per
     # task), b4/b8 -5..+5, b16 -10; 8B b1 within +-5, b8 -45
     bash bench/gpu_session24.sh 1 "$out" | grep -v "^date"
     timeout 170 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 --rounds 2 \
       --build default --build MK_ATT_TMA=1 --build MK_ATT_TMA=128 ;;
  6) # issue 11: the default build's step against the Triton path, both in one job (rows in mk_step.csv); 8B also
     # with MK_ATT_TMA=128 (call 7: a win at 8B only)
     for c in 512 4096; do
       T=100 step --ctx $c --model bench/models/llama-3.2-1b --batch 1 4 8 16
       T=120 step --ctx $c --model bench/models/llama-3.1-8b --batch 1 8 16
       T=100 step --ctx $c --model bench/models/llama-3.1-8b --batch 8 16 --no-triton --define MK_ATT_TMA=128
     done ;;
  7) # after call 4 (9f450e8: noinline ring path +30..+35 at 1B b4/b8 over the inlined one; the producer's lengths
     # loaded once brought 128's b1 to +4): the inlined ring path with the lengths loaded once, thresholds 128 and
     # 1024 (ctx 512 then never on the ring). Predicted: 128 b1 +0..+5, b4/b8 +5..+35 (the inlined build's), 1024 at
     # ctx 512 +0..+10 everywhere, ctx 4096 b16 -190 (1B) / -650 (8B) for both, 8B ctx 4096 b1 -70 for 128 only
     B="--build default --build MK_ATT_TMA=128 --build MK_ATT_TMA=1024"
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 4 8 16 --rounds 2 $B
     timeout 100 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group "1b ctx4096" --ctx 4096 \
       --batch 1 16 --rounds 2 $B
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 --rounds 2 $B
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group "8b ctx4096" --ctx 4096 \
       --batch 1 16 --rounds 2 $B ;;
  8) # MK_ATT_TMA per batch from the tuning table (8B b8/b16, 1B b16: att_tma 128), the inlined ring path with the
     # lengths loaded once (105337f's code). Correctness: the megakernel's GPU tests (tuned programs with att_tma,
     # block_size 32 caches turning it off), the race detector at 19 (both paths in one launch), the sanitizer
     # at 30 (batch 1) / 300 (batch 8), both mixing the paths; then the packaged table's 8B steps.
     timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_tensormap.py \
       2>&1 | grep -E "^E .*(assert not|: \{)|passed|failed|FAILED" | cut -c1-400 | head -12
     timeout 80 python3 bench/race_stress.py --batch 1 3 16 --replays 500 --define MK_ATT_TMA=19 2>&1 \
       | grep -E "^llama|Error|error" | head -4
     for tb in 30:1 300:8; do
       MK_SAN_DEFINES="MK_ATT_TMA=${tb%:*}" MK_SAN_BATCHES="${tb#*:}" MK_SAN_TIMEOUT=60 timeout 200 \
         bash bench/sanitize.sh "$out/san_${tb%:*}" 2 2>&1 | grep -E "SUMMARY|exit code"
     done
     for c in 512 4096; do
       T=90 step --ctx $c --model bench/models/llama-3.1-8b --batch 8 16
       T=60 step --ctx $c --model bench/models/llama-3.2-1b --batch 16
     done ;;
  3) # the rest of call 1's A/B (same builds, same predictions)
     B="--build default --build MK_ATT_TMA=1 --build MK_ATT_TMA=128"
     timeout 110 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group "1b ctx4096" --ctx 4096 \
       --batch 1 16 --rounds 2 $B
     timeout 170 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 --rounds 2 $B
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group "8b ctx4096" --ctx 4096 \
       --batch 1 16 --rounds 2 $B ;;
  2) # issue 11: the step of the MK_ATT_TMA=128 build against the Triton path (rows in mk_step.csv), then the
     # sanitizer at thresholds that mix both paths (2 layers; sanitize.py's batch 1 is 517 tokens in 16 chunks of 33
     # and a last one of 22: threshold 30; batch 8's requests are 0..944 tokens in 2 chunks: threshold 300)
     for c in 512 4096; do
       T=150 step --define MK_ATT_TMA=128 --ctx $c --model bench/models/llama-3.2-1b --batch 1 4 8 16
       T=200 step --define MK_ATT_TMA=128 --ctx $c --model bench/models/llama-3.1-8b --batch 1 8 16
     done
     for tb in 30:1 300:8; do
       MK_SAN_DEFINES="MK_ATT_TMA=${tb%:*}" MK_SAN_BATCHES="${tb#*:}" MK_SAN_TIMEOUT=100 timeout 320 \
         bash bench/sanitize.sh "$out/san_${tb%:*}" 2 2>&1 | grep -E "SUMMARY|exit code"
     done ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s24_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
