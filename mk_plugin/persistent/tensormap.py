"""CUtensorMap descriptors of the KV caches for the ring-fed attention (MK_ATT_TMA, csrc/attention_tma.cuh)
and of the weight matrices for one-copy ring chunks (MK_W_TMA, csrc/weight_tma.cuh; weight_maps below).

One map per layer's cache [num_blocks, 2, block_size, NKV, D] (vLLM's FLASH_ATTN layout), viewed as the
3-D tensor [rows = num_blocks * 2 * block_size][NKV][D] (innermost first for the driver: D, NKV, rows), with
a box of one head's 16 tokens: (D, 1, 16). So the copy at coordinates (0, g, (block * 2 + kv) * 16) brings
K (kv = 0) or V (kv = 1) of head g for the 16 tokens of one block: 2 KB at D = 64, 4 KB at D = 128.

The maps are encoded on the host by the driver (cuTensorMapEncodeTiled, through ctypes: neither torch nor
CuPy wraps it), 128 bytes each, and copied to the GPU once per set of caches (MegakernelDecoder._kv_table).
kv_tile_map_args() is the arithmetic, checked on any machine; encode_tile_map() needs libcuda.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..spec import LlamaSpec

TILE_ROWS = 16                 # tokens per box: csrc/attention_tma.cuh ATT_TMA_ROWS (a block of block_size 16)
MAP_BYTES = 128                # sizeof(CUtensorMap)
KV_PART = 32                   # MK_ATT_TMA: head-dim columns per 64-byte swizzle line (csrc/attention_ring_mma.cuh)
# CUtensorMapDataType / Interleave / Swizzle / L2promotion / FloatOOBfill (cuda.h)
_DTYPE_UINT16 = 1              # 2-byte elements: bf16 and fp16 alike (the copy moves bytes)
_INTERLEAVE_NONE = 0
_SWIZZLE_NONE = 0
_SWIZZLE_64B = 2
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2
_OOB_FILL_NONE = 0


@dataclass(frozen=True)
class TileMapArgs:
    """cuTensorMapEncodeTiled's shape arguments, innermost dimension first."""
    dims: tuple[int, ...]               # elements, innermost first (KV: 32, rows, D / 32, NKV)
    strides: tuple[int, ...]            # bytes of dims 1.. (dim 0 is contiguous)
    box: tuple[int, ...]                # KV: 32, TILE_ROWS, D / 32, 1
    swizzle: int = _SWIZZLE_NONE

    def __post_init__(self) -> None:
        if not 1 <= len(self.dims) <= 5 or len(self.box) != len(self.dims) or len(self.strides) != len(self.dims) - 1:
            raise ValueError(f"tensor map rank: dims {self.dims}, box {self.box}, strides {self.strides}")


