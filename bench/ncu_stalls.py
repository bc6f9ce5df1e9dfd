"""Where a kernel's warps stall, from Nsight Compute's source page exported as CSV (CPU only).

    ncu ... --section SourceCounters -o REP            (on the GPU host; bench/mk_diag.sh, bench/gpu_calls.sh ncu_b1)
    ncu --import REP.ncu-rep --page source --csv --print-source sass > SRC.csv
    python bench/ncu_stalls.py SRC.csv[.gz] [--top 25] [--context 3] [--out FILE.md]

Prints markdown: the samples per stall reason, per SASS mnemonic (HMMA, LDSM, SYNCS, BAR, ...), and the
instructions with the most samples, each with its top reasons and, with --context N, the N instructions
before it (what a stalled instruction waits on is usually just above it). A sample is one warp caught by the
sampler at that instruction; the shares say where the warps sit, not what limits the kernel by themselves.
With --fetch, also where the "no_inst" samples (a warp whose next instruction is not fetched yet) sit: the share
on branch targets and the targets with the most of them, each with the branches that jump there (session 32: at
1B batch 1, 85% of them sat on branch targets, the most on the unrolled M-tile checks of the chunk loop).
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
REASON_PREFIX = "stall_"


@dataclass
class Instr:
    index: int          # position in the listing
    address: str
    source: str         # the SASS text, e.g. "@P0 HMMA.16816.F32.BF16 R4, R8, R12, R4"
    samples: int
    reasons: dict[str, int] = field(default_factory=dict)   # all-samples reasons (no "(Not Issued)" columns)

    @property
    def mnemonic(self) -> str:
        """The opcode without predicate and modifiers: '@!P1 SYNCS.PHASECHK.TRANS64 ...' -> 'SYNCS'."""
        words = self.source.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0].split(".")[0] if words else "?"


def _int(text: str) -> int:
    text = text.strip().replace(",", "")
    return int(float(text)) if text not in ("", "-") else 0


def parse(text: str) -> list[Instr]:
    """The instructions of the first kernel in an `ncu --page source --csv` export. The export starts with
    a "Kernel Name" line, then the header row; a ValueError names what is missing."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError("no header row starting with \"Address\": not an ncu source-page CSV export")
    rows = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = next(rows)
    for col in ("Address", "Source", SAMPLES):
        if col not in header:
            raise ValueError(f"column {col!r} missing from the ncu export (has {len(header)} columns)")
    ia, isrc, isam = header.index("Address"), header.index("Source"), header.index(SAMPLES)
    reasons = [(i, h.removeprefix(REASON_PREFIX)) for i, h in enumerate(header)
               if h.startswith(REASON_PREFIX) and not h.endswith("(Not Issued)")]
    out = []
    for row in rows:
        if len(row) < len(header):
            if row and row[0].startswith("Kernel Name"):
                break   # a second kernel's listing follows
            continue
        r = {name: _int(row[i]) for i, name in reasons}
        out.append(Instr(len(out), row[ia], row[isrc].strip(), _int(row[isam]), {k: v for k, v in r.items() if v}))
    return out


BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+`?\(?(0x[0-9a-fA-F]+)")   # ncu prints a branch's absolute target address


def fetch_summary(instrs: list[Instr], top: int = 10) -> str:
    """The instruction-fetch stalls ("no_inst" samples) by where they sit: on branch targets or not, and the
    targets with the most, each with the branches (address, instruction) that jump there."""
    by_addr = {int(i.address, 16): i for i in instrs}
    sources: dict[int, list[Instr]] = {}
    for i in instrs:
        m = BRANCH.search(i.source)
        if m and int(m.group(1), 16) in by_addr:
            sources.setdefault(int(m.group(1), 16), []).append(i)
    total = sum(i.reasons.get("no_inst", 0) for i in instrs)
    on_targets = sorted((i for a, i in by_addr.items() if a in sources and i.reasons.get("no_inst")),
                        key=lambda i: -i.reasons["no_inst"])
    n_t = sum(i.reasons["no_inst"] for i in on_targets)
    out = [f"no_inst samples: {total}; on branch targets: {n_t} ({_share(n_t, total)})", "",
           "| target | instruction | no_inst | branches to it |", "|---|---|---|---|"]
    for i in on_targets[:top]:
        srcs = "; ".join(f"{b.address} `{b.source}`" for b in sources[int(i.address, 16)][:3])
        out.append(f"| {i.address} | `{i.source}` | {i.reasons['no_inst']} | {srcs} |")
    return "\n".join(out) + "\n"


def _share(n: int, total: int) -> str:
    return f"{100.0 * n / total:.1f}%" if total else "-"


def summarize(instrs: list[Instr], top: int = 25, context: int = 0) -> str:
    total = sum(i.samples for i in instrs)
    reasons: Counter[str] = Counter()
    mnem: Counter[str] = Counter()
    for i in instrs:
        reasons.update(i.reasons)
        mnem[i.mnemonic] += i.samples
    out = [f"{len(instrs)} instructions, {total} samples", "", "| stall reason | samples | share |", "|---|---|---|"]
    out += [f"| {k} | {v} | {_share(v, total)} |" for k, v in reasons.most_common()]
    out += ["", "| mnemonic | samples | share |", "|---|---|---|"]
    out += [f"| {k} | {v} | {_share(v, total)} |" for k, v in mnem.most_common(15)]
    out += ["", "| # | address | instruction | samples | share | top reasons |", "|---|---|---|---|---|---|"]
    for i in sorted(instrs, key=lambda x: -x.samples)[:top]:
        why = ", ".join(f"{k} {v}" for k, v in Counter(i.reasons).most_common(3))
        out.append(f"| {i.index} | {i.address} | `{i.source}` | {i.samples} | {_share(i.samples, total)} | {why} |")
        for j in range(max(0, i.index - context), i.index):
            out.append(f"|  | {instrs[j].address} | `{instrs[j].source}` (before) | {instrs[j].samples} | | |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--context", type=int, default=0, help="instructions shown before each top one")
    ap.add_argument("--fetch", action="store_true", help="also where the instruction-fetch stalls sit")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    raw = a.csv.read_bytes()
    text = (gzip.decompress(raw) if a.csv.suffix == ".gz" else raw).decode(errors="replace")
    instrs = parse(text)
    md = summarize(instrs, a.top, a.context)
    if a.fetch:
        md += "\n" + fetch_summary(instrs, a.top)
    if a.out:
        a.out.write_text(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
