#!/usr/bin/env bash
# Session 30's GPU calls (bench/NOTES.md session 30). `bash bench/gpu_session37.sh N $OUT` from the project root,
# .commit carried. Calls 11, 12 carry one vLLM bundle part each (tracked bench/results/**/*.gz moved aside first: the
# 64 MiB limit), 3 the third part and unpack.sh; later vLLM calls reuse the unpacked tree while the machine is warm.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env(), tbt_1layer_profiled()
{
case $n in
  1) # issue 11: MK_WGA_X (MK_WGMMA_A's x staging; prediction and rule in bench/NOTES.md session 30) against the table,
     # 2 alternated rounds: 8B batch 9 / 12 / 16 (the table's wgmma_a entries; 9 takes batch 10's), 1B batch 16 (the table's rstd_epi entry);
     # MK_NUM_STAGES=5 on the table's tuning is the control of the 5-slot builds (4 x buffers)
     W=MK_W_TMA=1,MK_WGMMA_A=4
     # (and the in-flight cap on the 5-slot x = 2 build: the b16 phase trace's qkv / o_proj releases take ~2.5 us)
     timeout 400 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b \
       --batch 9 12 16 --rounds 2 --build default --build $W,MK_WGA_X=1 --build $W,MK_WGA_X=2 \
       --build $W,MK_WGA_X=2,MK_NUM_STAGES=5 --build MK_NUM_STAGES=5 --build $W,MK_WGA_X=2,MK_NUM_STAGES=5,MK_INFLIGHT=2
     timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b \
       --batch 16 --rounds 2 --build default --build $W --build $W,MK_WGA_X=2 --build $W,MK_WGA_X=2,MK_NUM_STAGES=5 ;;
  2) # issue 11: MK_WGA_X's GPU tests (reference, Triton, bitwise repeatable, op by op against the VM), then the phase
     # trace of the 5-slot x = 2 build at 8B batch 16 (against session 29's wgmma_a traces, trace_phases --compare)
     timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_wgmma_a_gpu.py -k "wga_x" 2>&1 | tail -8
     timeout 120 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 --define MK_W_TMA=1 \
       --define MK_WGMMA_A=4 --define MK_WGA_X=2 --define MK_NUM_STAGES=5 --records-dir "$out" \
       --model bench/models/llama-3.1-8b --batch 16 2>&1 | tail -2
     for f in "$out"/*.records.json.gz; do python3 -m mk_plugin.persistent.trace_phases "$f" 2>&1 | sed -n 1,14p; done ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  3) vllm_env   # issues 11 and 12: 8B, stock alternated with the megakernel, 2 rounds, batch 1 / 4 / 8 / 16, prompt
     # 512, on the current table (issue 11: <= 0.85x stock at b1 and b8; the paths table's in-vLLM rows, which decide
     # auto: the megakernel at b1 / 4 / 8 today, stock at b16; 4 engines of ~90 s: auto as a third mode does not fit)
     timeout 560 python3 bench/tbt.py --models llama-3.1-8b --batches 1,4,8,16 --prompts 512 \
       --modes megakernel --rounds 2 --runs 1 --outdir "$out" 2>&1 | grep -v "^(EngineCore" \
       | grep -v "^\[tbt\]   worker" | tail -30
     grep -h "decode path ready\|MK_MODE=auto" "$out"/logs/*.log 2>/dev/null | sort | uniq -c | head -12
     rm -rf "$out/logs" ;;
  4) vllm_env && tbt_1layer_profiled call4 ;;   # issue 12: the one-layer model and 1B, 3 alternated rounds, profiles
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s37_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
