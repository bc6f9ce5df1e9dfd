"""csrc/ compiles for sm_90a without register spills, from exactly the source text and -D options
that runtime.py feeds NVRTC (build_source() + compile_options(spec)).

nvcc (/usr/local/cuda/bin/nvcc or on PATH) builds a cubin with `-Xptxas -v`; the test fails on a
compile error or on any "bytes spill stores/loads" != 0. If libnvrtc is importable, the same text
is also compiled through NVRTC itself (what cupy.RawModule does on the GPU host)."""
from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cuda_tools import libnvrtc_path, nvcc_path, nvrtc_compile  # tests/cuda_tools.py

from mk_plugin.persistent.runtime import build_source, compile_options
from mk_plugin.spec import LlamaSpec

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


def _specs() -> list[LlamaSpec]:
    return [
        LlamaSpec.tiny(),
        LlamaSpec.from_json_file(MODELS / "llama-3.2-1b"),
        LlamaSpec.from_json_file(MODELS / "llama-3.1-8b"),
        # fp16, head_dim 128 with a GQA group of 6 (head passes of 3), odd vocab
        LlamaSpec(hidden_size=320, num_q_heads=6, num_kv_heads=1, head_dim=128, intermediate_size=688,
                  vocab_size=999, dtype="float16", name="odd-fp16"),
    ]


def nvcc_options(spec: LlamaSpec) -> list[str]:
    """compile_options with NVRTC's --gpu-architecture=X spelled as nvcc's -arch=X."""
    out = []
    for o in compile_options(spec):
        out.append(o.replace("--gpu-architecture=", "-arch=") if o.startswith("--gpu-architecture=") else o)
    return out


