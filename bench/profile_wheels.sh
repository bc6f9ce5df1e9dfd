#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with nsight-python and the packages it needs that the GPU host's image
# lacks, for Python 3.12 on x86-64, so bench/profile_ops.py can run there (the device entry of the
# tool library: wheels travel with `carry: [".whl"]`). Run here, on the CPU machine, from the root.
set -euo pipefail
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_25_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl nsight-python==1.1.0 ncu-report==2026.3.1 deepdiff==9.1.0 orderly-set==5.5.0 "cachebox>=5.2,<6" \
  nvtx==0.2.17
ls -la .whl
# On the GPU host, first in the command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
