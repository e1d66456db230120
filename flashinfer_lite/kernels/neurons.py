"""The FFN's Numba kernels over neuron rows: the gating rule, written once, and the kernels built on it.

  the rule   coefficient: how a neuron's gate and up vectors become the coefficient of its down vector (act codes,
             threshold_of); coefficients_of_products: the rule on products taken already (BLAS, the reference FFN)
  bundles    ffn_coefficients and ffn_accumulate: the sparse FFN over bundle rows of float32 / float16 bits / int8
             or GGUF blocks (ffn.sparse binds them to a geometry)
  blocks     over GGUF blocks (the row operations: kernels.blocks): the down sum of block rows and columns
             (quant_ffn_accumulate, _rows for a prompt), the split layout's gate|up rows (quant_gate_coefficients),
             a whole layer in RAM (quant_dense_ffn_row, dequantize_dense_layer), the dense FFN over a GGUF's matrices
             and its experts (quant_ffn_row, quant_experts_rows)

The rule: GLU coefficient = act(gate) * up, MLP (OPT) coefficient = act(up); act: silu, gelu_tanh (GeGLU, Gemma), or
relu (dReLU: relu on the gate, and 0 unless up > 0 too). FATReLU: an activation act(gate) <= threshold counts as zero;
then the neuron's up vector is not read at all. SiLU and GELU have no threshold (threshold_of: -inf): both go
negative; for ReLU the default 0 is exactly ReLU. Its numpy twin, in float64, is the tests' oracle
(tests/glu_twin.py).

One summation order, whatever the thread count, the cache rows, the budget or the prefill strategy: the coefficients
are per neuron (each computed whole by one thread, so order-free), and the down accumulation adds the neurons'
contributions to each output element in the order the caller lists them (sorted neuron ids), one thread per fixed
block of OUT_BLOCK output elements. A caller may split a set into pieces and accumulate them one after the other into
the same y: the sum is bit-identical to one call over the whole set (tests/test_kernels.py).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from storage.errors import UserError

# These kernels inline blocks' dot products (intrinsics), and Numba's cache checks only this file's stamp: a change
# of their numbers there (the K-quants' block sums as one integer, shared with blocks.k_tiles) needs this file
# rewritten too, or a cached kernel here keeps the old bits while a prompt's tiles take the new ones.
from .blocks import (DOT8_ROWS, Q4_1, Q4_K, Q5_1, Q5_K, Q6_K, act8_dot, act8_row, act8_slice, act_dot, col_axpy,
                     col_axpy_run, col_int_run, col_dequant, col_group, col_span, quantize_act1, quantize_act_rows,
                     row_axpy, row_dequant, row_dot8, row_dot8k, rows_dot8, rows_dot8k)
from ..threads import numba_threads
from .rows import dot, f32_at, prefetch_ahead, prefetch_piece, prefetch_row, prefetch_row_l2, rows_ahead, scalar

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


# SiLU and the threshold test with fast math but for nnan / ninf, and division by IEEE rules (error_model numpy): an
# infinite or NaN gate product follows float32 semantics as kernels.blocks.silu_coefficient_rows does (NaN and -inf:
# 0; +inf: inf) instead of raising ZeroDivisionError (under nnan a NaN divisor compared equal to zero). GELU keeps
# all of fast math: its bits are as they were.
IEEE_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}


@njit(cache=True, fastmath=IEEE_FAST, error_model="numpy")
def silu(v):
    return v / (np.float32(1.0) + math.exp(-v))


@njit(cache=True, fastmath=True)
def activation(code, v):
    if code == ACT_SILU:
        return silu(v)
    if code == ACT_GELU_TANH:
        u = np.float32(GELU_C) * (v + np.float32(0.044715) * v * v * v)
        return np.float32(0.5) * v * (np.float32(1.0) + math.tanh(u))
    return v if v > np.float32(0.0) else np.float32(0.0)  # relu and drelu


@njit(cache=True, fastmath=IEEE_FAST)
def gate_activation(code, g, threshold):
    """act(g) when it clears the threshold, else 0 (also for NaN): the neuron fired or not. For MLP this is the
    coefficient itself (g: the up product)."""
    a = activation(code, g)
    return a if a > threshold else np.float32(0.0)


@njit(cache=True, fastmath=True)
def glu_coefficient(code, a, u):
    """A GLU neuron's coefficient from its fired gate a (gate_activation) and up product u: a * u; dReLU: 0 unless
    u > 0."""
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


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def coefficients_of_rows(g, u, F, glu, act, threshold, b_gate, b_up):
    """coefficients_of_products, the rows in parallel (each element's bits are its own: the same)."""
    for t in prange(u.shape[0]):
        coefficients_of_products(g[t:t + 1], u[t:t + 1], F, glu, act, threshold, b_gate, b_up)


# From this many coefficients a prompt's take both threads: a real 1.5B's 256 rows x 8960 neurons took 37 ms serial
# (an exp and a division each), a tenth of its layer's time
PARALLEL_COEFFICIENTS = 1 << 16


def activations(act: str, g: np.ndarray | None, u: np.ndarray, threshold) -> np.ndarray:
    """The coefficients [T, n] of the products g (GLU's gate; None: MLP) and u [T, n], biases added (a new array)."""
    a = np.array(u, dtype=np.float32, order="C")
    gg = a if g is None else np.ascontiguousarray(g, dtype=np.float32)
    F = np.zeros((a.shape[1], 0), np.float32)
    run = coefficients_of_rows if a.size >= PARALLEL_COEFFICIENTS else coefficients_of_products
    run(gg, a, F, g is not None, act_code(act), np.float32(threshold), -1, -1)
    return a


# ---------------------------------------------------------------------------------------------------------------
# The sparse FFN over bundle rows

# Output elements per task of the down accumulation: a constant (not the thread count), so that every element is
# summed by the same loop code in the same order whatever -t is.
OUT_BLOCK = 64


# nogil: flash reads run in Python threads while these compute the rows already cached.
@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def ffn_coefficients(W, F, slots, js, X, xa, sel, coef, n, glu, act, threshold, up_at, s_first, s_up, bg, bu, kind,
                     up_n, up_kind, head_bytes, act_threshold):
    """coef[t, j] = coefficient of neuron row slots[j] on X[t] if sel[t, j] else 0, for every j in js.

    W: the bundle matrix [rows, stride // itemsize] in its stored type (uint8 for blocks); F: its float32 view;
    slots: int32[n] rows; js: int64 positions into slots to compute now (the rest of coef is left alone);
    X: float32[T, d]; xa: quant.act8_buffers of X (filled here first) or empty; sel: uint8[T, >=n]; coef:
    float32[T, >=n]. act_threshold: coefficients with |c| <= it count as
    zero (SwiGLU's calibrated act_threshold; -1: none). head_bytes: the bytes before the down vector, asked for
    whole one row ahead (prefetch_piece: a 7B q4_0 head is 4.6 KB, and each row's starts at an address the hardware
    cannot guess). The rest: coefficient's.
    """
    quantize_act_rows(X, xa)
    for q in prange(js.shape[0]):
        j = js[q]
        r = slots[j]
        if q + 1 < js.shape[0]:
            prefetch_piece(W, slots[js[q + 1]], 0, head_bytes)
        wr = W[r]
        fr = F[r]
        for t in range(X.shape[0]):
            c = np.float32(0.0)
            if sel[t, j]:
                c = coefficient(wr[:n], wr[up_at:up_at + up_n], fr, X, xa, t, glu, act, threshold, s_first,
                                bg if glu else bu, s_up, bu, kind, up_kind, act_threshold)
            coef[t, j] = c


# No fastmath: nothing here needs reassociation to vectorise, and without it no FMA contraction can make one call
# site round differently from another.
@njit(cache=True, parallel=True, nogil=True)
def ffn_accumulate(W, F, slots, coef, Y, d, down_at, s_down):
    """Y[t] += sum over j = 0, 1, ... of coef[t, j] * down(slots[j]), in that order (zero coefficients skipped); the
    down vector at element down_at of a row, its scale at slot s_down (-1: none).

    Parallel over (row, block of OUT_BLOCK output elements): each output element is summed by one thread."""
    n = slots.shape[0]
    nb = (d + OUT_BLOCK - 1) // OUT_BLOCK
    for q in prange(Y.shape[0] * nb):
        t = q // nb
        lo = (q % nb) * OUT_BLOCK
        hi = min(d, lo + OUT_BLOCK)
        y = Y[t, lo:hi]
        m = hi - lo
        # the fired neurons in order, then four per pass: four rows' loads in flight at once (rows sit at random
        # addresses); each output element still adds them one after the other (no fastmath: no reassociation)
        fired = np.empty(n, np.int64)
        nf = 0
        for j in range(n):
            if coef[t, j] != np.float32(0.0):
                fired[nf] = j
                nf += 1
        q4 = nf - nf % 4
        for i in range(0, q4, 4):
            j0, j1, j2, j3 = fired[i], fired[i + 1], fired[i + 2], fired[i + 3]
            c0 = coef[t, j0] * scalar(F[slots[j0]], s_down, 1.0)
            c1 = coef[t, j1] * scalar(F[slots[j1]], s_down, 1.0)
            c2 = coef[t, j2] * scalar(F[slots[j2]], s_down, 1.0)
            c3 = coef[t, j3] * scalar(F[slots[j3]], s_down, 1.0)
            v0 = W[slots[j0], down_at + lo:down_at + hi]
            v1 = W[slots[j1], down_at + lo:down_at + hi]
            v2 = W[slots[j2], down_at + lo:down_at + hi]
            v3 = W[slots[j3], down_at + lo:down_at + hi]
            for k in range(m):
                y[k] = (((y[k] + c0 * f32_at(v0, k)) + c1 * f32_at(v1, k)) + c2 * f32_at(v2, k)) + c3 * f32_at(v3, k)
        for i in range(q4, nf):
            j = fired[i]
            c = coef[t, j] * scalar(F[slots[j]], s_down, 1.0)
            v = W[slots[j], down_at + lo:down_at + hi]
            for k in range(m):
                y[k] += c * f32_at(v, k)


# ---------------------------------------------------------------------------------------------------------------
# Over GGUF blocks

# quant_experts_rows: tasks per (row, expert) pair in each of its two passes. Any number gives the same bits (each
# coefficient and each down row is one task's whole); 2 keeps both threads busy on a batch of one expert. A batch of
# at least as many pairs as threads runs each pair as one task instead, in one parallel region.
EXPERT_TASKS = 2


# The activations of the fused FFN row kernels (quant_ffn_row, quant_experts_rows)
QUANT_FFN_ACTS = ("relu", "drelu", "silu", "gelu_tanh")


# Columns quant_ffn_accumulate adds in one pass: a whole sub-block's (col_group: 32 neurons at most), so its scales
# are formed and each output's sum loaded and stored once per sub-block, not once per 4 columns (q4_k columns of
# 1536: 0.064 against 0.095 ns per element and column, in cache; bench/README.md, issue 44)
COL_RUN_COLUMNS = 32


@njit(cache=True, parallel=True, nogil=True)
def quant_ffn_accumulate(B, F, slots, coef, Y, down_at, kind, weights, block_bytes, out_block, s_neuron, S):
    """Y[t] += sum over j = 0, 1, ... of coef[t, j] * down(slots[j]), in that order (zero coefficients skipped);
    the down rows (at byte down_at of a bundle) are in `kind`, blocks of `weights` weights in block_bytes; or, with
    s_neuron >= 0, columns of `kind` (storage.columns: the neuron id at float32 slot s_neuron of F = B's float32
    view, the layer's scale tables S).

    As ffn.sparse.ffn_accumulate: one thread per (row, out_block output elements), so each element sums its terms in
    slot order and a set accumulated in pieces gives the bit-identical sum. out_block is a multiple of the block's
    weights, so a task's outputs are whole blocks of the down rows. Each task asks for the pieces it reads a few rows
    ahead (the rows sit where the hardware cannot guess), and adds consecutive fired columns of one sub-block in one
    pass (col_axpy_run: their terms still in slot order, each output's sum in a register across them)."""
    n = slots.shape[0]
    d = Y.shape[1]
    nb = (d + out_block - 1) // out_block
    for q in prange(Y.shape[0] * nb):
        t = q // nb
        lo = (q % nb) * out_block
        hi = min(d, lo + out_block)
        y = Y[t, lo:hi]
        if s_neuron >= 0:
            c0, c1, h0, h1 = col_span(kind, d, lo, hi)
            ahead = rows_ahead(c1 - c0 + h1 - h0)
            rows, cs = np.empty(COL_RUN_COLUMNS, np.int64), np.empty(COL_RUN_COLUMNS, np.float32)
            held, group, first = 0, -1, 0   # fired neurons of one sub-block not yet added (col_axpy_run)
            for j in range(n + 1):
                if j + ahead < n:     # the column's pieces (into L2: col_axpy_run's pass fills L1) and neuron id
                    r = slots[j + ahead]
                    prefetch_row_l2(B, r, down_at + c0, down_at + c1)
                    prefetch_row_l2(B, r, down_at + h0, down_at + h1)
                    prefetch_row(B, r, 4 * s_neuron, 4 * s_neuron + 4)
                if j < n and coef[t, j] == np.float32(0.0):
                    continue
                neuron = np.int64(F[slots[j], s_neuron]) if j < n else -1
                g = col_group(kind, neuron) if j < n else -1
                if held and (g != group or held == COL_RUN_COLUMNS):
                    col_axpy_run(y, B, rows, cs, held, down_at, lo, kind, first, S)
                    held = 0
                if j < n:
                    if held == 0:
                        group, first = g, neuron
                    rows[held], cs[held] = slots[j], coef[t, j]
                    held += 1
            continue
        b_lo = down_at + lo // weights * block_bytes
        b_hi = down_at + hi // weights * block_bytes
        ahead = rows_ahead(b_hi - b_lo)
        for j in range(n):
            if j + ahead < n:
                prefetch_row(B, slots[j + ahead], b_lo, b_hi)
            c = coef[t, j]
            if c != np.float32(0.0):
                row_axpy(y, c, B[slots[j], b_lo:b_hi], kind)


_U = np.uint64


# A task of quant_ffn_accumulate_rows: this many of a prompt's rows times about DOWN_TILE_OUTPUTS outputs (whole
# out_blocks), 12 KiB of sums that stay in L1 while each needed down piece is decoded once for all the rows
DOWN_TILE_ROWS = 16


DOWN_TILE_OUTPUTS = 192


# A task of quant_ffn_accumulate (one row): at most this many outputs
DOWN_SPAN_OUTPUTS = 1024


def down_span(out_block: int, d: int) -> int:
    """The outputs of a task of quant_ffn_accumulate: whole out_blocks, as many as two tasks per thread allow (up to
    DOWN_SPAN_OUTPUTS). Each task walks every fired down row, so longer spans read longer pieces of each in fewer
    passes over the set (the exact gate's 64-output tasks of a real 1.5B spent 2-3x the time of 384-output ones on
    walking); an element's sum runs in slot order whatever the span."""
    return out_block * max(1, min(DOWN_SPAN_OUTPUTS // out_block, d // (out_block * 2 * numba_threads())))


@njit(cache=True, parallel=True, nogil=True)
def quant_ffn_accumulate_rows(B, F, slots, coef, Y, down_at, kind, weights, block_bytes, out_block, s_neuron, S):
    """quant_ffn_accumulate for many rows (a prompt's), bit for bit: one task per (DOWN_TILE_ROWS rows, a span of
    whole out_blocks) decodes each needed down piece once (as col_dequant, row_dequant: the weights col_axpy and
    row_axpy form) and adds c * w to each of its rows, neurons in slot order, zero coefficients skipped: each output
    element gets the same float32 products and sums, in the same order, as one row alone (no fastmath)."""
    n = slots.shape[0]
    T, d = Y.shape
    span = out_block * max(1, DOWN_TILE_OUTPUTS // out_block)
    ns = (d + span - 1) // span
    for q in prange((T + DOWN_TILE_ROWS - 1) // DOWN_TILE_ROWS * ns):
        t0 = q // ns * DOWN_TILE_ROWS
        rows = min(T, t0 + DOWN_TILE_ROWS) - t0
        lo = (q % ns) * span
        m = min(d, lo + span) - lo
        acc = np.empty((rows, m), np.float32)         # the rows' sums so far, contiguous
        for i in range(rows):
            acc[i] = Y[t0 + i, lo:lo + m]
        w = np.empty(m, np.float32)
        for j in range(n):
            used = False
            for i in range(rows):
                used = used or coef[t0 + i, j] != np.float32(0.0)
            if not used:
                continue
            r = slots[j]
            if s_neuron >= 0:
                w[:] = np.float32(-0.0)        # col_dequant's way: -0.0 + 1 * w is w
                col_axpy(w, np.float32(1.0), B, r, down_at, lo, kind, np.int64(F[r, s_neuron]), S)
            else:
                row_dequant(B[r, down_at + lo // weights * block_bytes:down_at + (lo + m) // weights * block_bytes],
                            w, kind)
            for i in range(_U(rows)):          # unsigned: no wrap-around checks, so the loop vectorises
                c = coef[t0 + i, j]
                if c != np.float32(0.0):
                    for k in range(_U(m)):
                        acc[i, k] += c * w[k]
        for i in range(rows):
            Y[t0 + i, lo:lo + m] = acc[i]


# ---------------------------------------------------------------------------------------------------------------
# The exact gate's down sum in integers (a GGUF's down columns, 8-bit activations on). A row's coefficients are
# rounded to 8 bits per block of the down's neurons as the dense path rounds them before its down GEMV (q8_K per 256
# for the K-quants, q8_0 per 32 for the others: ffn.flash.SplitRows.begin); then, per output element, each block's
# sum over its fired neurons is an exact integer (a K-quant's sub-blocks times their integer scales), and only the
# block's conversion is float: y += float(I) * (d * xd), then the block's min term (q4_1, q5_1: + K * (m * xd);
# q4_k, q5_k: - M * (dmin * xd), M = sum over sub-blocks of mn * K_s, K: the block's or sub-block's sum of the
# rounded coefficients). Three float operations per block and output instead of three per weight; the integers do not
# depend on the order of the neurons, so the float part runs in block order whatever the pieces, the chunks, the
# thread count or the rows that share a call. A call's slots hold ascending neuron ids, and so do a layer's calls one
# after the other (identity order): the last block of a call is carried (its integer sums) into the next, and the
# layer's last by gate_down_finish.

# Rows of a prompt per task of gate_down_ints: they share the walk over the slots (and the pieces it brings to L1)
GATE_DOWN_ROWS = 16


@njit(cache=True, nogil=True, inline="always")
def gate_down_groups(kind):
    """(neurons per block: a row of the a and m tables and of the coefficients' scales, per sub-block: of sc, mn)."""
    if kind == Q4_K or kind == Q5_K:
        return 256, 32
    if kind == Q6_K:
        return 256, 16
    return 32, 32


@njit(cache=True, nogil=True, inline="always")
def _convert_block(y, I, kind, b, t, lo, m, S, XD, KS):
    """y[e] += block b's float terms of output lo + e for row t (the block's integer sums I; the section's comment)."""
    A, M, SC, MN = S
    x = XD[t, b]
    a = A[b]
    for e in range(m):
        y[e] = y[e] + np.float32(I[e]) * (f32_at(a, lo + e) * x)
    if kind == Q4_1 or kind == Q5_1:
        mm, k = M[b], np.float32(KS[t, b])
        for e in range(m):
            y[e] = y[e] + k * (f32_at(mm, lo + e) * x)
    elif kind == Q4_K or kind == Q5_K:
        mm = M[b]
        for e in range(m):
            total = np.int32(0)
            for s in range(8 * b, 8 * b + 8):
                total += np.int32(MN[s, lo + e]) * KS[t, s]
            y[e] = y[e] - np.float32(total) * (f32_at(mm, lo + e) * x)


@njit(cache=True, parallel=True, nogil=True)
def gate_down_ints(B, F, slots, coef, KQ, XD, KS, Y, carry, cb_in, cb_out, down_at, kind, out_block, s_neuron, S,
                   rows, ACC):
    """Y[t] += the down sum of the columns in slots (ascending neuron ids, the neuron id at float32 slot s_neuron of F,
    B's float32 view) by the rounded coefficients KQ[t, neuron] (int8 [T, n], neuron order; coef [T, len(slots)]:
    which slots any row needs), in integers (the section's comment): each block's sums carried from the call before
    (carry [T, d], block cb_in[t]; -1: none) and into the next (carry, cb_out[t]); the blocks between converted in
    block order. XD [T, blocks]: the coefficients' scales; KS [T, sub-blocks]: their integer sums. ACC int32
    [T, blocks, d] (else [T, 0, d]): every block's sums kept whole instead, for slots in any neuron order (a permuted
    layout; gate_down_finish converts them). One task per
    (`rows` rows, out_block outputs); consecutive fired columns of one sub-block are added in one pass (col_int_run:
    each output's sum in a register across them, then times the sub-block's scale)."""
    n = slots.shape[0]
    T, d = Y.shape
    G, SW = gate_down_groups(kind)
    half = d // 2
    SC = S[2]
    ns = (d + out_block - 1) // out_block
    for q in prange((T + rows - 1) // rows * ns):
        t0 = q // ns * rows
        R = min(T, t0 + rows) - t0
        lo = (q % ns) * out_block
        m = min(d, lo + out_block) - lo
        c0, c1, h0, h1 = col_span(kind, d, lo, lo + m)
        # a run is added after its columns are gathered: ask for them a run's length earlier than one at a time
        ahead = rows_ahead(c1 - c0 + h1 - h0) + COL_RUN_COLUMNS
        I = np.empty((R, m), np.int32)
        cur_b = np.empty(R, np.int64)
        for i in range(R):
            I[i] = carry[t0 + i, lo:lo + m]
            cur_b[i] = cb_in[t0 + i]
        run, neurons = np.empty(COL_RUN_COLUMNS, np.int64), np.empty(COL_RUN_COLUMNS, np.int64)
        ks = np.empty(COL_RUN_COLUMNS, np.int32)
        whole = ACC.shape[1] > 0
        sums = np.empty(m, np.int32)
        held, group, s = 0, -1, -1
        for j in range(n + 1):
            if j + ahead < n:     # the column's pieces (into L2: col_int_run's pass fills L1) and neuron id
                r = slots[j + ahead]
                prefetch_row_l2(B, r, down_at + c0, down_at + c1)
                prefetch_row_l2(B, r, down_at + h0, down_at + h1)
                prefetch_row(B, r, 4 * s_neuron, 4 * s_neuron + 4)
            if j < n:
                used = False
                for i in range(R):
                    used = used or coef[t0 + i, j] != np.float32(0.0)
                if not used:
                    continue
                neuron = np.int64(F[slots[j], s_neuron])
                s = neuron // SW
            if held and (j == n or s != group or held == COL_RUN_COLUMNS):
                b = neurons[0] // G
                for i in range(R):
                    nonzero = False
                    for h in range(held):
                        ks[h] = KQ[t0 + i, neurons[h]]
                        nonzero = nonzero or ks[h] != 0
                    if not nonzero:
                        continue
                    if whole:
                        sums[:] = ACC[t0 + i, b, lo:lo + m]
                        col_int_run(sums, B, run, ks, held, down_at, lo, half, kind,
                                    SC[group] if SC.shape[0] else B[run[0]])
                        ACC[t0 + i, b, lo:lo + m] = sums
                        continue
                    if b != cur_b[i]:       # a new block: the one before is complete
                        if cur_b[i] >= 0:
                            _convert_block(Y[t0 + i, lo:lo + m], I[i], kind, cur_b[i], t0 + i, lo, m, S, XD, KS)
                        I[i] = 0
                        cur_b[i] = b
                    col_int_run(I[i], B, run, ks, held, down_at, lo, half, kind,
                                SC[group] if SC.shape[0] else B[run[0]])
                held = 0
            if j < n:
                if held == 0:
                    group = s
                run[held], neurons[held] = slots[j], neuron
                held += 1
        for i in range(R):
            carry[t0 + i, lo:lo + m] = I[i]
            if lo == 0:
                cb_out[t0 + i] = cur_b[i]


@njit(cache=True, parallel=True, nogil=True)
def gate_down_finish(Y, carry, cb, kind, S, XD, KS, ACC, fired):
    """Y[t] += the float terms of each row's last block (carry, cb[t]; -1: none), or with ACC [T, blocks, d] (not
    empty) of its every block b where fired[t, b], in block order: the layer's down sum complete."""
    T, d = Y.shape
    for t in prange(T):
        for b in range(ACC.shape[1]):
            if fired[t, b]:
                _convert_block(Y[t], ACC[t, b], kind, b, t, 0, d, S, XD, KS)
        if cb[t] >= 0:
            _convert_block(Y[t], carry[t], kind, cb[t], t, 0, d, S, XD, KS)


# Neurons per task of quant_gate_coefficients: their gate|up rows stay in L1 while x passes by, DOT8_ROWS rows at once
GATE_TILE_NEURONS = 16


@njit(cache=True, parallel=True, nogil=True)
def quant_gate_coefficients(H, Hf, X, xa, coef, rb, up_at, up_rb, kind, up_kind, act, threshold, s_gate, s_up, bg, bu,
                            act_threshold):
    """coef[t, j] = the coefficient of gate|up row H[j] (Hf: H's float32 view; gate: rb bytes in `kind`, up: up_rb
    bytes at byte up_at in up_kind, each a kind with an 8-bit dot product whose blocks xa holds) on X[t] (xa:
    act8_buffers of X, filled here), 0 where |c| <= act_threshold.

    Any number of rows gives each (row, neuron) the same bits: DOT8_ROWS rows at a time through rows_dot8 (rows_dot8k
    for the K-quants), the rest through row_dot8 (row_dot8k), which perform the same operations per row; no fastmath,
    so none of them is reassociated or contracted differently from one call site to the other."""
    quantize_act_rows(X, xa)
    T, d = X.shape
    n = H.shape[0]
    xq, xd, xs, xl = xa[0].reshape(-1), xa[1].reshape(-1), xa[2].reshape(-1), xa[3].reshape(-1)
    kq, kd, kb = xa[4].reshape(-1), xa[5].reshape(-1), xa[6].reshape(-1)
    full = T - T % DOT8_ROWS
    for p in prange((n + GATE_TILE_NEURONS - 1) // GATE_TILE_NEURONS):
        g = np.empty(DOT8_ROWS, np.float32)
        u = np.empty(DOT8_ROWS, np.float32)
        j0, j1 = p * GATE_TILE_NEURONS, min(n, (p + 1) * GATE_TILE_NEURONS)
        for t0 in range(0, full, DOT8_ROWS):
            for j in range(j0, j1):
                if kind >= Q4_K:
                    rows_dot8k(H[j, :rb], kq, kd, kb, d, t0, g, kind)
                else:
                    rows_dot8(H[j, :rb], xq, xd, xs, xl, d, t0, g, kind)
                if up_kind >= Q4_K:
                    rows_dot8k(H[j, up_at:up_at + up_rb], kq, kd, kb, d, t0, u, up_kind)
                else:
                    rows_dot8(H[j, up_at:up_at + up_rb], xq, xd, xs, xl, d, t0, u, up_kind)
                for i in range(DOT8_ROWS):
                    coef[t0 + i, j] = coefficient(g[i], u[i], Hf[j], X, xa, t0 + i, True, act, threshold, s_gate, bg,
                                                  s_up, bu, kind, up_kind, act_threshold)
        for t in range(full, T):
            for j in range(j0, j1):
                gate, up = H[j, :rb], H[j, up_at:up_at + up_rb]
                gt = (row_dot8k(gate, xa[4][t], xa[5][t], xa[6][t], kind) if kind >= Q4_K else
                      row_dot8(gate, xa[0][t], xa[1][t], xa[2][t], xa[3][t], kind))
                ut = (row_dot8k(up, xa[4][t], xa[5][t], xa[6][t], up_kind) if up_kind >= Q4_K else
                      row_dot8(up, xa[0][t], xa[1][t], xa[2][t], xa[3][t], up_kind))
                coef[t, j] = coefficient(gt, ut, Hf[j], X, xa, t, True, act, threshold, s_gate, bg, s_up, bu, kind,
                                         up_kind, act_threshold)


# A kernel made for the kinds a layout has (a factory per kernel, cached): the kinds reach the kernel as constants
# (literals), so each dot product or column run it calls holds those kinds' loops alone (blocks._emitted), not every
# kind's behind a branch. The same operations, so the same bits; a compile child's memory grows with the code it
# compiles: with every kind's, a first use's took more than a 300 MiB memory cgroup leaves beside the run
# (SmolLM2's q4_1 FLASHDIR: the gate's coefficients step 359 MiB, one kernel of them with its kinds alone 252).
@functools.cache
def gate_coefficients_for(kind: int, up_kind: int):
    """quant_gate_coefficients for gate rows in `kind` and up rows in up_kind (its arguments less the two kinds)."""
    @njit(cache=True, nogil=True)
    def kernel(H, Hf, X, xa, coef, rb, up_at, up_rb, act, threshold, s_gate, s_up, bg, bu, act_threshold):
        quant_gate_coefficients(H, Hf, X, xa, coef, rb, up_at, up_rb, kind, up_kind, act, threshold, s_gate, s_up,
                                bg, bu, act_threshold)
    return kernel


@functools.cache
def gate_down_for(kind: int):
    """gate_down_ints for down columns in `kind` (its arguments less the kind)."""
    @njit(cache=True, nogil=True)
    def kernel(B, F, slots, coef, KQ, XD, KS, Y, carry, cb_in, cb_out, down_at, out_block, s_neuron, S, rows, ACC):
        gate_down_ints(B, F, slots, coef, KQ, XD, KS, Y, carry, cb_in, cb_out, down_at, kind, out_block, s_neuron, S,
                       rows, ACC)
    return kernel


# The neuron ranges of a dense decode step: a constant, not the thread count, so -t does not change the bits. Each
# range is one task, coefficients then its partial down sum (rows front to back): one parallel region per layer, as
# each region pays for waking the pool (flashinfer_lite/__init__.py).
DOWN_PARTIALS = 4


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def quant_dense_ffn_row(H, Hf, D, X, xa, t, y, coef, partial, rb, glu, act, threshold, kind, bg, bu, down_kind,
                        up_rb, up_kind, s_neuron, S):
    """y[:] = sum over neurons j of coef[j] * dequant(D[j]), coef[j] = the coefficient of head row H[j] (Hf: its
    float32 view) on X[t] (xa: act8_buffers of X: row t filled here, or empty): partial[p] sums the p-th of
    len(partial) neuron ranges in order, then they add up in order.
    H's rows: the first vector (rb bytes in `kind`), then (GLU) up (up_rb bytes in up_kind); D's: as
    quant_ffn_accumulate's (s_neuron: the neuron id's slot in Hf)."""
    quantize_act1(X[t], act8_row(xa, t))
    n, P = H.shape[0], partial.shape[0]
    for p in prange(P):
        acc = partial[p]
        acc[:] = 0.0
        for j in range(p * n // P, (p + 1) * n // P):
            prefetch_ahead(H, j, 0, H.shape[1])
            prefetch_ahead(D, j, 0, D.shape[1])
            c = coefficient(H[j, :rb], H[j, rb:rb + up_rb], Hf[j], X, xa, t, glu, act, threshold, -1,
                            bg if glu else bu, -1, bu, kind, up_kind, np.float32(-1.0))
            coef[j] = c
            if c != np.float32(0.0):
                if s_neuron >= 0:
                    col_axpy(acc, c, D, j, 0, 0, down_kind, np.int64(Hf[j, s_neuron]), S)
                else:
                    row_axpy(acc, c, D[j], down_kind)
    y[:] = partial[0]
    for p in range(1, P):
        y += partial[p]


@njit(cache=True, nogil=True)
def dequantize_dense_layer(H, Hf, D, lo, G, U, Dw, bias, rb, glu, kind, bg, bu, down_kind, up_rb, up_kind, s_neuron,
                           S):
    """Neurons lo .. lo + len(Dw) widened to float32 rows: gate G (GLU only), up U, down Dw; their gate and up
    biases bias[r] (0 where there are none). Kinds and row bytes as quant_dense_ffn_row's."""
    for r in range(Dw.shape[0]):
        row = H[lo + r]
        if glu:
            row_dequant(row[:rb], G[r], kind)
            row_dequant(row[rb:rb + up_rb], U[r], up_kind)
        else:
            row_dequant(row[:rb], U[r], kind)
        if s_neuron >= 0:
            col_dequant(D, lo + r, 0, Dw[r], down_kind, np.int64(Hf[lo + r, s_neuron]), S)
        else:
            row_dequant(D[lo + r], Dw[r], down_kind)
        bias[r, 0] = scalar(Hf[lo + r], bg, 0.0)
        bias[r, 1] = scalar(Hf[lo + r], bu, 0.0)


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def dense_coefficients(Wg, Wu, X, xa, t, a, aa, lo, hi, glu, act, threshold, kind_g, kind_u):
    """The first pass of a quantized FFN on X[t] (xa: act8_buffers of X, row t filled, or empty), for neurons lo ..
    hi (whole blocks of the down rows): the coefficients a[j] from Wg[j] and Wu[j] (MLP: Wg is Wu),
    then their 8-bit blocks into aa (a 1-D act8_row tuple for a, or empty)."""
    x, xr = X[t], act8_row(xa, t)           # once, not per row (act8_dot)
    none = a[:0]                            # no scales, no biases
    for j in range(lo, hi):
        prefetch_ahead(Wu, j, 0, Wu.shape[1])
        if glu:
            prefetch_ahead(Wg, j, 0, Wg.shape[1])
        a[j] = coefficient(Wg[j], Wu[j], none, x, xr, 0, glu, act, threshold, -1, -1, -1, -1, kind_g, kind_u,
                           np.float32(-1.0))
    quantize_act1(a[lo:hi], act8_slice(aa, lo, hi))


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def ffn_down(Wd, a, aa, y, lo, hi, kind_d):
    """The second pass: y[i] = down row i . a for rows lo .. hi, each a whole row's dot product (on aa, a's 8-bit
    blocks, where the kind has them), so its bits do not depend on how the rows are split into tasks."""
    for i in range(lo, hi):
        prefetch_ahead(Wd, i, 0, Wd.shape[1])
        y[i] = act8_dot(Wd[i], a, aa, kind_d)


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def quant_ffn_row(Wg, Wu, Wd, x, xa, t, a, aa, y, tasks, glu, act, threshold, kind_g, kind_u, kind_d, down_weights):
    """y = Wd @ a with a[j] the coefficient of neuron j from Wg[j].x and Wu[j].x (MLP: Wu[j].x), x = x[t]
    (xa: act8_buffers of x: row t filled here, or empty; aa: 8-bit blocks of a, filled here, or empty). Two parallel
    passes of `tasks` tasks each: the coefficients of ranges of whole blocks of neurons (dense_coefficients, blocks of
    down_weights), then ranges of the down rows (ffn_down)."""
    quantize_act1(x[t], act8_row(xa, t))
    n, d = Wu.shape[0], Wd.shape[0]
    nb = n // down_weights
    for p in prange(tasks):
        dense_coefficients(Wg, Wu, x, xa, t, a, aa, p * nb // tasks * down_weights,
                           (p + 1) * nb // tasks * down_weights, glu, act, threshold, kind_g, kind_u)
    for p in prange(tasks):
        ffn_down(Wd, a, aa, y, p * d // tasks, (p + 1) * d // tasks, kind_d)


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def quant_experts_rows(S, X, xa, rows, slots, dest, A, aa, O, tasks, at_g, at_u, at_d, n, act, threshold, kind_g,
                       kind_u, kind_d, rb_g, rb_u, rb_d, down_weights):
    """O[dest[q]] = the GLU FFN of expert slot slots[q] on X[rows[q]], for every pair q: each expert is a row of S
    (uint8 [slots, chunk]) holding gate [n, d], up [n, d] and down [d, n] in block formats at bytes at_g, at_u, at_d
    (storage.experts). quant_ffn_row's two passes, each over (pair, range) tasks of every pair at once, so a pair's
    result has quant_ffn_row's bits whichever other pairs share the call; tasks 0: one parallel region, each task a
    whole pair's two passes (the same bits, one region less to wait for). xa: act8_buffers of X, filled (or empty);
    A [pairs, n] and aa (act8_buffers of A, or empty): scratch."""
    Q, d = rows.shape[0], O.shape[1]
    nb = n // down_weights
    if tasks == 0:
        for q in prange(Q):
            s = S[slots[q]]
            dense_coefficients(s[at_g:at_g + n * rb_g].reshape((n, rb_g)), s[at_u:at_u + n * rb_u].reshape((n, rb_u)),
                             X, xa, rows[q], A[q], act8_row(aa, q), 0, nb * down_weights, True, act, threshold,
                             kind_g, kind_u)
            ffn_down(s[at_d:at_d + d * rb_d].reshape((d, rb_d)), A[q], act8_row(aa, q), O[dest[q]], 0, d, kind_d)
        return
    for task in prange(Q * tasks):
        q, p = task // tasks, task % tasks
        s = S[slots[q]]
        dense_coefficients(s[at_g:at_g + n * rb_g].reshape((n, rb_g)), s[at_u:at_u + n * rb_u].reshape((n, rb_u)), X,
                         xa, rows[q], A[q], act8_row(aa, q), p * nb // tasks * down_weights,
                         (p + 1) * nb // tasks * down_weights, True, act, threshold, kind_g, kind_u)
    for task in prange(Q * tasks):
        q, p = task // tasks, task % tasks
        s = S[slots[q]]
        ffn_down(s[at_d:at_d + d * rb_d].reshape((d, rb_d)), A[q], act8_row(aa, q), O[dest[q]], p * d // tasks,
                 (p + 1) * d // tasks, kind_d)


@njit(cache=True, nogil=True)
def add_weighted_rows(Y, O, rows, w):
    """Y[rows[q]] += O[q] * w[q] for q = 0, 1, ... in order: float32 products, then sums (numpy's bits: no fused
    multiply-add without fastmath)."""
    for q in range(rows.shape[0]):
        y, o, c = Y[rows[q]], O[q], w[q]
        for i in range(y.shape[0]):
            y[i] += o[i] * c
