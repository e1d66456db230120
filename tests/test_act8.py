"""8-bit activations (flashinfer_lite.kernels.blocks: quantize_act, row_dot8, set_act8), against a numpy oracle written here
from llama.cpp's definitions (ggml's x86 quantize_row_q8_0 / q8_1 and its q4_0 / q4_1 / q5_0 / q5_1 / q8_0 dot
products): the 8-bit blocks equal it bit for bit; the dot products equal float64 sums of its exact integer products
to float32 rounding; and the results do not depend on the thread count or the GEMV path."""
from __future__ import annotations

import numpy as np
import pytest

from flashinfer_lite.kernels import blocks as quant
from flashinfer_lite.ffn.quant import quant_ffn
from flashinfer_lite.kernels.blocks import BLOCK, QuantMatrix, act8_of, quant_matmul_t, quantize, set_act8
from storage.blocks import QUANTIZABLE
from test_kernels import numba_threads

f16 = np.float16


@pytest.fixture
def act8(float32_activations):
    set_act8(True)         # float32_activations restores the default after the test


def q8_blocks(x: np.ndarray):
    """x [n] -> (q int8 [n], d [n/32], s [n/32]) as ggml rounds it: d = max|x| / 127 stored as float16, q = x times
    127 / max|x| rounded to even, s = float16 of the unrounded d times the block's sum of q (q8_1)."""
    b = x.astype(np.float32).reshape(-1, BLOCK)
    amax = np.abs(b).max(axis=1)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(b * inv[:, None]).astype(np.int8)
    s = (d * q.sum(axis=1).astype(np.float32)).astype(f16).astype(np.float32)
    return q.reshape(-1), d.astype(f16).astype(np.float32), s


def weight_blocks(row: np.ndarray, kind: str):
    """A row's blocks -> (q int [blocks, 32] the signed values, d [blocks], m [blocks] (0 without a min))."""
    nbytes = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}[kind]
    b = row.reshape(-1, nbytes)
    half = lambda o: b[:, o:o + 2].copy().view(f16)[:, 0].astype(np.float32)  # noqa: E731
    d = half(0)
    m = half(2) if kind in ("q4_1", "q5_1") else np.zeros_like(d)
    if kind == "q8_0":
        return b[:, 2:].view(np.int8).astype(np.int64), d, m
    head = 4 if kind in ("q4_1", "q5_1") else 2
    five = kind in ("q5_0", "q5_1")
    qs = b[:, head + 4 * five:].astype(np.int64)
    q = np.concatenate([qs & 15, qs >> 4], axis=1)
    if five:
        qh = b[:, head:head + 4].copy().view(np.uint32)[:, 0].astype(np.int64)
        q |= ((qh[:, None] >> np.arange(BLOCK)) & 1) << 4
    return q - {"q4_0": 8, "q5_0": 16}.get(kind, 0), d, m


def oracle_dot(row, kind, x):
    """llama.cpp's dot product of a weight row with x's 8-bit blocks, in float64 on its exact integer sums."""
    xq, xd, xs = q8_blocks(x)
    q, d, m = weight_blocks(row, kind)
    sums = (q * xq.reshape(-1, BLOCK).astype(np.int64)).sum(axis=1)
    return float(np.sum(d.astype(np.float64) * xd * sums) + np.sum(m.astype(np.float64) * xs)), \
        float(np.sum(np.abs(d.astype(np.float64) * xd * sums)) + np.sum(np.abs(m.astype(np.float64) * xs)))


