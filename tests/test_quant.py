"""GGUF block formats (q8_0, q4_0, q4_1) and the kernels over them.

Oracles: gguf.quants (llama.cpp's reference, ported bit-exactly) for the bytes and the dequantized values; float64
numpy on the dequantized weights for every kernel, so the comparison isolates the kernel from quantization error;
the float32 source weights for the quantization error itself.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from storage.errors import UserError
from flashinfer_lite.kernels.gemv import MATMUL_ROW_KERNEL_MAX_T
from flashinfer_lite.ffn.quant import DENSE_ROW_KERNEL_MAX_T, QuantSparseFFN, quant_ffn
from storage.blocks import QUANTIZABLE
from flashinfer_lite.kernels.blocks import BLOCK, QuantMatrix, dequantize, quant_matmul_t, quantize, row_bytes
from storage.format import BundleGeometry, FlashLayout, bundle_geometry, pack_bundles
from test_kernels import CASES, dense_coefficients, dense_ffn, make_model, numba_threads, rel_err, scatter_rows

pytestmark = pytest.mark.usefixtures("float32_activations")   # oracle: float64 on the dequantized weights

RTOL = 1e-5


def weights(rng, rows, cols):
    """Rows of different magnitudes, a few outliers, an all-zero block (d = 0) and a constant block (q4_1: d = 0,
    the minimum carries the value)."""
    w = (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-3, 1, (rows, 1)))).astype(np.float32)
    w[rng.random(w.shape) < 0.002] *= 30
    w[0, :BLOCK] = 0
    w[1, BLOCK:2 * BLOCK] = 0.37
    return w


def same_values(a, b):
    """Bit-identical, NaN for NaN (F16C and numpy may give NaNs different payloads)."""
    nan = np.isnan(b)
    return np.array_equal(np.isnan(a), nan) and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan])


# ---------------------------------------------------------------------------------------------------------------
# Formats

@pytest.mark.parametrize("kind", list(QUANTIZABLE))
def test_dequantize_is_bit_exact_with_gguf(kind):
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    ggml = GGMLQuantizationType[kind.upper()]
    cols = 8 * BLOCK
    q = quantize(weights(rng, 40, cols), kind)
    assert np.array_equal(dequantize(q, kind, cols), gguf_quants.dequantize(q, ggml))
    # arbitrary bytes, as a GGUF file may hold: every float16 scale (subnormal, inf, NaN) and every nibble / int8
    raw = rng.integers(0, 256, (300, row_bytes(cols, kind)), dtype=np.uint8)
    ids = np.array([7, 0, 299, 7])
    with np.errstate(invalid="ignore"):  # gguf's numpy warns on inf * 0
        assert same_values(dequantize(raw, kind, cols), gguf_quants.dequantize(raw, ggml))
        # given rows only: the embedding lookup
        assert same_values(dequantize(raw, kind, cols, rows=ids), gguf_quants.dequantize(raw[ids], ggml))


# Worst error of one weight, in units of its block's step d (q4_1: plus the float16 rounding of the minimum):
# half a step from rounding, plus the float16 rounding of d (2^-11 relative) times the largest level. q4_0 maps the
# largest magnitude to level -8, so the other extreme may need +8 and is clipped to +7: a whole step there.
ERROR_STEPS = {"q8_0": 0.5 + 127 * 2 ** -11, "q4_0": 1 + 8 * 2 ** -11, "q4_1": 0.5 + 15 * 2 ** -11,
               "q5_0": 1 + 16 * 2 ** -11, "q5_1": 0.5 + 31 * 2 ** -11}


@pytest.mark.parametrize("kind", list(QUANTIZABLE))
def test_quantize_is_gguf_and_within_half_a_step(kind):
    rng = np.random.default_rng(zlib.crc32(kind.encode()) + 1)
    w = weights(rng, 64, 12 * BLOCK)
    q = quantize(w, kind)
    assert q.dtype == np.uint8 and q.shape == (64, row_bytes(12 * BLOCK, kind))
    assert np.array_equal(q, gguf_quants.quantize(w, GGMLQuantizationType[kind.upper()]))
    # independent of gguf: the error bound of the format, block by block
    blocks = w.reshape(-1, BLOCK).astype(np.float64)
    err = np.abs(dequantize(q, kind, w.shape[1]).reshape(-1, BLOCK) - blocks).max(axis=1)
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    step = {"q8_0": np.maximum(-lo, hi) / 127, "q4_0": np.maximum(-lo, hi) / 8, "q4_1": (hi - lo) / 15,
            "q5_0": np.maximum(-lo, hi) / 16, "q5_1": (hi - lo) / 31}[kind]
    slack = np.abs(lo) * 2 ** -11 if kind in ("q4_1", "q5_1") else 0
    assert (err <= step * ERROR_STEPS[kind] + slack + 1e-30).all()
    assert dequantize(q, kind, w.shape[1])[0, :BLOCK].tolist() == [0.0] * BLOCK  # a zero block stays exactly zero


def test_bad_input_is_a_user_error():
    w = np.ones((2, 64), np.float32)
    for bad in (lambda: quantize(w, "q4_k"), lambda: quantize(w, "iq2_xs"), lambda: quantize(w[:, :48], "q4_0"), lambda: quantize(w[0], "q8_0"),
                lambda: quantize(np.where(w > 0, np.inf, 0).astype(np.float32), "q8_0"),
                lambda: quantize(w * 1e9, "q4_0"),                       # the float16 scale would overflow
                lambda: dequantize(np.zeros((2, 40), np.uint8), "q4_0", 64),
                lambda: dequantize(quantize(w, "q8_0"), "q8_0", 64, rows=[2]),
                lambda: quant_matmul_t(np.ones((1, 64), np.float32), quantize(w, "q4_1"), "q4_0")):
        with pytest.raises(UserError):
            bad()


# ---------------------------------------------------------------------------------------------------------------
# Resident matrices: x @ W^T

@pytest.mark.parametrize("kind", list(QUANTIZABLE))
@pytest.mark.parametrize("T", [1, 3, MATMUL_ROW_KERNEL_MAX_T, MATMUL_ROW_KERNEL_MAX_T + 1, 40])
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_equals_float64(kind, T, threads):
    rng = np.random.default_rng(zlib.crc32(repr((kind, T)).encode()))
    n, d = 203, 7 * BLOCK                       # odd row count: uneven row chunks per thread
    q = quantize(weights(rng, n, d), kind)
    x = rng.standard_normal((T, d)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize(q, kind, d).astype(np.float64).T
    with numba_threads(threads):
        for min_work in (0, 1 << 40):           # the parallel and the serial row kernel (T <= 12)
            y = quant_matmul_t(x, q, kind, parallel_min_work=min_work)
            assert y.shape == (T, n) and y.dtype == np.float32
            assert rel_err(y, ref) < RTOL
            assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


# ---------------------------------------------------------------------------------------------------------------
# Sparse FFN over quantized bundles

def pack(w, kind, glu):
    """-> QuantSparseFFN factory arguments, bundles uint8 [n, stride], dequantized weights (as make_model's).
    kind "q4_0/q8_0": gate and up in q4_0, down in q8_0 (a FlashLayout's down_dtype)."""
    kind, down_kind = (kind.split("/") + [None])[:2]
    names = ("gate", "up", "down") if glu else ("up", "down")
    n, d = w["up"].shape
    biases = tuple(b for b in ("bias.gate", "bias.up") if b in w)
    vecs = np.stack([w[v].T if v == "down" else w[v] for v in names], axis=1)      # [n, n_vec, d]
    layout = FlashLayout.create(d, [n], kind, glu, biases, down_dtype=down_kind)
    bundles = pack_bundles(layout, vecs, np.stack([w[b] for b in biases], 1) if biases else None)
    at = layout.vector_offsets
    dq = {v: dequantize(np.ascontiguousarray(bundles[:, at[k]:at[k + 1]]), layout.vector_dtypes[k], d)
          for k, v in enumerate(names)}
    dq["down"] = dq["down"].T
    dq.update({b: w[b] for b in biases})
    return dict(geometry=layout.geometry), bundles, dq


@pytest.mark.parametrize("kind", list(QUANTIZABLE) + ["q4_1/q8_0"])
@pytest.mark.parametrize("glu,act", CASES)
@pytest.mark.parametrize("biased", [False, True])
def test_sparse_equals_dense(kind, glu, act, biased):
    rng = np.random.default_rng(zlib.crc32(repr((kind, glu, act, biased)).encode()))
    d, n = 3 * BLOCK, 257                         # d = 96: a tail output block of 32
    w = make_model(rng, d, n, glu, biased)
    args, bundles, dq = pack(w, kind, glu)
    M, rows = scatter_rows(rng, bundles, extra=31)
    threshold = 0.05 if act != "silu" else None
    ffn = QuantSparseFFN(act=act, relu_threshold=threshold, **args)
    x = rng.standard_normal(d).astype(np.float32)
    h = dense_coefficients(dq, x, glu, act, threshold)
    y = np.full(d, np.nan, np.float32)
    coef = np.zeros(n, np.float32)
    ffn(M, rows, x, y, coef)                      # all neurons: the dense FFN; coef says which fired
    assert rel_err(y, dense_ffn(dq, h)) < RTOL
    assert np.array_equal(coef != 0, h != 0)
    np.testing.assert_allclose(coef, h, rtol=1e-4, atol=1e-6 * np.abs(h).max())
    S = np.sort(rng.choice(n, n // 3, replace=False))  # any chosen set: the dense math restricted to it
    h_S = np.zeros(n)
    h_S[S] = h[S]
    ffn(M, rows[S], x, y)
    assert rel_err(y, dense_ffn(dq, h_S)) < RTOL


@pytest.mark.parametrize("kind", list(QUANTIZABLE) + ["q4_0/q8_0"])
def test_sparse_same_bits_whatever_the_split_or_threads(kind):
    """ffn.sparse's one summation order holds here too: pieces, thread counts and batched rows give the same bits."""
    rng = np.random.default_rng(zlib.crc32(kind.encode()) + 2)
    d, n, T = 5 * BLOCK, 300, 4
    w = make_model(rng, d, n, True, True)
    args, bundles, dq = pack(w, kind, True)
    ffn = QuantSparseFFN(act="silu", **args)
    X = rng.standard_normal((T, d)).astype(np.float32)
    sel = (rng.random((T, n)) < 0.4).astype(np.uint8)
    Y = np.zeros((T, d), np.float32)            # all rows at once, the selection as a mask
    coef = np.empty((T, n), np.float32)
    slots = np.arange(n, dtype=np.int32)
    ffn.coefficients(bundles, slots, None, X, coef, sel=sel, act_threshold=0.02)
    ffn.accumulate(bundles, slots, coef, Y)
    for t in range(T):
        S = np.flatnonzero(sel[t]).astype(np.int32)
        h = dense_coefficients(dq, X[t], True, "silu", None)
        assert rel_err(Y[t], dense_ffn(dq, np.where(np.abs(h) > 0.02, h, 0.0) * sel[t])) < RTOL
        for threads, piece in ((1, len(S)), (2, 7), (2, 64)):
            y = np.zeros((1, d), np.float32)
            with numba_threads(threads):
                for lo in range(0, len(S), piece):
                    c = np.empty((1, len(S[lo:lo + piece])), np.float32)
                    ffn.coefficients(bundles, S[lo:lo + piece], None, X[t:t + 1], c, act_threshold=0.02)
                    ffn.accumulate(bundles, S[lo:lo + piece], c, y)
            assert np.array_equal(y[0], Y[t]), (t, threads, piece)


@pytest.mark.parametrize("kind", list(QUANTIZABLE) + ["q4_1/q8_0"])
@pytest.mark.parametrize("glu,act", CASES)
@pytest.mark.parametrize("T", [1, DENSE_ROW_KERNEL_MAX_T, DENSE_ROW_KERNEL_MAX_T + 1, 40])
def test_dense_layer_equals_float64(kind, glu, act, T):
    """QuantSparseFFN.dense over a whole layer's bundles (the in-RAM FFN): the row kernel for a few rows, widened
    blocks + BLAS for a prompt; the neuron count is not a multiple of the widened block."""
    rng = np.random.default_rng(zlib.crc32(repr((kind, glu, act, T)).encode()))
    d, n = 3 * BLOCK, 1500
    w = make_model(rng, d, n, glu, True)
    args, bundles, dq = pack(w, kind, glu)
    threshold = 0.05 if act != "silu" else None
    ffn = QuantSparseFFN(act=act, relu_threshold=threshold, **args)
    X = rng.standard_normal((T, d)).astype(np.float32)
    ref = np.stack([dense_ffn(dq, dense_coefficients(dq, x, glu, act, threshold)) for x in X])
    for threads in (1, 2):
        Y = np.full((T, d), np.nan, np.float32)
        with numba_threads(threads):
            ffn.dense(ffn.dense_layer(bundles), X, Y)
        assert rel_err(Y, ref) < RTOL, threads


@pytest.mark.parametrize("kind", list(QUANTIZABLE))
@pytest.mark.parametrize("glu,act", CASES)
def test_fused_ffn_over_matrices_equals_float64(kind, glu, act):
    """quant_ffn (a GGUF's FFN at decode: gate/up [n, d], down [d, n] in blocks along n): one call per row."""
    rng = np.random.default_rng(zlib.crc32(repr((kind, glu, act)).encode()) + 3)
    d, n = 3 * BLOCK, 9 * BLOCK
    w = make_model(rng, d, n, glu, False)
    m = {v: QuantMatrix(quantize(w[v], kind), kind, w[v].shape[1]) for v in w}
    dq = {v: m[v][np.arange(w[v].shape[0])] for v in w}
    threshold = 0.05 if act != "silu" else None
    X = rng.standard_normal((2, d)).astype(np.float32)
    ref = np.stack([dense_ffn(dq, dense_coefficients(dq, x, glu, act, threshold)) for x in X])
    for threads in (1, 2):
        with numba_threads(threads):
            y = quant_ffn(X, m.get("gate"), m["up"], m["down"], act, threshold or 0.0)
        assert y.shape == (2, d) and rel_err(y, ref) < RTOL, threads


def test_quantized_bundles_track_source_weights():
    """Quantization error only, end to end against the float32 source weights: the weights' rms error is the
    format's (a Gaussian block: ~0.5% at 8 bits, ~8% at 4); the output's, through three matrices and the
    neurons that flip sign, stays within 5x it (at most 4.1x over 30 seeds)."""
    rng = np.random.default_rng(5)
    d, n = 4 * BLOCK, 200
    w = make_model(rng, d, n, True, False)
    x = rng.standard_normal(d).astype(np.float32)
    y_src = dense_ffn(w, dense_coefficients(w, x, True, "relu", None))
    for kind, weight_tol in (("q8_0", 0.01), ("q4_1", 0.1), ("q4_0", 0.1)):
        args, bundles, dq = pack(w, kind, True)
        weight_err = np.sqrt(sum(((dq[v] - w[v]) ** 2).sum() for v in ("gate", "up", "down")) /
                             sum((w[v] ** 2).sum() for v in ("gate", "up", "down")))
        y = np.zeros(d, np.float32)
        QuantSparseFFN(act="relu", **args)(bundles, np.arange(n, dtype=np.int32), x, y)
        assert weight_err < weight_tol and rel_err(y, y_src) < 5 * weight_err, kind


def test_bad_bundle_geometry_is_a_user_error():
    so, stride = bundle_geometry(64, ("q4_0",) * 3, n_scalars=0)
    assert so == 3 * row_bytes(64, "q4_0") and stride % 512 == 0
    with pytest.raises(UserError):
        BundleGeometry.of(512, "q4_0", True, stride=512)              # vectors past the stride
    with pytest.raises(UserError):
        QuantSparseFFN(BundleGeometry.of(48, "q4_0", True), "relu")   # d not whole blocks
    with pytest.raises(UserError):
        QuantSparseFFN(BundleGeometry.of(64, "f16", True), "relu")    # not a quantized kind
    with pytest.raises(UserError):
        BundleGeometry.of(64, "q4_0", True, stride=so)                # a stride not a multiple of 512
    ffn = QuantSparseFFN(BundleGeometry.of(64, "q4_0", True, stride=stride), "relu")
    B, x = np.zeros((4, stride), np.uint8), np.zeros(64, np.float32)
    for bad in (lambda: ffn(np.zeros((4, stride + 4), np.uint8), np.arange(2), x, x.copy()),
                lambda: ffn(B, np.arange(2), np.zeros(96, np.float32), x.copy()),   # x longer than d: no over-read
                lambda: ffn.accumulate(B, np.arange(2), np.ones((1, 2), np.float32), np.zeros((1, 96), np.float32))):
        with pytest.raises(UserError):
            bad()
