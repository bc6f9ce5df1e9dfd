"""Shared helpers of the GPU bench scripts (tbt.py, vllm_correctness.py): provenance (commit, GPU,
vLLM version), one vLLM engine per child process with the env of a mode, result hand-off from child
to parent, CSV/markdown writing. Importing this module imports neither torch nor vLLM."""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "bench" / "models"
RESULTS = REPO / "bench" / "results"
RESULT_MARK = "MK_BENCH_RESULT "
HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak; the floor every TBT is compared against

# Modes a child can run in. "stock" is vLLM without the plugin (VLLM_PLUGINS=""); "mk-stock" loads
# the plugin with MK_MODE=stock (our class, stock path: shows the wrapper costs nothing).
MODES = ("stock", "mk-stock", "triton", "megakernel", "auto")
PLUGIN_MODES = ("triton", "megakernel", "auto")
RUNNERS = ("default", "v1", "v2")


# ---- provenance ------------------------------------------------------------------------------------
def today() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")


def _git(*args: str, repo: Path = REPO) -> str | None:
    try:
        c = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return c.stdout.strip() if c.returncode == 0 else None


def git_commit(repo: Path = REPO) -> str:
    """The commit the results belong to. `.commit` (written with `git rev-parse --short HEAD > .commit`, then
    committed, and carried to the GPU host, whose copy of the tree has stale git metadata: runs there reported an
    old HEAD) wins unless the checkout's history shows it stale: it wins when git does not know its commit (the
    host's metadata predates it), when HEAD is that commit or an ancestor of it (stale metadata), or when the code
    since it differs only in `.commit` itself (the commit that recorded it). Otherwise (a fresh clone, or a .commit
    left behind by later work) the checkout's short commit, '+dirty' when it has changes."""
    head = _git("rev-parse", "--short", "HEAD", repo=repo)
    f = repo / ".commit"
    rec = f.read_text().strip() if f.exists() else ""
    if rec and (head is None or _commit_file_current(rec, repo)):
        return rec
    if head:
        dirty = _git("status", "--porcelain", "--untracked-files=no", repo=repo)
        return head + ("+dirty" if dirty else "")
    return "unknown"


def _commit_file_current(rec: str, repo: Path) -> bool:
    """Whether `.commit`'s commit rec still names the checkout's code (git_commit's rule)."""
    if _git("cat-file", "-e", f"{rec}^{{commit}}", repo=repo) is None:
        return True   # unknown here: the GPU host's stale metadata
    if _git("merge-base", "--is-ancestor", "HEAD", rec, repo=repo) is not None:
        return True   # HEAD is rec or older: stale metadata
    if _git("merge-base", "--is-ancestor", rec, "HEAD", repo=repo) is None:
        return False  # another branch
    changed = _git("diff", "--name-only", rec, "HEAD", repo=repo)
    return changed is not None and set(changed.split()) <= {".commit"}


def run_stamp() -> str:
    """<date>_<commit> for result file names: two runs on one day must not overwrite each other."""
    return f"{today()}_{git_commit().replace('+', '-')}"


def write_record(outdir: Path, name: str, text: str) -> Path:
    """Print a markdown record and write it to outdir/name (the file a run leaves in bench/results)."""
    print(text)
    outdir.mkdir(parents=True, exist_ok=True)
    out = outdir / name
    out.write_text(text)
    print(f"written: {out}")
    return out


