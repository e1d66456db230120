"""A prompt's matrix products over weights in block formats (kernels.blocks.quant_tile: tiles of weight rows against
DOT8_ROWS rows of x at a time, the K-quants' by k_tiles, x in 8-bit blocks): each (row, weight row) has the bits of the decode path's one-row
product, whatever T, the thread count or the serial/parallel split; and against float64 on the dequantized weights
times x as its 8-bit blocks round it (llama.cpp's numerics), within float32 rounding of the per-block sums."""
from __future__ import annotations

import numpy as np
import pytest

from flashinfer_lite.kernels import blocks as quant
from flashinfer_lite.kernels.blocks import DOT8_ROWS, QUANT_TILE_ROWS, quant_matmul_t, quantize, set_act8
from storage.blocks import QUANTIZABLE
from test_act8 import oracle_dot, q8k_blocks
from test_kernels import numba_threads

KINDS = [*QUANTIZABLE, "q4_k", "q5_k", "q6_k"]
# rows of x: fewer than a tile of x's rows, whole tiles, whole tiles and a rest
ROWS = [2, DOT8_ROWS, 2 * DOT8_ROWS + 3]


@pytest.fixture
def act8(float32_activations):
    set_act8(True)         # float32_activations restores the default after the test


def matrix(kind: str, n: int, d: int, rng) -> np.ndarray:
    w = (rng.standard_normal((n, d)) * np.exp(rng.uniform(-3, 1, (n, 1)))).astype(np.float32)
    if kind in QUANTIZABLE:
        return quantize(w, kind)
    from conftest import kquant_blocks
    return kquant_blocks(w, kind.upper())


