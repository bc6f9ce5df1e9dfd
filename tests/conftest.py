"""Test-suite rules, stated once and printed in the pytest header:

- No CUDA device: tests marked `gpu` are DESELECTED (they show up in the "deselected" count of the
  summary), and Triton runs in its CPU interpreter (TRITON_INTERPRET=1, set before triton loads).
- With a CUDA device: everything runs; `pytest -m gpu` runs only the GPU tests at realistic sizes.
- `--mk-define NAME=VALUE` (repeatable) compiles the megakernel of the GPU tests with -DNAME=VALUE:
  the same correctness tests for a kernel variant (bench/final_gpu_run.sh).
"""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--mk-define", action="append", default=[], metavar="NAME=VALUE",
                     help="compile the megakernel of the gpu tests with -DNAME=VALUE (repeatable)")


def pytest_report_header(config):
    if HAS_CUDA:
        defs = config.getoption("--mk-define")
        return (f"mk_plugin: CUDA device {torch.cuda.get_device_name()}: gpu tests enabled"
                + (f"; megakernel defines {defs}" if defs else ""))
    return ("mk_plugin: no CUDA device: tests marked 'gpu' are deselected (rule in tests/conftest.py); "
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    gpu = [it for it in items if it.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [it for it in items if not it.get_closest_marker("gpu")]


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="session")
def mk_defines(pytestconfig) -> tuple[str, ...]:
    """-D options for MegakernelDecoder(defines=...) from --mk-define."""
    return tuple(f"-D{d}" for d in pytestconfig.getoption("--mk-define"))
