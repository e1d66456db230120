"""The numpy twin of kernels.neurons's rule, in float64: the oracle the Numba rule is checked against (tests only)."""
from __future__ import annotations

import numpy as np


def activation(act: str, g: np.ndarray) -> np.ndarray:
    if act == "silu":
        return g / (1.0 + np.exp(-g))
    if act == "gelu_tanh":
        return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
    return np.maximum(g, 0.0)                                 # relu, drelu


def coefficients(act: str, g: np.ndarray | None, u: np.ndarray, threshold: float, act_threshold: float = -1.0):
    """The coefficients of products g (GLU's gate; None: MLP, whose only product is u) and u, float64: act(first)
    where it clears threshold, else 0; GLU: times u (dReLU: times max(u, 0)); |c| <= act_threshold counts as 0."""
    first = np.asarray(u if g is None else g, np.float64)
    a = activation(act, first)
    a = np.where(a > threshold, a, 0.0)
    if g is not None:
        u = np.asarray(u, np.float64)
        a = a * (np.maximum(u, 0.0) if act == "drelu" else u)
    return np.where(np.abs(a) <= act_threshold, 0.0, a)