def oracle(Q: np.ndarray, kind: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float64 results [T, n], the sums of |terms| [T, n]) of llama.cpp's dot products: the 32-weight kinds by
    test_act8.oracle_dot (q4_1 / q5_1's min term from x's float16 s), the K-quants as the dequantized weights times x
    as its q8_K blocks round it."""
    if kind in QUANTIZABLE:
        ref = np.array([[oracle_dot(Q[j], kind, r) for j in range(len(Q))] for r in x])
        return ref[..., 0], ref[..., 1]
    w = quant.dequantize(Q, kind, x.shape[1]).astype(np.float64)
    xr = np.stack([(q.reshape(-1, 256) * d[:, None].astype(np.float64)).reshape(-1) for q, d in map(q8k_blocks, x)])
    return xr @ w.T, np.abs(xr) @ np.abs(w).T


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompts_rows_have_the_one_row_bits(kind, act8):
    rng = np.random.default_rng(len(kind))
    n, d = 2 * QUANT_TILE_ROWS + 5, 512               # a short last tile of weight rows
    Q = matrix(kind, n, d, rng)
    x = (rng.standard_normal((ROWS[-1], d)) * 2).astype(np.float32)
    with numba_threads(1):
        one = np.concatenate([quant_matmul_t(x[t:t + 1], Q, kind, parallel_min_work=1 << 40) for t in range(len(x))])
    for T in ROWS:
        for threads, min_work in ((1, 1 << 40), (2, 0)):          # serial, parallel over tiles
            with numba_threads(threads):
                y = quant_matmul_t(x[:T], Q, kind, parallel_min_work=min_work)
            assert np.array_equal(y.view(np.uint32), one[:T].view(np.uint32)), (kind, T, threads)


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
def test_a_prompts_k_quant_tiles_at_the_largest_sums(kind, act8):
    """The tiles' sub-block sums at their extremes (kernels.blocks._paired_lanes packs two sub-blocks' 4-weight sums
    into one lane's 16-bit halves): every weight at its largest code (q6_k: 63, the sums +-4 * 63 * 127), scales at
    their largest and smallest, x at +-127 by sub-block; each (row, weight row) has the one-row bits and equals the
    float64 product of the dequantized weights and the rounded x."""
    from storage.blocks import row_bytes
    rng = np.random.default_rng(17)
    n, d = 2 * QUANT_TILE_ROWS + 3, 512
    per = row_bytes(256, kind)
    Q = np.full((n, d // 256, per), 0xFF, np.uint8)
    if kind == "q6_k":         # int8 scales +-127 and -128, d 1.0 (float16 0x3c00)
        Q[:, :, 192:208] = rng.choice(np.array([127, 129, 128, 1, 255], np.uint8), (n, d // 256, 16))
        Q[:, :, 208:210] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    else:                      # d 1.0, dmin 0.5, 6-bit scales and mins at 63 or a random pattern
        Q[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
        Q[:, :, 2:4] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
        Q[n // 2:, :, 4:16] = rng.integers(0, 256, (n - n // 2, d // 256, 12), dtype=np.uint8)
    head = Q[-3:, :, 208:210] if kind == "q6_k" else Q[-3:, :, 0:4]
    kept = head.copy()
    Q[-3:] = rng.integers(0, 256, (3, d // 256, per), dtype=np.uint8)     # random codes and scales, d kept
    head[...] = kept
    Q = Q.reshape(n, -1)
    # x: the first value +1 (so it rounds to -127), then whole sub-blocks of +1 or -1 (-127 or +127)
    signs = rng.choice([-1.0, 1.0], (ROWS[-1], d // 32))
    signs[:, 0] = 1.0
    x = np.repeat(signs, 32, axis=1).astype(np.float32)
    with numba_threads(1):
        one = np.concatenate([quant_matmul_t(x[t:t + 1], Q, kind, parallel_min_work=1 << 40) for t in range(len(x))])
    with numba_threads(2):
        y = quant_matmul_t(x, Q, kind, parallel_min_work=0)
    assert np.array_equal(y.view(np.uint32), one.view(np.uint32))
    want, scale = oracle(Q, kind, x)
    assert np.all(np.abs(y - want) <= 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompts_products_are_float64_of_the_rounded_x(kind, act8):
    """The documented rounding: per block the exact integer sum, then float32 products and sums over the row's
    blocks, so each result is the float64 one within a few float32 steps of the sum of |terms|."""
    rng = np.random.default_rng(7 + len(kind))
    n, d = 23, 768
    Q = matrix(kind, n, d, rng)
    x = (rng.standard_normal((ROWS[-1], d)) * 3).astype(np.float32)
    want, scale = oracle(Q, kind, x)
    with numba_threads(2):
        got = quant_matmul_t(x, Q, kind, parallel_min_work=0)
    assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30), kind


def test_a_prompts_coefficients_in_parallel_have_the_serial_bits():
    """The dense FFN's coefficients of a prompt (kernels.neurons.activations: rows in parallel from
    PARALLEL_COEFFICIENTS elements) against the serial kernel, silu and gelu_tanh."""
    from flashinfer_lite.kernels.neurons import PARALLEL_COEFFICIENTS, act_code, activations, coefficients_of_products
    rng = np.random.default_rng(3)
    g, u = (rng.standard_normal((9, PARALLEL_COEFFICIENTS // 8)).astype(np.float32) * 4 for _ in range(2))
    for act in ("silu", "gelu_tanh"):
        want = u.copy()
        coefficients_of_products(g, want, np.zeros((u.shape[1], 0), np.float32), True, act_code(act),
                                 np.float32(-np.inf), -1, -1)
        with numba_threads(2):
            got = activations(act, g, u, -np.inf)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), act


def test_a_prompts_silu_coefficients_have_the_scalar_bits():
    """The dense FFN's SiLU coefficients of a prompt (blocks.silu_coefficient_rows: glibc's expf 8 at a time) against
    the decode path's scalar kernel, bit for bit: every 331st finite float32 bit pattern (each range expf treats
    apart: underflow, overflow, subnormals, signed zeros) times up products of both signs. (Infinities and NaNs:
    test_silu_coefficients_of_infinities_and_nans.)"""
    from flashinfer_lite.ffn.dense import silu_reference
    from flashinfer_lite.kernels.blocks import HAS_AVX512, prompt_silu_ok, silu_coefficient_rows
    if not HAS_AVX512:
        pytest.skip("the 8-wide SiLU needs AVX-512's permutes; the scalar path runs instead")
    assert prompt_silu_ok(silu_reference)
    g = np.arange(0, 1 << 32, 331, dtype=np.uint64).astype(np.uint32).view(np.float32)
    g = g[np.isfinite(g)]
    g = g[:len(g) - len(g) % 4096].reshape(-1, 4096)
    u = np.random.default_rng(5).standard_normal(g.shape).astype(np.float32) * 3
    want, got = u.copy(), u.copy()
    silu_reference(g, want)
    with numba_threads(2):
        silu_coefficient_rows(g, got)
    same = got.view(np.uint32) == want.view(np.uint32)
    assert same.all(), (g[~same][:5], got[~same][:5], want[~same][:5])


def test_silu_coefficients_of_infinities_and_nans():
    """Gate and up products of +-inf, NaN (two payloads), zeros, the largest and smallest magnitudes: the scalar
    kernel (decode's, kernels.neurons) follows IEEE float32 (it raised ZeroDivisionError on a NaN gate): an infinite
    or NaN gate against the float64 twin (NaN and -inf: 0, +inf: inf times u; finite u, as the twin reads u even
    where the gate is 0), an infinite or NaN u times a gate of 1.5 by IEEE rules, and every pair bit for bit against
    the 8-wide prompt kernel."""
    from flashinfer_lite.ffn.dense import silu_reference
    from flashinfer_lite.kernels.blocks import HAS_AVX512, silu_coefficient_rows
    from glu_twin import coefficients
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38, -3.4e38, 1e-45, -1e-45, 88.73, -104.0, 1.5],
                       np.float32)
    special = np.append(special, np.uint32(0xFFC00001).view(np.float32))       # a negative NaN with a payload
    g, u = (a.astype(np.float32).reshape(1, -1) for a in np.meshgrid(special, special, indexing="ij"))
    pad = (-g.shape[1]) % 8
    g, u = np.pad(g, ((0, 0), (0, pad)), constant_values=1), np.pad(u, ((0, 0), (0, pad)), constant_values=1)
    got = u.copy()
    silu_reference(g, got)
    odd_gate = ~np.isfinite(g) & np.isfinite(u)
    with np.errstate(all="ignore"):
        want = coefficients("silu", g.astype(np.float64), u.astype(np.float64), -np.inf).astype(np.float32)
        ieee = np.float32(1.5) / (np.float32(1) + np.exp(np.float32(-1.5))) * u
    assert np.array_equal(got[odd_gate], want[odd_gate], equal_nan=True)
    odd_up = (g == 1.5) & ~np.isfinite(u)
    assert np.array_equal(got[odd_up], ieee[odd_up], equal_nan=True)
    if HAS_AVX512:
        eight = u.copy()
        silu_coefficient_rows(g, eight)
        assert np.array_equal(got.view(np.uint32), eight.view(np.uint32))


@pytest.mark.parametrize("kinds", [("q4_k", "q6_k"), ("q5_0", "q8_0")])
def test_a_prompts_dense_ffn_rows_have_the_decode_bits(kinds, act8):
    """ffn.dense.FeedForward over matrices in blocks: a prompt's rows (the tiles, the 8-wide SiLU, the tiles of the
    down products) give each row the bits of the decode path's fused kernel alone (ffn.quant.quant_ffn)."""
    from types import SimpleNamespace
    from flashinfer_lite.ffn.dense import FeedForward
    from flashinfer_lite.ffn.quant import quant_ffn
    from flashinfer_lite.kernels.blocks import QuantMatrix
    rng = np.random.default_rng(11)
    d, n = 512, 768
    gate, up = (QuantMatrix(matrix(kinds[0], n, d, rng), kinds[0], d) for _ in range(2))
    down = QuantMatrix(matrix(kinds[1], d, n, rng), kinds[1], n)
    cfg = SimpleNamespace(glu=True, act="silu", relu_threshold=None)
    ffn = FeedForward(cfg, {"p.gate.weight": gate, "p.up.weight": up, "p.down.weight": down}, 0, prefix="p.")
    x = (rng.standard_normal((2 * DOT8_ROWS + 3, d)) * 2).astype(np.float32)
    with numba_threads(2):
        y = ffn(x)
    with numba_threads(1):
        one = np.concatenate([quant_ffn(x[t:t + 1], gate, up, down, "silu", None) for t in range(len(x))])
    assert np.array_equal(y.view(np.uint32), one.view(np.uint32)), kinds


