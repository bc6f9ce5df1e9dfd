# Shared by bench/gpu_session*.sh, sourced once `n` (the call number) and `out` (the output folder) are
# set: the run's header line, step() (mk_step with 100 replays, rows to $out/mk_step.csv, its timeout T or
# STEP_T, default 200 s) and vllm_env() (unpack the vLLM bundle once per machine, then install the
# checkout without dependencies).
export PYTHONUNBUFFERED=1
commit=$(python3 bench/common.py)
echo "date $(date -u +%FT%TZ) call $n commit $commit"
step() { timeout "${T:-${STEP_T:-200}}" python3 bench/mk_step.py --reps 100 --csv "$out/mk_step.csv" "$@" 2>&1 | grep -v "^tuning" | tail -12; }
vllm_env() {
  mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ 2>/dev/null
  [ -f /root/vsite/vllm/__init__.py ] || bash .gpuhost/unpack.sh /root/parts > /dev/null || exit 1
  export PYTHONPATH=/root/vsite VLLM_USE_FLASHINFER_SAMPLER=0
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
}
