"""`python -m mk_plugin check [--config path/to/config.json] [--mode both|triton|megakernel] [--fallback ops]`:
every Triton op and a whole decode step through the Triton path and the megakernel against the fp32
reference, as one table. On CPU it uses the Triton
interpreter; on a GPU it also prints each op's time and achieved GB/s."""
from __future__ import annotations

import argparse
import os
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mk_plugin")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="compare every Triton op and a decode step with the fp32 reference")
    c.add_argument("--config", help="Hugging Face config.json (or its folder); default: the tiny built-in model")
    c.add_argument("--batch", type=int, default=3, help="decode tokens per step (1..16)")
    c.add_argument("--context", type=int, default=None,
                   help="longest context; others shorter and one padded entry (default: 37 CPU, 1000 GPU)")
    c.add_argument("--layers", type=int, default=None, help="layers in the whole-step check (default: all on GPU, 2 on CPU)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--no-timing", action="store_true", help="skip per-op timing on the GPU")
    c.add_argument("--mode", choices=("both", "triton", "megakernel"), default="both",
                   help="which whole-step decode paths to check (default both; the megakernel runs on the "
                        "GPU, or on its CPU interpreter (VM) without one)")
    c.add_argument("--fallback", default="",
                   help="comma list of ops the megakernel step leaves to the Triton kernels (MK_FALLBACK names)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_ops is imported
    from .check import run_check
    return run_check(args)


if __name__ == "__main__":
    sys.exit(main())
