"""The FFN over weights in GGUF's block formats (storage/blocks.py; their row kernels: flashinfer_lite.quant).

QuantSparseFFN: ffn.sparse.SparseFFN over bundles whose gate, up and down vectors are quantized rows along d, each
vector in its own block format (the bundle's geometry as storage.format.BundleGeometry says: blocks in place of
elements). Its dense() computes a whole layer in RAM (DenseLayer, ffn.resident.ResidentFFN). quant_ffn: the dense
FFN over a GGUF's QuantMatrix weights.
The gate and up products (and quant_ffn's down products, rows along n) round x (the coefficients) to 8 bits where the
kind has an 8-bit dot product (quant.set_act8); the rest is float32 on the dequantized weights. The gating rule is
ffn.gating's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from storage.errors import UserError
from flashinfer_lite.kernels.gemv import WIDEN_BLOCK_BYTES
from flashinfer_lite.kernels.prefetch import prefetch_ahead, prefetch_row, rows_ahead
from flashinfer_lite.kernels.rows import scalar
from flashinfer_lite.threads import numba_threads
from flashinfer_lite.quant import (COL_RUN_MAX, DOT8_ROWS, KINDS, Q4_K, QuantMatrix, act8_buffers, act8_dot, act8_of,
                                   act8_rounded, act8_row, act8_slice, col_axpy, col_axpys, col_dequant, col_group,
                                   col_span, column_tables, quant_kind, quantize_act1, quantize_act_rows, row_axpy,
                                   row_dequant, row_dot8, row_dot8k, rows_dot8, rows_dot8k)
from storage import columns

from .gating import act_code, coefficient, coefficients_of_products, threshold_of
from .sparse import OUT_BLOCK, SparseFFN

# QuantSparseFFN.dense: up to this many rows, the row kernel per row (the layer's blocks read once per row); more
# (a prompt): widened blocks + BLAS, which read them once for all rows
DENSE_ROW_KERNEL_MAX_T = 2

# quant_experts_rows: tasks per (row, expert) pair in each of its two passes. Any number gives the same bits (each
# coefficient and each down row is one task's whole); 2 keeps both threads busy on a batch of one expert. A batch of
# at least as many pairs as threads runs each pair as one task instead, in one parallel region.
EXPERT_TASKS = 2

# The activations of the fused FFN row kernels (quant_ffn_row, quant_experts_rows)
QUANT_FFN_ACTS = ("relu", "drelu", "silu", "gelu_tanh")


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
    pass (col_axpys: their terms still in slot order)."""
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
            rows, cs = np.empty(COL_RUN_MAX, np.int64), np.empty(COL_RUN_MAX, np.float32)
            held, group, first = 0, -1, 0   # fired neurons of one sub-block not yet added (col_axpys)
            for j in range(n + 1):
                if j + ahead < n:     # the column's pieces and its neuron id, a few rows ahead
                    r = slots[j + ahead]
                    prefetch_row(B, r, down_at + c0, down_at + c1)
                    prefetch_row(B, r, down_at + h0, down_at + h1)
                    prefetch_row(B, r, 4 * s_neuron, 4 * s_neuron + 4)
                if j < n and coef[t, j] == np.float32(0.0):
                    continue
                neuron = np.int64(F[slots[j], s_neuron]) if j < n else -1
                g = col_group(kind, neuron) if j < n else -1
                if held and (g != group or held == COL_RUN_MAX):
                    col_axpys(y, B, rows, cs, held, down_at, lo, kind, first, S)
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


# ---------------------------------------------------------------------------------------------------------------
# Dense FFN over a whole layer (every neuron): the in-RAM path, where there is nothing to predict or look up. The
# layer's bundles are split once into two contiguous matrices (DenseLayer): [gate | up | biases] rows and down rows,
# without the bundles' 512-byte padding, so each pass streams only what it reads (the bundle layout made the
# coefficients ~30% slower than the same rows back to back, single thread). Decode (a row or two) is one Numba call
# per row; a prompt widens the rows to float32 one L2-sized block of neurons at a time and hands the three products
# to BLAS.


@dataclass(frozen=True, eq=False)
class DenseLayer:
    """One layer's FFN for QuantSparseFFN.dense: head uint8 [n, head_bytes] (gate and up rows, or up for MLP, then
    the float32 scalars: biases at bg / bu of its float32 view, a column's neuron id at `neuron`, -1: none) and down
    uint8 [n, row bytes of d weights]."""
    head: np.ndarray
    down: np.ndarray
    bg: int
    bu: int
    neuron: int = -1

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + self.down.nbytes


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