def k_integers(Q: np.ndarray, kind: str, d: int):
    """A K-quant matrix's parts, parsed from its bytes (llama.cpp's layouts) as numpy integers: codes u [n, d] (q6_k:
    q + 32), each weight's scale [n, d], each 16 weights' multiplier of x's group sum [n, d // 16] (q4_k / q5_k: the
    min of their sub-block; q6_k: their scale), and the float16 d and dmin [n, d // 256] as float32."""
    n, nb = len(Q), d // 256
    B = Q.reshape(n, nb, -1).astype(np.int64)
    e = np.arange(256)
    half = lambda at: B[:, :, at:at + 2].astype(np.uint8).copy().view(np.float16)[..., 0].astype(np.float32)  # noqa
    if kind == "q6_k":
        h, r, l = e // 128, (e % 128) // 32, e % 32
        u = (B[:, :, h * 64 + (r & 1) * 32 + l] >> (4 * (r >> 1))) & 15
        u |= ((B[:, :, 128 + h * 32 + l] >> (2 * r)) & 3) << 4
        sc = B[:, :, 192:208].astype(np.uint8).view(np.int8).astype(np.int64)
        return (u.reshape(n, d), np.repeat(sc, 16, axis=2).reshape(n, d), sc.reshape(n, -1), half(208),
                np.zeros((n, nb), np.float32))
    s = e // 32
    u = (B[:, :, (16 if kind == "q4_k" else 48) + (s >> 1) * 32 + e % 32] >> (4 * (s & 1))) & 15
    if kind == "q5_k":
        u |= ((B[:, :, 16 + e % 32] >> s) & 1) << 4
    b = B[:, :, 4:16]
    sc = np.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 15) | ((b[..., 0:4] >> 6) << 4)], axis=2)
    mn = np.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], axis=2)
    return (u.reshape(n, d), np.repeat(sc, 32, axis=2).reshape(n, d), np.repeat(mn, 2, axis=2).reshape(n, -1),
            half(0), half(2))


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_products_sum_each_block_as_one_integer(kind, act8):
    """The documented order (kernels.blocks.row_dot8k, k_tile_dot: llama.cpp's tiled GEMM's): per block of 256 the
    exact integer sum of scale * code * x, computed here in int64 from the bytes, then in float32, block after block,
    acc += float(sum) * (d * x's d) and the mins' (dmin * x's d) * float(mins' sum) (q6_k: (d * x's d) * float(32 *
    scale-weighted x's sums)) summed apart, the result acc - mins. Every (row, weight row) of a prompt has exactly
    these bits, whatever T and the threads (the tiles), and so has the decode path's row."""
    rng = np.random.default_rng(5 + len(kind))
    n, d = QUANT_TILE_ROWS + 7, 768
    Q = matrix(kind, n, d, rng)
    x = (rng.standard_normal((2 * DOT8_ROWS + 3, d)) * 3).astype(np.float32)
    u, sc, mult, wd, wm = k_integers(Q, kind, d)
    f32 = np.float32
    want = np.empty((len(x), n), np.float32)
    for t, (q, xd) in enumerate(map(q8k_blocks, x)):
        q = q.astype(np.int64)
        tot = (u * sc * q).reshape(n, -1, 256).sum(axis=2)                      # [n, blocks], exact
        low = (mult * q.reshape(-1, 16).sum(axis=1)).reshape(n, -1, 16).sum(axis=2)
        for j in range(n):
            acc = mins = f32(0)
            for b in range(d // 256):
                dd = f32(wd[j, b] * xd[b])
                acc = f32(acc + f32(f32(tot[j, b]) * dd))
                m = f32(dd * f32(32 * low[j, b])) if kind == "q6_k" else f32(f32(wm[j, b] * xd[b]) * f32(low[j, b]))
                mins = f32(mins + m)
            want[t, j] = f32(acc - mins)
    with numba_threads(2):
        y = quant_matmul_t(x, Q, kind, parallel_min_work=0)
    with numba_threads(1):
        one = np.concatenate([quant_matmul_t(x[t:t + 1], Q, kind, parallel_min_work=1 << 40) for t in range(len(x))])
    assert np.array_equal(one.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kind", QUANTIZABLE)
def test_32_weight_products_sum_each_block_as_one_integer(kind, act8):
    """The documented order of the 32-weight kinds (kernels.blocks.row_dot8, q_tile_dot: the K-quants' above): per
    block the exact integer sum of code * x (int64 here, from the bytes), then in float32, block after block, acc +=
    float(sum) * (d * x's d) in two sums (even and odd blocks) added at the end; q4_1 / q5_1's min * x's s summed
    apart the same way and added last. Every (row, weight row) of a
    prompt has exactly these bits, whatever T and the threads (the tiles), and so has the decode path's row: rows of
    8 groups' width and of a group and a rest (row_dot8 sums whole groups of blocks by one transpose)."""
    from test_act8 import q8_blocks, weight_blocks
    f32 = np.float32
    for d in (2048, 1056):
        rng = np.random.default_rng(d + len(kind))
        n = QUANT_TILE_ROWS + 7
        Q = matrix(kind, n, d, rng)
        x = (rng.standard_normal((2 * DOT8_ROWS + 3, d)) * 3).astype(np.float32)
        want = np.empty((len(x), n), np.float32)
        for t in range(len(x)):
            xq, xd, xs = q8_blocks(x[t])
            for j in range(n):
                q, wd, wm = weight_blocks(Q[j], kind)
                tot = (q * xq.reshape(-1, 32).astype(np.int64)).sum(axis=1)
                acc, mins = [f32(0), f32(0)], [f32(0), f32(0)]       # even, odd blocks
                for b in range(len(tot)):
                    acc[b % 2] = f32(acc[b % 2] + f32(f32(tot[b]) * f32(wd[b] * xd[b])))
                    mins[b % 2] = f32(mins[b % 2] + f32(wm[b] * xs[b]))
                total = f32(acc[0] + acc[1])
                want[t, j] = f32(total + f32(mins[0] + mins[1])) if kind in ("q4_1", "q5_1") else total
        with numba_threads(2):
            y = quant_matmul_t(x, Q, kind, parallel_min_work=0)
        with numba_threads(1):
            one = np.concatenate([quant_matmul_t(x[t:t + 1], Q, kind, parallel_min_work=1 << 40)
                                  for t in range(len(x))])
        assert np.array_equal(one.view(np.uint32), want.view(np.uint32)), (kind, d)
        assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), (kind, d)