def kv_tile_map_args(shape: tuple[int, ...], stride: tuple[int, ...], elem_size: int) -> TileMapArgs:
    """The map arguments of one layer's cache tensor (shape/stride in elements, as torch gives them).
    Raises ValueError naming what is unsupported: another layout, block size or element size, a
    non-contiguous cache.

    The box is one head's 16-token tile, landing as [D / 32 parts][16 rows][32 columns] with the 64-byte swizzle
    (csrc/attention_ring_mma.cuh, the tensor-core consumers), so that the 8 token rows of one ldmatrix read sit in 8 different
    bank groups (the plain tile's rows are D * 2 bytes apart: every row in the same banks). A 4-D view, innermost
    first (32, rows, D / 32, NKV) with strides (row, 64 bytes, D * 2 bytes): the part's dimension has the smallest
    stride and is outside the rows, which is what stacks a part's 16 rows (as weight_map_args' column groups)."""
    if len(shape) != 5 or shape[1] != 2:
        raise ValueError(f"kv cache shape {tuple(shape)}: expected [num_blocks, 2, block_size, num_kv_heads, head_dim]")
    nb, _, bs, nkv, d = shape
    if bs != TILE_ROWS:
        raise ValueError(f"kv cache block_size {bs}: MK_ATT_TMA copies {TILE_ROWS}-token blocks (block_size 16)")
    if elem_size != 2:
        raise ValueError(f"kv cache element size {elem_size} bytes: MK_ATT_TMA supports 2-byte (bf16/fp16) caches")
    want = (2 * bs * nkv * d, bs * nkv * d, nkv * d, d, 1)
    if tuple(stride) != want:
        raise ValueError(f"kv cache strides {tuple(stride)}: MK_ATT_TMA needs a contiguous cache {want}")
    if (d * elem_size) % 16 or d > 256:
        raise ValueError(f"head_dim {d}: a box row must be a multiple of 16 bytes and at most 256 elements")
    if d % KV_PART:
        raise ValueError(f"head_dim {d}: MK_ATT_TMA's swizzled tiles need a multiple of {KV_PART}")
    return TileMapArgs(dims=(KV_PART, nb * 2 * bs, d // KV_PART, nkv),
                       strides=(nkv * d * elem_size, KV_PART * elem_size, d * elem_size),
                       box=(KV_PART, TILE_ROWS, d // KV_PART, 1), swizzle=_SWIZZLE_64B)


def _libcuda() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"MK_ATT_TMA / MK_W_TMA need the CUDA driver (libcuda.so.1) to encode tensor maps: {e}") from e
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def encode_tile_map(address: int, args: TileMapArgs) -> bytes:
    """The 128-byte CUtensorMap of a tensor at device `address` (16-byte aligned) with `args`."""
    if address % 16:
        raise ValueError(f"tensor address {address:#x} is not 16-byte aligned")
    lib = _libcuda()
    buf = (ctypes.c_ubyte * (MAP_BYTES + 64))()          # the driver wants the map 64-byte aligned
    base = ctypes.addressof(buf)
    aligned = (base + 63) // 64 * 64
    rank = len(args.dims)
    dims = (ctypes.c_uint64 * rank)(*args.dims)
    strides = (ctypes.c_uint64 * max(rank - 1, 1))(*args.strides)
    box = (ctypes.c_uint32 * rank)(*args.box)
    es = (ctypes.c_uint32 * rank)(*([1] * rank))
    rc = lib.cuTensorMapEncodeTiled(ctypes.c_void_p(aligned), _DTYPE_UINT16, rank, ctypes.c_void_p(address), dims,
                                    strides, box, es, _INTERLEAVE_NONE, args.swizzle, _L2_PROMOTION_128B,
                                    _OOB_FILL_NONE)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for {args} at {address:#x}")
    return bytes((ctypes.c_ubyte * MAP_BYTES).from_address(aligned))


def check_model(spec: LlamaSpec) -> None:
    """MK_ATT_TMA's kernel reads each ring slot once: one head pass of the kv group (csrc/attention.cuh ATT_HG:
    4 heads, or 3 / 2 / 1 when G is not a multiple of 4), i.e. G = num_q_heads / num_kv_heads of 1, 2, 3 or 4,
    and a head_dim that is a multiple of 32 (its swizzled tiles; every supported head_dim is)."""
    g = spec.num_q_heads // spec.num_kv_heads
    if g not in (1, 2, 3, 4):
        raise ValueError(f"MK_ATT_TMA supports 1-4 query heads per kv head; {spec.name} has {g} "
                         f"({spec.num_q_heads} / {spec.num_kv_heads})")
    if spec.head_dim % KV_PART:
        raise ValueError(f"MK_ATT_TMA needs a head_dim that is a multiple of {KV_PART}; {spec.name} has {spec.head_dim}")


def device_maps(kv_caches: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The caches' tensor maps, MAP_BYTES each in layer order, as one uint8 tensor on `device` (torch's
    allocations are 512-byte aligned, so every map is 128-byte aligned)."""
    import torch

    maps = b"".join(encode_tile_map(c.data_ptr(), kv_tile_map_args(tuple(c.shape), c.stride(), c.element_size()))
                    for c in kv_caches)
    return torch.frombuffer(bytearray(maps), dtype=torch.uint8).to(device)


# ---- MK_W_TMA: one tensor-map copy per weight ring chunk ---------------------------------------------------
W_KGROUP = 64          # columns per 128-byte swizzle line: csrc/weight_tma.cuh W_KG_COLS
W_CHUNK_KGROUPS = 16   # column groups per ring chunk (CHUNK_COLS = 1024 columns): the full box
W_MAP_OPS = ("qkv", "o", "gate_up", "down")   # per layer, in this order; then the LM head's pair
W_MAPS_PER_MATRIX = 2  # box of W_CHUNK_KGROUPS column groups (a whole chunk), box of 1 (a chunk's tail)


def weight_map_args(rows: int, k: int, box_kgroups: int, half_rows: int | None = None) -> TileMapArgs:
    """The map of one [rows, k] row-major 2-byte matrix whose ring chunk is 16 rows x box_kgroups * 64 columns,
    landing in shared memory as [column group][16 rows][64 columns] with the 128-byte swizzle (so the 8 rows of
    one ldmatrix read sit in 8 different bank groups). The column-group dimension is the outermost (its stride,
    128 bytes, is the smallest): that order is what puts a group's 16 rows next to each other in the box.
    Plain matrices: dims (64, rows, k / 64), box (64, 16, n). qkv (half_rows = head_dim / 2): a tile is 8 rows of
    the first half of a head and the same 8 of its second half (the RoPE pairs, tasks.qkv_unit_rows), so a 4-D
    view (64, rows - half_rows, 2, k / 64) with the half's stride half_rows * k * 2, box (64, 8, 2, n)."""
    if k % W_KGROUP:
        raise ValueError(f"MK_W_TMA: K = {k} is not a multiple of {W_KGROUP} (a 128-byte swizzle line)")
    if not 1 <= box_kgroups <= W_CHUNK_KGROUPS:
        raise ValueError(f"box_kgroups={box_kgroups}: 1..{W_CHUNK_KGROUPS}")
    row, kg = k * 2, k // W_KGROUP
    if half_rows is None:
        return TileMapArgs(dims=(W_KGROUP, rows, kg), strides=(row, 128), box=(W_KGROUP, 16, box_kgroups),
                           swizzle=_SWIZZLE_128B)
    if half_rows % 8 or rows <= half_rows:
        raise ValueError(f"MK_W_TMA: qkv half rows {half_rows} must be a multiple of 8 below {rows}")
    return TileMapArgs(dims=(W_KGROUP, rows - half_rows, 2, kg), strides=(row, half_rows * row, 128),
                       box=(W_KGROUP, 8, 2, box_kgroups), swizzle=_SWIZZLE_128B)


def check_weights_model(spec: LlamaSpec) -> None:
    """MK_W_TMA's column groups: every matrix's K (hidden, q size, intermediate) a multiple of 64."""
    for name, k in (("hidden_size", spec.hidden_size), ("q size", spec.q_size),
                    ("intermediate_size", spec.intermediate_size)):
        if k % W_KGROUP:
            raise ValueError(f"MK_W_TMA needs every matrix's K to be a multiple of {W_KGROUP}; {spec.name}'s "
                             f"{name} is {k}")


def weight_maps(spec: LlamaSpec, layers: list, lm_head: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The weights' tensor maps as one uint8 tensor on `device`: for each layer and W_MAP_OPS matrix the pair
    (whole chunk, one column group), then the LM head's pair (zeros without one). csrc/weight_tma.cuh w_map()
    indexes it the same way. (The decoder checks the model first: check_weights_model; weight_map_args refuses a
    matrix whose K is not a multiple of 64.)"""
    import torch

    maps = []

    def pair(t: torch.Tensor, half_rows: int | None = None) -> None:
        if t.stride() != (t.shape[1], 1) or t.element_size() != 2:
            raise ValueError(f"MK_W_TMA: weight {tuple(t.shape)} must be a contiguous 2-byte matrix")
        for n in (W_CHUNK_KGROUPS, 1):
            maps.append(encode_tile_map(t.data_ptr(), weight_map_args(t.shape[0], t.shape[1], n, half_rows)))

    for lw in layers:
        pair(lw.qkv, spec.head_dim // 2)
        pair(lw.o)
        pair(lw.gate_up)
        pair(lw.down)
    if lm_head is not None:
        pair(lm_head)
    else:
        maps += [bytes(MAP_BYTES)] * W_MAPS_PER_MATRIX
    return torch.frombuffer(bytearray(b"".join(maps)), dtype=torch.uint8).to(device)
