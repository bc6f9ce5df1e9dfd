"""Guard rails of the megakernel decoder: what a compiled program was built for (ProgramMeta), read
back from its encoded words, and every way it differs from what a decoder will launch."""
from __future__ import annotations

from dataclasses import dataclass

from .encoding import LAYOUT, MAGIC, VERSION, H, spec_hash
from .errors import ProgramMismatch
from .schedule import Program


@dataclass(frozen=True)
class ProgramMeta:
    """What a compiled program was built for; checked before it is handed to a launch."""
    spec_hash: int          # encoding.spec_hash(spec): the model constants compiled into the kernel
    spec_name: str
    batch: int
    num_sms: int            # queues per segment = grid size (one CTA per SM, all co-resident)
    smem_bytes: int         # dynamic shared memory per CTA the kernel layout needs
    encoding_version: int   # encoding.VERSION of the program words
    source_hash: str        # runtime.source_hash(): the kernel text the layout belongs to
    lm_head: bool
    fallback: frozenset[str]
    attn_chunks: int = 0    # KV chunks per (request, kv head): sizes the partial-attention buffers


def program_meta(program: Program, source: str | None = None) -> ProgramMeta:
    """ProgramMeta of `program`. Header-backed fields (version, spec hash, batch, queues) are read
    from the encoded words of its segments, so a program whose words disagree with its Python
    attributes is caught; ProgramMismatch if the segments disagree among themselves."""
    from .runtime import source_hash

    p = program
    hdrs = [{k: int(seg.encoded[i]) for k, i in H.items()} for seg in p.segments]  # raw words: no decode checks
    vals: dict[str, set[int]] = {k: {h[k] for h in hdrs}
                                 for k in ("version", "spec_hash", "batch", "num_queues", "attn_chunks")}
    bad = [f"segments disagree on {k}: {sorted(v)}" for k, v in vals.items() if len(v) > 1]
    bad += [f"segment {i} is not a megakernel program (magic {h['magic']:#x})" for i, h in enumerate(hdrs)
            if h["magic"] != MAGIC]
    if bad:
        raise ProgramMismatch(bad)

    def one(k: str, default: int) -> int:
        return next(iter(vals[k])) if vals[k] else default

    return ProgramMeta(spec_hash=one("spec_hash", spec_hash(p.spec)), spec_name=p.spec.name, batch=one("batch", p.batch),
                       num_sms=one("num_queues", p.num_sms), smem_bytes=LAYOUT.smem_bytes,
                       encoding_version=one("version", VERSION), source_hash=source or source_hash(),
                       lm_head=p.lm_head, fallback=frozenset(p.fallback),
                       attn_chunks=one("attn_chunks", p.attn_chunks))


def meta_mismatches(meta: ProgramMeta, want: ProgramMeta, *, device_sms: int | None = None,
                    device_smem: int | None = None) -> list[str]:
    """Every field of `meta` (the program) that differs from `want` (what the decoder will launch),
    plus the live device's limits: the grid must fit the SMs (all CTAs co-resident, else the
    program deadlocks) and the shared memory must fit one block."""
    out = []
    if meta.spec_hash != want.spec_hash:
        out.append(f"model spec: program built for {meta.spec_name!r} (hash {meta.spec_hash:#x}), the decoder "
                   f"runs {want.spec_name!r} (hash {want.spec_hash:#x})")
    for f, label in (("batch", "batch size"), ("num_sms", "SM count (grid)"), ("smem_bytes", "shared memory bytes"),
                     ("encoding_version", "encoding version"), ("source_hash", "kernel source hash"),
                     ("lm_head", "lm_head"), ("fallback", "fallback ops"),
                     ("attn_chunks", "attention chunks (partial buffers are sized for the decoder's)")):
        a, b = getattr(meta, f), getattr(want, f)
        if a != b:
            if isinstance(a, frozenset):
                a, b = sorted(a), sorted(b)
            out.append(f"{label}: program {a!r}, decoder {b!r}")
    if device_sms is not None and meta.num_sms > device_sms:
        out.append(f"SM count: the program's grid of {meta.num_sms} CTAs exceeds the device's {device_sms} SMs "
                   "(the CTAs would not all be co-resident: the launch would deadlock)")
    if device_smem is not None and meta.smem_bytes > device_smem:
        out.append(f"shared memory: the kernel needs {meta.smem_bytes} bytes per block, the device allows "
                   f"{device_smem}")
    return out
