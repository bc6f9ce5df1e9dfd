#!/usr/bin/env bash
# Session 20's GPU calls (bench/NOTES.md session 20). Run from the project root on the GPU host with .commit
# carried; output under $2 (default $OUT). Calls 1 and 2 need no vLLM; 11, 12 carry the bundle parts (move
# bench/results/**/*.gz aside first), 3 the third part and unpack.sh.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11, the in-flight question: is the hand-off's 5.8-us floor under streaming the queue of 6 x 32 KB per
     # SM? The probe with the streaming SMs' chunks in flight capped at 6 (none), 3, 2, 1 slots, the ping-pong SMs
     # streaming too (1) or not (2): hand-off ns and the streaming rate per cap. Predicted: the floor (mode 3)
     # falls with the cap (~6 -> ~2 us at 2 slots) while the rate stays >= 95% of 6 slots' at 2 slots.
     timeout 120 python3 bench/release_probe.py --inflight 6,3,2,1 --stream 0,1,2 --modes 0,3 --reps 3 \
       --out "$out/release_probe_inflight.md" 2>&1 | tail -24
     # MK_INFLIGHT computes what the default build computes: whole steps and graph replays against the VM
     timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py --mk-define MK_INFLIGHT=2 \
       -k "whole_step or graph_replay" 2>&1 | tail -3
     # the A/B at 1B (predicted in NOTES session 20: b1 -20..-60 us at cap 2, b8/b16 -20..-80; cap 1 loses rate)
     B="--build default --build MK_INFLIGHT=1 --build MK_INFLIGHT=2 --build MK_INFLIGHT=3"
     timeout 330 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 2 $B ;;
  2) # the A/B at 8B, the caps call 1 kept (CAPS="2 3" by default), and the race detector on the best cap
     B="--build default"; for c in ${CAPS:-2 3}; do B="$B --build MK_INFLIGHT=$c"; done
     timeout 360 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 $B
     timeout 100 python3 bench/race_stress.py --batch 1 3 16 --replays 300 --define MK_INFLIGHT=${BEST:-2} 2>&1 | tail -6 ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  3) vllm_env   # issues 11/12: 8B TBT, stock alternated with the megakernel, batch 8 / 16 at prompts 512 and 2048
     timeout 580 python3 bench/tbt.py --models llama-3.1-8b --batches 8,16 --prompts 512,2048 --modes megakernel \
       --rounds 2 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s27_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
