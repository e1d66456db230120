"""The gating rule: how a neuron's gate and up products become the coefficient of its down vector. Written once, as
Numba scalar functions for the kernels and their numpy twin for the dense model (model.FeedForward).

  GLU: coefficient = act(gate) * up          MLP (OPT): coefficient = act(up)
  act: silu, gelu_tanh (GeGLU, Gemma), or relu (dReLU: relu on the gate, and 0 unless up > 0 too)
  FATReLU: an activation act(gate) <= threshold counts as zero; then the neuron's up vector need not be read at all.
  SiLU and GELU have no threshold (threshold_of: -inf): both go negative; for ReLU the default 0 is exactly ReLU.

The kernels call gate_activation first and skip the up product when it is 0 (nothing fired), then glu_coefficient.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from storage.errors import UserError

ACT_RELU, ACT_SILU, ACT_DRELU, ACT_GELU_TANH = 0, 1, 2, 3
ACT_CODES = {"relu": ACT_RELU, "silu": ACT_SILU, "drelu": ACT_DRELU, "gelu_tanh": ACT_GELU_TANH}
GELU_C = math.sqrt(2.0 / math.pi)  # GELU's tanh approximation: 0.5 x (1 + tanh(GELU_C (x + 0.044715 x^3)))


def act_code(act: str) -> int:
    if act not in ACT_CODES:
        raise UserError(f"unsupported FFN activation {act!r} (expected one of {sorted(ACT_CODES)})")
    return ACT_CODES[act]


def threshold_of(act: str, relu_threshold: float | None) -> np.float32:
    """The gate threshold a model's config means: none (-inf) for SiLU, whose relu_threshold field is unused; the
    FATReLU threshold for the ReLU family (None: 0, plain ReLU)."""
    if act in ("silu", "gelu_tanh"):
        return np.float32(-np.inf)
    return np.float32(0.0 if relu_threshold is None else relu_threshold)


@njit(cache=True, fastmath=True)
def activation(code, v):
    if code == ACT_SILU:
        return v / (np.float32(1.0) + math.exp(-v))
    if code == ACT_GELU_TANH:
        u = np.float32(GELU_C) * (v + np.float32(0.044715) * v * v * v)
        return np.float32(0.5) * v * (np.float32(1.0) + math.tanh(u))
    return v if v > np.float32(0.0) else np.float32(0.0)  # relu and drelu


@njit(cache=True, fastmath=True)
def gate_activation(code, g, threshold):
    """act(g) when it clears the threshold, else 0 (also for NaN): the neuron fired or not. For MLP this is the
    coefficient itself (g: the up product)."""
    a = activation(code, g)
    return a if a > threshold else np.float32(0.0)


@njit(cache=True, fastmath=True)
def glu_coefficient(code, a, u):
    """A GLU neuron's coefficient from its fired gate a (gate_activation) and up product u: a * u; dReLU: 0 unless u > 0."""
    if code == ACT_DRELU and not u > np.float32(0.0):
        return np.float32(0.0)
    return a * u


def silu(x: np.ndarray) -> np.ndarray:
    # Written via exp(-|x|) so large |x| neither overflows nor loses the tail.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, x / (1.0 + e), x * e / (1.0 + e))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + np.tanh(np.float32(GELU_C) * (x + np.float32(0.044715) * x * x * x)))).astype(x.dtype)


def coefficients(act_name: str, g: np.ndarray, u: np.ndarray | None, threshold: float) -> np.ndarray:
    """The numpy twin of gate_activation and glu_coefficient over whole arrays: g [T, n] the gate products (MLP: the up products), u
    [T, n] the up products (None for MLP); threshold as threshold_of."""
    code = act_code(act_name)
    a = silu(g) if code == ACT_SILU else gelu_tanh(g) if code == ACT_GELU_TANH else np.maximum(g, 0.0)
    if threshold > -np.inf:
        a = np.where(a > threshold, a, 0.0).astype(g.dtype)
    if u is None:
        return a
    return a * (np.maximum(u, 0.0) if code == ACT_DRELU else u)
