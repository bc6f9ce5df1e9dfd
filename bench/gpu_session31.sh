#!/usr/bin/env bash
# Session 24's GPU calls (bench/NOTES.md session 23, "Next"). Run from the project root on the GPU host with
# .commit carried: `bash bench/gpu_session31.sh N $OUT` (out must be set: records written elsewhere do not come
# back), in the order 1, 8, 11, 12, 3, 4, then 5, 6, 7 if time is left. Calls 1 and 8 need no vLLM; 11 and 12 carry the
# bundle parts (move bench/results/**/*.gz aside first: the 64 MiB carry limit), 3 the third part and unpack.sh;
# 4-7 reuse the unpacked tree while the machine stays warm.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env(), serve_1b_auto(), soak_megakernel()
{
case $n in
  1) # issue 11: the per-chunk fragment build (MK_DIAG=16: at NT = 1 a pass's first chunk's activation fragments
     # serve all its chunks; wrong results, timing only). Predicted (NOTES session 23): 1B b1 -30..-60 us, 8B b1
     # -80..-150, 1B / 8B b8 -50..-150 if the fragment build is most of the ~0.6-0.7 us fixed per column step.
     # Rule: > ~3% at 8B b1 -> a branch-free fragment build is next; < ~1% -> the MMA / ring side of the loop.
     # MK_XFRAG=1 (the branch-free fragment build, built for the case the diag shows a price): its bitwise test
     # first, then in the same A/B. Predicted: 1B b1 -15..-30 us, 8B b1 -40..-80 (about half of what the diag
     # frees at batch 1, where lanes 4..31 skip the loads today), b8 0..-2% (column groups: no lane masked there,
     # only the loads' overlap changes). Kept if it gains > 1% at batch 1 with b8 not slower.
     timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py -k xfrag 2>&1 | tail -3
     B="--build default --build MK_DIAG=16 --build MK_XFRAG=1"
     timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b --batch 1 8 --rounds 2 $B
     timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b --batch 1 8 --rounds 2 $B
     # ... and the phase traces of both builds at 1B b1 (chunk phase per op: what the diag removed, per chunk)
     for d in "" "--define MK_DIAG=16"; do
       timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 $d \
         --records-dir "$out" --model bench/models/llama-3.2-1b --batch 1 2>&1 | tail -3
     done
     for f in "$out"/*.records.json.gz; do python3 -m mk_plugin.persistent.trace_phases "$f" 2>&1 | sed -n 1,12p; done ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  3) vllm_env   # issue 12: the real client, 8B, stock against the default mode (auto) at concurrency 1 / 8 / 16
     # (the serve rows are from 2026-12-01, before the session-21 entries); the startup of each server is in its log
     timeout 580 python3 bench/serve.py --models llama-3.1-8b --modes auto --concurrency 1,8,16 \
       --prompts 32 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -16 ;;
  4) vllm_env   # issue 12: the same for 1B (host-bound: one server each; the medians need the spread)
     serve_1b_auto ;;
  5) vllm_env   # issue 11's done-when (the vLLM checks on the kernel as it stands): the megakernel's soak, engines
     soak_megakernel --engines-only ;;
  6) vllm_env   # ... then the fp32 verdict over the same engines' outputs (stock control included)
     soak_megakernel ;;
  7) vllm_env   # issue 12: why auto's 1B rounds sat above stock's with less GPU work: our class on the stock path
     # (mk-stock) against auto and stock, 2 alternated rounds, in one job
     timeout 560 python3 bench/tbt.py --models llama-3.2-1b --batches 1,8 --prompts 512 --modes mk-stock,auto \
       --rounds 2 --outdir "$out" 2>&1 | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -16
     rm -f "$out"/logs/*payload* ;;
  8) # issue 11: can L2 hold the next op's weights across the 1B batch-1 chain and hand them out faster than HBM?
     # bulk_probe re-reads the same region every launch, so at a few tens of MB its timed launches stream from L2
     # (warm) with the megakernel's copy pattern; 0.5 GB is the HBM reference. Rule: the per-row KC 1024 NS 6 rows'
     # marginal rate between sizes >= ~1.5x the HBM row -> L2 parking has headroom (NOTES session 23); <= ~1.2x ->
     # the chain itself must shrink. (Each launch also pays its start and ring fill: compare sizes, not one row.)
     for g in 0.018 0.035 0.052 0.5; do   # 17.3 / 34.6 / 51.9 MB: the probe cuts rows in 16s
       timeout 100 python3 bench/bulk_probe.py --gb $g --reps 20 --out "$out/bulk_probe_l2_${g}.md" 2>&1 | tail -1
       grep "per-row | 1024 | 2048 | 16 | 6 " "$out/bulk_probe_l2_${g}.md"
     done
     cp bench/results/bulk_probe.csv "$out/" ;;   # its rows (the device's copy of the CSV does not come back)
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s31_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
