"""Which loads an out-of-line megakernel function still has in flight when it returns, on a CPU machine.

An out-of-line device function's RET waits for every scoreboard its loads set (the caller cannot know which the
callee used), so a load issued "early" inside it -- to overlap what the caller does next -- completes before the
return: a whole global round trip on the caller's path (session 31: the wgmma path's ready step waited for its next
group's norm weights at every x group; `wga_pass_start` for its epilogue loads). This reads the control bits of
cuobjdump's listing (Volta+ 128-bit instructions: the high word's stall, yield, write / read barrier and wait-mask
fields), follows each function (start addresses from nvdisasm's labels) and lists the loads whose scoreboard nothing
waited on before a RET that waits on it.

    python bench/sass_waits.py --model bench/models/llama-3.1-8b --define MK_W_TMA=1 --define MK_WGMMA_A=4

Needs nvcc and Triton's cuobjdump / nvdisasm (as bench/sass.py); prints a table, writes nothing.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass  # bench/sass.py: the compile and the tools

ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(\S.*?)\s*;")
HI = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
LOAD = re.compile(r"^(@!?U?P\w+\s+)?(LDG|LD\.|LDL)")
NO_BARRIER = 7


@dataclass(frozen=True)
class Control:
    """The scheduling fields of one instruction (bits 105..121 of the 128-bit encoding)."""
    stall: int
    yield_: int
    write_barrier: int   # the scoreboard its result sets (7: none)
    read_barrier: int    # the scoreboard released once its sources are read (7: none)
    wait_mask: int       # the scoreboards it waits for (bit i: SB i)

    @classmethod
    def of(cls, hi: int) -> Control:
        return cls(stall=(hi >> 41) & 0xF, yield_=(hi >> 45) & 1, write_barrier=(hi >> 46) & 7,
                   read_barrier=(hi >> 49) & 7, wait_mask=(hi >> 52) & 0x3F)


def opcode(text: str) -> str:
    """The instruction's opcode with its modifiers, past a predicate: '@!P0 RET.REL.NODEC R2 0x0' -> 'RET.REL.NODEC'."""
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def instructions(listing: str) -> list[tuple[int, str, Control]]:
    """(address, instruction text, control) of every instruction of a cuobjdump -sass listing (the control word is
    the comment on the line after the instruction)."""
    lines = listing.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        m, h = ADDR.search(line), HI.match(lines[i + 1])
        if m and h:
            out.append((int(m.group(1), 16), m.group(2), Control.of(int(h.group(1), 16))))
    return out


def function_starts(nvdisasm_listing: str) -> list[tuple[int, str]]:
    """(start address, symbol) of each out-of-line function (nvdisasm's `$kernel$symbol:` labels)."""
    out, lines = [], nvdisasm_listing.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\$\w+\$\S+):\s*$", line)
        if m:
            for nxt in lines[i + 1:i + 5]:
                a = re.search(r"/\*([0-9a-f]{4,})\*/", nxt)
                if a:
                    out.append((int(a.group(1), 16), m.group(1)))
                    break
    return sorted(out)


def pending_at_returns(insns: list[tuple[int, str, Control]], starts: list[tuple[int, str]]
                       ) -> list[tuple[str, int, str]]:
    """(function, RET address, load) for each load still pending at a RET that waits on its scoreboard. Straight-line
    reading in address order (a branch's other path may wait earlier: a candidate list to read, not a proof)."""
    out = []
    bounds = [a for a, _ in starts[1:]] + [1 << 62]
    for (start, name), end in zip(starts, bounds):
        pending: dict[int, str] = {}
        for addr, text, c in insns:
            if not start <= addr < end:
                continue
            if opcode(text).startswith("RET"):
                out += [(name, addr, load) for sb, load in sorted(pending.items()) if c.wait_mask >> sb & 1]
            for sb in [sb for sb in pending if c.wait_mask >> sb & 1]:
                del pending[sb]
            if LOAD.match(text) and c.write_barrier != NO_BARRIER:
                pending[c.write_barrier] = text
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(sass.ROOT / "bench" / "models" / "llama-3.2-1b"), help="config folder")
    p.add_argument("--define", action="append", default=[], metavar="X=Y", help="-D of the build (repeatable)")
    a = p.parse_args()
    from mk_plugin.persistent.runtime import build_source
    from mk_plugin.spec import LlamaSpec

    spec = LlamaSpec.from_json_file(Path(a.model))
    with tempfile.TemporaryDirectory() as tmp:
        cub = Path(tmp) / "k.cubin"
        sass.compile_cubin(build_source(), spec, [f"-D{d}" for d in a.define], cub)
        cu = subprocess.run([sass.tool("cuobjdump"), "-sass", str(cub)], capture_output=True, text=True, timeout=300,
                            check=True).stdout
        nv = subprocess.run([sass.tool("nvdisasm"), "-c", str(cub)], capture_output=True, text=True, timeout=300,
                            check=True).stdout
    rows = pending_at_returns(instructions(cu), function_starts(nv))
    print(f"{spec.name}, {' '.join(a.define) or 'default'}: loads a RET waits for\n")
    print("| function | RET at | load |\n|---|---|---|")
    for name, addr, load in rows:
        print(f"| {sass.short_name(name)} | {addr:#x} | `{load}` |")
    if not rows:
        print("| (none) | | |")


if __name__ == "__main__":
    main()
