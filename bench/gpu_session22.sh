#!/usr/bin/env bash
# Session 17's GPU calls (bench/NOTES.md session 16, "Next"). Run from the project root on the GPU host with
# .commit carried; output under $2 (default $OUT). Calls 1-3 need no vLLM; the vLLM calls 11, 12 (carrying
# .gpuhost/part.0 / part.1), then 4 with part.2 and unpack.sh, as gpu_session20.sh's.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
Q="MK_BULK_RELEASE=1,MK_BULK_QKV=1"
{
case $n in
  1) # issue 11: is MK_BULK_RELEASE race-free, and does MK_BULK_QKV add to it?
     # (a) the race detector: 2,000 (1B) / 600 (8B) replays per batch, scratch poisoned in the graph, each
     # replay compared bitwise with the first. The default build is the control: it must show 0.
     for d in "" "--define MK_BULK_RELEASE=1" "--define MK_BULK_RELEASE=2" \
              "--define MK_BULK_RELEASE=1 --define MK_BULK_QKV=1"; do
       timeout 120 python3 bench/race_stress.py --batch 1 3 8 --replays 2000 $d 2>&1 | grep -E "^llama|Error|error" | head -4
     done
     for d in "" "--define MK_BULK_RELEASE=1 --define MK_BULK_QKV=1"; do
       timeout 120 python3 bench/race_stress.py --model bench/models/llama-3.1-8b --batch 1 4 --replays 600 $d 2>&1 \
         | grep -E "^llama|Error|error" | head -3
     done
     # (b) session 16's failing op-by-op case, repeated with its failure lines kept
     t="tests/test_persistent_gpu.py::test_megakernel_vs_vm_op_by_op[llama-3.2-1b-2-seq_lens1]"
     for m in 1 1 1 1 1 2 2 2 2 2; do
       r=$(timeout 40 python3 -m pytest -m gpu -q -p no:cacheprovider "$t" --mk-define MK_BULK_RELEASE=$m 2>&1 \
           | grep -E "^E .*\{|passed|failed" | cut -c1-400 | tr '\n' ' '); echo "BULK=$m: $r"
     done
     # (c) the A/B. Predicted MK_BULK_QKV on top of MK_BULK_RELEASE=1: 1B batch 1 -10..-15 us (qkv's release 1.2 ->
     # ~0.4 us per layer), batch 4 -5..-10; 8B batch 1 -30..-60, batch 4 -20..-40; batch 8 (no qkv bulk) +-noise
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 4 8 --rounds 3 \
       --build default --build MK_BULK_RELEASE=1 --build $Q --build MK_BULK_RELEASE=2,MK_BULK_QKV=1
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 4 8 --rounds 2 \
       --build default --build MK_BULK_RELEASE=1 --build $Q
     # (d) attention's share of the SM's loads: hold the next task's weights after attention too (gate mask 36 =
     # gate_up | attn_partial; never measured alone: session 8 measured 96, 48, 50, 126). Predicted batch 16 ctx 4096
     # -5..-15% if attention is slowed by the weight copies in flight, +1..+3% at ctx 512 batch 1 if not.
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group "1b ctx4096" --ctx 4096 \
       --batch 1 16 --rounds 2 --build default --build MK_RELEASE_GATE=36
     # and where attention's time goes there (phase traces of both builds: KV loop vs merges, per task)
     for d in "" "--define MK_RELEASE_GATE=36"; do
       timeout 60 python3 bench/mk_step.py --reps 30 --no-triton --trace --define MK_TRACE_PHASES=1 $d --ctx 4096 \
         --records-dir "$out" --model bench/models/llama-3.2-1b --batch 16 2>&1 | grep -E "attn_partial|step_us|megakernel"
     done ;;
  2) # issue 11: MK_ATT_TMA (attention's K/V through the ring by tensor-map copies; built without device time).
     # Correctness first: the op-by-op GPU-vs-VM cases, the whole step, graph replays, the tensor-map encode,
     # then the race detector (its copies stream before the dependency: the newest token must come from global
     # memory), then the A/B. Predicted (bench/NOTES.md session 16): 1B ctx 512 batch 1 -10..-25 us, batch 8
     # -40..-80, batch 16 -100..-175; ctx 4096 batch 16 -500..-750; 8B ctx 4096 batch 16 -1.5..-2.6 ms.
     timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_tensormap.py \
       -k "vs_vm or whole_step or graph or driver_encodes" --mk-define MK_ATT_TMA=1 2>&1 \
       | grep -E "^E .*(assert not|: \{)|passed|failed|FAILED" | cut -c1-400 | head -12
     timeout 90 python3 bench/race_stress.py --batch 1 3 16 --replays 500 --define MK_ATT_TMA=1 2>&1 \
       | grep -E "^llama|Error|error" | head -4
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 3 \
       --build default --build MK_ATT_TMA=1
     # with the KV in the ring a task's token count costs little: fewer chunks at batch 1 (fewer partials to
     # merge on the chain; C = 16 today, 32 tokens per task). Predicted chunks=8 -3..-8 us over MK_ATT_TMA alone
     timeout 120 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 --rounds 3 \
       --build MK_ATT_TMA=1 --build MK_ATT_TMA=1,chunks=8 --build MK_ATT_TMA=1,chunks=4
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group "1b ctx4096" --ctx 4096 \
       --batch 1 16 --rounds 2 --build default --build MK_ATT_TMA=1
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group "8b ctx4096" --ctx 4096 \
       --batch 1 16 --rounds 2 --build default --build MK_ATT_TMA=1
     timeout 60 python3 bench/mk_step.py --reps 30 --no-triton --trace --define MK_TRACE_PHASES=1 --define MK_ATT_TMA=1 \
       --ctx 4096 --records-dir "$out" --model bench/models/llama-3.2-1b --batch 16 2>&1 | grep -E "attn_partial|megakernel" ;;
  3) # the winners' gpu tests (all of test_persistent_gpu.py) and the sanitizer on them (2 layers, batch 1 and 8):
     # WIN="MK_BULK_RELEASE=1 MK_ATT_TMA=1" bash bench/gpu_session22.sh 3
     md=""; for d in ${WIN:?set WIN to the winning defines}; do md="$md --mk-define $d"; done
     timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py $md 2>&1 | tail -4
     MK_SAN_DEFINES="$WIN" MK_SAN_BATCHES="1 8" MK_SAN_TIMEOUT=100 timeout 280 bash bench/sanitize.sh "$out" 2 2>&1 \
       | grep -E "SUMMARY|exit code" ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  4) vllm_env   # issue 11's vLLM target: 8B TBT with MK_MODE=megakernel <= 0.85x stock at batch 1 and 8
     timeout 580 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 --modes megakernel \
       --rounds 2 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  5) vllm_env   # issue 13: the Triton mode's 2,000-request soak, engines first (kept in /root/soak_work) ...
     timeout 580 python3 bench/soak.py --requests 2000 --mode triton --outdir "$out" --work /root/soak_work \
       --engines-only 2>&1 | grep -v "^(EngineCore" | tail -8 ;;
  6) vllm_env   # ... then the same soak again: its engines reused, the fp32 verdict (stock control included)
     timeout 580 python3 bench/soak.py --requests 2000 --mode triton --outdir "$out" --work /root/soak_work \
       2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  *) echo "no call $n here: see bench/gpu_session21.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s22_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