# Kernel variants selected with -D for A/B runs (bench/mk_step.py --define) and the autotuner's ring
# depths (MK_NUM_STAGES, tuning.num_stages): each must compile
# without spills too, at the 1B shape.
VARIANTS = [("-DMK_ROUNDING=1",), ("-DMK_NUM_STAGES=5",), ("-DMK_NUM_STAGES=4",), ("-DMK_DIAG=7",), ("-DMK_DIAG=8",), ("-DMK_DIAG=16", "-DMK_TRACE_PHASES=1"),
            ("-DMK_TRACE_PHASES=1",), ("-DMK_RELEASE_GATE=96",), ("-DMK_RELEASE_GATE=0",),
            ("-DMK_ATT_TMA=128",), ("-DMK_ATT_TMA=1",), ("-DMK_W_TMA=1",), ("-DMK_W_TMA=1", "-DMK_ATT_TMA=128"),
            ("-DMK_INFLIGHT=2",), ("-DMK_INFLIGHT=1", "-DMK_ATT_TMA=128"), ("-DMK_W_TMA=1", "-DMK_INFLIGHT=2"),
            ("-DMK_ATT_TMA=1", "-DMK_NUM_STAGES=5"), ("-DMK_ATT_TMA=128", "-DMK_NUM_STAGES=4"),
            ("-DMK_W_TMA=1", "-DMK_INFLIGHT=2", "-DMK_ATT_TMA=128"), ("-DMK_RSTD_EPI=1",),
            ("-DMK_RSTD_EPI=1", "-DMK_ATT_TMA=128", "-DMK_W_TMA=1", "-DMK_INFLIGHT=2"),
            # session 28's A/B switch MK_WGMMA_A at each pass size, 5 stages, its phase build
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=1"), ("-DMK_W_TMA=1", "-DMK_WGMMA_A=2"),
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_NUM_STAGES=5"),
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_TRACE_PHASES=1"),
            # session 30's MK_WGA_X (MK_WGMMA_A's rstd epilogue) at 2 and 4 x buffers, and x per warpgroup
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=1"),
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=1", "-DMK_NUM_STAGES=5"),
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=2"), ("-DMK_W_TMA=1", "-DMK_WGMMA_A=2", "-DMK_WGA_X=2"),
            # session 35's MK_GATE_AHEAD (a gated task's first chunks before the release) on the default and wgmma paths
            ("-DMK_RELEASE_GATE=48", "-DMK_GATE_AHEAD=2"),
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=2", "-DMK_RELEASE_GATE=48", "-DMK_GATE_AHEAD=2"),
            # session 35's MK_DIAG & 32 (weights folded into L2, timing only) on both tensor-map paths
            ("-DMK_W_TMA=1", "-DMK_DIAG=32"), ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=2", "-DMK_DIAG=32"),
            # session 44's MK_DIAG & 64 (the wgmma path's x ready steps skipped after a pass's first group, timing only)
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=2", "-DMK_DIAG=64"),
            # session 46's MK_DIAG & 128 (the next group's norm-weight load skipped), alone and with 64
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=2", "-DMK_DIAG=128"),
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=2", "-DMK_DIAG=192"),
            # session 46's MK_WGA_NWS (the norm weights by cp.async with the x groups)
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=2", "-DMK_WGA_NWS=1"),
            # session 39's b16_inflight A/B: the in-flight cap on the wgmma path (the b16 entries' build)
            ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=2", "-DMK_INFLIGHT=3"),
            # session 40's L2 fold window (gate_up's chunks 2..9 from L2, timing only) on the 1B b1 entry's gate
            ("-DMK_W_TMA=1", "-DMK_INFLIGHT=2", "-DMK_RELEASE_GATE=48", "-DMK_GATE_AHEAD=2", "-DMK_DIAG=32",
             "-DMK_DIAG_L2_FROM=2", "-DMK_DIAG_L2_N=8"),
            # session 47's MK_X_GROUPS (x by column groups at every batch size), alone, with the rstd epilogue, and on
            # the 1B batch-4 entry's program (the b8 program: K-split down, ring-fed attention, gate 112 + ahead 2)
            ("-DMK_X_GROUPS=1",), ("-DMK_X_GROUPS=1", "-DMK_RSTD_EPI=1"),
            ("-DMK_X_GROUPS=1", "-DMK_RSTD_EPI=1", "-DMK_ATT_TMA=128", "-DMK_RELEASE_GATE=112", "-DMK_GATE_AHEAD=2"),
            # session 49's MK_NTILES (one batch class a build), on the default build and the wgmma path's
            ("-DMK_NTILES=1",), ("-DMK_NTILES=2",), ("-DMK_NTILES=2", "-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=2"),
            ("-DMK_NTILES=2", "-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=2", "-DMK_WGA_ONLY=1"),
            ("-DMK_NTILES=1", "-DMK_X_WHOLE=1", "-DMK_RELEASE_GATE=48", "-DMK_GATE_AHEAD=2"),
            # session 52's MK_DIAG & 256 (the whole-x staging's norm statistics skipped, timing only) on that build
            ("-DMK_DIAG=256", "-DMK_NTILES=1", "-DMK_X_WHOLE=1", "-DMK_RELEASE_GATE=48", "-DMK_GATE_AHEAD=2")]


