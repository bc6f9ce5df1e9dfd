"""The ring-fed attention's tensor-core lane mapping (csrc/attention_ring_mma.cuh), checked on the CPU: a numpy emulation of one ring slot's
tiles as the 64-byte-swizzled tensor copy lays them out, of ldmatrix (.trans), mma.m16n8k16 / m16n8k8 fragments as
the PTX ISA defines them, and of the kernel's per-lane steps (am_patch, am_group, the final row sums), against fp64
attention. It checks the design's index arithmetic (which lane holds which score, that P's A fragment is the scores'
C fragment, the swizzle addresses), not the CUDA text: the GPU test test_tensor_core_attention_matches_the_reference
runs the kernel itself."""
from __future__ import annotations

import numpy as np
import pytest

ROWS = 16   # tokens per block (ATT_TMA_ROWS)


def swz(addr: int) -> int:
    """The 64-byte swizzle on a shared-memory byte address: bits 4..5 ^= bits 7..8 (CUTLASS Swizzle<2, 4, 3>)."""
    return addr ^ (((addr >> 7) & 3) << 4)


def tma_tile(mem: np.ndarray, base: int, rows: np.ndarray) -> None:
    """The box (32 columns, 16 rows, D / 32 parts) of one head's 16 token rows [16, D] into `mem` (uint16 words,
    byte address / 2) at `base`: linear offset ((part * 16 + r) * 32 + col) * 2, then swizzled."""
    d = rows.shape[1]
    for p in range(d // 32):
        for r in range(ROWS):
            for col in range(32):
                mem[swz(base + ((p * ROWS + r) * 32 + col) * 2) // 2] = rows[r, p * 32 + col]


def am_addr(tile: int, r: int, c: int) -> int:   # the kernel's address of row r, 16-byte chunk c
    row = tile + (c >> 2) * (ROWS * 64) + r * 64
    return row + (((c & 3) ^ ((row >> 7) & 3)) << 4)


def ldmatrix_x4(mem: np.ndarray, addrs: list[int], trans: bool) -> np.ndarray:
    """[32 lanes][4 regs][2 halves]: matrix m's rows come from lanes 8m..8m+7 (8 elements of 16 bytes each);
    thread t gets (row t / 4, cols 2 (t % 4), +1), or with .trans (rows 2 (t % 4), +1 at col t / 4)."""
    mats = np.array([[mem[addrs[8 * m + i] // 2: addrs[8 * m + i] // 2 + 8] for i in range(8)] for m in range(4)])
    out = np.zeros((32, 4, 2), dtype=mem.dtype)
    for t in range(32):
        for m in range(4):
            if trans:
                out[t, m] = mats[m, 2 * (t % 4): 2 * (t % 4) + 2, t // 4]
            else:
                out[t, m] = mats[m, t // 4, 2 * (t % 4): 2 * (t % 4) + 2]
    return out


def mma_16816(c, a, b):
    """c[32][4] += A (16 x 16) B (16 x 8) from per-lane fragments a[32][4][2], b[32][2][2] (PTX ISA layouts)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for t in range(32):
        g, q = t // 4, t % 4
        A[g, 2 * q: 2 * q + 2], A[g + 8, 2 * q: 2 * q + 2] = a[t][0], a[t][1]
        A[g, 2 * q + 8: 2 * q + 10], A[g + 8, 2 * q + 8: 2 * q + 10] = a[t][2], a[t][3]
        B[2 * q: 2 * q + 2, g], B[2 * q + 8: 2 * q + 10, g] = b[t][0], b[t][1]
    C = A @ B
    for t in range(32):
        g, q = t // 4, t % 4
        c[t] += [C[g, 2 * q], C[g, 2 * q + 1], C[g + 8, 2 * q], C[g + 8, 2 * q + 1]]


def mma_1688(c, a, b):
    """c[32][4] += A (16 x 8) B (8 x 8): a[32][2][2], b[32][2]."""
    A, B = np.zeros((16, 8)), np.zeros((8, 8))
    for t in range(32):
        g, q = t // 4, t % 4
        A[g, 2 * q: 2 * q + 2], A[g + 8, 2 * q: 2 * q + 2] = a[t][0], a[t][1]
        B[2 * q: 2 * q + 2, g] = b[t]
    C = A @ B
    for t in range(32):
        g, q = t // 4, t % 4
        c[t] += [C[g, 2 * q], C[g, 2 * q + 1], C[g + 8, 2 * q], C[g + 8, 2 * q + 1]]


def am_patch(mem, kt: int, vt: int, r0: int, t0: int, s_lo: int, s_hi: int, newest: int, k, v) -> None:
    """The kernel's am_patch on 8 tile rows: V of tokens outside [s_lo, s_hi) zeroed, the newest token's K and V
    rows written from the context."""
    d = k.shape[1]
    for rr in range(8):
        tok = t0 + rr
        valid = s_lo <= tok < s_hi
        for ch in range(d // 8):
            if valid and tok == newest:
                mem[am_addr(kt, r0 + rr, ch) // 2: am_addr(kt, r0 + rr, ch) // 2 + 8] = k[tok, ch * 8:ch * 8 + 8]
                mem[am_addr(vt, r0 + rr, ch) // 2: am_addr(vt, r0 + rr, ch) // 2 + 8] = v[tok, ch * 8:ch * 8 + 8]
            elif not valid:
                mem[am_addr(vt, r0 + rr, ch) // 2: am_addr(vt, r0 + rr, ch) // 2 + 8] = 0.0


def am_block(mem, w: dict, qa, kt: int, vt: int, t0: int, s_lo: int, s_hi: int, G: int, D: int, qscale: float,
             round_p) -> None:
    """AM_BLOCK's am_block on warp state w: the two 8-token halves' scores (m16n8k16 with A's rows gid + 8 zero),
    one online-softmax update over 16 columns, O += P V by m16n8k16 with V's B fragments from ldmatrix.x4.trans
    (lanes 0-7 / 8-15: rows 0-7 / 8-15 of n-tile 2q, lanes 16-31: n-tile 2q + 1)."""
    s = [np.zeros((32, 4)), np.zeros((32, 4))]
    for qq in range(D // 32):
        for h in range(2):
            kb = ldmatrix_x4(mem, [am_addr(kt, 8 * h + (ln & 7), 4 * qq + (ln >> 3)) for ln in range(32)], False)
            a0 = [[qa[t, 2 * qq, 0], (0, 0), qa[t, 2 * qq, 1], (0, 0)] for t in range(32)]
            a1 = [[qa[t, 2 * qq + 1, 0], (0, 0), qa[t, 2 * qq + 1, 1], (0, 0)] for t in range(32)]
            mma_16816(s[h], a0, [[kb[t, 0], kb[t, 1]] for t in range(32)])
            mma_16816(s[h], a1, [[kb[t, 2], kb[t, 3]] for t in range(32)])

    def xs(u: int) -> list[float]:   # lane u's 4 scaled scores, -inf outside the range
        ta = t0 + 2 * (u % 4)
        return [s[h][u, j] * qscale if s_lo <= ta + 8 * h + j < s_hi else -np.inf for h in range(2) for j in range(2)]

    pa, pb, corr = np.zeros((32, 2)), np.zeros((32, 2)), np.zeros(32)
    for t in range(32):
        x = xs(t)
        mx = max(max(xs(u)) for u in range(32) if u // 4 == t // 4)
        mn = max(w["m"][t], mx)
        corr[t] = np.exp2(w["m"][t] - mn)
        p = np.exp2(np.array(x) - mn)
        w["l"][t] = w["l"][t] * corr[t] + p.sum()
        w["m"][t] = mn
        if t // 4 < G:
            pa[t], pb[t] = round_p(p[0:2]), round_p(p[2:4])
    for qq in range(D // 16):
        vb = ldmatrix_x4(mem, [am_addr(vt, (ln & 7) + ((ln >> 3) & 1) * 8, 2 * qq + (ln >> 4)) for ln in range(32)],
                         True)
        for u in range(2):
            n = 2 * qq + u
            c = np.zeros((32, 4))
            c[:, 0], c[:, 1] = w["o"][:, n, 0] * corr, w["o"][:, n, 1] * corr
            mma_16816(c, [[pa[t], (0, 0), pb[t], (0, 0)] for t in range(32)],
                      [[vb[t, 2 * u], vb[t, 2 * u + 1]] for t in range(32)])
            w["o"][:, n, 0], w["o"][:, n, 1] = c[:, 0], c[:, 1]


def emulate(q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: int, hi: int, newest: int, base: int, rng,
            round_p=lambda p: p, unit: int = 8) -> tuple:
    """One task's tokens [lo, hi) of one kv group through the kernel's steps, one ring slot of 4 blocks at `base`
    per 64 tokens, 8 warps x one 8-token group each (unit 16: AM_BLOCK, the task's 16-token block u to warp
    u % 8); K / V rows the kernel must not trust hold garbage (NaN for the rows past the range, random for the newest
    token's stale tile). Returns per-head (m, l, o) merged over warps (exp2 units), as attn_warps_store would.
    round_p: what packing P into 16-bit A fragments does (pack2)."""
    G, D = q.shape
    qscale = 1.0 / np.sqrt(D) * np.log2(np.e)
    bps = 32768 // (2 * ROWS * D * 2)
    tile_bytes = ROWS * D * 2
    warps = [{"m": np.full(32, -np.inf), "l": np.zeros(32), "o": np.zeros((32, D // 8, 2))} for _ in range(8)]
    qa = np.zeros((32, D // 16, 2, 2))   # Q's A fragments: rows gid < G
    for t in range(32):
        g, tq = t // 4, t % 4
        if g < G:
            for j in range(D // 16):
                qa[t, j, 0] = q[g, 16 * j + 2 * tq: 16 * j + 2 * tq + 2]
                qa[t, j, 1] = q[g, 16 * j + 8 + 2 * tq: 16 * j + 10 + 2 * tq]
    blk0 = lo // ROWS
    nslots = -(-((hi - 1) // ROWS - blk0 + 1) // bps) if hi > lo else 0
    for si in range(nslots):
        mem = np.full(65536, np.nan, dtype=np.float64)   # the slot's bytes / 2 (stale: NaN)
        sb = blk0 + si * bps
        s_lo, s_hi = max(lo, sb * ROWS), min(hi, (sb + bps) * ROWS)
        for bi in range(bps):
            toks = np.arange(ROWS) + (sb + bi) * ROWS
            # what the cache holds: the context's rows, NaN past the request's last token
            kr = np.where((toks < hi)[:, None], k[np.minimum(toks, len(k) - 1)], np.nan)
            vr = np.where((toks < hi)[:, None], v[np.minimum(toks, len(v) - 1)], np.nan)
            if newest // ROWS == sb + bi:   # the newest token's tile predates qkv's store
                kr[newest % ROWS] = rng.standard_normal(D) * 50
                vr[newest % ROWS] = rng.standard_normal(D) * 50
            tma_tile(mem, base + bi * 2 * tile_bytes, kr)
            tma_tile(mem, base + bi * 2 * tile_bytes + tile_bytes, vr)
        if unit == 16:
            for bi in range(bps):
                t0 = (sb + bi) * ROWS
                if t0 + ROWS <= s_lo or t0 >= s_hi:
                    continue
                kt = base + bi * 2 * tile_bytes
                for h in range(2):
                    am_patch(mem, kt, kt + tile_bytes, 8 * h, t0 + 8 * h, s_lo, s_hi, newest, k, v)
                am_block(mem, warps[(si * bps + bi) % 8], qa, kt, kt + tile_bytes, t0, s_lo, s_hi, G, D, qscale,
                         round_p)
            continue
        for gi in range(bps * ROWS // 8):
            w = warps[gi % 8]
            t0 = sb * ROWS + gi * 8
            if t0 + 8 <= s_lo or t0 >= s_hi:
                continue
            kt = base + (gi >> 1) * 2 * tile_bytes
            vt = kt + tile_bytes
            r0 = (gi & 1) * 8
            am_patch(mem, kt, vt, r0, t0, s_lo, s_hi, newest, k, v)
            s = np.zeros((32, 4))
            for qq in range(D // 32):   # am_group: scores
                kb = ldmatrix_x4(mem, [am_addr(kt, r0 + (ln & 7), 4 * qq + (ln >> 3)) for ln in range(32)], False)
                a0 = [[qa[t, 2 * qq, 0], (0, 0), qa[t, 2 * qq, 1], (0, 0)] for t in range(32)]
                a1 = [[qa[t, 2 * qq + 1, 0], (0, 0), qa[t, 2 * qq + 1, 1], (0, 0)] for t in range(32)]
                mma_16816(s, a0, [[kb[t, 0], kb[t, 1]] for t in range(32)])
                mma_16816(s, a1, [[kb[t, 2], kb[t, 3]] for t in range(32)])
            pa = np.zeros((32, 2))
            corr = np.zeros(32)
            for t in range(32):
                ta = t0 + 2 * (t % 4)
                x = [s[t, 0] * qscale if s_lo <= ta < s_hi else -np.inf,
                     s[t, 1] * qscale if s_lo <= ta + 1 < s_hi else -np.inf]
                row = [u for u in range(32) if u // 4 == t // 4]
                mx = max(max(s[u, 0] * qscale if s_lo <= t0 + 2 * (u % 4) < s_hi else -np.inf,
                             s[u, 1] * qscale if s_lo <= t0 + 2 * (u % 4) + 1 < s_hi else -np.inf) for u in row)
                mn = max(w["m"][t], mx)
                corr[t] = np.exp2(w["m"][t] - mn)
                p = np.exp2(np.array(x) - mn)
                w["l"][t] = w["l"][t] * corr[t] + p.sum()
                w["m"][t] = mn
                pa[t] = round_p(p) if t // 4 < G else 0.0
            for qq in range(D // 32):   # am_group: P V
                vb = ldmatrix_x4(mem, [am_addr(vt, r0 + (ln & 7), 4 * qq + (ln >> 3)) for ln in range(32)], True)
                for u in range(4):
                    n = 4 * qq + u
                    c = np.zeros((32, 4))
                    c[:, 0], c[:, 1] = w["o"][:, n, 0] * corr, w["o"][:, n, 1] * corr
                    mma_1688(c, [[pa[t], (0, 0)] for t in range(32)], [vb[t, u] for t in range(32)])
                    w["o"][:, n, 0], w["o"][:, n, 1] = c[:, 0], c[:, 1]
    # each warp's rows gid < G: l summed over the row's 4 lanes; then attn_warps_store's merge
    M = np.full(G, -np.inf)
    for w in warps:
        M = np.maximum(M, w["m"][0:4 * G:4])
    ls, os = np.zeros(G), np.zeros((G, D))
    for w in warps:
        for h in range(G):
            lanes = range(4 * h, 4 * h + 4)
            mw = w["m"][4 * h]
            a = 0.0 if mw == -np.inf else np.exp2(mw - M[h])
            ls[h] += a * sum(w["l"][t] for t in lanes)
            for t in lanes:
                for n in range(D // 8):
                    os[h, n * 8 + 2 * (t % 4): n * 8 + 2 * (t % 4) + 2] += a * w["o"][t, n]
    return ls, os


@pytest.mark.parametrize("d,g,lo,hi,newest", [
    (128, 4, 0, 1, 0),          # one token: the newest, in the first group
    (128, 4, 5, 71, 70),        # a range starting and ending inside 8-token groups, over two slots
    (64, 4, 16, 150, 149),      # D = 64: 8 blocks a slot, two groups a warp
    (128, 2, 40, 100, 99),      # 2 heads a kv group
    (64, 4, 5, 331, 330),       # D = 64 over 3 slots, a range starting and ending inside blocks
])
@pytest.mark.parametrize("unit", [8, 16])
def test_lane_mapping_computes_attention(d, g, lo, hi, newest, unit):
    """unit 16: AM_BLOCK's 16-token blocks (the kernel builds them at head_dim <= 64; the mapping holds at 128)."""
    rng = np.random.default_rng(d + g + hi)
    q = rng.standard_normal((g, d))
    k = rng.standard_normal((hi + 64, d))
    v = rng.standard_normal((hi + 64, d))
    ls, os = emulate(q, k, v, lo, hi, newest, base=512 * 3, rng=rng, unit=unit)   # att_tiles: 512-aligned, not 1024
    sc = q @ k[lo:hi].T / np.sqrt(d)
    p = np.exp(sc - sc.max(axis=1, keepdims=True))
    want = (p @ v[lo:hi]) / p.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(os / ls[:, None], want, rtol=1e-9, atol=1e-9)


def test_the_emulated_steps_are_the_kernels():
    """The lines of csrc/attention_ring_mma.cuh whose index arithmetic the emulation above mirrors."""
    from pathlib import Path
    src = (Path(__file__).resolve().parents[1] / "csrc" / "attention_ring_mma.cuh").read_text()
    for line in ("const unsigned row = tile + (unsigned)((c >> 2) * (ATT_TMA_ROWS * 64) + r * 64);",
                 "return row + ((((unsigned)c & 3u) ^ ((row >> 7) & 3u)) << 4);",
                 "const int lr = r0 + (lane & 7), mi = lane >> 3, tq = lane & 3;",
                 "ldmatrix_x4(kb, am_addr(kt, lr, 4 * q + mi));",
                 ("const unsigned a0[4] = {qa[2 * q][0], 0u, qa[2 * q][1], 0u}, a1[4] = {qa[2 * q + 1][0], 0u, "
                  "qa[2 * q + 1][1], 0u};"),
                 "const unsigned b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};",
                 "ldmatrix_x4_trans(vb, am_addr(vt, lr, 4 * q + mi));",
                 "mma_1688_top(o[4 * q + u][0], o[4 * q + u][1], pa, vb[u]);",
                 "qa[j][0] = qrow ? ld_cg_u32(qp + 16 * j) : 0u;",
                 "qa[j][1] = qrow ? ld_cg_u32(qp + 16 * j + 8) : 0u;",
                 ("const unsigned kt = att_tiles(S, slot) + (unsigned)((gi >> 1) * 2 * ATT_TILE_BYTES), vt = kt + "
                  "ATT_TILE_BYTES;"),
                 "const int r0 = (gi & 1) * 8;",
                 # AM_BLOCK (am_block and its loop: head_dim <= 64)
                 "ldmatrix_x4(kb, am_addr(kt, 8 * h + lr, 4 * q + mi));",
                 "mma_16816_top(sh[0], sh[1], qa[2 * q][0], qa[2 * q][1], kb[0], kb[1]);",
                 "mma_16816_top(sh[0], sh[1], qa[2 * q + 1][0], qa[2 * q + 1][1], kb[2], kb[3]);",
                 "const unsigned pa = qrow ? pack2(p0, p1) : 0u, pb = qrow ? pack2(p2, p3) : 0u;",
                 "const int vr = (lane & 7) + ((lane >> 3) & 1) * 8, vc = lane >> 4;",
                 "ldmatrix_x4_trans(vb, am_addr(vt, vr, 2 * q + vc));",
                 "mma_16816_top(o[2 * q + u][0], o[2 * q + u][1], pa, pb, vb[2 * u], vb[2 * u + 1]);",
                 ("for (int bi = ((warp - si * ATT_TMA_BPS) % CONSUMER_WARPS + CONSUMER_WARPS) % CONSUMER_WARPS; bi < "
                  "ATT_TMA_BPS;"),
                 "const unsigned kt = att_tiles(S, slot) + (unsigned)(bi * 2 * ATT_TILE_BYTES), vt = kt + ATT_TILE_BYTES;",
                 "am_patch(kt, vt, 8 * h, th, s_lo, s_hi, newest, wo, lane);",
                 "if (AM_BLOCK) return rel % CONSUMER_WARPS;"):
        assert line in src, line


@pytest.mark.parametrize("d,g,lo,hi,unit", [(128, 4, 5, 300, 8), (64, 4, 16, 531, 8), (64, 2, 0, 7, 8),
                                            (128, 3, 129, 130, 8), (64, 4, 16, 531, 16), (64, 4, 5, 300, 16),
                                            (64, 2, 0, 7, 16), (128, 4, 5, 300, 16)])
def test_the_vm_models_the_kernels_p_rounding(d, g, lo, hi, unit):
    """vm.ring_pv_weights (the VM's ring attention tasks) against this emulation of the kernel's warps with P rounded
    to bf16 as pack2 does: the same output to fp64 precision, and a visibly different one from exact softmax."""
    import torch

    from mk_plugin.persistent.vm import ring_pv_weights
    rng = np.random.default_rng(d * g + hi)
    q = rng.standard_normal((g, d)) * 2
    k = rng.standard_normal((hi + 64, d))
    v = rng.standard_normal((hi + 64, d))
    bf16 = lambda p: torch.from_numpy(np.asarray(p)).to(torch.bfloat16).double().numpy()
    ls, os = emulate(q, k, v, lo, hi, newest=hi - 1, base=512, rng=rng, round_p=bf16, unit=unit)
    s = torch.from_numpy(q @ k[lo:hi].T / np.sqrt(d))                   # [G, T] natural units
    w = ring_pv_weights(s, lo, torch.bfloat16, unit).double()
    l_ = torch.exp(s - s.max(-1, keepdim=True).values).sum(-1)
    got = (w @ torch.from_numpy(v[lo:hi])) / l_[:, None]
    np.testing.assert_allclose(got.numpy(), os / ls[:, None], rtol=1e-9, atol=1e-12)
    exact = torch.softmax(s, -1) @ torch.from_numpy(v[lo:hi])
    if hi - lo > 8:   # more than one group: some P is rounded relative to a running maximum below the final one
        assert (got - exact).abs().max() > 1e-6
