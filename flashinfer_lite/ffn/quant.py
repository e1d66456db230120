"""The FFN over weights in GGUF's block formats (storage/blocks.py; their row kernels: flashinfer_lite.kernels.blocks).

QuantSparseFFN: ffn.sparse.SparseFFN over bundles whose gate, up and down vectors are quantized rows along d, each
vector in its own block format (the bundle's geometry as storage.format.BundleGeometry says: blocks in place of
elements). Its dense() computes a whole layer in RAM (DenseLayer, ffn.resident.ResidentFFN). quant_ffn: the dense
FFN over a GGUF's QuantMatrix weights.
The gate and up products (and quant_ffn's down products, rows along n) round x (the coefficients) to 8 bits where the
kind has an 8-bit dot product (blocks.set_act8); the rest is float32 on the dequantized weights.
The kernels: kernels.neurons.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from storage import columns
from storage.errors import UserError

from ..kernels.blocks import (KINDS, QuantMatrix, act8_buffers, act8_of, act8_rounded, act8_row, column_tables,
                              quant_kind)
from ..kernels.gemv import WIDEN_BLOCK_BYTES
from ..kernels.neurons import (DOWN_PARTIALS, EXPERT_TASKS, OUT_BLOCK, act_code, down_span,
                               coefficients_of_products, dequantize_dense_layer, quant_dense_ffn_row,
                               quant_experts_rows, quant_ffn_accumulate, quant_ffn_row, threshold_of)
from ..threads import numba_threads
from .sparse import SparseFFN

# QuantSparseFFN.dense: up to this many rows, the row kernel per row (the layer's blocks read once per row); more
# (a prompt): widened blocks + BLAS, which read them once for all rows
DENSE_ROW_KERNEL_MAX_T = 2


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
        quant_ffn_accumulate(W, F, slots, coef, Y, self.down_at, self.down_kind.code, self.down_kind.weights,
                             self.down_kind.block_bytes, down_span(self.out_block, self.d), self.s_neuron, self.S)

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
        # BLAS on x as its 8-bit blocks round it, for the kinds that have them (as blocks.quant_matmul_t)
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


def quant_ffn(x: np.ndarray, gate: QuantMatrix | None, up: QuantMatrix, down: QuantMatrix, act: str,
              relu_threshold: float) -> np.ndarray:
    """The FFN of the rows of x [T, d] over QuantMatrix weights without gate/up biases (down's bias not included):
    quant_ffn_row per row. act, relu_threshold: the model config's (kernels.neurons.threshold_of). With set_act8 on, x
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