def test_the_8_bit_blocks_are_llama_cpps(act8):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(40 * BLOCK) * np.exp(rng.uniform(-8, 4, 40 * BLOCK))).astype(np.float32)
    x[:BLOCK] = 0                                           # an all-zero block: d = 0, q = 0
    x[BLOCK:2 * BLOCK] = np.arange(BLOCK) - 15.5            # halves: ties round to even
    x[2 * BLOCK:3 * BLOCK] *= 1e-6
    q, d, s, lanes = (v[0] for v in quant_act(x)[:4])
    xq, xd, xs = q8_blocks(x)
    assert np.array_equal(q, xq) and np.array_equal(d.view(np.uint32), xd.view(np.uint32))
    assert np.array_equal(s.view(np.uint32), xs.view(np.uint32))
    assert np.array_equal(lanes, xq.astype(np.int32).reshape(-1, 4).sum(axis=1))
    assert np.abs(xq).max() == 127 and len(set(xq[BLOCK:2 * BLOCK])) > 20


def quant_act(x):
    return act8_of(x[None], "q4_0")


@pytest.mark.parametrize("kind", QUANTIZABLE)
def test_the_dot_products_are_llama_cpps_integers(kind, act8):
    rng = np.random.default_rng(1)
    n, d = 37, 576
    w = (rng.standard_normal((n, d)) * np.exp(rng.uniform(-3, 1, (n, 1)))).astype(np.float32)
    w[0, :BLOCK] = 0
    Q = quantize(w, kind)
    x = (rng.standard_normal((3, d)) * 2).astype(np.float32)
    ref = np.array([[oracle_dot(Q[j], kind, x[t]) for j in range(n)] for t in range(3)])    # [T, n, (value, scale)]
    for T in (1, 3):
        for threads, min_work in ((1, 1 << 40), (2, 0)):     # serial, parallel
            with numba_threads(threads):
                y = quant_matmul_t(x[:T], Q, kind, parallel_min_work=min_work)
            assert np.all(np.abs(y - ref[:T, :, 0]) <= 4e-7 * ref[:T, :, 1] + 1e-30), kind
            if T == 1 and threads == 1:
                first = y
            elif T == 1:
                assert np.array_equal(y.view(np.uint32), first.view(np.uint32))   # thread count: the same bits
    # a prompt (blocks.quant_tile): the same dot products, tiles of rows at a time
    X = (rng.standard_normal((20, d))).astype(np.float32)
    ref = np.array([[oracle_dot(Q[j], kind, X[t]) for j in range(n)] for t in range(len(X))])
    assert np.all(np.abs(quant_matmul_t(X, Q, kind) - ref[..., 0]) <= 4e-7 * ref[..., 1] + 1e-30), kind


@pytest.mark.parametrize("kinds", [("q4_1", "q4_1", "q4_1"), ("q4_0", "q5_1", "q8_0"), ("q5_0", "q8_0", "q6_k"),
                                   ("q4_k", "q5_k", "q5_1")])