def gpu_name() -> str:
    """GPU name from nvidia-smi (no CUDA context in the parent), else 'unknown'."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20, check=False)
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def gpu_memory_used_mib() -> int | None:
    """Memory in use on GPU 0 (nvidia-smi), None when it cannot be read."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20, check=False)
        if p.returncode == 0 and p.stdout.strip():
            return int(p.stdout.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return None


_BASELINE_MIB: list[int | None] = []


def wait_gpu_released(timeout: float = 120.0) -> None:
    """Before starting an engine: wait until the previous child's engine processes have given the
    GPU memory back (vLLM refuses to start when free memory is below gpu_memory_utilization)."""
    if not _BASELINE_MIB:
        _BASELINE_MIB.append(gpu_memory_used_mib())  # first call: nothing of ours is running yet
        return
    base = _BASELINE_MIB[0]
    if base is None:
        time.sleep(5)
        return
    t0 = time.time()
    while time.time() - t0 < timeout:
        used = gpu_memory_used_mib()
        if used is None or used <= base + 1024:
            return
        time.sleep(2)
    print(f"warning: GPU memory still {gpu_memory_used_mib()} MiB used (baseline {base} MiB) after {timeout:.0f} s",
          file=sys.stderr)


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return "unknown"


# ---- models ----------------------------------------------------------------------------------------
def model_dir(name: str) -> Path:
    """'llama-3.2-1b', '1b', '8b' or a path to a folder with a config.json."""
    aliases = {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}
    p = Path(name)
    if p.is_dir():
        return p.resolve()
    p = MODELS / aliases.get(name.lower(), name)
    if not (p / "config.json").exists():
        known = ", ".join(sorted(d.name for d in MODELS.iterdir() if (d / "config.json").exists()))
        raise SystemExit(f"unknown model {name!r}: give a folder with config.json or one of: {known}")
    return p


def load_hf_config(mdir: Path) -> dict[str, Any]:
    return json.loads((Path(mdir) / "config.json").read_text())


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def max_model_len_for(prompt: int, output: int, multiple: int = 16) -> int:
    """prompt + output + 16 tokens of slack, rounded up to a whole KV block."""
    return round_up(prompt + output + 16, multiple)


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else float("nan")


# ---- kernel benches (torch is imported inside: this module stays torch-free) ------------------------
def bench_decode_batch(spec: Any, seq_lens: Sequence[int], seed: int, device: Any, generator: Any = None
                       ) -> tuple[Any, list[Any], Any, Any, Any, Any]:
    """A decode batch for the kernel benches (mk_step, autotune, sanitize, profile_ops): the testing
    batch of seq_lens (its own caches not built), N(0, 1) KV caches in the model dtype with 4 spare
    blocks, and its positions, seq_lens, block_table and slot_mapping on `device`."""
    import torch

    from mk_plugin.testing import make_decode_batch

    b = make_decode_batch(spec, list(seq_lens), seed=seed, num_layers=0)
    nb = int(b.block_table.max()) + 4
    caches = [torch.randn(nb, 2, 16, spec.num_kv_heads, spec.head_dim, generator=generator, device=device)
              .to(spec.torch_dtype) for _ in range(spec.num_layers)]
    pos, sl, bt, slots = (t.to(device) for t in (b.positions, b.seq_lens, b.block_table, b.slot_mapping))
    return b, caches, pos, sl, bt, slots


# ---- the CUDA probes (bulk_probe.py, release_probe.py) ---------------------------------------------
def inline_includes(source: Path) -> str:
    """A probe's .cu text with its local `#include "X"` lines replaced by X's text (from the same folder, once
    each, `#pragma once` dropped): NVRTC (CuPy RawModule) gets one self-contained source, as nvcc does."""
    seen: set[str] = set()

    def expand(path: Path) -> str:
        out = []
        for line in path.read_text().splitlines():
            name = line.strip()[len('#include "'):-1] if line.strip().startswith('#include "') else None
            if name is not None:
                if name not in seen:
                    seen.add(name)
                    out.append(expand(path.parent / name))
            elif line.strip() != "#pragma once":
                out.append(line)
        return "\n".join(out)

    return expand(source) + "\n"


def probe_compile_options(arch: str) -> tuple[str, ...]:
    """A probe's NVRTC options, as the project's runtime.py (nvcc takes -arch=X for --gpu-architecture=X)."""
    return ("-std=c++17", f"--gpu-architecture={arch}")


def handoff_ns(total_ns: int, iters: int) -> float:
    """A ping-pong probe's ns per hand-off: one round is two hand-offs (CTA 0 -> 1 -> 0)."""
    if iters < 1:
        raise ValueError(f"iters {iters}: want >= 1")
    return total_ns / (2 * iters)


def int_list(text: str) -> list[int]:
    """A probe's comma-separated integer option ("0,1,2" -> [0, 1, 2]), or SystemExit naming the text."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"{text!r}: want comma-separated integers") from None


def probe_device(tool: str) -> tuple[Any, dict]:
    """(cupy, the current device's properties) for a cp.async.bulk probe, or SystemExit naming what is missing
    (CuPy, a GPU, sm_90)."""
    try:
        import cupy as cp
    except ImportError as e:
        raise SystemExit(f"{tool} needs CuPy and a CUDA GPU (cupy import failed: {e})") from e
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as e:
        raise SystemExit(f"{tool} needs a CUDA GPU: {e}") from e
    if n == 0:
        raise SystemExit(f"{tool} needs a CUDA GPU: none is visible")
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    if props["major"] < 9:
        raise SystemExit(f"cp.async.bulk needs sm_90 or newer; this GPU is sm_{props['major']}{props['minor']}")
    return cp, props


# ---- child processes -------------------------------------------------------------------------------
def plugin_entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "mk_plugin" for ep in entry_points(group="vllm.general_plugins"))


def ensure_plugin_visible() -> Path | None:
    """vLLM finds plugins only through installed entry points: when mk_plugin is not pip-installed,
    make a temporary shim (and say so); returns its path, or None when nothing was needed."""
    if plugin_entry_point_installed():
        return None
    shim = make_plugin_shim(Path(tempfile.mkdtemp(prefix="mk_shim_")))
    print(f"note: mk_plugin is not pip-installed; using an entry-point shim at {shim}")
    return shim


def make_plugin_shim(where: Path) -> Path:
    """A dist-info folder that lets importlib.metadata find the mk_plugin entry point without a pip
    install (put it and the repo on PYTHONPATH). Used only when the package is not installed."""
    d = Path(where) / "mk_plugin_bench_shim"
    info = d / "mk_plugin_bench_shim-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mk-plugin-bench-shim\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nmk_plugin = mk_plugin.vllm_adapter:register\n")
    return d


class _MkEnvAction(argparse.Action):
    """Accumulates --mk-env items into a checked dict (parse_mk_env); a bad item is a usage error."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any,
                 option_string: str | None = None) -> None:
        try:  # checked together with the earlier items: config validation sees the whole set
            env = parse_mk_env([*(f"{k}={v}" for k, v in getattr(ns, self.dest).items()), value])
        except ValueError as e:
            parser.error(str(e))
        setattr(ns, self.dest, env)


def add_mk_env_arg(p: argparse.ArgumentParser) -> None:
    """--mk-env NAME=VALUE (repeatable): MK_* switches for the plugin children only (stock runs
    without the plugin), e.g. --mk-env MK_ROUNDING=stock. Parsed and checked while the command line
    is read: args.mk_env is the dict child_env(mk_env=...) takes."""
    p.add_argument("--mk-env", action=_MkEnvAction, default={}, metavar="MK_NAME=VALUE",
                   help="an MK_* switch for the plugin runs (repeatable), e.g. MK_ROUNDING=stock")


def mk_env_text(env: dict[str, str]) -> str:
    """The --mk-env settings as written on the command line (for record headers)."""
    return " ".join(f"{k}={v}" for k, v in env.items())


def parse_mk_env(items: Sequence[str]) -> dict[str, str]:
    """The --mk-env list as a dict, checked now (mk_plugin.config) so a typo fails before any engine
    starts. MK_MODE is the script's own --mode and cannot be set here."""
    from mk_plugin.config import MkConfig

    env: dict[str, str] = {}
    for it in items:
        name, sep, value = it.partition("=")
        if not sep or not name.startswith("MK_") or name == "MK_MODE":
            raise ValueError(f"--mk-env {it!r}: want MK_NAME=VALUE (not MK_MODE: use --mode)")
        env[name] = value
    MkConfig.from_env(env)  # raises ConfigError naming the bad value
    return env


def split_mode(label: str) -> tuple[str, dict[str, str]]:
    """A --modes entry: one of MODES, optionally followed by MK_* switches for that mode only, joined by '+'
    (`megakernel+MK_LM_HEAD=megakernel`): (mode, switches). Two entries of one mode with different switches are
    measured side by side in one job. Raises ValueError naming what is wrong."""
    mode, *items = label.split("+")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} of {label!r}; choose one of {MODES}")
    if items and mode == "stock":
        raise ValueError(f"{label!r}: stock runs without the plugin, so it takes no MK_* switch")
    return mode, parse_mk_env(items) if items else {}


