"""linear (skinny GEMM with rms-norm prologue, residual / silu_and_mul epilogues) vs the fp32 reference.

CPU runs force small-tile configs (few programs: the interpreter runs them one by one); the
default heuristic table is exercised on small shapes and, on the GPU, at Llama sizes."""
from __future__ import annotations

import pytest
import torch

from mk_plugin import reference as ref
from mk_plugin.testing import assert_matches, poison_
from mk_plugin.triton_ops.linear import (
    DEFAULT_NUM_SMS,
    LinearConfig,
    _linear,
    linear,
    linear_bytes,
    select_config,
)

EPS = 1e-5
# Forced configs keep the interpreter's program count small: the dot path (tensor cores, any M)
# and the FMA GEMV path (M == 1), both with K chunks that leave a partial tail for K = 688.
DOT = LinearConfig(block_n=32, block_k=64, split_k=1, use_dot=True)
FMA = LinearConfig(block_n=16, block_k=128, split_k=1, use_dot=False)
DOT_SPLIT = LinearConfig(block_n=32, block_k=64, split_k=4, use_dot=True)
FMA_SPLIT = LinearConfig(block_n=16, block_k=64, split_k=3, use_dot=False)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_inputs(m: int, n_w: int, k: int, dtype: torch.dtype, device, *, norm: bool, res: bool,
                silu: bool, seed: int = 0):
    g = _gen(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n_w, k, generator=g) * k ** -0.5).to(device=device, dtype=dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device=device, dtype=dtype) if norm else None
    n_out = n_w // 2 if silu else n_w
    r = torch.randn(m, n_out, generator=g).to(device=device, dtype=dtype) if res else None
    return x, w, nw, r


def expected(x, w, nw, r, silu: bool, eps: float = EPS) -> torch.Tensor:
    """fp32 reference; the normed row is rounded to x.dtype before the matmul, as the kernel does."""
    a = x.float() if nw is None else ref.rms_norm(x, nw, eps)[0].to(x.dtype).float()
    y = ref.linear(a, w)
    if silu:
        y = ref.silu_and_mul(y)
    if r is not None:
        y = y + r.float()
    return y


FUSIONS = {  # name: (norm, residual, silu)
    "plain": (False, False, False),
    "norm": (True, False, False),
    "residual": (False, True, False),
    "silu_norm": (True, False, True),
    "silu_norm_residual": (True, True, True),
}


def run_case(m, n_w, k, dtype, device, fusion, config, out_dtype=None, seed=0):
    norm, res, silu = FUSIONS[fusion]
    x, w, nw, r = make_inputs(m, n_w, k, dtype, device, norm=norm, res=res, silu=silu, seed=seed)
    n_out = n_w // 2 if silu else n_w
    out = poison_(torch.empty(m, n_out, dtype=out_dtype or dtype, device=device))
    y = _linear(x, w, norm_weight=nw, eps=EPS, residual=r, activation="silu_and_mul" if silu else None,
                out=out, out_dtype=out_dtype, config=config)
    assert y is out
    assert_matches(y, expected(x, w, nw, r, silu), out_dtype or dtype)
    return y


# bf16 with every fusion; fp16 with the two that touch the most code (prologue, both epilogues).
DTYPE_FUSIONS = [(torch.bfloat16, f) for f in FUSIONS] + [
    (torch.float16, "norm"), (torch.float16, "silu_norm_residual")]


@pytest.mark.parametrize("dtype,fusion", DTYPE_FUSIONS)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_dot_path(device, dtype, m, fusion):
    # K = 688 = 10 full chunks of 64 + a partial one; N = 320 = 10 tiles of 32.
    run_case(m, 640 if FUSIONS[fusion][2] else 320, 688, dtype, device, fusion, DOT)


@pytest.mark.parametrize("dtype,fusion", DTYPE_FUSIONS)
@pytest.mark.parametrize("k", [688, 1024])
def test_fma_path_m1(device, dtype, fusion, k):
    # N = 200: the last tile of 16 rows is partial (rows are clamped, the store is masked).
    run_case(1, 400 if FUSIONS[fusion][2] else 200, k, dtype, device, fusion, FMA)


