"""Test-suite rules, stated once and printed in the pytest header:

- No CUDA device: tests marked `gpu` are DESELECTED (they show up in the "deselected" count of the
  summary), and Triton runs in its CPU interpreter (TRITON_INTERPRET=1, set before triton loads).
- With a CUDA device: everything runs; `pytest -m gpu` runs only the GPU tests at realistic sizes.
- `--mk-define NAME=VALUE` (repeatable: MK_ROUNDING, MK_NUM_STAGES) builds the GPU tests' megakernel variant:
  the same correctness tests for a kernel variant (e.g. --mk-define MK_NUM_STAGES=5).
"""
from __future__ import annotations

import os
from dataclasses import replace

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
def mk_variant(pytestconfig):
    """The megakernel variant of the GPU tests (variant.KernelVariant) from --mk-define NAME=VALUE."""
    from mk_plugin.persistent.variant import KernelVariant

    return KernelVariant.parse(pytestconfig.getoption("--mk-define"))


@pytest.fixture(scope="module")
def models():
    """get(name, layers) -> (spec, weights): a bench/models shape with `layers` layers ("tiny": LlamaSpec.tiny()), random
    weights drawn on the GPU, cached per module (the GPU tests; helpers in tests/gpu_helpers.py)."""
    try:  # a GPU machine without CuPy cannot run the product: fail, never skip
        import cupy  # noqa: F401
    except ImportError as e:
        pytest.fail(f"CuPy is not importable on this GPU machine ({e}); pip install -e '.[cuda]'")
    from gpu_helpers import DEV, spec_of  # after TRITON_INTERPRET is set

    from mk_plugin.weights import random_weights

    cache: dict[str, tuple] = {}

    def get(name: str, layers: int):
        key = f"{name}/{layers}"
        if key not in cache:
            spec = spec_of(name, layers)
            cache[key] = (spec, random_weights(spec, seed=len(cache), device=DEV, draw_on_device=True))
        return cache[key]

    return get


# ---- a deliberately corrupted program (the watchdog tests), as a fixture: test modules never import
# each other, and the package carries no code that only tests use.
def with_unsatisfiable_wait(program, tid: int | None = None):
    """A deliberately corrupted copy of `program` (tests of the watchdog): task `tid` (default: the
    first task of the middle op that has a wait) waits for its counter to reach one more than the
    counter's total, which never happens. vm.check_deadlock_free rejects the result; on the GPU the
    watchdog fires on the SM that runs that task."""
    from mk_plugin.persistent.encoding import TASK_WORDS, F, H  # after TRITON_INTERPRET is set
    from mk_plugin.persistent.schedule import Segment

    segs = [s for s in program.steps if isinstance(s, Segment)]
    cands = [(si, i) for si, s in enumerate(segs) for i, w in enumerate(s.waits) if w]
    if tid is not None:
        cands = [(si, i) for si, i in cands if segs[si].tasks[i].tid == tid]
        if not cands:
            raise ValueError(f"task {tid} is not a megakernel task with a dependency wait")
    elif not cands:
        raise ValueError("the program has no megakernel task with a dependency wait")
    si, i = cands[len(cands) // 2] if tid is None else cands[0]
    seg = segs[si]
    (c, _), *rest = seg.waits[i]
    waits = [list(w) for w in seg.waits]
    waits[i] = [(c, program.counters[c].total + 1), *rest]
    words = seg.encoded.copy()
    at = int(words[H["tasks_at"]])
    pos = [t for q in seg.queues for t in q].index(i)   # the record's slot in the encoded task array
    rec = at + pos * TASK_WORDS
    assert words[rec + F["tid"]] == seg.tasks[i].tid and words[rec + F["wait0_ctr"]] == c
    words[rec + F["wait0_target"]] = program.counters[c].total + 1
    bad = replace(seg, waits=waits, encoded=words)
    return replace(program, steps=[bad if s is seg else s for s in program.steps])


@pytest.fixture(scope="session")
def unsatisfiable_wait():
    """with_unsatisfiable_wait(program, tid=None) -> the corrupted copy (see its docstring)."""
    return with_unsatisfiable_wait
