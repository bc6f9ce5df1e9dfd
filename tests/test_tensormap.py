"""mk_plugin.persistent.tensormap (MK_ATT_TMA's tensor maps of the KV caches): the map arithmetic on any
machine, the driver encode on the GPU."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mk_plugin.persistent import tensormap as tm
from mk_plugin.persistent.variant import KernelVariant
from mk_plugin.spec import LlamaSpec

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "bench" / "models"


def _cache(nb: int, bs: int, nkv: int, d: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.zeros(nb, 2, bs, nkv, d, dtype=dtype)


@pytest.mark.parametrize("nkv,d", [(8, 64), (8, 128), (2, 96)])
def test_map_args_stack_each_parts_rows(nkv, d):
    """The ring's view of a cache: (32 columns, rows, D / 32 parts, heads) with the 64-byte swizzle, so a box of one
    head's 16 tokens lands as [part][16 rows][64 bytes] (csrc/attention_ring_mma.cuh am_addr), 16 * D * 2 bytes: the
    kernel's tile (csrc/attention_tma.cuh ATT_TILE_BYTES)."""
    c = _cache(37, 16, nkv, d)
    a = tm.kv_tile_map_args(tuple(c.shape), c.stride(), c.element_size())
    assert a.dims == (32, 37 * 2 * 16, d // 32, nkv) and a.box == (32, 16, d // 32, 1)
    assert a.strides == (2 * nkv * d, 64, 2 * d) and a.swizzle == tm._SWIZZLE_64B
    assert 2 * a.box[0] * a.box[1] * a.box[2] == 16 * d * 2
    with pytest.raises(ValueError, match="head_dim 80: MK_ATT_TMA's swizzled tiles need a multiple of 32"):
        b = _cache(4, 16, 8, 80)
        tm.kv_tile_map_args(tuple(b.shape), b.stride(), b.element_size())
    src = (ROOT / "csrc" / "attention_ring_mma.cuh").read_text()
    assert "(c >> 2) * (ATT_TMA_ROWS * 64) + r * 64" in src   # part stride 16 rows x 64 bytes, row stride 64 bytes
    tma = (ROOT / "csrc" / "attention_tma.cuh").read_text()
    assert re.search(rf"ATT_TMA_ROWS = {tm.TILE_ROWS};", tma) and "ATT_TILE_BYTES = ATT_TMA_ROWS * D * 2;" in tma


def test_unsupported_caches_are_clear_errors():
    c = _cache(4, 32, 8, 64)
    with pytest.raises(ValueError, match="block_size 32: MK_ATT_TMA copies 16-token blocks"):
        tm.kv_tile_map_args(tuple(c.shape), c.stride(), c.element_size())
    f = _cache(4, 16, 8, 64, torch.float32)
    with pytest.raises(ValueError, match="element size 4 bytes"):
        tm.kv_tile_map_args(tuple(f.shape), f.stride(), f.element_size())
    nc = torch.zeros(4, 2, 16, 16, 64, dtype=torch.bfloat16)[:, :, :, :8]   # every other head: not contiguous
    with pytest.raises(ValueError, match="needs a contiguous cache"):
        tm.kv_tile_map_args(tuple(nc.shape), nc.stride(), nc.element_size())
    with pytest.raises(ValueError, match="expected \\[num_blocks, 2, block_size"):
        tm.kv_tile_map_args((4, 16, 8, 64), (8192, 512, 64, 1), 2)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        tm.encode_tile_map(0x1008, tm.TileMapArgs((64, 8, 32), (128, 1024), (64, 1, 16)))


def test_models_with_more_than_four_heads_per_kv_head_are_refused():
    spec = LlamaSpec.from_json_file(MODELS / "llama-3.2-1b")
    tm.check_model(spec)   # G = 4
    with pytest.raises(ValueError, match="1-4 query heads per kv head; .* has 8"):
        tm.check_model(spec.__class__(**{**spec.__dict__, "num_kv_heads": 4}))


def test_the_tensor_core_attention_needs_head_dims_of_32():
    spec = LlamaSpec.from_json_file(MODELS / "llama-3.2-1b")
    tm.check_model(spec)   # head_dim 64
    # LlamaSpec takes head_dim 64 / 128 only (both fine); the check stands for any other spec-like config
    odd = __import__("types").SimpleNamespace(name="odd", num_q_heads=32, num_kv_heads=8, head_dim=80)
    with pytest.raises(ValueError, match="MK_ATT_TMA needs a head_dim that is a multiple of 32; .* has 80"):
        tm.check_model(odd)
    # session 26: the tensor-core consumers won their A/B and are the ring's code, the switch left
    with pytest.raises(ValueError, match="unknown kernel variant 'MK_RING_MMA'"):
        KernelVariant.parse(["MK_RING_MMA=1"])
    assert "MK_RING_MMA" not in (ROOT / "csrc" / "tasks.h").read_text()


def test_the_switch_is_a_kernel_variant():
    v = KernelVariant.parse(["MK_ATT_TMA=1"])
    assert v.att_tma == 1 and v.defines() == ("-DMK_ATT_TMA=1",) and v.label() == "att_tma=1"
    # a threshold in tokens per task; the default build has it off (0)
    assert KernelVariant.parse(["MK_ATT_TMA=128"]).label() == "att_tma=128" and KernelVariant().att_tma == 0
    assert KernelVariant.parse(["MK_ATT_TMA=0"]) == KernelVariant()
    with pytest.raises(ValueError, match="MK_ATT_TMA=x: bad value"):
        KernelVariant.parse(["MK_ATT_TMA=x"])
    with pytest.raises(ValueError, match=r"att_tma=-1: the ring path's minimum tokens per attention task, 0 \(off\)"):
        KernelVariant(att_tma=-1)
    with pytest.raises(ValueError, match="att_tma=True"):
        KernelVariant(att_tma=True)


@pytest.mark.gpu
def test_the_driver_encodes_a_map_of_a_gpu_cache():
    c = _cache(64, 16, 8, 64).cuda()
    m = tm.device_maps([c, c[:32]], c.device)
    assert m.shape == (2 * tm.MAP_BYTES,) and m.dtype == torch.uint8 and m.data_ptr() % 128 == 0
    assert bool(m[: tm.MAP_BYTES].ne(0).any()) and not torch.equal(m[: tm.MAP_BYTES], m[tm.MAP_BYTES:])


def test_a_model_with_eight_heads_per_kv_head_runs_without_the_ring_path(caplog):
    """The ring-fed attention (a variant's or a tuning's) needs 1-4 query heads per kv head: a decoder of another model turns
    it off at construction with one warning (the kernel compiles it out for that model: csrc/attention_tma.cuh)."""
    import logging
    from dataclasses import replace

    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.persistent.tuning import ScheduleTuning
    from mk_plugin.weights import random_weights

    spec = replace(LlamaSpec.tiny(), num_q_heads=8, num_kv_heads=1, head_dim=64, hidden_size=512)
    with caplog.at_level(logging.WARNING, logger="vllm.mk_plugin.persistent"):
        dec = MegakernelDecoder(spec, random_weights(spec), 2, "cpu", num_sms=6, variant=KernelVariant(att_tma=128),
                                tuning={2: ScheduleTuning(att_tma=64)}, class_builds=False)
    assert dec.variant == KernelVariant() and dec.variant_for(1) == dec.variant_for(2) == KernelVariant()
    assert sum("ring-fed" in r.getMessage() for r in caplog.records) == 1 and "has 8" in caplog.text, caplog.text
    ok = MegakernelDecoder(LlamaSpec.tiny(), random_weights(LlamaSpec.tiny()), 2, "cpu", num_sms=6,
                           tuning={2: ScheduleTuning(att_tma=64)}, class_builds=False)
    # G = 2: the path stays on where the tuning asks for it (a batch's variant, like its ring depth)
    assert ok.variant == ok.variant_for(1) == KernelVariant() and ok.variant_for(2) == KernelVariant(att_tma=64)
