"""Attention of a decode step over the KV cache's pages, in a few Numba calls. At T = 1 each numpy op costs ~1-3 us of
dispatch on vectors of 64-576 elements, ~25 of them per layer; a call per pass over a batch of pages replaces them
(model.Attention, kv_pages.KVCache.attend)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .rows import axpy, dot


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
