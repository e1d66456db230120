"""Attention of a decode step over the KV cache's pages, in a few Numba calls. At T = 1 each numpy op costs ~1-3 us of
dispatch on vectors of 64-576 elements, ~25 of them per layer; a call per pass over a batch of pages replaces them
(model.Attention, kv_pages.KVCache.attend)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .rows import _bits_as_f32, axpy, dot, f32_at


@njit(cache=True, fastmath=True, nogil=True)
def _rope_inplace(x, cos, sin, half):
    """x [2 * half] rotated in place: the half-split pairing of model.apply_rope."""
    for i in range(half):
        a, b = x[i], x[i + half]
        x[i] = a * cos[i] - b * sin[i]
        x[i + half] = b * cos[i] + a * sin[i]


# ----------------------------------------------------------------------------------------------------------------------
# Attention over pages (kv_pages.KVCache.attend): per query head the scores, their max, then exp and the weighted
# values position by position, over the pages a step reads, one batch of pages at a time: the bits do not depend on
# which pages came in which batch, so neither on which pages were in DRAM.

@njit(cache=True, fastmath=True, nogil=True)
def rotate_rows(q, k, cos, sin):
    """q [T, H, hd] and k [T, Hkv, hd] rotated in place (cos, sin [T, hd/2]; [T, 0]: no RoPE)."""
    half = cos.shape[1]
    if half == 0:
        return
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            _rope_inplace(q[t, h], cos[t], sin[t], half)
        for c in range(k.shape[1]):
            _rope_inplace(k[t, c], cos[t], sin[t], half)


@njit(cache=True, fastmath=True, nogil=True)
def page_scores(q, K, slots, pages, page_rows, lo, hi, chosen, scale, scores, m):
    """Scores q.k x scale of the positions in pages `pages` (page pages[i] is K[slots[i]], [page_rows, Hkv, hd]
    float16 bits or float32) that query row t sees (lo[t]..hi[t]) and its KV head reads (chosen[page, Hkv]), into
    scores [T, H, S] at their positions; m [T, H] keeps the largest."""
    T, H, hd = q.shape
    group = H // K.shape[2]
    for i in range(len(slots)):
        p = pages[i]
        Kp = K[slots[i]]
        base = p * page_rows
        for t in range(T):
            a, b = max(lo[t], base), min(hi[t] + 1, base + page_rows)
            for h in range(H):
                c = h // group
                if chosen[p, c] == 0:
                    continue
                qh = q[t, h]
                mh = m[t, h]
                for j in range(a, b):
                    s = dot(Kp[j - base, c], qh, hd) * scale
                    scores[t, h, j] = s
                    mh = max(mh, s)
                m[t, h] = mh


@njit(cache=True, fastmath=True, nogil=True)
def page_values(scores, m, V, slots, pages, page_rows, lo, hi, chosen, out, total):
    """The softmax's weights exp(score - m) of page_scores' positions times their values (V as K there), added to
    out [T, H, hd] and their sum to total [T, H], position by position in the order of `pages`."""
    T, H, hd = out.shape
    group = H // V.shape[2]
    for i in range(len(slots)):
        p = pages[i]
        Vp = V[slots[i]]
        base = p * page_rows
        for t in range(T):
            a, b = max(lo[t], base), min(hi[t] + 1, base + page_rows)
            for h in range(H):
                c = h // group
                if chosen[p, c] == 0:
                    continue
                o = out[t, h]
                mh = m[t, h]
                tot = total[t, h]
                for j in range(a, b):
                    w = np.float32(math.exp(scores[t, h, j] - mh))
                    tot += w
                    axpy(o, w, Vp[j - base, c], hd)
                total[t, h] = tot


# ----------------------------------------------------------------------------------------------------------------------
# A prompt's attention (model.prompt_attention): per KV head and block of keys the head's keys and values widened once
# (head_rows), then per tile of query rows (the g query heads of the KV head stacked: one key load serves them all) two
# numpy BLAS products around one Numba pass of the online softmax (softmax_tile), which replaced ~10 numpy passes over
# each tile's scores (scale, mask, max, subtract, exp, sum, rescale): ~30% of the attention's time at 4,000 tokens.
# The products stay numpy's: inside Numba, np.dot needs scipy (its BLAS), not a dependency of the runtime.

# No ninf/nnan: the running max starts at -inf, and a row that sees no key of a block keeps it.
_SOFTMAX_MATH = {"reassoc", "contract", "nsz", "arcp", "afn"}

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.0)      # exp(-87) = 1.6e-38, a normal float32; below it exp_nonpositive gives 0


@njit(cache=True, fastmath=_SOFTMAX_MATH, inline="always")
def exp_nonpositive(x):
    """exp(x) for float32 x <= 0 (-inf: 0), in operations LLVM vectorizes (Numba has no SIMD expf without SVML, and a
    scalar expf call per score cost more than the products): x = n ln2 + r, |r| <= ln2/2, Cephes' expf polynomial
    for e^r, 2^n as float bits. Within 1 ulp of float64's exp (tests/test_decode_kernels.py); 0 below -87."""
    y = max(x, _EXP_MIN)
    n = np.floor(y * _LOG2E + np.float32(0.5))
    r = y - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    e = (p * r * r + r + np.float32(1.0)) * _bits_as_f32(np.int32(n) + np.int32(127) << np.int32(23))
    return e if x >= _EXP_MIN else np.float32(0.0)