@pytest.mark.parametrize("m,config", [(1, FMA_SPLIT), (3, DOT_SPLIT), (8, DOT_SPLIT)])
@pytest.mark.parametrize("fusion", ["plain", "silu_norm_residual", "residual"])
def test_split_k_matches_and_is_deterministic(device, m, config, fusion):
    y1 = run_case(m, 192, 688, torch.bfloat16, device, fusion, config).clone()
    y2 = run_case(m, 192, 688, torch.bfloat16, device, fusion, config)
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_default_config_small_shapes(device, m):
    # Default table: M=1 -> FMA GEMV; M>1 -> dot, which splits K here (4 tiles of 16 < SMs/2).
    cfg = select_config(m, 64, 1024, num_sms=DEFAULT_NUM_SMS)
    if m > 1:
        assert cfg.use_dot and cfg.split_k > 1
    run_case(m, 64, 1024, torch.bfloat16, device, "residual", None)
    run_case(m, 128, 1024, torch.float16, device, "silu_norm", None)


def test_out_dtype_fp32_and_allocation(device):
    x, w, nw, _ = make_inputs(3, 96, 320, torch.bfloat16, device, norm=True, res=False, silu=False)
    y = _linear(x, w, norm_weight=nw, out_dtype=torch.float32, config=DOT)
    assert y.dtype == torch.float32 and y.shape == (3, 96)
    # bf16 inputs: the normed row is rounded to bf16 on both sides, so use the bf16 tolerance.
    assert_matches(y, expected(x, w, nw, None, False), torch.bfloat16)
    y2 = _linear(x, w, config=DOT)
    assert y2.dtype == torch.bfloat16
    assert_matches(y2, expected(x, w, None, None, False), torch.bfloat16)


def test_out_may_alias_residual(device):
    """o_proj / down in place on the residual stream: out is residual."""
    x, w, _, r = make_inputs(3, 96, 320, torch.bfloat16, device, norm=False, res=True, silu=False)
    want = expected(x, w, None, r, False)
    y = _linear(x, w, residual=r, out=r, config=DOT)
    assert y is r
    assert_matches(y, want, torch.bfloat16)


def test_public_linear_wrapper(device):
    x, w, nw, r = make_inputs(1, 64, 320, torch.float16, device, norm=True, res=True, silu=True)
    y = linear(x, w, norm_weight=nw, eps=EPS, residual=r, activation="silu_and_mul")
    assert_matches(y, expected(x, w, nw, r, True), torch.float16)


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------

def _ok(device, m=2, n=32, k=64, dtype=torch.bfloat16):
    x = torch.randn(m, k).to(device=device, dtype=dtype)
    w = torch.randn(n, k).to(device=device, dtype=dtype)
    return x, w