# A/B builds that spill, as built: (model, defines) -> (spill stores, spill loads) bytes of mk_decode. (MK_WGMMA_A=4 at
# 8B with the ring-fed attention spilled 4 / 16 bytes from session 28 until session 52's newest-row staging became the
# code: none since.)
KNOWN_VARIANT_SPILLS: dict[tuple[str, tuple[str, ...]], tuple[int, int]] = {
    # the phase-trace builds (bench only): the phases' 64-bit sums, in mk_decode (none in the chunk loops' functions);
    # since session 33's chunk-loop layout (ptxas allocates mk_decode anew) 36 / 48 (was 4 / 16) and 16 / 16 (was 0)
    ("llama-3.2-1b", ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_TRACE_PHASES=1")): (36, 48),
    ("llama-3.2-1b", ("-DMK_TRACE_PHASES=1",)): (16, 16),
    ("llama-3.2-1b", ("-DMK_DIAG=16", "-DMK_TRACE_PHASES=1")): (16, 16)}


def _compile(nvcc: str, src: Path, spec: LlamaSpec, tmp: Path, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    cubin = tmp / f"{spec.name}{'_'.join(extra)}.cubin"
    r = subprocess.run([nvcc, *nvcc_options(spec), *extra, "-cubin", "-Xptxas", "-v", "-o", str(cubin), str(src)],
                       capture_output=True, text=True, timeout=300, check=False)
    return r.returncode, r.stdout + r.stderr


def _spills(log: str) -> list[tuple[int, int]]:
    """(spill store bytes, spill load bytes) of each function in ptxas's -v report."""
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]


def test_megakernel_compiles_without_spills(tmp_path):
    nvcc = nvcc_path()
    # CI machines carry nvcc 13.0 (no GPU); a missing compiler is a broken machine, not a skip.
    assert nvcc is not None, "nvcc not found (looked in /usr/local/cuda/bin and on PATH)"
    src = tmp_path / "megakernel_full.cu"
    src.write_text(build_source())
    one_b = LlamaSpec.from_json_file(MODELS / "llama-3.2-1b")
    # MK_ATT_TMA (a tuning's ring-fed attention) on every shape too: a model with G != ATT_HG compiles the path out
    jobs = [(s, ()) for s in _specs()] + [(one_b, v) for v in VARIANTS] + \
        [(s, ("-DMK_ATT_TMA=128",)) for s in _specs() if s.name != one_b.name] + \
        [(s, ("-DMK_W_TMA=1",)) for s in _specs() if s.name == "llama-3.1-8b"] + \
        [(s, ("-DMK_ATT_TMA=128", "-DMK_W_TMA=1", "-DMK_INFLIGHT=2")) for s in _specs() if s.name == "llama-3.1-8b"] + \
        [(s, ("-DMK_ATT_TMA=128", "-DMK_W_TMA=1", f"-DMK_WGMMA_A={a}")) for s in _specs() if s.name == "llama-3.1-8b"
         for a in (1, 4)]
    with ThreadPoolExecutor(max_workers=2) as ex:
        results = list(ex.map(lambda j: _compile(nvcc, src, j[0], tmp_path, j[1]), jobs))
    for (spec, extra), (rc, log) in zip(jobs, results):
        name = f"{spec.name} {' '.join(extra)}".strip()
        assert rc == 0, f"{name}: nvcc failed:\n{log[-4000:]}"
        spills = _spills(log)
        assert spills, f"{name}: no ptxas resource report:\n{log[-2000:]}"
        bad = [s for s in spills if s != (0, 0)]
        known = KNOWN_VARIANT_SPILLS.get((spec.name, extra))
        if known is not None:   # exactly the known bytes: a change either way is seen
            assert bad == [known], f"{name}: register spills {bad}, known {known}:\n{log[-4000:]}"
        else:
            assert not bad, f"{name}: register spills {bad}:\n{log[-4000:]}"
        assert re.search(r"Compiling entry function 'mk_decode' for 'sm_90a'", log), log[-2000:]
        # MK_WGMMA_A: ptxas serialises wgmma only with an info line (C7510 / C7520: a call or divergence in the way)
        assert "Potential Performance Loss" not in log, f"{name}: wgmma serialised:\n{log[-2000:]}"


@pytest.mark.skipif(libnvrtc_path() is None, reason="no libnvrtc on this machine")
def test_nvrtc_compiles_the_runtime_source():
    src = build_source()
    # the 1B and 8B builds, and the bench-only variants of session 7 together in one 1B build (the GPU
    # compiles them with NVRTC too, through CuPy)
    builds = [(spec, ()) for spec in _specs()[:2]]
    builds.append((_specs()[0], ("-DMK_TRACE_PHASES=1", "-DMK_RELEASE_GATE=96", "-DMK_NUM_STAGES=5")))
    builds.append((_specs()[2], ("-DMK_ATT_TMA=128",)))   # the ring's tensor-core attention (inline PTX)
    one_b = LlamaSpec.from_json_file(MODELS / "llama-3.2-1b")   # the warpgroup MMA (A/B switch; K % 64 == 0)
    builds.append((one_b, ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4")))
    for spec, extra in builds:
        rc, log = nvrtc_compile(libnvrtc_path(), src, "megakernel.cu", (*compile_options(spec), *extra))
        assert rc == 0, f"{spec.name}: NVRTC failed:\n{log[-4000:]}"
        assert "warning" not in log.lower(), log[-2000:]


# Builds of the packaged tables that spill, as measured: (model, batch) -> (spill stores, spill loads) bytes summed over
# the kernel's functions. Each was the measured winner regardless; listed so that a change is seen either way.
# (8B batch 8, att_tma 128 + w_tma + inflight 2, spilled 4 / 8 bytes in mk_decode from session 21 until the ring's
# CUDA-core consumer loop left in session 26: none since.)
# 8B batch 12 / 16 (att_tma 128 + w_tma + wgmma_a 4, session 29): the traced task start time, 16 bytes stored once
# per task before the chunk loops (session 28's SASS); measured -9% with it. 8B batch 16 with wga_x (session 30): 32 /
# 32 bytes, as measured (-2.1%). Since session 33's chunk-loop layout (ptxas allocates mk_decode anew when matvec_task's
# code changes; the builds measured on the H100 in session 33): 4 / 16 and 20 / 32. 8B batch 16 with wga_x 2 (x per
# warpgroup, session 34's H100 A/B -2.5 / -2.4%): 16 / 16, as session 30 built it; 8B batch 12 with wga_x 2 too since
# session 35 (H100 A/B -2.3 / -2.1%): 16 / 16, which left batch 10 the only entry at 4 / 16. 8B batch 10 with wga_x 2 +
# wga_nws (session 47, H100 A/B -2.8 / -2.8%): 32 / 32, one more 64-bit pair stored once at the kernel's start (session
# 46's SASS: none in the chunk loops). 8B batch 12 / 16 with wga_nws + release_gate 48 + gate_ahead 2 (session 48, H100
# A/B -2.5 / -2.7% as built): 36 / 48. Since session 50 the decoder serves those entries on their class's build with
# MK_WGA_ONLY (every task on the wgmma path, the default matvec path compiled out): none spills.
KNOWN_TABLE_SPILLS: dict[tuple[str, int], tuple[int, int]] = {}


def test_every_packaged_tuning_compiles_at_its_own_shape(tmp_path):
    """The variant each packaged table entry compiles into its batch's kernel (tuning.tuned_variant: ring depth,
    ring-fed attention, in-flight cap, weight maps; tasks.class_build: the build of its batch class where every task
    takes one matvec path), at the entry's model shape: no spills but the known ones (the variants above are checked at
    the 1B shape only)."""
    from mk_plugin.persistent.encoding import spec_hash
    from mk_plugin.persistent.tasks import class_build
    from mk_plugin.persistent.tuning_table import TUNED_DIR, TuningTable
    from mk_plugin.persistent.variant import KernelVariant

    nvcc = nvcc_path()
    assert nvcc is not None, "nvcc not found (looked in /usr/local/cuda/bin and on PATH)"
    src = tmp_path / "megakernel_full.cu"
    src.write_text(build_source())
    specs = {spec_hash(s): s for s in (LlamaSpec.from_json_file(MODELS / m) for m in ("llama-3.2-1b", "llama-3.1-8b"))}
    jobs = {}
    for path in sorted(TUNED_DIR.glob("megakernel_*.json")):
        table = TuningTable.load(path, path.stem)
        for key in table.entries:
            e = table.winner(key)
            if e is None:
                continue
            assert key.spec_hash in specs, f"{path.name}: an entry for a model not in bench/models ({key})"
            spec = specs[key.spec_hash]
            # the decoder's build (variant_for): since session 50 per class where the program allows
            defines = class_build(KernelVariant(), spec, e.tuning, key.batch, lm_head=key.lm_head).defines()
            jobs.setdefault((spec.name, defines), []).append(key.batch)
    assert jobs, "no packaged tuning entries found"

    def run(job):
        (name, defines), _ = job
        return _compile(nvcc, src, next(s for s in specs.values() if s.name == name), tmp_path, defines)

    with ThreadPoolExecutor(max_workers=2) as ex:
        results = list(ex.map(run, jobs.items()))
    for ((name, defines), batches), (rc, log) in zip(jobs.items(), results):
        assert rc == 0, f"{name} {defines}: nvcc failed:\n{log[-4000:]}"
        spills = _spills(log)
        assert spills, f"{name} {defines}: no ptxas resource report"
        total = (sum(a for a, _ in spills), sum(b for _, b in spills))
        known = {KNOWN_TABLE_SPILLS.get((name, b), (0, 0)) for b in batches}
        assert total in known, f"{name} batch {batches} {defines}: spills {total}, known {known}:\n{log[-3000:]}"