@njit(cache=True, fastmath=True)
def scaled_max(p, scale):
    """p *= scale in place, and its largest: finite scores, so all of fastmath's flags (nnan lets LLVM vectorize the
    max)."""
    mx = p[0] * scale
    for k in range(len(p)):
        v = p[k] * scale
        p[k] = v
        mx = max(mx, v)
    return mx


@njit(cache=True, fastmath=True, nogil=True)
def head_rows(K, c, out):
    """out [n, hd] = KV head c's rows of K [n, Hkv, hd] (float16 bits or float32) as float32."""
    for j in range(out.shape[0]):
        kj, o = K[j, c], out[j]
        for d in range(out.shape[1]):
            o[d] = f32_at(kj, d)


@njit(cache=True, fastmath=_SOFTMAX_MATH, nogil=True)
def softmax_tile(P, c, t0, rows, pos0, b0, window, scale, m, total, acc):
    """The online softmax of one tile: P [g x rows, n] the scores q.k of query rows t0.. (row j x rows + r: query head
    c g + j, position pos0 + t0 + r) over keys b0..b0 + n - 1, before the scale. Each row's visible keys (causal;
    window > 0: within the sliding window) become exp(score - m_new), the others 0; the running max m, sum total
    [Hkv, g, T] and the weighted values acc [Hkv, g, T, hd] are rescaled by exp(m_old - m_new) (flash attention),
    so that acc + P @ V is the tile's new acc."""
    M, n = P.shape
    first = pos0 + t0
    for i in range(M):
        j, r = i // rows, i % rows
        t, pos = t0 + r, first + r
        lo = 0 if window <= 0 else min(n, max(0, pos - window + 1 - b0))   # the row's keys: lo .. hi - 1
        hi = max(lo, min(n, pos + 1 - b0))
        p = P[i]
        p[:lo] = 0.0
        p[hi:] = 0.0
        if hi == lo:
            continue
        seen = p[lo:hi]          # a slice, so indices start at 0: no wraparound check, the loops vectorize
        mo = m[c, j, t]
        mx = max(mo, scaled_max(seen, scale))
        s = np.float32(0.0)
        for k in range(hi - lo):
            w = exp_nonpositive(seen[k] - mx)
            seen[k] = w
            s += w
        alpha = exp_nonpositive(mo - mx)
        m[c, j, t] = mx
        total[c, j, t] = total[c, j, t] * alpha + s
        a = acc[c, j, t]
        for d in range(a.shape[0]):
            a[d] *= alpha


@njit(cache=True, fastmath=True, nogil=True)
def add_tile(PV, c, t0, rows, acc):
    """acc[c, j, t0 + r] += PV[j x rows + r] (the tile's weighted values, softmax_tile's row order)."""
    for i in range(PV.shape[0]):
        a, pv = acc[c, i // rows, t0 + i % rows], PV[i]
        for d in range(pv.shape[0]):
            a[d] += pv[d]
