#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with nsight-python and the packages it needs that the GPU host's image
# lacks, for Python 3.12 on x86-64, so bench/profile_ops.py can run there (the device entry of the
# tool library: wheels travel with `carry: [".whl"]`). Run here, on the CPU machine, from the root.
set -euo pipefail
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_25_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# Versions match the host's Nsight Compute (2025.3.1, H200 image of 2026-12): nsight-python >= 1.0 refuses
# an ncu older than 2026.2.1 ("Nsight Compute 2026.2.1.0 or later is required"), so 0.9.6 (same API as
# profile_ops.py uses) and the ncu-report of the same Nsight Compute release.
rm -f .whl/nsight_python-*.whl .whl/ncu_report-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl nsight-python==0.9.6 ncu-report==2025.3.1 deepdiff==9.1.0 orderly-set==5.5.0 "cachebox>=5.2,<6" \
  nvtx==0.2.17
ls -la .whl
# On the GPU host, first in the command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