def plugin_modes(text: str) -> list[str]:
    """The --modes entries of tbt.py / serve.py (comma list; stock is always run and dropped here), each checked by
    split_mode: ValueError names the first bad one."""
    modes = [m for m in text.split(",") if m and m != "stock"]
    for m in modes:
        split_mode(m)
    return modes


def mode_tag(label: str) -> str:
    """A --modes entry as a file-name part (no '+' or '=')."""
    return label.replace("+", "_").replace("=", "-")


def child_env(mode: str, runner: str = "default", extra: dict[str, str] | None = None,
              shim: Path | None = None, mk_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of one engine process. Stock and plugin children differ only in MK_MODE and
    VLLM_PLUGINS (and mk_env, applied to plugin children only); every other variable (engine
    arguments are passed identically) is the same."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; choose one of {MODES}")
    if runner not in RUNNERS:
        raise ValueError(f"runner {runner!r}; choose one of {RUNNERS}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MK_")}
    env.update({
        "VLLM_USE_FLASHINFER_SAMPLER": "0",      # FlashInfer is not in the GPU host's site tree
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # no internet there; never wait on it
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # LLM.apply_model(mk_status) pickles a function
        "PYTHONUNBUFFERED": "1",
    })
    if mode == "stock":
        env.update({"VLLM_PLUGINS": "", "MK_MODE": "stock"})
    else:
        env.update({"VLLM_PLUGINS": "mk_plugin", "MK_MODE": "stock" if mode == "mk-stock" else mode})
        env.update(mk_env or {})
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if runner != "default":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    paths = [str(REPO)] + ([str(shim)] if shim is not None else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra or {})
    return env


