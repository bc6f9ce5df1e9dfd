"""rms_norm (optionally fused with the residual add) vs the fp32 reference."""
from __future__ import annotations

import pytest
import torch

from mk_plugin import reference as ref
from mk_plugin.testing import assert_matches, poison_
from mk_plugin.triton_ops.rms_norm import MAX_SINGLE_PASS, rms_norm

EPS = 1e-5


def make(m: int, h: int, dtype: torch.dtype, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, h, generator=g) * 2).to(device=device, dtype=dtype)
    r = torch.randn(m, h, generator=g).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(device=device, dtype=dtype)
    return x, r, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("h", [320, 688, 1000])
def test_with_residual(device, dtype, m, h):
    x, r, w = make(m, h, dtype, device)
    out = poison_(torch.empty_like(x))
    h_out = poison_(torch.empty_like(x))
    o, hh = rms_norm(x, w, EPS, r, out=out, residual_out=h_out)
    assert o is out and hh is h_out
    eo, eh = ref.rms_norm(x, w, EPS, r)
    assert_matches(o, eo, dtype)
    assert_matches(hh, eh, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_without_residual(device, dtype, m):
    x, _, w = make(m, 688, dtype, device, seed=1)
    o, hh = rms_norm(x, w, EPS)
    assert hh is x
    assert o.dtype == dtype and o.shape == x.shape
    assert_matches(o, ref.rms_norm(x, w, EPS)[0], dtype)


def test_fp32_weight_with_bf16_x(device):
    x, r, w = make(3, 320, torch.bfloat16, device, seed=2)
    w32 = w.float() + 0.01
    o, _ = rms_norm(x, w32, 1e-6, r)
    assert_matches(o, ref.rms_norm(x, w32, 1e-6, r)[0], torch.bfloat16)


def test_in_place_like_fused_add_rms_norm(device):
    """out aliases x and residual_out aliases residual (vLLM's in-place fused_add_rms_norm)."""
    x, r, w = make(3, 1000, torch.bfloat16, device, seed=3)
    eo, eh = ref.rms_norm(x, w, EPS, r)
    o, hh = rms_norm(x, w, EPS, r, out=x, residual_out=r)
    assert o is x and hh is r
    assert_matches(x, eo, torch.bfloat16)
    assert_matches(r, eh, torch.bfloat16)


def test_two_pass_long_rows(device):
    h = MAX_SINGLE_PASS + 3000  # not a multiple of the two-pass block
    x, r, w = make(2, h, torch.bfloat16, device, seed=4)
    o, hh = rms_norm(x, w, EPS, r)
    eo, eh = ref.rms_norm(x, w, EPS, r)
    assert_matches(o, eo, torch.bfloat16)
    assert_matches(hh, eh, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------

def test_rejects_bad_inputs(device):
    x, r, w = make(2, 64, torch.bfloat16, device)
    with pytest.raises(ValueError, match="x has dtype torch.int32"):
        rms_norm(x.to(torch.int32), w, EPS)
    with pytest.raises(ValueError, match="weight has dtype torch.int64"):
        rms_norm(x, w.long(), EPS)
    with pytest.raises(ValueError, match="residual has dtype torch.float16"):
        rms_norm(x, w, EPS, r.half())
    with pytest.raises(ValueError, match=r"weight has shape \(63,\), expected \(64,\)"):
        rms_norm(x, w[:63].contiguous(), EPS)
    with pytest.raises(ValueError, match=r"residual has shape \(2, 32\), expected \(2, 64\)"):
        rms_norm(x, w, EPS, r[:, :32].contiguous())
    with pytest.raises(ValueError, match=r"out has shape \(1, 64\), expected \(2, 64\)"):
        rms_norm(x, w, EPS, out=torch.empty(1, 64, dtype=x.dtype, device=device))
    with pytest.raises(ValueError, match="out has dtype torch.float32"):
        rms_norm(x, w, EPS, out=torch.empty(2, 64, device=device))
    with pytest.raises(ValueError, match="residual_out given without residual"):
        rms_norm(x, w, EPS, residual_out=torch.empty_like(x))
    with pytest.raises(ValueError, match="eps=0"):
        rms_norm(x, w, 0)
    with pytest.raises(ValueError, match="x must be 2-D"):
        rms_norm(x[0], w, EPS)


@pytest.mark.parametrize("m", [0, 17])
def test_rejects_token_count(device, m):
    x = torch.randn(m, 64).to(device=device, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=f"x has {m} rows; decode ops support 1..16"):
        rms_norm(x, w, EPS)


def test_rejects_non_contiguous_and_overlap(device):
    x, r, w = make(2, 128, torch.bfloat16, device)
    with pytest.raises(ValueError, match="x must be contiguous"):
        rms_norm(x[:, ::2], w[:64].contiguous(), EPS)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        rms_norm(x[:, :64].contiguous(), w[:64].contiguous(), EPS, r[:, ::2])
    buf = torch.empty(3, 128, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="out partially overlaps x"):
        rms_norm(buf[:2], w, EPS, out=buf[1:])
    with pytest.raises(ValueError, match="out and residual_out overlap"):
        rms_norm(x, w, EPS, r, out=buf[:2], residual_out=buf[1:])
    big = MAX_SINGLE_PASS + 16
    xb = torch.randn(1, big).to(device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"out aliases x, which needs H <= {MAX_SINGLE_PASS}"):
        rms_norm(xb, torch.ones(big, dtype=torch.bfloat16, device=device), EPS, out=xb)


def test_rejects_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, _, w = make(1, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="tensor on cpu given to a GPU op"):
        rms_norm(x, w, EPS)


# ----------------------------------------------------------------------------------------------
# GPU: Llama hidden sizes, CUDA graphs
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("h", [2048, 4096])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_llama_sizes(h, m, dtype):
    x, r, w = make(m, h, dtype, "cuda", seed=m)
    out, h_out = poison_(torch.empty_like(x)), poison_(torch.empty_like(x))
    o, hh = rms_norm(x, w, EPS, r, out=out, residual_out=h_out)
    eo, eh = ref.rms_norm(x, w, EPS, r)
    assert_matches(o, eo, dtype)
    assert_matches(hh, eh, dtype)
    o2, _ = rms_norm(x, w, EPS)
    assert_matches(o2, ref.rms_norm(x, w, EPS)[0], dtype)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    x, r, w = make(4, 2048, torch.bfloat16, "cuda")
    out, h_out = torch.empty_like(x), torch.empty_like(x)
    rms_norm(x, w, EPS, r, out=out, residual_out=h_out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        rms_norm(x, w, EPS, r, out=out, residual_out=h_out)
    x2, r2, _ = make(4, 2048, torch.bfloat16, "cuda", seed=9)
    x.copy_(x2)
    r.copy_(r2)
    poison_(out)
    poison_(h_out)
    g.replay()
    torch.cuda.synchronize()
    eo, eh = ref.rms_norm(x2, w, EPS, r2)
    assert_matches(out, eo, torch.bfloat16)
    assert_matches(h_out, eh, torch.bfloat16)
