"""RMSNorm rows, and the residual add fused with it: one pass over the hidden state instead of numpy's several."""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, fastmath=True, nogil=True)
def _rms_norm_row(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w over one row [d]."""
    d = x.shape[0]
    ss = np.float32(0.0)
    for i in range(d):
        ss += x[i] * x[i]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
    for i in range(d):
        out[i] = x[i] * r * w[i]


@njit(cache=True, fastmath=True, nogil=True)
def rms_norm_rows(x, w, eps, out):
    """out[t] = RMSNorm(x[t]) * w; x, out float32 [T, d], w float32 [d]."""
    for t in range(x.shape[0]):
        _rms_norm_row(x[t], w, eps, out[t])


@njit(cache=True, fastmath=True, nogil=True)
def add_rms_norm_rows(x, delta, w, eps, out):
    """x[t] += delta[t] (the residual add, in place), then out[t] = RMSNorm(x[t]) * w: one pass over x."""
    for t in range(x.shape[0]):
        xt, dt = x[t], delta[t]
        for i in range(xt.shape[0]):
            xt[i] += dt[i]
        _rms_norm_row(xt, w, eps, out[t])
