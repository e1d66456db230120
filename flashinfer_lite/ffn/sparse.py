"""SparseFFN: the sparse FFN's kernels (kernels.neurons) bound to one bundle geometry: only the listed neurons' rows
are touched.

A bundle matrix B is uint8[rows, stride]; row r holds one neuron, laid out as its storage.format.BundleGeometry says:
  GLU: [gate_i | up_i | down_i], MLP (OPT): [up_i (fc1 row) | down_i (fc2 column)], each d values of the storage
  dtype (float32, float16, int8; the block formats: ffn.quant), then float32 scalars (int8 scales per vector,
  then bias_gate, bias_up).

  GLU: y = sum_j act(gate_j.x + bg_j) * (up_j.x + bu_j) * down_j     MLP: y = sum_j act(up_j.x + bu_j) * down_j
with act and its threshold as kernels.neurons says. The per-output down bias is not in the bundles: the caller adds it.

One summation order (kernels.neurons): a caller may split a set into pieces and accumulate them one after the other
into the same y, bit-identical to one call over the whole set (the runtime relies on this: budget, overlap, pieces and
prefill streaming all give the same output, tests/test_kernels.py).
"""
from __future__ import annotations

import numpy as np

from storage.errors import UserError
from storage.format import BundleGeometry

from ..kernels.blocks import act8_buffers
from ..kernels.neurons import ACT_DRELU, act_code, ffn_accumulate, ffn_coefficients, threshold_of

STORAGE_VIEWS = {"f32": np.float32, "f16": np.uint16, "int8": np.int8}  # dtype name -> view of B the kernel reads


# ---------------------------------------------------------------------------------------------------------------
# Python entry point: geometry bound once, scratch allocated once, no allocation per call.