def test_the_fused_ffn_rounds_x_and_the_coefficients(kinds, act8):
    """quant_ffn's gate/up products on x's 8-bit blocks, the down products on the coefficients' (per neuron range:
    with a q6_k down, 2 blocks of 256 neurons over 4 ranges, two of them empty)."""
    from conftest import kquant_blocks
    rng = np.random.default_rng(2)
    d, n = 256, 512

    def matrix(kind, shape):
        w = rng.standard_normal(shape).astype(np.float32) * 0.2
        return QuantMatrix(kquant_blocks(w, kind.upper()) if kind.endswith("_k") else quantize(w, kind), kind, shape[1])

    def dot(m, j, v):       # the oracle of one row's product: 32-weight kinds by integers, K-quants on q8_K blocks
        if not m.kind.endswith("_k"):
            return oracle_dot(m.q[j], m.kind, v)[0]
        q, dd = q8k_blocks(v)
        return float(quant.dequantize(m.q[j:j + 1], m.kind, m.cols)[0].astype(np.float64)
                     @ (q.reshape(-1, 256) * dd[:, None].astype(np.float64)).reshape(-1))
    gate, up, down = (matrix(k, s) for k, s in zip(kinds, ((n, d), (n, d), (d, n))))
    x = rng.standard_normal((2, d)).astype(np.float32)
    y = quant_ffn(x, gate, up, down, "silu", None)
    for t in range(2):
        g = np.array([dot(gate, j, x[t]) for j in range(n)])
        u = np.array([dot(up, j, x[t]) for j in range(n)])
        a = (g / (1 + np.exp(-g)) * u).astype(np.float32)
        ref = np.array([dot(down, i, a) for i in range(d)])
        np.testing.assert_allclose(y[t], ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    set_act8(False)
    assert np.abs(quant_ffn(x, gate, up, down, "silu", None) - y).max() > 1e-4 * np.abs(y).max()   # it did round


def q8k_blocks(x: np.ndarray):
    """x [n] -> (q int8 [n], d [n/256]) as ggml's quantize_row_q8_K rounds it: scale -127 / (the first value of
    largest |x|), q = x times it rounded to even (at most 127), d = 1 / scale."""
    b = x.astype(np.float32).reshape(-1, 256)
    top = b[np.arange(len(b)), np.abs(b).argmax(axis=1)]
    iscale = np.divide(np.float32(-127), top, out=np.zeros_like(top), where=top != 0)
    q = np.minimum(np.rint(b * iscale[:, None]), 127).astype(np.int8)
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    return q.reshape(-1), d


def test_the_q8_k_blocks_are_llama_cpps(act8):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(6 * 256) * np.exp(rng.uniform(-6, 3, 6 * 256))).astype(np.float32)
    x[:256] = 0
    x[256:512] = (np.arange(256) - 100.5) / 4        # the largest |x| positive: the scale's sign
    x[300] = -x[256:512].max()                       # a tie for the largest |x|: the first one (negative) counts
    a = act8_of(x[None], "q4_k")
    q, d = q8k_blocks(x)
    assert a[0].shape[1] == 0 and np.array_equal(a[4][0], q) and np.array_equal(a[5][0].view(np.uint32),
                                                                                 d.view(np.uint32))
    assert np.array_equal(a[6][0], q.astype(np.int32).reshape(-1, 16).sum(axis=1))
    assert q.min() == -127 and q.max() == 127


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
def test_the_k_quant_dot_products_are_on_q8_k_blocks(kind, act8):
    """row_dot8k against float64 on gguf's dequantized weights times x as its q8_K blocks round it: the same sum,
    which the kernel takes in exact integers per block (so only float32 rounding apart)."""
    from conftest import kquant_blocks
    rng = np.random.default_rng(4)
    n, d = 29, 768
    Q = kquant_blocks(rng.standard_normal((n, d)).astype(np.float32), kind.upper())
    w = quant.dequantize(Q, kind, d).astype(np.float64)
    x = rng.standard_normal((3, d)).astype(np.float32)
    xr = np.stack([(lambda q, dd: (q.reshape(-1, 256) * dd[:, None].astype(np.float64)).reshape(-1))(*q8k_blocks(r))
                   for r in x])
    ref, scale = xr @ w.T, np.abs(xr) @ np.abs(w).T
    for T, threads, min_work in ((1, 1, 1 << 40), (1, 2, 0), (3, 1, 1 << 40)):
        with numba_threads(threads):
            y = quant_matmul_t(x[:T], Q, kind, parallel_min_work=min_work)
        assert np.all(np.abs(y - ref[:T]) <= 2e-6 * scale[:T]), kind
        if T == 1 and threads == 1:
            first = y
        elif T == 1:
            assert np.array_equal(y.view(np.uint32), first.view(np.uint32))
    X = rng.standard_normal((20, d)).astype(np.float32)     # a prompt (blocks.quant_tile): the same dot products
    Xr = np.stack([(lambda q, dd: (q.reshape(-1, 256) * dd[:, None].astype(np.float64)).reshape(-1))(*q8k_blocks(r))
                   for r in X])
    assert np.all(np.abs(quant_matmul_t(X, Q, kind) - Xr @ w.T) <= 2e-6 * (np.abs(Xr) @ np.abs(w).T)), kind
