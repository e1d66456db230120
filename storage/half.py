"""Which weights are kept in float16: one rule for `convert` (what resident.safetensors stores) and the runtime (what
it keeps in DRAM), kept here at the bottom so that both can use it."""
from __future__ import annotations

import numpy as np


def half_matrix(a: np.ndarray) -> np.ndarray:
    """A float32 matrix as float16; anything else (norms, biases: 1-D, small, added rather than multiplied; a matrix
    already float16) as is. A matrix with values beyond float16's range (|w| > 65504) stays float32: linear() runs
    either."""
    if a.ndim != 2 or a.dtype != np.float32:
        return a
    with np.errstate(over="ignore"):  # overflow is checked for just below
        h = a.astype(np.float16)
    return a if np.isinf(h).any() and not np.isinf(a).any() else h