def dense_geometry(g) -> tuple[int, int]:
    """(offset of the scalars in a head row of QuantSparseFFN.dense_layer: after the gate and up rows, float32-aligned;
    bytes of the head row) for bundles of geometry g."""
    at = -(-g.offset("down") // 4) * 4
    return at, at + 4 * len(g.scalars)


def dense_row_bytes(g) -> int:
    """DRAM per neuron of QuantSparseFFN.dense_layer (what the budget counts for a resident FFN)."""
    return dense_geometry(g)[1] + g.vector_bytes("down")


class QuantSparseFFN(SparseFFN):
    """SparseFFN over quantized bundles (storage.format.pack_bundles): each vector in a kind of KINDS (gate, up and
    down each its own, as the geometry's vector_dtypes say), the rest as SparseFFN:

    ffn = QuantSparseFFN(BundleGeometry.of(4096, "q4_0", glu=True, down_dtype="q8_0"), act="relu")
    ffn(B, slots, x, y)  |  ffn.coefficients(B, slots, js, X, coef)  +  ffn.accumulate(B, slots, coef, Y)

    A down vector of columns (storage.columns: a GGUF's down kept exactly) needs its layer's scale tables,
    down_scales ({name: array}, FlashCheckpoint.down_scales; kept decoded, storage.columns.decode): such a kernel
    belongs to one layer.
    """
    DTYPES = KINDS

    def __init__(self, geometry, *args, down_scales: dict | None = None, **kw):
        super().__init__(geometry, *args, **kw)
        g = geometry
        self.kind, up = (quant_kind(g.dtype_of(v)) for v in (g.vectors[0], "up"))
        column = columns.kind_of(g.dtype_of("down"))
        self.down_kind = quant_kind(column or g.dtype_of("down"))
        if column and down_scales is None:
            raise ValueError("a down vector of columns needs its layer's scale tables (down_scales)")
        self.s_neuron = g.scalar_slot("neuron.down")     # columns: the bundle's neuron id (tables are by neuron)
        self.S = column_tables(down_scales if column else None, column, g.d)   # decoded for the run
        self.row_bytes, self.up_len = g.vector_bytes(g.vectors[0]), g.vector_bytes("up")
        self.vector_len, self.block_kind, self.up_kind = self.row_bytes, self.kind.code, up.code
        # the down pass's task: OUT_BLOCK outputs, or one block of the down's kind when that is longer (K-quants;
        # a column's elements stand alone)
        self.out_block = OUT_BLOCK if column else max(OUT_BLOCK, self.down_kind.weights)
        self._widened = None     # dense(): float32 blocks of a prompt's widened bundles, allocated on first use
        self._partial = np.empty((DOWN_PARTIALS, geometry.d), np.float32)  # dense(): the down pass's partial sums

    def _offset(self, vector: str) -> int:
        return self.geometry.offset(vector)      # bytes: the kernels read B as uint8

    def views(self, B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if B.dtype != np.uint8 or B.ndim != 2 or B.shape[1] != self.stride:
            raise UserError(f"bundle matrix must be uint8[rows, {self.stride}], got {B.dtype}{list(B.shape)}")
        return B, B.view(np.float32)

    def _rows_of_d(self, X: np.ndarray) -> None:
        if X.ndim != 2 or X.shape[1] != self.d or X.dtype != np.float32 or not X.flags.c_contiguous:
            raise UserError(f"expected C-contiguous float32[T, {self.d}], got {X.dtype}{list(X.shape)}")

    def _coefficients(self, W, F, slots, js, X, sel, coef, act_threshold) -> None:
        self._rows_of_d(X)       # the row kernels read as many weights as x has
        super()._coefficients(W, F, slots, js, X, sel, coef, act_threshold)

    def act8(self, X: np.ndarray) -> tuple:
        return act8_buffers(*X.shape, self.block_kind, self.up_kind)

    def _accumulate(self, W, F, slots, coef, Y) -> None:
        self._rows_of_d(Y)
        # tasks of whole out_blocks, as long as two per thread allow (up to DOWN_SPAN_OUTPUTS): each reads longer
        # pieces of every down row, in fewer passes over the set; an element's sum runs in slot order whatever the span
        blocks = max(1, min(DOWN_SPAN_OUTPUTS // self.out_block, self.d // (self.out_block * 2 * numba_threads())))
        quant_ffn_accumulate(W, F, slots, coef, Y, self.down_at, self.down_kind.code, self.down_kind.weights,
                             self.down_kind.block_bytes, self.out_block * blocks, self.s_neuron, self.S)

    def _dense_geometry(self) -> tuple[int, int]:
        return dense_geometry(self.geometry)

    def dense_layer(self, B: np.ndarray) -> DenseLayer:
        """A whole layer's bundles uint8 [n, stride] as the two contiguous matrices of dense() (copies: B can go)."""
        self.views(B)
        g, head_bytes = self.geometry, self.down_at
        at, row = self._dense_geometry()
        so = g.scalars_offset
        head = np.zeros((B.shape[0], row), np.uint8)
        head[:, :head_bytes] = B[:, :head_bytes]
        head[:, at:] = B[:, so:so + row - at]
        down = np.ascontiguousarray(B[:, head_bytes:head_bytes + g.vector_bytes("down")])
        slot = lambda name: at // 4 + g.scalars.index(name) if name in g.scalars else -1  # noqa: E731
        return DenseLayer(head, down, slot("bias.gate"), slot("bias.up"), slot("neuron.down"))

    def dense(self, layer: DenseLayer, X: np.ndarray, Y: np.ndarray) -> None:
        """Y[:] = the FFN of every neuron of `layer` (dense_layer) on X [T, d] (down bias not included)."""
        H, D, Hf = layer.head, layer.down, layer.head.view(np.float32)
        self._rows_of_d(X)
        self._rows_of_d(Y)
        n, T = H.shape[0], X.shape[0]
        if T <= DENSE_ROW_KERNEL_MAX_T:
            xa = act8_buffers(T, self.d, self.kind.code, self.up_kind)
            self._grow(n)
            for t in range(T):
                quant_dense_ffn_row(H, Hf, D, X, xa, t, Y[t], self.coef, self._partial, self.row_bytes, self.glu,
                                    self.act_code, self.relu_threshold, self.kind.code, layer.bg, layer.bu,
                                    self.down_kind.code, self.up_len, self.up_kind, layer.neuron, self.S)
            return
        # BLAS on x as its 8-bit blocks round it, for the kinds that have them (as quant.quant_matmul_t)
        xa = act8_of(X, self.kind.code, self.up_kind)
        Xf, Xu = act8_rounded(X, xa, self.kind.code), act8_rounded(X, xa, self.up_kind)
        d = self.d
        block = max(1, min(n, WIDEN_BLOCK_BYTES // (4 * d)))
        if self._widened is None or self._widened[0].shape[0] != block:
            self._widened = (np.empty((block, d), np.float32), np.empty((block, d), np.float32),
                             np.empty((block, d), np.float32), np.empty((block, 2), np.float32))
        G, U, Dw, bias = self._widened
        Y[:] = 0.0
        for lo in range(0, n, block):
            m = min(block, n - lo)
            dequantize_dense_layer(H, Hf, D, lo, G[:m], U[:m], Dw[:m], bias[:m], self.row_bytes, self.glu,
                                   self.kind.code, layer.bg, layer.bu, self.down_kind.code, self.up_len, self.up_kind,
                                   layer.neuron, self.S)
            a = (Xu if self.glu else Xf) @ U[:m].T                    # [T, m], then the coefficients in place
            coefficients_of_products(Xf @ G[:m].T if self.glu else a, a, bias[:m], self.glu, self.act_code,
                                     self.relu_threshold, 0, 1)
            Y += a @ Dw[:m]


def sparse_ffn(layout, layer: int = 0, down_scales=None, **kw) -> SparseFFN:
    """The sparse FFN kernel of a FlashLayout's bundles of layer `layer` (SparseFFN.from_layout's arguments);
    down_scales: per layer the down columns' scale tables (FlashCheckpoint.down_scales; None: a layout without)."""
    if not layout.quantized:
        return SparseFFN.from_layout(layout, layer=layer, **kw)
    tables = down_scales[layer] if down_scales is not None else None
    return QuantSparseFFN.from_layout(layout, layer=layer, down_scales=tables, **kw)


def sparse_ffns(layout, down_scales=None, **kw) -> list[SparseFFN]:
    """Per layer its sparse FFN kernel: one object per distinct bundle geometry (most layouts have one), one per
    layer when its down columns have tables of their own."""
    made: dict = {}
    key = lambda i, g: (g, i) if layout.columns else g  # noqa: E731
    return [made.setdefault(key(i, g), sparse_ffn(layout, layer=i, down_scales=down_scales, **kw))
            if key(i, g) not in made else made[key(i, g)] for i, g in enumerate(layout.geometries)]


# ---------------------------------------------------------------------------------------------------------------
# A dense FFN whose matrices are QuantMatrix in the checkpoint's orientation (a GGUF's: gate and up [n, d], down
# [d, n] in blocks along n): at decode one Numba call, both passes parallel, instead of three serial GEMVs and the
# activation's numpy ops in between.


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def dense_coefficients(Wg, Wu, X, xa, t, a, aa, lo, hi, glu, act, threshold, kind_g, kind_u):
    """The first pass of a quantized FFN on X[t] (xa: act8_buffers of X, row t filled, or empty), for neurons lo ..
    hi (whole blocks of the down rows): the coefficients a[j] from Wg[j] and Wu[j] (MLP: Wg is Wu; ffn.gating),
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
    """y = Wd @ a with a[j] the coefficient of neuron j from Wg[j].x and Wu[j].x (MLP: Wu[j].x; ffn.gating), x = x[t]
    (xa: act8_buffers of x: row t filled here, or empty; aa: 8-bit blocks of a, filled here, or empty). Two parallel
    passes of `tasks` tasks each: the coefficients of ranges of whole blocks of neurons (dense_coefficients, blocks of
    down_weights), then ranges of the down rows (ffn_down)."""
    quantize_act1(x[t], act8_row(xa, t))
    n, d = Wu.shape[0], Wd.shape[0]
    nb = n // down_weights
    for p in prange(tasks):
        dense_coefficients(Wg, Wu, x, xa, t, a, aa, p * nb // tasks * down_weights, (p + 1) * nb // tasks * down_weights,
                         glu, act, threshold, kind_g, kind_u)
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


def quant_ffn(x: np.ndarray, gate: QuantMatrix | None, up: QuantMatrix, down: QuantMatrix, act: str,
              relu_threshold: float) -> np.ndarray:
    """The FFN of the rows of x [T, d] over QuantMatrix weights without gate/up biases (down's bias not included):
    quant_ffn_row per row. act, relu_threshold: the model config's (ffn.gating.threshold_of). With set_act8 on, x
    and the coefficients are rounded to 8-bit blocks for the dot products of the kinds that have them."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, n = x.shape[0], up.shape[0]
    y = np.empty((T, down.shape[0]), np.float32)
    a = np.empty(n, np.float32)
    g = gate if gate is not None else up
    xa = act8_buffers(T, x.shape[1], g.kind, up.kind)
    aa = act8_row(act8_buffers(1, n, down.kind), 0)   # quant_ffn_row fills them, range by range
    kd = quant_kind(down.kind)
    for r in range(T):
        quant_ffn_row(g.q, up.q, down.q, x, xa, r, a, aa, y[r], DOWN_PARTIALS, gate is not None, act_code(act),
                      threshold_of(act, relu_threshold), quant_kind(g.kind).code, quant_kind(up.kind).code, kd.code,
                      kd.weights)
    return y


def quant_experts(S: np.ndarray, layout, X: np.ndarray, rows, slots, dest, O: np.ndarray, act: str,
                  relu_threshold: float) -> None:
    """O[dest[q]] = the FFN of the expert in row slots[q] of S (uint8 [slots, layout.chunk]: storage.experts'
    chunks, every matrix in a block format) on X[rows[q]] (float32 [T, d]), every pair q in one kernel call
    (quant_experts_rows): each pair's bits are quant_ffn's on that expert's matrices. layout: an ExpertLayout."""
    rows, slots, dest = (np.asarray(v, np.int64) for v in (rows, slots, dest))
    kg, ku, kd = (quant_kind(t) for t in layout.dtypes)
    at_g, at_u, at_d, _ = layout.matrix_offsets
    A = np.empty((len(rows), layout.n), np.float32)
    X = np.ascontiguousarray(X, dtype=np.float32)
    xa, aa = act8_of(X, kg.code, ku.code), act8_buffers(len(rows), layout.n, kd.code)
    tasks = 0 if len(rows) >= numba_threads() else EXPERT_TASKS
    quant_experts_rows(S, X, xa, rows, slots, dest, A, aa, O, tasks, at_g, at_u, at_d, layout.n,
                       act_code(act), threshold_of(act, relu_threshold), kg.code, ku.code, kd.code,
                       layout.row_bytes("gate"), layout.row_bytes("up"), layout.row_bytes("down"), kd.weights)
