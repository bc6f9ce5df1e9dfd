"""What a kernel change does to the megakernel's machine code, on a CPU machine: compile two builds (the base,
and the base plus --define options) as the decoder does, disassemble both with the nvdisasm that ships in
Triton's wheel, and compare them per function (mk_decode and its out-of-line helpers: matvec_task<1|2>,
ksplit_merge, ...): instruction counts, the opcode classes that matter for the hot loops (shared-memory and
ldmatrix loads, MMAs, barriers, global and local memory), and how much of the base's opcode sequence the other
build keeps; and both builds' chained bound checks (check_chains: unrolled `if (m < mt)` ladders, each rung a taken
branch for a short pass). A switch that is off must leave the base's code as it was (two A/B switches cost 2-4% while
inactive: MK_PASS_PREFETCH bit 2 in session 21, MK_DATA_FLAG in session 22); this shows where it did not.

    python bench/sass.py --model bench/models/llama-3.1-8b --define MK_DIAG=8
    python bench/sass.py --model bench/models/llama-3.1-8b --base MK_W_TMA=1 --base MK_INFLIGHT=2 --define X=1
    python bench/sass.py --source-a OLD.cu --source-b NEW.cu      # two saved sources (runtime.build_source())

Needs nvcc (the compile) and Triton's nvdisasm; prints a table, writes nothing.
"""
from __future__ import annotations

import argparse
import difflib
import glob
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))   # cuda_tools: where nvcc is on a CPU machine (shared with the compile tests)
from cuda_tools import nvcc_path

from mk_plugin.persistent.runtime import build_source, compile_options
from mk_plugin.spec import LlamaSpec

# Opcode classes reported per function (the prefix of the SASS opcode, before the first '.').
CLASSES = {"LDS": "lds", "LDSM": "ldsm", "HMMA": "mma", "BAR": "bar", "SYNCS": "mbar", "LDG": "ldg", "STG": "stg",
           "LDGSTS": "cp.async", "UBLKCP": "bulk", "UTMALDG": "tma", "LDL": "ldl", "STL": "stl", "MEMBAR": "membar",
           "RED": "red", "ATOM": "atom", "BRA": "bra"}
INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
FUNC = re.compile(r"^\s*\.type\s+(\S+),@function")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"`\((\.L_x_\d+)\)")


def tool(name: str) -> str:
    """Triton's copy of a CUDA binary tool (the CPU machine has no CUDA toolkit beyond nvcc)."""
    import triton
    hits = glob.glob(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name))
    path = hits[0] if hits else shutil.which(name)
    if not path:
        raise SystemExit(f"{name} not found (looked in Triton's backends/nvidia/bin and PATH)")
    return path


def compile_cubin(source: str, spec: LlamaSpec, defines: list[str], out: Path) -> None:
    src = out.with_suffix(".cu")
    src.write_text(source)
    opts = [o.replace("--gpu-architecture=", "-arch=") for o in compile_options(spec)]
    nvcc = nvcc_path()
    if nvcc is None:
        raise SystemExit("nvcc not found (looked in /usr/local/cuda/bin and on PATH)")
    r = subprocess.run([nvcc, *opts, *defines, "-cubin", "-o", str(out), str(src)], capture_output=True, text=True,
                       timeout=600, check=False)
    if r.returncode:
        raise SystemExit(f"nvcc failed ({' '.join(defines) or 'base'}):\n{r.stderr[-3000:]}")


