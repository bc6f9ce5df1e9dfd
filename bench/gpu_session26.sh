#!/usr/bin/env bash
# Session 19's GPU calls after call 1 (bench/gpu_session25.sh 1). Run from the project root on the GPU host with
# .commit carried; output under $2 (default $OUT). No vLLM in calls 2 and 3.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  2) # issue 11, MK_W_TMA (one tensor-map copy per weight chunk): correctness first -- bitwise the default build
     # (test_weight_tma_chunks_are_bitwise_the_row_copies), the maps, op by op against the VM and whole steps on
     # the switch's build, the race detector
     timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_weight_tma.py tests/test_persistent_gpu.py \
       -k "weight_tma or driver_encodes" 2>&1 | tail -4
     timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py --mk-define MK_W_TMA=1 \
       -k "vs_vm or whole_step or graph_replay" 2>&1 | tail -4
     timeout 90 python3 bench/race_stress.py --batch 1 3 16 --replays 300 --define MK_W_TMA=1 2>&1 | tail -6 ;;
  3) # the A/B, 2 alternated rounds. Predicted (NOTES session 19): 1B b1 -10..-25, b8/b16 -10..-40; 8B b1/b8/b16
     # -100..-200 us (the chunks' copy issue cost: 2 KB copies at 94-95% of the copy rate, one 32 KB copy at 101%)
     B="--build default --build MK_W_TMA=1"
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 4 8 16 --rounds 2 $B
     timeout 250 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 $B ;;
  4) # call 2's failures fixed (K-split parts now start on 64-column groups; the tiny model skipped under the switch):
     # the bitwise test again, then call 3's A/B
     timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py -k "weight_tma" 2>&1 | tail -3
     B="--build default --build MK_W_TMA=1"
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 4 8 16 --rounds 2 $B
     timeout 230 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 $B ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s26_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