class SparseFFN:
    """The sparse FFN of one bundle geometry. Create once; call per layer per token.

    ffn = SparseFFN(layout.geometry, act="relu")      # or SparseFFN.from_layout(layout): the model's act
    ffn(B, slots, x, y)   # y[:] = sum over slots of the neuron outputs (down bias not included)

    In two steps, for a caller that overlaps reads with compute or computes a set in pieces:
    ffn.coefficients(B, slots, js, X, coef)   # coef[:, js] for rows slots[js] (js: any subset, any time)
    ffn.accumulate(B, slots, coef, Y)         # Y += the neurons' outputs, in the order of slots

    relu_threshold: the gate threshold (None: kernels.neurons.threshold_of the activation). Subclasses for other bundle
    encodings (ffn.quant.QuantSparseFFN) replace DTYPES, views and the two kernel calls.
    """
    DTYPES = STORAGE_VIEWS

    def __init__(self, geometry: BundleGeometry, act: str, relu_threshold: float | None = None, max_active: int = 0):
        g = geometry
        if g.dtype not in self.DTYPES:
            raise UserError(f"unsupported FFN storage dtype {g.dtype!r} (expected one of {sorted(self.DTYPES)})")
        self.act_code = act_code(act)
        if self.act_code == ACT_DRELU and not g.glu:
            raise UserError("dReLU needs a gated (GLU) FFN")
        self.geometry, self.d, self.dtype, self.glu, self.act, self.stride = g, g.d, g.dtype, g.glu, act, g.stride
        self.relu_threshold = threshold_of(act, None) if relu_threshold is None else np.float32(relu_threshold)
        first = g.vectors[0]     # gate (GLU) or up (MLP)
        self.s_first, self.s_up, self.s_down = (g.scalar_slot(f"scale.{v}") for v in (first, "up", "down"))
        self.bg, self.bu = g.scalar_slot("bias.gate"), g.scalar_slot("bias.up")
        self.up_at, self.down_at = self._offset("up"), self._offset("down")
        # coefficient's n and kind of the first and the up vector: d elements, no block format
        self.vector_len, self.block_kind, self.up_len, self.up_kind = g.d, 0, g.d, 0
        self.head_bytes = g.offset("down")
        self.coef = np.zeros(max(max_active, 1), np.float32)  # per-call activation coefficients
        self._ones = np.ones(max(max_active, 1), np.uint8)     # "every listed neuron is selected"
        self._positions = np.arange(max(max_active, 1), dtype=np.int64)

    @classmethod
    def from_layout(cls, layout, act: str | None = None, relu_threshold: float | None = None, layer: int = 0,
                    **kw) -> "SparseFFN":
        """Bound to a storage.format.FlashLayout's geometry (of layer `layer`: a layout may mix block formats from
        layer to layer); act and the threshold default to the model config's."""
        act = act or layout.config["act"]
        if relu_threshold is None:
            relu_threshold = threshold_of(act, layout.config.get("relu_threshold"))
        return cls(layout.geometry_of(layer), act, relu_threshold=relu_threshold, **kw)

    def views(self, B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(typed weight view, float32 scalar view) of a bundle matrix uint8[rows, stride]."""
        if B.dtype != np.uint8 or B.ndim != 2 or B.shape[1] != self.stride:
            raise UserError(f"bundle matrix must be uint8[rows, {self.stride}], got {B.dtype}{list(B.shape)}")
        return B.view(STORAGE_VIEWS[self.dtype]), B.view(np.float32)

    def _offset(self, vector: str) -> int:
        """A vector's offset in a row of views(B)[0]: elements of the storage dtype."""
        return self.geometry.offset(vector) // np.dtype(STORAGE_VIEWS[self.dtype]).itemsize

    def _grow(self, n: int) -> None:
        """Scratch grows once to the largest set seen, then is reused."""
        if self.coef.shape[0] < n:
            self.coef = np.zeros(n, np.float32)
            self._ones = np.ones(n, np.uint8)
            self._positions = np.arange(n, dtype=np.int64)

    def coefficients(self, B: np.ndarray, slots: np.ndarray, js: np.ndarray | None, X: np.ndarray, coef: np.ndarray,
                     sel: np.ndarray | None = None, act_threshold: float = -1.0) -> None:
        """coef[t, j] (float32[T, >= len(slots)]) = coefficient of bundle row slots[j] on X[t] (float32[T, d]) for
        j in js (int64; None: all), 0 where sel[t, j] (uint8[T, >= len(slots)]; None: all selected) is 0 or the
        neuron did not fire (ReLU / FATReLU, or |coefficient| <= act_threshold as SwiGLU thresholds calibrate)."""
        W, F = self.views(B)
        n = len(slots)
        self._grow(n)
        if js is None:
            js = self._positions[:n]
        if sel is None:
            if X.shape[0] != 1:
                raise ValueError("sel is required for more than one row")
            sel = self._ones[None, :n]
        self._coefficients(W, F, slots, js, X, sel, coef, np.float32(act_threshold))

    def _coefficients(self, W, F, slots, js, X, sel, coef, act_threshold) -> None:
        ffn_coefficients(W, F, slots, js, X, self.act8(X), sel, coef, self.vector_len, self.glu, self.act_code,
                         self.relu_threshold,
                         self.up_at, self.s_first, self.s_up, self.bg, self.bu, self.block_kind, self.up_len,
                         self.up_kind, self.head_bytes, act_threshold)

    def act8(self, X: np.ndarray) -> tuple:
        """Room for X's 8-bit blocks, which ffn_coefficients fills (blocks.act8_buffers): none for float rows."""
        return act8_buffers(*X.shape)

    def accumulate(self, B: np.ndarray, slots: np.ndarray, coef: np.ndarray, Y: np.ndarray) -> None:
        """Y[t] += sum of coef[t, j] * down(slots[j]) over j in order (Y float32[T, d])."""
        W, F = self.views(B)
        self._accumulate(W, F, slots, coef, Y)

    def _accumulate(self, W, F, slots, coef, Y) -> None:
        ffn_accumulate(W, F, slots, coef, Y, self.d, self.down_at, self.s_down)

    def __call__(self, B: np.ndarray, slots: np.ndarray, x: np.ndarray, y: np.ndarray,
                 coef: np.ndarray | None = None, act_threshold: float = -1.0) -> np.ndarray:
        """y[:] = sparse FFN of x over bundle rows `slots`; coef (float32[>= len(slots)]), if given, receives each
        neuron's coefficient, so `coef != 0` is the set that actually fired (after ReLU / FATReLU, and after the
        act_threshold: a neuron with |coefficient| <= act_threshold is skipped, as SwiGLU thresholds calibrate)."""
        n = len(slots)
        self._grow(n)
        c = (self.coef if coef is None else coef)[None, :n]
        y[:] = 0.0
        self.coefficients(B, slots, None, x[None, :], c, act_threshold=act_threshold)
        self.accumulate(B, slots, c, y[None, :])
        return y
