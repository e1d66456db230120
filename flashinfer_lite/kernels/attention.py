"""Attention of a decode step over the float16 KV cache, in one Numba call. At T = 1 each numpy op costs ~1-3 us of
dispatch on vectors of 64-576 elements, ~25 of them per layer; one call replaces them (model.Attention)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .f16 import f32_to_f16_bits
from .rows import axpy, dot


@njit(cache=True, fastmath=True, nogil=True)
def _rope_inplace(x, cos, sin, half):
    """x [2 * half] rotated in place: the half-split pairing of model.apply_rope."""
    for i in range(half):
        a, b = x[i], x[i + half]
        x[i] = a * cos[i] - b * sin[i]
        x[i + half] = b * cos[i] + a * sin[i]


@njit(cache=True, fastmath=True, nogil=True)
def attention_rows(q, k, v, cos, sin, K, V, pos0, sliding_window, scale, out):
    """Causal GQA attention of T new rows at positions pos0.., appending their keys and values to a layer's cache.

    q [T, H, hd], k and v [T, Hkv, hd] float32 (q and k are rotated in place); cos, sin [T, hd/2] float32 (shape
    [T, 0]: no RoPE); K, V [capacity, Hkv, hd] float16 bits (uint16), rows pos0 .. pos0+T-1 written here;
    sliding_window: the layer's (0: none); scale: of the scores q.k (float32); out [T, H, hd] float32. Query head h
    reads KV head h // (H / Hkv)."""
    T, H, hd = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    half = cos.shape[1]
    for t in range(T):
        for h in range(H if half else 0):
            _rope_inplace(q[t, h], cos[t], sin[t], half)
        for c in range(Hkv):
            if half:
                _rope_inplace(k[t, c], cos[t], sin[t], half)
            Kr, Vr = K[pos0 + t, c], V[pos0 + t, c]
            for i in range(hd):
                Kr[i] = f32_to_f16_bits(k[t, c, i])
                Vr[i] = f32_to_f16_bits(v[t, c, i])
    scores = np.empty(pos0 + T, np.float32)
    for t in range(T):
        pos = pos0 + t
        lo = max(0, pos - sliding_window + 1) if sliding_window > 0 else 0    # keys pos - sliding_window < j <= pos
        for h in range(H):
            c = h // group
            qh = q[t, h]
            m = -np.inf
            for j in range(lo, pos + 1):
                s = dot(K[j, c], qh, hd) * scale
                scores[j] = s
                m = max(m, s)
            o = out[t, h]
            o[:] = 0.0
            total = np.float32(0.0)
            for j in range(lo, pos + 1):
                p = np.float32(math.exp(scores[j] - m))
                total += p
                axpy(o, p, V[j, c], hd)
            inv = np.float32(1.0) / total
            for i in range(hd):
                o[i] *= inv