class ChildFailed(RuntimeError):
    pass


def run_child(script: Path, payload: dict[str, Any], env: dict[str, str], log_path: Path,
              timeout: float) -> dict[str, Any]:
    """Run `python script --child @FILE` with env, FILE holding the JSON payload (beside log_path: a
    soak's fp32 payload carries every token of 2,000 requests, past the kernel's argument-length limit,
    session 13); its output goes to log_path; returns the JSON the child printed after RESULT_MARK.
    Raises ChildFailed with the log's tail on any failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    wait_gpu_released()
    text = json.dumps(payload)
    pfile = log_path.with_name(log_path.name + ".payload.json")
    pfile.write_text(text)
    cmd = [sys.executable, str(script), "--child", f"@{pfile}"]
    shown = text if len(text) <= 2000 else f"{len(text)} bytes in {pfile.name}"
    with open(log_path, "w") as log:
        log.write(f"# {' '.join(cmd[:3])} <payload>\n# payload: {shown}\n"
                  f"# MK_MODE={env.get('MK_MODE')} VLLM_PLUGINS={env.get('VLLM_PLUGINS')!r} "
                  f"VLLM_USE_V2_MODEL_RUNNER={env.get('VLLM_USE_V2_MODEL_RUNNER')}\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log_path.read_text(errors="replace")
    results = [line[len(RESULT_MARK):] for line in text.splitlines() if line.startswith(RESULT_MARK)]
    if rc != 0 or not results:
        tail = "\n".join(text.splitlines()[-40:])
        raise ChildFailed(f"child {script.name} ({env.get('MK_MODE')}) exited with {rc}; log {log_path}:\n{tail}")
    return json.loads(results[-1])


def child_payload(arg: str) -> dict[str, Any]:
    """Child side of run_child: `--child @FILE` (the JSON in FILE) or `--child JSON`."""
    return json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg)


def emit_result(obj: dict[str, Any]) -> None:
    """Child side of run_child."""
    sys.stdout.flush()
    print(RESULT_MARK + json.dumps(obj), flush=True)


def worker_status(llm: Any) -> list[dict[str, Any]]:
    """mk_status of every worker's model (class name, backend, decode counts, messages logged)."""
    try:
        from mk_plugin.vllm_adapter import mk_status

        return list(llm.apply_model(mk_status))
    except Exception as e:  # noqa: BLE001 - provenance only; never fail a measurement on it
        return [{"error": f"{type(e).__name__}: {e}"}]


def path_check(label: str, status: list[dict[str, Any]], mk_env: dict[str, str] | None = None) -> str:
    """'ok' when the workers ran what the mode (a --modes entry: split_mode; mk_env: --mk-env's switches)
    promises, else what went wrong (printed in tables)."""
    mode, own = split_mode(label)
    env = (mk_env or {}) | own
    if not status or "error" in status[0]:
        return f"unverified ({status[0].get('error') if status else 'no status'})"
    s = status[0]
    cls = s.get("class")
    if mode == "stock":
        return "ok" if cls == "LlamaForCausalLM" else f"class {cls} (plugin loaded?)"
    if cls != "MkLlamaForCausalLM":
        return f"class {cls}: plugin not loaded (pip install -e . or check VLLM_PLUGINS)"
    if mode == "mk-stock":
        return "ok"
    if s.get("unsupported"):
        return f"stock fallback: {s['unsupported']}"
    decode = sum(v for k, v in (s.get("counts") or {}).items() if k.startswith("decode:"))
    if decode == 0:
        return "no decode step took the mk path"
    if mode == "megakernel" and s.get("backend") != "megakernel":
        return f"megakernel unavailable, ran {s.get('backend')}"
    asked = env.get("MK_LM_HEAD", "vllm")
    if asked != (s.get("lm_head") or "vllm"):
        return f"MK_LM_HEAD={asked} asked, the LM head ran in {s.get('lm_head')}"
    return "ok"


# ---- output files ----------------------------------------------------------------------------------
def append_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Append rows; write the header when the file is new; refuse a file whose header differs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="") as f:
            first = next(csv.reader(f), None)
        if first != list(header):
            raise SystemExit(f"{path} has header {first}, expected {list(header)}; move it away first")
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(header)
        for r in rows:
            w.writerow(r)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


if __name__ == "__main__":  # `python3 bench/common.py`: the commit for shell scripts' records
    print(git_commit())
