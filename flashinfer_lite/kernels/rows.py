"""Building blocks over one vector: `v` is a 1-D typed slice of d elements (float32, float16 bits or int8, read by
f16.f32_at). Slices, not row + offset: with a runtime offset Numba's negative-index wraparound check stays in the loop
and blocks vectorisation."""
from __future__ import annotations

import numpy as np
from numba import njit

from .f16 import f32_at


@njit(cache=True, fastmath=True)
def dot(v, x, d):
    acc = np.float32(0.0)
    for k in range(d):
        acc += f32_at(v, k) * x[k]
    return acc


@njit(cache=True, fastmath=True)
def axpy(out, a, v, d):
    for k in range(d):
        out[k] += a * f32_at(v, k)


@njit(cache=True)
def scalar(f, idx, default):
    """float32 scalar of a row (scale or bias) or `default` when the layout has none (idx < 0)."""
    return f[idx] if idx >= 0 else np.float32(default)

