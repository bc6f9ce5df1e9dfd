"""The A/B table of a GPU call's log (bench/gpu_calls.sh, bench/mk_ab.py): builds alternated over rounds, each block headed

    == round R[ GROUP]: LABEL            (LABEL "default" or the build's --define flags)

and followed by mk_step's result rows (`megakernel  BATCH  STEP_US ...`). One row per build, one column per
(group, batch); each cell lists the rounds' step times and, for a build other than the default, the mean's
difference from the default build's mean in the same column (us). CPU only: it reads text.

    python bench/ab_table.py LOG[=GROUP] [LOG[=GROUP] ...] [--out FILE.md]
    python bench/ab_table.py LOG --rule 2 --at "llama-3.1-8b 16" --at "llama-3.2-1b 16" --worst 0.5

--rule G with --at "GROUP BATCH" (repeatable) and --worst S adds the verdict of bench/NOTES.md's A/B rules: a build
passes when every one of its rounds is at least G% below the default's mean at each --at column and no round of any
column is more than S% above it.

GROUP names the column group of a log whose headers have none (session 10's calls 1 and 2: one model
per log), so that several logs make one table.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

HEAD = re.compile(r"^== round (\d+)(?: ([^:]+))?: (.*)$")
ROW = re.compile(r"^megakernel\s+(\d+)\s+([\d.]+)\s")
DEFAULT = "default"


def parse(lines: Iterable[str], group: str = "") -> dict[str, dict[tuple[str, int], list[float]]]:
    """build label -> (group, batch) -> step us per round, in log order. A build's label drops the
    `--define ` prefixes; a header without a group takes `group`; rows outside a headed block are ignored."""
    out: dict[str, dict[tuple[str, int], list[float]]] = {}
    cur: tuple[str, str] | None = None
    for line in lines:
        m = HEAD.match(line.rstrip("\n"))
        if m is None and line.startswith("=="):
            cur = None   # another kind of block: its rows belong to no build
            continue
        if m:
            label = m.group(3).replace("--define ", "").strip() or DEFAULT
            cur = (label, (m.group(2) or group).strip())
            continue
        r = ROW.match(line)
        if r and cur is not None:
            out.setdefault(cur[0], {}).setdefault((cur[1], int(r.group(1))), []).append(float(r.group(2)))
    return out


def table(builds: dict[str, dict[tuple[str, int], list[float]]]) -> str:
    """The markdown table: one row per build (the default first), one column per (group, batch)."""
    if DEFAULT not in builds:
        raise ValueError(f"no '{DEFAULT}' build in the log: the differences need it (builds: {', '.join(builds)})")
    cols = sorted({c for b in builds.values() for c in b}, key=lambda c: (c[0], c[1]))
    base = {c: statistics.mean(builds[DEFAULT][c]) for c in cols if c in builds[DEFAULT]}
    head = " | ".join(f"{g + ' ' if g else ''}b{b}" for g, b in cols)
    lines = [f"| build | {head} |", "|---" * (len(cols) + 1) + "|"]
    for name in [DEFAULT, *[n for n in builds if n != DEFAULT]]:
        cells = []
        for c in cols:
            xs = builds[name].get(c, [])
            txt = " / ".join(f"{x:.1f}" for x in xs)
            if xs and name != DEFAULT and c in base:
                txt += f" ({statistics.mean(xs) - base[c]:+.0f})"
            cells.append(txt)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def verdict(builds: dict[str, dict[tuple[str, int], list[float]]], gain_pct: float, at: list[tuple[str, int]],
            worst_pct: float) -> str:
    """One line per build other than the default: PASS / FAIL by the rule (every round >= gain_pct % below the
    default's mean at each `at` column, no round of any column > worst_pct % above it), with the numbers that
    decided it."""
    base = {c: statistics.mean(xs) for c, xs in builds[DEFAULT].items()}
    out = []
    for name, cols in builds.items():
        if name == DEFAULT:
            continue
        pct = {c: [100.0 * (x - base[c]) / base[c] for x in xs] for c, xs in cols.items() if c in base}
        missing = [c for c in at if c not in pct]
        gains = {c: max(pct[c]) for c in at if c in pct}          # the worst round at each column
        slow = {c: max(v) for c, v in pct.items() if max(v) > worst_pct}
        ok = not missing and all(g <= -gain_pct for g in gains.values()) and not slow
        why = ", ".join(f"{g} b{b}: worst round {v:+.1f}%" for (g, b), v in gains.items())
        if missing:
            why += f"; not measured at {', '.join(f'{g} b{b}' for g, b in missing)}"
        if slow:
            why += "; slower: " + ", ".join(f"{g} b{b} {v:+.1f}%" for (g, b), v in slow.items())
        out.append(f"{'PASS' if ok else 'FAIL'} {name}: {why}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", metavar="LOG[=GROUP]")
    ap.add_argument("--out", type=Path, default=None, help="write the table here too")
    ap.add_argument("--rule", type=float, default=None, metavar="G", help="the gain (%%) every round must reach")
    ap.add_argument("--at", action="append", default=[], metavar="'GROUP BATCH'", help="a column the rule needs")
    ap.add_argument("--worst", type=float, default=0.5, metavar="S", help="no round of any column more than S%% slower")
    args = ap.parse_args(argv)
    if args.rule is not None and not args.at:
        ap.error("--rule needs at least one --at 'GROUP BATCH'")
    at = []
    for item in args.at:
        g, _, b = item.rpartition(" ")
        if not b.isdigit():
            ap.error(f"--at {item!r}: want 'GROUP BATCH', e.g. 'llama-3.1-8b 16'")
        at.append((g.strip(), int(b)))
    builds: dict[str, dict[tuple[str, int], list[float]]] = {}
    for item in args.logs:
        path, _, group = item.partition("=")
        for name, cols in parse(Path(path).read_text().splitlines(), group).items():
            for c, xs in cols.items():
                builds.setdefault(name, {}).setdefault(c, []).extend(xs)
    text = table(builds)
    if args.rule is not None:
        text += f"\nRule: every round >= {args.rule:g}% faster at the named columns, none > {args.worst:g}% slower:\n\n"
        text += verdict(builds, args.rule, at, args.worst)
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
