"""lm_head: fp32 logits of the (optionally rms-normed) hidden states vs the fp32 reference."""
from __future__ import annotations

import pytest
import torch

from mk_plugin import reference as ref
from mk_plugin.testing import assert_matches, poison_
from mk_plugin.triton_ops.lm_head import lm_head

EPS = 1e-5


def make(m: int, h: int, v: int, dtype: torch.dtype, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(m, h, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(v, h, generator=g) * h ** -0.5).to(device=device, dtype=dtype)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(device=device, dtype=dtype)
    return hid, w, nw


def expected(hid, w, nw, eps=EPS):
    a = hid.float() if nw is None else ref.rms_norm(hid, nw, eps)[0].to(hid.dtype).float()
    return ref.linear(a, w)


# CPU: V = 136 with K = 320 keeps the default table's program count small for the interpreter
# (M = 1 takes the FMA GEMV path, one row per program at this V).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("norm", [False, True])
def test_logits(device, dtype, m, norm):
    hid, w, nw = make(m, 320, 136, dtype, device, seed=m)
    nw = nw if norm else None
    out = poison_(torch.empty(m, 136, dtype=torch.float32, device=device))
    y = lm_head(hid, w, norm_weight=nw, eps=EPS, out=out)
    assert y is out and y.dtype == torch.float32
    # Inputs are `dtype`; fp32 logits carry only accumulation-order error beyond the shared
    # rounding of the normed row, which the input dtype's tolerance covers.
    assert_matches(y, expected(hid, w, nw), dtype)


def test_allocates_fp32_when_no_out(device):
    hid, w, _ = make(2, 320, 136, torch.bfloat16, device)
    y = lm_head(hid, w)
    assert y.dtype == torch.float32 and y.shape == (2, 136)
    assert_matches(y, expected(hid, w, None), torch.bfloat16)


def test_rejects_bad_inputs(device):
    hid, w, nw = make(2, 64, 100, torch.bfloat16, device)
    with pytest.raises(ValueError, match="out has dtype torch.bfloat16"):
        lm_head(hid, w, out=torch.empty(2, 100, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match=r"out has shape \(2, 99\), expected \(2, 100\)"):
        lm_head(hid, w, out=torch.empty(2, 99, device=device))
    with pytest.raises(ValueError, match="in_features 64 != x's K=32"):
        lm_head(hid[:, :32].contiguous(), w)
    with pytest.raises(ValueError, match=r"norm_weight has shape \(32,\), expected \(64,\)"):
        lm_head(hid, w, norm_weight=nw[:32].contiguous())
    with pytest.raises(ValueError, match="weight has dtype torch.float16"):
        lm_head(hid, w.half())
    with pytest.raises(ValueError, match="x has 17 rows"):
        lm_head(torch.randn(17, 64).to(device=device, dtype=torch.bfloat16), w)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [2048, 4096])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("norm", [False, True])
def test_gpu_llama_vocab(h, m, norm):
    v = 128256
    hid, w, nw = make(m, h, v, torch.bfloat16, "cuda", seed=m)
    nw = nw if norm else None
    out = poison_(torch.empty(m, v, dtype=torch.float32, device="cuda"))
    y = lm_head(hid, w, norm_weight=nw, out=out)
    assert_matches(y, expected(hid, w, nw), torch.bfloat16)