def disassemble(cubin: Path) -> str:
    """nvdisasm's listing of the cubin (parse() and check_chains() read it)."""
    r = subprocess.run([tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, timeout=300, check=False)
    if r.returncode:
        raise SystemExit(f"nvdisasm failed: {r.stderr[-2000:]}")
    return r.stdout


CHECK = re.compile(r"ISETP\.\w+\.AND (P\d+), PT, (R\d+), (?:0x[0-9a-f]+|\d+), PT")
PRED_BRANCH = re.compile(r"@!?(P\d+)\s+BRA `\((\.L_x_\d+)\)")
TEXT = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def instructions(listing: str) -> tuple[list[tuple[str, str, str]], dict[str, int], list[str]]:
    """The instructions of nvdisasm's text in address order, (function, opcode, instruction text), each label's index
    into them (the instruction that follows it), and the functions in listing order. Function names are demangled
    loosely (short_name)."""
    insns: list[tuple[str, str, str]] = []
    labels: dict[str, int] = {}
    functions: list[str] = []
    name = None
    for line in listing.splitlines():
        m = FUNC.match(line)
        if m:
            name = short_name(m.group(1))
            functions.append(name)
            continue
        lab = LABEL.match(line)
        if lab:
            labels[lab.group(1)] = len(insns)
            continue
        m = INSN.search(line)
        if m and name is not None:
            t = TEXT.search(line)
            insns.append((name, m.group(1), t.group(1).strip() if t else m.group(1)))
    return insns, labels, functions


def check_chains(listing: str) -> int:
    """Chained bound checks: an `ISETP` of a register against a constant whose predicated branch (within the next 3
    instructions) jumps forward onto another such check of the same register -- an unrolled `if (m < mt)` ladder that
    a short pass climbs one taken branch at a time. Session 13's samples (1B batch 1) held ~390 "no instruction"
    samples on each rung; since session 33 (session 32's MK_FALLTHROUGH, measured and made the code) none is left."""
    insns, labels, _ = instructions(listing)
    ins = [text for _, _, text in insns]
    n = 0
    for i, text in enumerate(ins):
        c = CHECK.match(text)
        if not c:
            continue
        for j in range(i + 1, min(i + 4, len(ins))):
            b = PRED_BRANCH.match(ins[j])
            if b and b.group(1) == c.group(1):
                t = labels.get(b.group(2))
                nxt = CHECK.match(ins[t]) if t is not None and j < t < len(ins) else None
                n += bool(nxt and nxt.group(2) == c.group(2))
                break
    return n


def parse(listing: str) -> tuple[dict[str, list[str]], list[tuple[str, list[str]]]]:
    """(opcode sequence of each function, the loops that hold MMAs in address order: (function, their opcodes)) from
    nvdisasm's text. A loop is a backward branch's range."""
    insns, labels, functions = instructions(listing)
    out: dict[str, list[str]] = {fn: [] for fn in functions}
    for fn, op, _ in insns:
        out[fn].append(op)
    loops = []
    for i, (fn, op, text) in enumerate(insns):
        t = BRANCH.search(text) if op.startswith("BRA") else None
        j = labels.get(t.group(1), i + 1) if t else i + 1
        if j <= i:
            body = [o for _, o, _ in insns[j:i + 1]]
            if any(o.startswith("HMMA") for o in body):
                loops.append((j, fn, body))
    return out, [(fn, body) for _, fn, body in sorted(loops)]


def short_name(sym: str) -> str:
    """'$mk_decode$_ZN2mk11matvec_taskILi2EE...' -> 'matvec_task<2>'; 'mk_decode' stays."""
    m = re.search(r"_ZN2mk(\d+)(\w+)", sym)
    if not m:
        return sym.strip("$")
    n = int(m.group(1))
    base, rest = m.group(2)[:n], m.group(2)[n:]
    t = re.match(r"ILi(\d+)E", rest)
    return f"{base}<{t.group(1)}>" if t else base


def classes(ops: list[str]) -> Counter:
    c: Counter = Counter()
    for op in ops:
        head = op.split(".")[0]
        if head in CLASSES:
            c[CLASSES[head]] += 1
    return c


def class_diff(x: list[str], y: list[str]) -> str:
    """The opcode classes whose counts differ between two opcode sequences ('-' if none)."""
    cx, cy = classes(x), classes(y)
    return ", ".join(f"{k} {cx[k]} -> {cy[k]}" for k in sorted(set(cx) | set(cy)) if cx[k] != cy[k]) or "-"


def compare(a: dict[str, list[str]], b: dict[str, list[str]]) -> list[str]:
    rows = ["| function | insns base -> build | kept of base's sequence | opcode classes that changed (base -> build) |",
            "|---|---|---|---|"]
    for name in sorted(set(a) | set(b), key=lambda n: -len(a.get(n, b.get(n, [])))):
        x, y = a.get(name, []), b.get(name, [])
        sm = difflib.SequenceMatcher(None, x, y, autojunk=False)
        kept = sum(blk.size for blk in sm.get_matching_blocks()) / max(1, len(x))
        rows.append(f"| {name} | {len(x)} -> {len(y)} ({len(y) - len(x):+d}) | {100 * kept:.1f}% | {class_diff(x, y)} |")
    return rows


def compare_loops(a: list[tuple[str, list[str]]], b: list[tuple[str, list[str]]]) -> list[str]:
    """The MMA loops of both builds side by side, in address order (the steady state of every matvec)."""
    rows = ["| loop | function | insns base -> build | opcode classes that changed (base -> build) |", "|---|---|---|---|"]
    for i in range(max(len(a), len(b))):
        (fa, x), (fb, y) = (a[i] if i < len(a) else ("-", [])), (b[i] if i < len(b) else ("-", []))
        fn = fa if fa == fb else f"{fa} / {fb}"
        rows.append(f"| {i} | {fn} | {len(x)} -> {len(y)} ({len(y) - len(x):+d}) | {class_diff(x, y)} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "bench" / "models" / "llama-3.2-1b"), help="config folder")
    p.add_argument("--base", action="append", default=[], metavar="X=Y", help="-D of both builds (repeatable)")
    p.add_argument("--define", action="append", default=[], metavar="X=Y", help="-D of the second build only")
    p.add_argument("--source-a", type=Path, help="a saved kernel source for the base (default: csrc now)")
    p.add_argument("--source-b", type=Path, help="a saved kernel source for the second build (default: csrc now)")
    a = p.parse_args()
    if not a.define and not (a.source_a or a.source_b):
        p.error("give --define X=Y (the second build's options) or --source-a / --source-b")
    spec = LlamaSpec.from_json_file(Path(a.model))
    base = [f"-D{d}" for d in a.base]
    src_a = a.source_a.read_text() if a.source_a else build_source()
    src_b = a.source_b.read_text() if a.source_b else build_source()
    with tempfile.TemporaryDirectory() as tmp:
        ca, cb = Path(tmp) / "a.cubin", Path(tmp) / "b.cubin"
        compile_cubin(src_a, spec, base, ca)
        compile_cubin(src_b, spec, base + [f"-D{d}" for d in a.define], cb)
        ta, tb = disassemble(ca), disassemble(cb)
    (fa, la), (fb, lb) = parse(ta), parse(tb)
    label = " ".join(a.define) or f"{a.source_a} vs {a.source_b}"
    print(f"{spec.name}: base {' '.join(a.base) or 'default'}; build + {label}\n")
    print(f"chained bound checks (check_chains): {check_chains(ta)} -> {check_chains(tb)}\n")
    print("\n".join(compare(fa, fb)))
    print("\nLoops that hold MMAs (a backward branch's range; nested loops listed each):\n")
    print("\n".join(compare_loops(la, lb)))


if __name__ == "__main__":
    main()
