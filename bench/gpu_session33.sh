#!/usr/bin/env bash
# Session 25's GPU calls (bench/NOTES.md session 24, "Next"). `bash bench/gpu_session33.sh N $OUT` from the project
# root, .commit carried; calls 11, 12 carry the vLLM bundle parts (move bench/results/**/*.gz aside first: the 64 MiB
# limit), 3 the third part and unpack.sh; 4 reuses the unpacked tree while the machine stays warm.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: MK_XPIPE (the staged one-n-tile pass's next-chunk x loads before this chunk's MMAs) and MK_FULLK
     # (full chunks without the per-k-step predicate, A fragments in two quads). Their bitwise GPU tests, then the
     # A/B over 2 rounds (NOTES session 24: predictions and rules). XPIPE: 1B b1 -5..-15 us, 8B b1 -5..-15, b8
     # 0..+10; FULLK: 1B b1 -5..-20, 8B b1 -10..-40, b8 -10..-50, b16 -20..-80 (one and two n-tiles).
     timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py -k "xpipe or fullk" 2>&1 | tail -3
     B="--build default --build MK_XPIPE=1 --build MK_FULLK=1 --build MK_XPIPE=1,MK_FULLK=1"
     timeout 170 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 2 $B
     timeout 250 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 $B ;;
  2) # issue 11, 8B batch 8 (0.907x Triton, bar 0.90x) and 16 on the XFRAG kernel: the release-gate masks of session
     # 21's call 9 (96: b8 -13; 114: b8 -38, b16 +99, on the older kernel), a 5-slot ring, the in-flight cap at 3
     # (b16 only: b8's entry sets 2). Carries part 0 of the vLLM bundle for call 3. Rule: a build that wins >= 0.7%
     # at b8 in both rounds becomes b8's tuning (release_gate is not a tuning field yet: it would become one).
     mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts
     B="--build default --build MK_RELEASE_GATE=96 --build MK_RELEASE_GATE=114 --build MK_NUM_STAGES=5 --build MK_INFLIGHT=3"
     timeout 300 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b --batch 8 16 --rounds 2 $B ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  3) vllm_env   # issue 12: 1B TBT with alternation and the GPU busy per step: stock / mk-stock / auto, 3 rounds
     timeout 580 python3 bench/tbt.py --models llama-3.2-1b --batches 1,8 --prompts 512 --modes mk-stock,auto \
       --rounds 3 --runs 3 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -24
     # at most 8 files come back: the engines' logs in one archive, the profiles summarised in the table already
     rm -f "$out"/logs/*payload*; tar czf "$out/logs_call3.tgz" -C "$out" logs && rm -rf "$out/logs" "$out/profiles" ;;
  4) vllm_env   # issue 12: the 8B batch x context sweep, stock against auto, one engine each (GPU-bound: 8B engines
     # of one mode agreed within 0.5% in session 22; two rounds would not fit one call)
     timeout 580 python3 bench/tbt.py --sweep --models llama-3.1-8b --modes auto --outdir "$out" 2>&1 \
       | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -30
     rm -f "$out"/logs/*payload* ;;
  5) vllm_env   # issue 12: serve 1B, stock against auto, 2 alternated rounds (session 24's one-run c8 row: 1.02x)
     timeout 590 python3 bench/serve.py --models llama-3.2-1b --modes auto --concurrency 1,8,16 --prompts 32 \
       --rounds 2 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -20
     tar czf "$out/logs_call5.tgz" -C "$out" logs && rm -rf "$out/logs" ;;   # at most 8 files come back
  6) vllm_env   # ad hoc after call 4 (8B auto slower than stock at long contexts): which path loses there. Run as
     # `n=6; out=$OUT; source bench/gpu_lib.sh; vllm_env; timeout 330 python3 bench/tbt.py ...` (this line's command; the
     # default 3 rounds did not fit: cut in round 2)
     timeout 330 python3 bench/tbt.py --models llama-3.1-8b --batches 2,8,16 --prompts 2048,8192 --modes triton,megakernel \
       --runs 1 --outdir "$out" 2>&1 | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -22; rm -rf "$out/logs" ;;
  7) # is the long-context attention bound by its consumers or by its copies? MK_DIAG=2 drops every weight / KV ring
     # copy (wrong results, timing only): if 8B b8 / b16 at ctx 8192 stay far above the no-copy matvec time, the
     # ring-fed attention's CUDA-core consumer loop is the bound (NOTES session 25)
     timeout 170 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b_ctx8192 \
       --ctx 8192 --batch 8 16 --rounds 1 --reps 30 --build default --build MK_DIAG=2 ;;
  8) # MK_RING_MMA (built after call 7): its GPU test against the reference, then 8B ctx 8192 b8 / b16 against the
     # default (both on their tuned entries: ring-fed attention at 128 tokens). Predicted (NOTES session 25): the
     # attention consumers 5-10x fewer instructions, the step -1..-2.5 ms at b16, -0.5..-1.1 at b8
     timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py -k tensor_core -x 2>&1 | tail -4
     timeout 120 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b_ctx8192 \
       --ctx 8192 --batch 16 8 --rounds 1 --reps 20 --build default --build MK_RING_MMA=1 ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s33_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
