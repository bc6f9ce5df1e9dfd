# Shared by bench/gpu_calls.sh, sourced once `n` (the call name) and `out` (the output folder) are
# set: the run's header line, step() (mk_step with 100 replays, rows to $out/mk_step.csv, its timeout T or
# STEP_T, default 200 s), ab() (an mk_ab.py A/B, rows to $out/mk_ab.csv), edited_table (the H200 table edited
# for an A/B's base) and ab_without_gate (ab on the table without release gates), untuned_table (an empty table
# file: MK_TUNING set to it runs the untuned program), h100_table_ab (two H100 tables before / after, ABBA),
# copy_parts() / vllm_env() (the vLLM bundle's parts to /root/parts; unpack it once per
# machine, then install the checkout without dependencies), and the vLLM runs more than one call makes
# (serve_auto, tbt_1layer_profiled, soak).
export PYTHONUNBUFFERED=1
: "${n:?gpu_lib.sh: set n (the call name) first}" "${out:?gpu_lib.sh: set out (the output folder, e.g. \$OUT) first: records written elsewhere do not come back}"
commit=$(python3 bench/common.py)
echo "date $(date -u +%FT%TZ) call $n commit $commit"
step() { timeout "${T:-${STEP_T:-200}}" python3 bench/mk_step.py --reps 100 --csv "$out/mk_step.csv" "$@" 2>&1 | grep -v "^tuning" | tail -12; }
ab() {   # ab SECONDS MODEL ARGS...: bench/mk_ab.py on bench/models/MODEL (its column group), rows to $out/mk_ab.csv
  local t=$1 m=$2
  shift 2
  timeout "$t" python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model "bench/models/$m" --group "$m" "$@"
}
untuned_table() {   # an empty tuning table file in $out, its path printed: MK_TUNING set to it times the untuned program
  # (MK_TUNING unset reads the packaged table of this GPU, which an H100 has since session 40)
  echo '{"format": 1, "gpu": "none", "entries": []}' > "$out/empty_table.json" && echo "$out/empty_table.json"
}
edited_table() {   # edited_table NAME PY: the packaged H200 table with PY run on it (`d`, the parsed JSON), written to
  # $out/NAME.json and its path printed: an A/B's base table (MK_TUNING=$(edited_table ...) ab ...; remove it after)
  python3 -c 'import json, sys
d = json.load(open("mk_plugin/persistent/tuned/megakernel_nvidia_h200.json"))
exec(sys.argv[2])
json.dump(d, open(sys.argv[1], "w"), indent=1)' "$out/$1.json" "$2" && echo "$out/$1.json"
}
ab_without_gate() {   # ab's arguments, run on the packaged H200 table with every entry's release_gate / gate_ahead
  # dropped (the gate A/B calls' base), written to $out for the run and removed after it
  local table rc
  table=$(edited_table table_without_gate 'for e in d["entries"]:
    e["tuning"].pop("release_gate", None); e["tuning"].pop("gate_ahead", None)') || return 1
  MK_TUNING="$table" ab "$@"
  rc=$?
  rm -f "$table"
  return $rc
}
convert_traces() {   # every trace's records in $out: its PNG and per-op table, the phase table; the perfetto JSON
  # (large, never committed: `mk_plugin.trace convert` rebuilds it from the records) removed
  local f
  for f in "$out"/*.records.json.gz; do
    python3 -m mk_plugin.trace convert "$f" --outdir "$out" 2>&1 | tail -2
    python3 -m mk_plugin.persistent.trace_phases "$f" 2>&1 | sed -n 1,12p
  done
  rm -f "$out"/*.perfetto.json
}
h100_table_ab() {   # h100_table_ab BEFORE AFTER T "BATCHES" B4096: two H100 tuning tables (JSON files), 1B batch sizes
  # BATCHES at ctx 512 (timeout T) and B4096 at ctx 4096, 2 rounds ABBA, rows to $out/mk_step_{before,after}.csv; then the
  # packaged tables' GPU test on AFTER. Returns 2 on any other card (sessions 54-55's down K-split candidates).
  local before=$1 after=$2 t=$3 bs=$4 b4096=$5 order tab TAB
  if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then echo "$n: not an H100"; return 2; fi
  for order in "before after" "after before"; do
    for tab in $order; do
      if [ $tab = before ]; then TAB=$before; else TAB=$after; fi
      MK_TUNING=$TAB T=$t step --model bench/models/llama-3.2-1b --batch $bs --no-triton --csv "$out/mk_step_$tab.csv"
      MK_TUNING=$TAB T=45 step --model bench/models/llama-3.2-1b --batch $b4096 --ctx 4096 --no-triton \
        --csv "$out/mk_step_$tab.csv"
    done
  done
  # the GPU test reads the packaged table: this machine's copy of the tree gets the candidate (not committed here)
  cp "$after" mk_plugin/persistent/tuned/megakernel_nvidia_h100_80gb_hbm3.json
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_packaged_tables_gpu.py -k h100 2>&1 | tail -3
  git checkout -q -- mk_plugin/persistent/tuned/megakernel_nvidia_h100_80gb_hbm3.json 2>/dev/null || true
}
copy_parts() { mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ 2>/dev/null; }
vllm_env() {   # on an H100 the vLLM runs read the H100's own packaged tables, as a user's would (session 40), not
  # the H200 table gpu_calls.sh sets for the kernel calls
  unset MK_TUNING
  copy_parts
  [ -f /root/vsite/vllm/__init__.py ] || bash .gpuhost/unpack.sh /root/parts > /dev/null || exit 1
  export PYTHONPATH=/root/vsite VLLM_USE_FLASHINFER_SAMPLER=0
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
}
serve_auto() {   # issue 12: serve.py MODEL, stock and auto (c 1, 8, 16; extra args: e.g. --rounds 2)
  local model=$1; shift
  timeout 580 python3 bench/serve.py --models "$model" --modes auto --concurrency 1,8,16 \
    --prompts 32 --outdir "$out" "$@" 2>&1 | grep -v "^(APIServer" | tail -16
}
tbt_1layer_profiled() {   # issue 12: the one-layer model (vLLM's host floor) against stock, 3 alternated rounds with
  # profiles; the logs packed as $out/logs_$1.tgz (payloads dropped), the profiles removed
  timeout 590 python3 bench/tbt.py --models llama-3.2-1b-1layer --batches 1,8 --prompts 512 --modes auto \
    --rounds 3 --runs 3 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -20
  rm -f "$out"/logs/*payload*; tar czf "$out/logs_$1.tgz" -C "$out" logs && rm -rf "$out/logs" "$out/profiles"
}
soak() {   # the 2,000-request soak with preemption of MK_MODE=$1, its engines kept in /root/soak_work_$1 (extra args:
  # --engines-only for the first of its two calls; session 20's Triton soak took 434 s for the engines, 376 s for the verdict)
  local mode=$1; shift
  timeout 580 python3 bench/soak.py --requests 2000 --mode "$mode" --outdir "$out" --work "/root/soak_work_$mode" "$@" \
    2>&1 | grep -v "^(EngineCore" | tail -16
}
