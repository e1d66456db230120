"""SplitKernels: ffn.sparse's two kernels bound to the split layout's rows (storage.format.SPLIT_PARTS), per layer,
for ffn.gate.GateFFN: the coefficients over gate|up rows, the down sum over down rows."""
from __future__ import annotations

import numpy as np

from storage import columns
from ..kernels.blocks import K_KINDS, KINDS, act8_buffers, column_tables
from ..kernels.neurons import (OUT_BLOCK, act_code, ffn_accumulate, ffn_coefficients, quant_ffn_accumulate,
                               quant_ffn_accumulate_rows, quant_gate_coefficients, threshold_of)
from .sparse import STORAGE_VIEWS


class SplitKernels:
    """The two kernels of ffn.sparse over the split layout's rows, per layer (a Q4_K_M GGUF's layers mix block
    formats): coefficients over gate|up rows, the down sum over down rows."""

    def __init__(self, gate_up, down, act: str, relu_threshold, down_scales=None):
        shared: dict = {}       # layers without scale tables share their geometry's (an MoE's regions: 1000s)

        def rows(i: int) -> SplitRows:
            tables = down_scales[i] if down_scales is not None else None
            key = i if tables is not None else (gate_up.dtypes_of(i), down.dtypes_of(i))
            if key not in shared:
                shared[key] = SplitRows(gate_up.geometry_of(i), down.geometry_of(i), act, relu_threshold, tables,
                                        gate_up.quantized)
            return shared[key]
        self.layers = [rows(i) for i in range(gate_up.n_layers)]

    def coefficients(self, H: np.ndarray, X: np.ndarray, coef: np.ndarray, act_threshold: float, layer: int) -> None:
        self.layers[layer].coefficients(H, X, coef, act_threshold)

    def accumulate(self, D: np.ndarray, slots: np.ndarray, coef: np.ndarray, Y: np.ndarray, layer: int) -> None:
        self.layers[layer].accumulate(D, slots, coef, Y)


class SplitRows:
    """One layer's rows: the kernels' offsets and scalar slots from the parts' BundleGeometry (gu: gate|up, dn: down)
    and, for down columns, the layer's scale tables."""

    def __init__(self, gu, dn, act: str, relu_threshold, tables, quantized: bool):
        self.gu, self.dn, self.quantized = gu, dn, quantized
        self.act = act_code(act)
        self.threshold = threshold_of(act, relu_threshold)
        g = self.gu
        if self.quantized:
            self.kind, self.up_kind = KINDS[g.dtype_of("gate")].code, KINDS[g.dtype_of("up")].code
            self.n, self.up_n, self.up_at = g.vector_bytes("gate"), g.vector_bytes("up"), g.offset("up")
            column = columns.kind_of(self.dn.dtype_of("down"))
            self.down_kind = KINDS[column or self.dn.dtype_of("down")]
            # a task covers whole blocks (as QuantSparseFFN); a column's elements stand alone
            self.out_block = OUT_BLOCK if column else max(OUT_BLOCK, self.down_kind.weights)
            if column and tables is None:
                raise ValueError("down columns need their layers' scale tables (down_scales)")
            self.S = column_tables(tables if column else None, column, self.dn.d)
        else:
            size = np.dtype(STORAGE_VIEWS[g.dtype]).itemsize
            self.kind, self.n, self.up_at = 0, g.d, g.offset("up") // size
            self.up_kind, self.up_n = 0, g.d
        self.s_gate, self.s_up = g.scalar_slot("scale.gate"), g.scalar_slot("scale.up")
        self.bg, self.bu = g.scalar_slot("bias.gate"), g.scalar_slot("bias.up")
        self.s_down, self.s_neuron = self.dn.scalar_slot("scale.down"), self.dn.scalar_slot("neuron.down")

    def _view(self, B: np.ndarray, dtype: str) -> np.ndarray:
        return B if self.quantized else B.view(STORAGE_VIEWS[dtype])

    def coefficients(self, H: np.ndarray, X: np.ndarray, coef: np.ndarray, act_threshold: float) -> None:
        """coef[t, j] = the coefficient of gate|up row j (H uint8 [n, stride]) on X[t], 0 where |c| <= act_threshold.
        Gate and up in block kinds with 8-bit dot products (all of them, with set_act8 on): quant_gate_coefficients,
        for one row (decode) as for a prompt's many, so a token's bits do not depend on the rows it came with (the
        prefill chunk)."""
        n = H.shape[0]
        if self.quantized:
            xa = act8_buffers(*X.shape, self.kind, self.up_kind)
            if all(xa[4 if k in K_KINDS else 0].shape[1] for k in (self.kind, self.up_kind)):  # x's blocks for both
                quant_gate_coefficients(H, H.view(np.float32), X, xa, coef, self.n, self.up_at, self.up_n, self.kind,
                                        self.up_kind, self.act, self.threshold, self.s_gate, self.s_up, self.bg,
                                        self.bu, np.float32(act_threshold))
                return
        ones = np.ones((X.shape[0], n), np.uint8)
        ffn_coefficients(self._view(H, self.gu.dtype), H.view(np.float32), np.arange(n, dtype=np.int32),
                         np.arange(n, dtype=np.int64), X, act8_buffers(*X.shape, self.kind, self.up_kind)
                         if self.quantized else act8_buffers(*X.shape), ones, coef, self.n, True, self.act,
                         self.threshold,
                         self.up_at, self.s_gate, self.s_up, self.bg, self.bu, self.kind, self.up_n, self.up_kind,
                         self.gu.stride, np.float32(act_threshold))

    def accumulate(self, D: np.ndarray, slots: np.ndarray, coef: np.ndarray, Y: np.ndarray) -> None:
        """Y[t] += sum over j in order of coef[t, j] * down row slots[j] of D (uint8 [rows, stride])."""
        if self.quantized:
            # a prompt's rows: each down piece decoded once for many rows, with the bits of one row alone
            kernel = quant_ffn_accumulate_rows if Y.shape[0] > 1 else quant_ffn_accumulate
            kernel(D, D.view(np.float32), slots, coef, Y, 0, self.down_kind.code, self.down_kind.weights,
                   self.down_kind.block_bytes, self.out_block, self.s_neuron, self.S)
        else:
            ffn_accumulate(self._view(D, self.dn.dtype), D.view(np.float32), slots, coef, Y, self.dn.d, 0,
                           self.s_down)
