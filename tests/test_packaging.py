"""A plain (non-editable) install ships the megakernel sources: build the wheel, install it without
-e into a temporary folder and, in a fresh interpreter that sees that folder and not the checkout,
check that the runtime finds the sources in the package (same source hash as the checkout), that
nvcc compiles them for sm_90a, and that `python -m mk_plugin check` passes with both decode paths."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, subprocess, sys, tempfile, os
import mk_plugin
from mk_plugin.persistent.runtime import CSRC, build_source, compile_options, source_hash
from mk_plugin.spec import LlamaSpec
spec = LlamaSpec.tiny()
src = os.path.join(tempfile.mkdtemp(), "mk.cu")
open(src, "w").write(build_source())
opts = [o.replace("--gpu-architecture=", "-arch=") for o in compile_options(spec)]
r = subprocess.run([NVCC, *opts, "-cubin", "-o", src + ".cubin", src], capture_output=True, text=True)
print(json.dumps({"package": mk_plugin.__file__, "csrc": str(CSRC), "hash": source_hash(),
                  "nvcc_rc": r.returncode, "nvcc_log": (r.stdout + r.stderr)[-2000:]}))
"""


def _fresh_python(site: Path, code: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """python -S (no site-packages processing: the checkout's editable-install hook stays out) with the
    install folder first and this interpreter's site-packages (torch, triton, numpy) after it."""
    libs = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    boot = f"import sys; sys.path[:0] = [{str(site)!r}]; sys.path += {libs!r}\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-S", "-c", boot + code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip"]
    r = subprocess.run([*pip, "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(ROOT)], capture_output=True,
                       text=True, timeout=900, check=False)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    (whl,) = (tmp / "dist").glob("mk_plugin-*.whl")
    r = subprocess.run([*pip, "install", "--no-deps", "--no-compile", "-q", "--target", str(tmp / "site"), str(whl)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, f"pip install --target failed:\n{r.stderr[-3000:]}"
    return tmp / "site"


def _nvcc() -> str:
    for c in ("/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if c and os.path.exists(c):
            return c
    raise AssertionError("nvcc not found (CI machines carry nvcc 13.0): a broken machine, not a skip")


def test_wheel_finds_and_compiles_its_kernel_sources(installed, tmp_path):
    from mk_plugin.persistent.runtime import source_hash

    r = _fresh_python(installed, f"NVCC = {_nvcc()!r}\n" + PROBE, tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["package"]).resolve().is_relative_to(installed.resolve()), got["package"]
    assert Path(got["csrc"]).resolve() == (installed / "mk_plugin" / "csrc").resolve()
    assert got["hash"] == source_hash(), "the wheel's kernel sources differ from the checkout's"
    assert got["nvcc_rc"] == 0, got["nvcc_log"]


def test_wheel_check_command_passes_both_paths(installed, tmp_path):
    code = ("import os, sys, runpy\nos.environ.setdefault('TRITON_INTERPRET', '1')\n"
            "sys.argv = ['mk_plugin', 'check', '--batch', '2']\nrunpy.run_module('mk_plugin', run_name='__main__')\n")
    r = _fresh_python(installed, code, tmp_path, timeout=600)
    out = r.stdout
    assert r.returncode == 0 and "ALL PASS" in out, out[-3000:] + r.stderr[-2000:]
    assert "decode_step logits vs pure fp32 ref" in out and "megakernel (vm) logits vs pure fp32 ref" in out


def test_wheel_has_every_subpackage_and_data_file(installed):
    pkg = ROOT / "mk_plugin"
    want = sorted(str(p.relative_to(ROOT)) for p in pkg.rglob("*") if p.is_file()
                  and (p.suffix == ".py" or p.parent.name == "tuned") and "__pycache__" not in p.parts)
    want += sorted(f"mk_plugin/csrc/{p.name}" for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh", ".h"))
    missing = [w for w in want if not (installed / w).is_file()]
    assert not missing, f"the wheel lacks {missing} (pyproject.toml [tool.setuptools] packages / package-data)"
