"""MK_W_TMA (one tensor-map copy per weight ring chunk, csrc/weight_tma.cuh): the maps' arithmetic and the
kernel's constants on any machine; the maps encoded by the driver, and the step on the GPU (the GPU tests of
tests/test_persistent_gpu.py run on the build with `--mk-define MK_W_TMA=1`)."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mk_plugin.persistent import tensormap as tm
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.encoding import HeaderCheck, ModelPtr
from mk_plugin.persistent.variant import KernelVariant
from mk_plugin.spec import LlamaSpec
from mk_plugin.weights import random_weights

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "bench" / "models"
SRC = (ROOT / "csrc" / "weight_tma.cuh").read_text()


def test_plain_matrix_chunks_are_16_rows_by_column_groups():
    a = tm.weight_map_args(4096, 2048, tm.W_CHUNK_KGROUPS)
    # innermost first: 64 columns (one 128-byte line), the rows (a row of K columns apart), the column groups
    # (128 bytes apart): the box lands as [group][16 rows][64], each line swizzled by its row
    assert a.dims == (64, 4096, 32) and a.strides == (4096, 128) and a.box == (64, 16, 16)
    assert a.swizzle == tm._SWIZZLE_128B
    assert tm.weight_map_args(4096, 2048, 1).box == (64, 16, 1)   # a chunk's tail, one group per copy
    # one whole-chunk box is the kernel's 32 KB ring chunk
    assert 64 * 16 * 16 * 2 == 32768 and "W_CHUNK_KG * W_KG_BYTES == 32768" in SRC


def test_qkv_tiles_pair_the_halves_of_a_head():
    """A qkv tile is rows s*8..s*8+7 of a head and the same 8 rows of its second half (the RoPE pairs): the
    4-D view's third dimension steps half a head down the matrix."""
    d, k, rows = 64, 2048, 3072
    a = tm.weight_map_args(rows, k, tm.W_CHUNK_KGROUPS, half_rows=d // 2)
    assert a.dims == (64, rows - d // 2, 2, k // 64) and a.box == (64, 8, 2, 16)
    assert a.strides == (2 * k, d // 2 * 2 * k, 128)
    # the last head's last tile starts at rows - d + 3 * 8 < rows - d / 2: inside the view's row dimension
    assert rows - d + 24 + 7 < a.dims[1]


def test_unsupported_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="K = 688 is not a multiple of 64"):
        tm.weight_map_args(320, 688, 16)
    with pytest.raises(ValueError, match="box_kgroups=17"):
        tm.weight_map_args(320, 640, 17)
    spec = LlamaSpec(hidden_size=320, num_q_heads=5, num_kv_heads=1, head_dim=64, intermediate_size=688,
                     vocab_size=999, name="odd")
    with pytest.raises(ValueError, match="odd's intermediate_size is 688"):
        tm.check_weights_model(spec)
    with pytest.raises(ValueError, match="MK_W_TMA needs every matrix's K to be a multiple of 64"):
        MegakernelDecoder(spec, random_weights(spec), 2, "cpu", num_sms=6, variant=KernelVariant(w_tma=True))
    # a tuning that asks for the maps later (retune) is refused the same way, on the CPU executor too
    from mk_plugin.persistent.tuning import ScheduleTuning
    dec = MegakernelDecoder(spec, random_weights(spec), 2, "cpu", num_sms=6)
    with pytest.raises(ValueError, match="MK_W_TMA needs every matrix's K to be a multiple of 64"):
        dec.retune(2, ScheduleTuning(w_tma=True))
    assert not dec.tunings[2].w_tma   # the refused tuning was not taken
    tm.check_weights_model(LlamaSpec.from_json_file(MODELS / "llama-3.1-8b"))


def test_the_kernel_agrees_on_the_map_table():
    assert re.search(rf"W_KG_COLS = {tm.W_KGROUP};", SRC)
    assert re.search(rf"W_MAP_OPS = {len(tm.W_MAP_OPS)};", SRC)
    assert "MP_WEIGHT_MAPS" in SRC and ModelPtr.WEIGHT_MAPS == 2
    assert HeaderCheck.SMEM_ALIGN == 64   # a build whose shared memory is not 1024-byte aligned refuses to run


def test_the_switch_is_a_kernel_variant():
    v = KernelVariant.parse(["MK_W_TMA=1"])
    assert v.w_tma and v.defines() == ("-DMK_W_TMA=1",) and v.label() == "w_tma"
    assert KernelVariant.parse(["MK_W_TMA=0"]) == KernelVariant() and not KernelVariant().w_tma
    with pytest.raises(ValueError, match="w_tma=1 must be true or false"):
        KernelVariant(w_tma=1)   # type: ignore[arg-type]


@pytest.mark.gpu
def test_the_driver_encodes_the_weight_maps():
    spec = replace(LlamaSpec.from_json_file(MODELS / "llama-3.2-1b"), num_layers=2)
    w = random_weights(spec, device="cuda", draw_on_device=True)
    m = tm.weight_maps(spec, w.layers, w.lm_head, torch.device("cuda"))
    n = (2 * len(tm.W_MAP_OPS) + 1) * tm.W_MAPS_PER_MATRIX
    assert m.shape == (n * tm.MAP_BYTES,) and m.data_ptr() % 128 == 0
    maps = m.view(n, tm.MAP_BYTES)
    assert all(bool(maps[i].ne(0).any()) for i in range(n))
    assert len({bytes(maps[i].cpu().numpy()) for i in range(n)}) == n