def test_rejects_bad_dtypes(device):
    x, w = _ok(device)
    with pytest.raises(ValueError, match="x has dtype torch.float32"):
        linear(x.float(), w)
    with pytest.raises(ValueError, match="weight has dtype torch.float16"):
        linear(x, w.half())
    with pytest.raises(ValueError, match="out_dtype=torch.int32"):
        linear(x, w, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="residual has dtype torch.int64"):
        linear(x, w, residual=torch.zeros(2, 32, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="out has dtype torch.bfloat16"):
        linear(x, w, out_dtype=torch.float32, out=torch.empty(2, 32, dtype=torch.bfloat16, device=device))


def test_rejects_bad_shapes(device):
    x, w = _ok(device)
    with pytest.raises(ValueError, match="in_features 48 != x's K=64"):
        linear(x, w[:, :48].contiguous())
    with pytest.raises(ValueError, match=r"residual has shape \(2, 31\), expected \(2, 32\)"):
        linear(x, w, residual=torch.zeros(2, 31, dtype=x.dtype, device=device))
    with pytest.raises(ValueError, match=r"residual has shape \(2, 32\), expected \(2, 16\)"):
        linear(x, w, residual=torch.zeros(2, 32, dtype=x.dtype, device=device), activation="silu_and_mul")
    with pytest.raises(ValueError, match="even number of weight rows.*got 31"):
        linear(x, w[:31], activation="silu_and_mul")
    with pytest.raises(ValueError, match=r"norm_weight has shape \(32,\), expected \(64,\)"):
        linear(x, w, norm_weight=torch.ones(32, dtype=x.dtype, device=device))
    with pytest.raises(ValueError, match=r"out has shape \(2, 16\), expected \(2, 32\)"):
        linear(x, w, out=torch.empty(2, 16, dtype=x.dtype, device=device))
    with pytest.raises(ValueError, match="x must be 2-D"):
        linear(x[0], w)


@pytest.mark.parametrize("m", [0, 17])
def test_rejects_token_count(device, m):
    x, w = _ok(device, m=max(m, 1))
    x = torch.randn(m, 64).to(device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"x has {m} rows; decode ops support 1..16"):
        linear(x, w)


def test_rejects_non_contiguous(device):
    x, w = _ok(device)
    wide = torch.randn(2, 128).to(device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x must be contiguous"):
        linear(wide[:, ::2], w)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        linear(x, torch.randn(64, 32).to(device=device, dtype=torch.bfloat16).t())


def test_rejects_bad_activation_and_eps(device):
    x, w = _ok(device)
    with pytest.raises(ValueError, match="activation='gelu'"):
        linear(x, w, activation="gelu")
    with pytest.raises(ValueError, match="eps=-1.0"):
        linear(x, w, eps=-1.0)


def test_rejects_aliasing_and_bad_config(device):
    x, w = _ok(device, n=64)
    with pytest.raises(ValueError, match="out overlaps x"):
        linear(x, w, out=x)
    with pytest.raises(ValueError, match="FMA path, which handles M == 1 only"):
        _linear(x, w, config=FMA)
    with pytest.raises(ValueError, match="block_n=8 must be >= 16 with use_dot"):
        LinearConfig(block_n=8, block_k=64, split_k=1, use_dot=True)
    with pytest.raises(ValueError, match="split_k=9"):
        LinearConfig(block_n=16, block_k=64, split_k=9, use_dot=True)


def test_rejects_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w = _ok("cpu")
    with pytest.raises(ValueError, match="tensor on cpu given to a GPU op"):
        linear(x, w)


# ----------------------------------------------------------------------------------------------
# Config table and byte count
# ----------------------------------------------------------------------------------------------

LLAMA = {  # name: (hidden, qkv rows, intermediate, vocab)
    "llama-3.2-1b": (2048, 3072, 8192, 128256),
    "llama-3.1-8b": (4096, 6144, 14336, 128256),
}


def llama_ops(name: str) -> dict[str, tuple[int, int, bool, bool, bool]]:
    """op: (weight rows, K, norm, residual, silu)."""
    h, qkv, i, v = LLAMA[name]
    return {"qkv": (qkv, h, True, False, False), "o_proj": (h, h, False, True, False),
            "gate_up": (2 * i, h, True, False, True), "down": (h, i, False, True, False),
            "lm_head": (v, h, True, False, False)}


@pytest.mark.parametrize("name", list(LLAMA))
def test_table_fills_the_gpu_without_split_at_llama_sizes(name):
    for m in range(1, 17):
        for op, (n_w, k, _, _, silu) in llama_ops(name).items():
            n_out = n_w // 2 if silu else n_w
            cfg = select_config(m, n_out, k, silu=silu)
            assert cfg.split_k == 1, (name, op, m, cfg)
            assert cfg.use_dot == (m > 1)
            if m == 1:  # FMA GEMV: about one wave of programs or more (M > 1: 64-row tiles, measured)
                assert -(-n_out // cfg.block_n) >= DEFAULT_NUM_SMS - 4, (name, op, m, cfg)
            assert k % cfg.block_k == 0  # no K masks on the hot path


def test_linear_bytes():
    bf = torch.bfloat16
    assert linear_bytes(1, 3072, 2048, bf) == 3072 * 2048 * 2 + 2048 * 2 + 3072 * 2
    assert linear_bytes(4, 16384, 2048, bf, activation="silu_and_mul", norm=True) == (
        16384 * 2048 * 2 + 4 * 2048 * 2 + 2048 * 2 + 4 * 8192 * 2)
    assert linear_bytes(2, 2048, 2048, bf, residual=True) == 2048 * 2048 * 2 + 2 * 2048 * 2 * 3
    assert linear_bytes(1, 1000, 64, bf, out_dtype=torch.float32) == 1000 * 64 * 2 + 64 * 2 + 1000 * 4


# ----------------------------------------------------------------------------------------------
# GPU: Llama sizes, default table, CUDA graphs
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LLAMA))
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_llama_sizes(name, m, dtype):
    for op, (n_w, k, norm, res, silu) in llama_ops(name).items():
        if op == "lm_head":
            continue  # tests/test_lm_head.py
        fusion = {(True, False, False): "norm", (False, True, False): "residual",
                  (True, False, True): "silu_norm"}[(norm, res, silu)]
        run_case(m, n_w, k, dtype, "cuda", fusion, None, seed=m)


@pytest.mark.gpu
@pytest.mark.parametrize("m,config", [(1, None), (4, None), (1, FMA_SPLIT), (8, DOT_SPLIT)])
def test_gpu_deterministic(m, config):
    y1 = run_case(m, 4096, 2048, torch.bfloat16, "cuda", "silu_norm_residual", config).clone()
    y2 = run_case(m, 4096, 2048, torch.bfloat16, "cuda", "silu_norm_residual", config)
    assert torch.equal(y1, y2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_cuda_graph_replay(m):
    """Captured with out given (no allocation), replayed on new inputs copied into the same buffers."""
    x, w, nw, _ = make_inputs(m, 2 * 8192, 2048, torch.bfloat16, "cuda", norm=True, res=False, silu=True)
    out = torch.empty(m, 8192, dtype=torch.bfloat16, device="cuda")
    kw = {"norm_weight": nw, "activation": "silu_and_mul", "out": out}
    linear(x, w, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        linear(x, w, **kw)
    x2 = torch.randn(m, 2048, generator=_gen(7)).to(device="cuda", dtype=torch.bfloat16)
    x.copy_(x2)
    poison_(out)
    g.replay()
    torch.cuda.synchronize()
    assert_matches(out, expected(x2, w, nw, None, True), torch.bfloat16)


# ---- measured configs (mk_plugin/triton_ops/tuned/*.json, written by bench/sweep_linear.py) ----
def _tuned_entries():
    import json

    from mk_plugin.triton_ops.linear import TUNED_DIR
    for p in sorted(TUNED_DIR.glob("linear_*.json")):
        for e in json.loads(p.read_text())["entries"]:
            yield pytest.param(e, id=f"{p.stem}-{e['op']}-m{e['m']}")


@pytest.mark.parametrize("entry", list(_tuned_entries()))
def test_every_tuned_config_is_correct(entry):
    """Each measured winner computes the right answer at its own K (N cut to 48 columns, M to 1 or 3):
    the sweep that picked them timed them without checking their results."""
    from mk_plugin.triton_ops.linear import LinearConfig, _linear

    torch.manual_seed(0)
    cfg = LinearConfig(**entry["config"])
    m, n_out, k, silu = (1 if entry["m"] == 1 else 3), min(entry["n_out"], 48), entry["k"], entry["silu"]
    x = torch.randn(m, k).to(torch.bfloat16)
    w = (torch.randn(2 * n_out if silu else n_out, k) * 0.02).to(torch.bfloat16)
    nw = (torch.rand(k) + 0.5).to(torch.bfloat16)
    out = torch.full((m, n_out), float("nan"), dtype=torch.bfloat16)
    _linear(x, w, norm_weight=nw, activation="silu_and_mul" if silu else None, out=out, config=cfg)
    a, _ = ref.rms_norm(x, nw, 1e-5)
    y = ref.linear(a.to(torch.bfloat16), w)
    assert_matches(out, ref.silu_and_mul(y) if silu else y, torch.bfloat16)


def test_tuned_table_only_serves_its_gpu_and_kind():
    from mk_plugin.triton_ops.linear import select_config, tuned_table

    table = tuned_table("NVIDIA H200")
    assert table, "the H200 table measured on 2026-11-30 is shipped with the package"
    (m, n, k, silu), cfg = next(iter(table.items()))
    assert select_config(m, n, k, silu=silu, device_name="NVIDIA H200") == cfg
    assert select_config(m, n, k, silu=silu, device_name="Some Other GPU") == select_config(m, n, k, silu=silu)
    assert select_config(m, n, k, silu=silu) == select_config(m, n, k, silu=silu, device_name=None)
    for (tm, tn, tk, ts), c in table.items():  # M > 1 never gets an FMA-only config
        assert tm == 1 or c.use_dot
