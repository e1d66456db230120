"""The gating rule: how a neuron's gate and up vectors become the coefficient of its down vector. Written once, in
Numba (`coefficient`), and called by every kernel that computes one: the sparse FFN over bundles (ffn.sparse), the
blocks' gate|up rows (ffn.quant, ffn.split), the dense FFN over a GGUF's matrices and its experts, and the products
of the whole-layer and reference FFNs (coefficients_of_products: ffn.quant.QuantSparseFFN.dense, ffn.dense). The
tests hold its numpy twin (tests/glu_twin.py), in float64.

  GLU: coefficient = act(gate) * up          MLP (OPT): coefficient = act(up)
  act: silu, gelu_tanh (GeGLU, Gemma), or relu (dReLU: relu on the gate, and 0 unless up > 0 too)
  FATReLU: an activation act(gate) <= threshold counts as zero; then the neuron's up vector need not be read at all.
  SiLU and GELU have no threshold (threshold_of: -inf): both go negative; for ReLU the default 0 is exactly ReLU.

A neuron that did not fire has coefficient 0 and its up vector is not read.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from storage.errors import UserError
from flashinfer_lite.kernels.rows import dot, scalar
from flashinfer_lite.quant import act8_dot, act_dot

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


def product(v, X, xa, t, kind):
    """v . x, x = X[t] (X 2-D) or X (1-D: a row already picked, xa then its act8_row): v a vector of float32,
    float16 bits or int8 elements, or GGUF blocks (uint8, `kind` the block format's code; xa: x's 8-bit blocks,
    quant.act8_buffers, or empty); or the product itself, taken already (a float32). Resolved per type at compile
    time, so every kernel shares one coefficient body."""


@overload(product)
def _product_impl(v, X, xa, t, kind):
    if isinstance(v, types.Float):
        return lambda v, X, xa, t, kind: v
    if v.dtype == types.uint8:
        if X.ndim == 1:
            return lambda v, X, xa, t, kind: act8_dot(v, X, xa, kind)
        return lambda v, X, xa, t, kind: act_dot(v, X, xa, t, kind)
    if X.ndim == 1:
        return lambda v, X, xa, t, kind: dot(v, X, v.shape[0])
    return lambda v, X, xa, t, kind: dot(v, X[t], v.shape[0])


# Inlined into each kernel, so it computes with that kernel's floating-point flags (fastmath or not), as before it was
# shared; the activation itself is always the one compiled above.
@njit(cache=True, inline="always")
def coefficient(first, up, fr, X, xa, t, glu, act, threshold, s_first, b_first, s_up, b_up, kind, up_kind,
                act_threshold):
    """The coefficient of one neuron on x (X, xa, t: as product's). GLU: f = first . x (the gate) and u = up . x;
    MLP: f = first . x (its up vector), `up` unused. Each product times its scale and plus its bias, float32 slots
    s_first, b_first, s_up, b_up of fr (-1: none). Then act(f) where it clears `threshold` (gate_activation), else 0
    and u is not computed; GLU: times u (glu_coefficient); |c| <= act_threshold counts as 0 (the exact gate's
    calibrated magnitude; -1: none)."""
    a = gate_activation(act, product(first, X, xa, t, kind) * scalar(fr, s_first, 1.0) + scalar(fr, b_first, 0.0),
                        threshold)
    c = a
    if glu and a != np.float32(0.0):
        c = glu_coefficient(act, a, product(up, X, xa, t, up_kind) * scalar(fr, s_up, 1.0) + scalar(fr, b_up, 0.0))
    return np.float32(0.0) if abs(c) <= act_threshold else c


@njit(cache=True, fastmath=True, nogil=True)
def coefficients_of_products(g, u, F, glu, act, threshold, b_gate, b_up):
    """u[t, j] = the coefficient of neuron j from its products g = X G^T (GLU; MLP: unused) and u = X U^T (in place),
    each plus its bias at slot b_gate / b_up of F[j] (float32 [n, slots]; -1: none)."""
    for t in range(u.shape[0]):
        for j in range(u.shape[1]):
            first = g[t, j] if glu else u[t, j]
            u[t, j] = coefficient(first, u[t, j], F[j], u, u, t, glu, act, threshold, -1, b_gate if glu else b_up, -1,
                                  b_up, 0, 0, np.float32(-1.0))


def activations(act: str, g: np.ndarray | None, u: np.ndarray, threshold) -> np.ndarray:
    """The coefficients [T, n] of the products g (GLU's gate; None: MLP) and u [T, n], biases added (a new array)."""
    a = np.array(u, dtype=np.float32, order="C")
    gg = a if g is None else np.ascontiguousarray(g, dtype=np.float32)
    F = np.zeros((a.shape[1], 0), np.float32)
    coefficients_of_products(gg, a, F, g is not None, act_code(act), np.float32(threshold), -1, -1)
    return a
