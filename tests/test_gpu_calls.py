"""bench/gpu_calls.sh (the GPU host's named calls) on the CPU: it parses, and every MK_* name it uses is one the code
still reads -- a kernel build's -D switch (variant.VARIANT_DEFINES), an environment switch of mk_plugin.config, or
bench/sanitize.sh's own MK_SAN_* -- so a call can never name a switch that has left the kernel (session 34: most
of the 38 per-session scripts it replaced did)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mk_plugin import config
from mk_plugin.persistent.variant import VARIANT_DEFINES

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = (BENCH / "gpu_calls.sh", BENCH / "gpu_lib.sh")


def _known_names() -> set[str]:
    names = {d for d, _, _ in VARIANT_DEFINES}
    names |= set(re.findall(r"\bMK_[A-Z0-9_]+\b", Path(config.__file__).read_text()))
    names |= set(re.findall(r"\bMK_SAN_[A-Z0-9_]+\b", (BENCH / "sanitize.sh").read_text()))
    return names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script: Path):
    bash = shutil.which("bash")
    assert bash is not None, "bash not found on PATH"
    r = subprocess.run([bash, "-n", str(script)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"{script.name}: {r.stderr}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_switch_named_is_read_by_the_code(script: Path):
    used = set(re.findall(r"\bMK_[A-Z0-9_]+\b", script.read_text()))
    unknown = sorted(used - _known_names())
    assert not unknown, f"{script.name} names {unknown}: neither a kernel define, a config switch nor sanitize.sh's"


def test_every_named_call_is_listed_at_the_top():
    text = (BENCH / "gpu_calls.sh").read_text()
    calls = re.findall(r"^  ([a-z0-9_|]+)\)", text, re.MULTILINE)
    cases = {c.strip() for line in calls for c in line.split("|")}
    listed = set(re.findall(r"^#   ([a-z0-9_]+(?: [a-z0-9_]+)*)\s{2,}", text, re.MULTILINE))
    listed = {w for entry in listed for w in entry.split()}
    assert cases, "no calls found"
    assert cases == listed, f"calls {sorted(cases)} against the list at the top {sorted(listed)}"
