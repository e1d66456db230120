"""FlashFFN: the FFN of every layer from flash, one class: a selector (which neurons, and where their coefficients
come from) times a row source (the neuron cache, or the layer read whole as a stream). An FFNFn (model.py).

Selectors:
  Predicted   the predictor, the oracle or a replayed trace names the neurons; their bundles (gate, up and down
              together) are read and the coefficients computed on the rows read (ffn.sparse's kernels)
  ExactGate   every neuron's coefficient act(gate.x) * up.x from its gate|up row (kept in DRAM; a layer whose rows do
              not fit the budget is read as one sequential stream), the calibrated magnitude threshold (|c| <= t: the
              neuron does not count); only the down rows of the neurons that clear it are read (SplitKernels).
              No predictor: the set is the thresholded model's own, so the output is one function of x
              whatever the budget.
Per layer and token: the selector, a cache lookup, one batched read of the misses straight into their cache rows, and
the sum over those rows. A prompt of many tokens touches most neurons, so prefill can instead stream each layer's rows
with large sequential reads; FlashFFN picks whichever moves fewer bytes (and the exact gate also streams a decoded
token's down rows when the cache cannot hold the layer anyway).

Why gate AND up in DRAM for the exact gate (docs/PREDICTORS.md, bench/exact_gate.py): on SmolLM2 a gate-only score
(CATS) costs +15% perplexity at 40% of the neurons dropped, the product |act(g) * u| +1.5%; the product needs the up
row, and with both rows resident only the down row (a third of a bundle's weights) is read for the neurons that count.

One summation order (kernels.neurons): the coefficients are per neuron, computed by the same kernel for any T; the
down rows are added in bundle order, whatever the cache holds, the pieces or the prefill strategy. A GGUF's down
columns (8-bit activations on) are summed in integers on the coefficients rounded to 8 bits per block of neurons
(SplitRows.begin), exact whatever the order, and converted to float once per block, in block order.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from storage import columns
from storage.checksums import drop_from_page_cache
from storage.config import ModelConfig
from storage.errors import UserError
from storage.profile import stream_settings, stream_shape
from storage.reader import BundleReader, FlashStats, RowStream, bundle_reader

from ..kernels.blocks import ACT8, INT8_KINDS, K_KINDS, KINDS, Q6_K, act8_buffers, column_tables, quantize_act_rows
from ..kernels.neurons import (GATE_DOWN_ROWS, OUT_BLOCK, act_code, down_span, ffn_accumulate, ffn_coefficients,
                               gate_coefficients_for, gate_down_finish, gate_down_for, quant_ffn_accumulate,
                               quant_ffn_accumulate_rows, threshold_of)
from ..neuron_cache import NeuronCache, staging_rows
from ..threads import beside_reads
from .quant import sparse_ffns
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
                                        gate_up.quantized, order=down.order[i])
            return shared[key]
        self.layers = [rows(i) for i in range(gate_up.n_layers)]

    def coefficients(self, H: np.ndarray, X: np.ndarray, coef: np.ndarray, act_threshold: float, layer: int) -> None:
        self.layers[layer].coefficients(H, X, coef, act_threshold)

    def accumulate(self, D: np.ndarray, slots: np.ndarray, coef: np.ndarray, Y: np.ndarray, layer: int) -> None:
        self.layers[layer].accumulate(D, slots, coef, Y)

    def begin(self, coef: np.ndarray, layer: int) -> None:
        self.layers[layer].begin(coef)

    def finish(self, Y: np.ndarray, layer: int) -> None:
        self.layers[layer].finish(Y)


class SplitRows:
    """One layer's rows: the kernels' offsets and scalar slots from the parts' BundleGeometry (gu: gate|up, dn: down)
    and, for down columns, the layer's scale tables."""

    def __init__(self, gu, dn, act: str, relu_threshold, tables, quantized: bool, order=None):
        self.gu, self.dn, self.quantized = gu, dn, quantized
        # bundle b holds neuron order[b]; None or the identity: neuron b (begin's carried blocks need ascending neurons)
        self.order = None if order is None or np.array_equal(order, np.arange(len(order))) else np.asarray(order)
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
            self.down_columns = column is not None
        else:
            size = np.dtype(STORAGE_VIEWS[g.dtype]).itemsize
            self.kind, self.n, self.up_at = 0, g.d, g.offset("up") // size
            self.up_kind, self.up_n = 0, g.d
            self.down_columns = False
        self._ints = None    # begin's rounded coefficients and the down sum's integer state, until finish
        self._row = None     # begin's 8-bit buffers for one row, kept for the next token
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
                gate_coefficients_for(self.kind, self.up_kind)(
                    H, H.view(np.float32), X, xa, coef, self.n, self.up_at, self.up_n, self.act, self.threshold,
                    self.s_gate, self.s_up, self.bg, self.bu, np.float32(act_threshold))
                return
        ones = np.ones((X.shape[0], n), np.uint8)
        ffn_coefficients(self._view(H, self.gu.dtype), H.view(np.float32), np.arange(n, dtype=np.int32),
                         np.arange(n, dtype=np.int64), X, act8_buffers(*X.shape, self.kind, self.up_kind)
                         if self.quantized else act8_buffers(*X.shape), ones, coef, self.n, True, self.act,
                         self.threshold,
                         self.up_at, self.s_gate, self.s_up, self.bg, self.bu, self.kind, self.up_n, self.up_kind,
                         self.gu.stride, np.float32(act_threshold))

    def begin(self, coef: np.ndarray) -> None:
        """A layer's down sum starts, over coef [T, n] (every neuron's coefficient, bundle order): with down columns
        and 8-bit activations on, the coefficients are rounded to the 8-bit blocks the dense path gives its down GEMV
        (act8_buffers of the down's kind: q8_K per 256 neurons for the K-quants, q8_0 per 32 for the others), by
        blocks of neurons whatever the bundles' order, and the pieces accumulate integers
        (kernels.neurons.gate_down_ints) until finish. Otherwise nothing: the float32 sum."""
        self._ints = None
        if not self.down_columns:
            return
        T, n = coef.shape
        code = self.down_kind.code
        if T == 1 and self._row is not None and self._row[0] == (n, ACT8[0]):
            xa = self._row[1]           # a decoded token's: the buffers of the last one
        else:
            xa = act8_buffers(T, n, code)
            if T == 1:
                self._row = ((n, ACT8[0]), xa)
        q, part = (0, 1) if code in INT8_KINDS else (4, 5)
        if not xa[q].shape[1]:
            return                      # 8-bit activations off: the float32 sum
        if self.order is not None:      # rounded by the blocks of neurons, whatever the bundles' order
            by_neuron = np.empty_like(coef)
            by_neuron[:, self.order] = coef
            coef = by_neuron
        quantize_act_rows(np.ascontiguousarray(coef), xa)
        block, sub = (256, 16 if code == Q6_K else 32) if code not in INT8_KINDS else (32, 32)
        KQ = xa[q]
        KS = KQ.reshape(T, n // sub, sub).sum(axis=2, dtype=np.int32)
        d = self.dn.d
        # a permuted layout's slots come in any neuron order: every block's sums kept to the end (T x blocks x d)
        ACC = np.zeros((T, n // block if self.order is not None else 0, d), np.int32)
        fired = KQ.reshape(T, n // block, block).any(axis=2) if self.order is not None else np.zeros((T, 0), bool)
        self._ints = (KQ, xa[part], KS, np.zeros((T, d), np.int32), np.full(T, -1, np.int64), np.full(T, -1, np.int64),
                      ACC, fired)

    def finish(self, Y: np.ndarray) -> None:
        """Y[t] += what begin's integer sums still carry: the layer's down sum complete (nothing for the float one)."""
        if self._ints is not None:
            KQ, XD, KS, carry, cb, _, ACC, fired = self._ints
            gate_down_finish(Y, carry, cb, self.down_kind.code, self.S, XD, KS, ACC, fired)
            self._ints = None

    def accumulate(self, D: np.ndarray, slots: np.ndarray, coef: np.ndarray, Y: np.ndarray) -> None:
        """Y[t] += sum over j in order of coef[t, j] * down row slots[j] of D (uint8 [rows, stride]); between begin
        and finish, in integers (begin) over the slots whose coefficient is not 0, ascending within and across the
        calls (any order in a permuted layout)."""
        if self._ints is not None:
            KQ, XD, KS, carry, cb_in, cb_out, ACC, fired = self._ints
            k = self.down_kind
            gate_down_for(k.code)(D, D.view(np.float32), slots, coef, KQ, XD, KS, Y, carry, cb_in, cb_out, 0,
                                  down_span(self.out_block, self.dn.d), self.s_neuron, self.S,
                                  GATE_DOWN_ROWS if Y.shape[0] > 1 else 1, ACC)
            self._ints = (KQ, XD, KS, carry, cb_out, cb_in, ACC, fired)      # the blocks carried, for the next piece
            return
        if self.quantized:
            # a prompt's rows: each down piece decoded once for many rows, with the bits of one row alone
            rows = Y.shape[0] > 1
            kernel = quant_ffn_accumulate_rows if rows else quant_ffn_accumulate
            kernel(D, D.view(np.float32), slots, coef, Y, 0, self.down_kind.code, self.down_kind.weights,
                   self.down_kind.block_bytes, self.out_block if rows else down_span(self.out_block, self.dn.d),
                   self.s_neuron, self.S)
        else:
            ffn_accumulate(self._view(D, self.dn.dtype), D.view(np.float32), slots, coef, Y, self.dn.d, 0,
                           self.s_down)


class Predicted:
    """Selector: select(layer, x [T, d]) -> bool [T, n_neurons] by original neuron id, the neurons to compute (the
    predictor, the oracle, or a replayed trace); their coefficients come from the bundle rows read.
    predictors: the PredictorSet of the FLASHDIR, if any: its neuron frequencies choose the pinned hot neurons and its
    act_threshold (per layer) is the SwiGLU magnitude under which a computed neuron counts as not fired."""
    coefficients_first = False

    def __init__(self, cfg: ModelConfig, layout, select, predictors=None):
        self.cfg, self.layout, self.select, self.predictors = cfg, layout, select, predictors
        self.bundle_of = layout.bundle_of    # selections speak original neuron ids, the cache bundle ids
        self.act_threshold = [predictors.act_threshold(i) if predictors is not None else 0.0
                              for i in range(cfg.n_layers)]

    def freq(self) -> list[np.ndarray] | None:
        """Per layer the neurons' activation frequencies in bundle order (they choose the pinned hot rows), if known."""
        if self.predictors is None:
            return None
        return [self.predictors.neuron_freq(i)[self.layout.order[i]] for i in range(self.cfg.n_layers)]


class ExactGate:
    """Selector: every neuron's coefficient from the gate|up rows (layout.parts["gate_up"]), 0 where it does not clear
    its layer's threshold (calibration: storage.gate_file.GateCalibration, whose neuron frequencies choose the pinned
    hot rows). resident_layers: how many layers, from the first, keep their gate|up rows in DRAM (the rest are read
    as a stream, with its chunks in flight while one is computed). kernels: the split layout's SplitKernels."""
    coefficients_first = True

    def __init__(self, cfg: ModelConfig, layout, plan, calibration, kernels: SplitKernels, stats: FlashStats,
                 resident_layers: int | None = None, threads: int | None = None):
        self.cfg, self.kernels, self.stats = cfg, kernels, stats
        self.gate_up = layout.parts["gate_up"]
        self.thresholds = list(calibration.thresholds)
        self.calibration = calibration
        k = plan.gate_layers if resident_layers is None else resident_layers
        self.heads = [self._read_gate_up(i) if i < k else None for i in range(cfg.n_layers)]
        st = stream_settings(layout)
        self.gate_up_reader = BundleReader(self.gate_up, threads=threads) if k < cfg.n_layers else None
        # one stream over every streamed layer: its buffers go on to the next streamed layer as they free up
        self.gate_up_stream = RowStream(self.gate_up_reader, *stream_shape(self.gate_up, st.chunk_bytes, st.depth),
                                        follow=self._next_streamed) if self.gate_up_reader else None
        self.observe = None     # observe(layer, coef [T, n]): calibration's view of every coefficient

    def freq(self) -> list[np.ndarray]:
        """Per layer the share of calibration tokens each neuron counted in (they choose the pinned hot rows)."""
        return list(self.calibration.freq)

    @property
    def resident_layers(self) -> int:
        return sum(h is not None for h in self.heads)

    def _read_gate_up(self, layer: int, dest: np.ndarray | None = None) -> np.ndarray:
        """Layer `layer`'s gate|up rows uint8 [n, stride]: one sequential read of its region (into dest if given),
        its pages dropped from the page cache behind it (the rows live in DRAM as this array, not twice)."""
        G = self.gate_up
        out = np.empty((G.n_neurons[layer], G.stride), np.uint8) if dest is None else dest
        with open(G.ffn_path, "rb") as f:
            got = os.preadv(f.fileno(), [out], G.offset[layer])
            drop_from_page_cache(f.fileno(), G.offset[layer], out.nbytes)
        if got != out.nbytes:
            raise UserError(f"{G.ffn_path}: short read of layer {layer}: the file is truncated; re-run convert")
        return out

    def coefficients(self, layer: int, x: np.ndarray) -> np.ndarray:
        """coef float32 [T, n] in bundle order: every neuron's coefficient, 0 where it did not clear the threshold.
        A layer whose gate|up rows are not resident: chunk by chunk as they are read (a neuron's coefficient is its
        own row's, so the bits are the resident layer's)."""
        H = self.heads[layer]
        if H is not None:
            coef = np.empty((x.shape[0], H.shape[0]), np.float32)
            t0 = time.perf_counter()
            self.kernels.coefficients(H, x, coef, self.thresholds[layer], layer)
            self.stats.compute_s += time.perf_counter() - t0
            return coef
        coef = np.empty((x.shape[0], self.gate_up.n_neurons[layer]), np.float32)
        part = np.empty((x.shape[0], self.gate_up_stream.rows), np.float32)
        for start, H, rs, waited in self.gate_up_stream.chunks(layer):
            m = H.shape[0]
            self.stats.read_s += waited
            self.stats.io_s += rs.io_s
            self.stats.read_bytes += rs.read_bytes
            t0 = time.perf_counter()
            self.kernels.coefficients(H, x, part[:, :m], self.thresholds[layer], layer)
            coef[:, start:start + m] = part[:, :m]
            self.stats.compute_s += time.perf_counter() - t0
        self.gate_up_stream.prime(self._next_streamed(layer))
        return coef

    def _next_streamed(self, layer: int) -> int:
        """The layer after `layer` whose gate|up rows are not resident (the next token's first, after the last)."""
        n = self.cfg.n_layers
        return next(i % n for i in range(layer + 1, layer + 1 + n) if self.heads[i % n] is None)


class FlashFFN:
    """The FFN of every layer from flash: `selector` (Predicted or ExactGate) times the rows of `layout` (the bundles,
    or the split layout's down rows) through the neuron cache or read whole; build it with FlashFFN.predicted or
    FlashFFN.exact_gate.

    plan: the budget.BudgetPlan that sizes the neuron cache (window rows, hot bytes, window tokens).
    kernels: per layer the kernels over the rows (ffn.sparse.SparseFFN-s; the exact gate: ffn.flash.SplitRows-es).
    down_bias: per layer the FFN down bias (resident; None where the model has none).
    overlap: compute on the cached rows while the misses are read (False: read, then compute; for measuring).
    lookahead(layer, x [1, d]) -> bool [1, n_neurons]: a guess of `layer`'s set from the previous layer's FFN input
    x, so its reads start one layer early (Deja Vu); the exact set still decides, a wrong guess costs only bytes.
    """

    def __init__(self, cfg: ModelConfig, layout, plan, selector, kernels: list, stats: FlashStats, reader, streams,
                 down_bias=None, overlap: bool = True, lookahead=None, verbose: bool = False, reads=None):
        self.cfg, self.layout, self.plan, self.selector, self.kernels = cfg, layout, plan, selector, kernels
        self.verbose, self.overlap, self.lookahead = verbose, overlap, lookahead
        self.stats, self.reader = stats, reader
        self.down_bias = list(down_bias) if down_bias is not None else [None] * cfg.n_layers
        # reads: the exact gate's reads planned for time on this device (budget.TokenReads): it pins the hot rows and
        # says per layer whether a token's down rows stream or are read sparse
        self.reads = reads
        if reads is not None:
            hot = list(reads.pinned) if plan.hot_bytes else None
        else:
            freq = selector.freq() if plan.hot_bytes else None
            hot = plan.hot_neurons(freq) if freq is not None else None
        if verbose and self.reads is not None:
            print(self.reads.describe(), file=sys.stderr)
        self.cache = NeuronCache(layout.n_neurons, layout.stride, self.reader, capacity=plan.window_rows,
                                 window=plan.window, hot=hot,
                                 staging_rows=staging_rows(plan.max_active) if lookahead else 0, stats=self.stats)
        self._coef = np.zeros(max(layout.n_neurons), np.float32)   # one piece's coefficients
        # streaming's buffers (counted in the plan's buffers): streams, the device's storage.profile.StreamSettings
        # the exact gate's down rows: one stream over the layers the plan streams (prefill streams without follow)
        follow = (lambda layer: self.reads.following("down", layer)) if self.reads is not None else None
        self.stream = RowStream(self.reader, *stream_shape(layout, streams.chunk_bytes, streams.depth), follow=follow)
        self.streamed = [False] * cfg.n_layers    # exact gate, per layer: were its down rows read whole last time
        self._pass_lookups = 0   # hits + misses when the current forward pass began
        self._pass_streamed = False
        # the rows are decoded tokens of several sequences (model.Transformer.forward_batch), not a prompt's: the
        # exact gate reads their union's down rows as a decoded token's, and the bytes count as decode reads
        self.decoding = False

    @property
    def predictors(self):
        """The PredictorSet the selector asks (Predicted's, if it has one), else None."""
        return getattr(self.selector, "predictors", None)

    @classmethod
    def predicted(cls, cfg: ModelConfig, layout, plan, select, predictors=None, down_bias=None,
                  threads: int | None = None, overlap: bool = True, lookahead=None, verbose: bool = False,
                  down_scales=None) -> "FlashFFN":
        """The neurons select names (Predicted), their bundles through the neuron cache. down_scales: per layer the
        down columns' scale tables (FlashCheckpoint.down_scales), if the bundles have them."""
        kernels = sparse_ffns(layout, act=cfg.act, relu_threshold=threshold_of(cfg.act, cfg.relu_threshold),
                              max_active=max(layout.n_neurons), down_scales=down_scales)   # per layer
        return cls(cfg, layout, plan, Predicted(cfg, layout, select, predictors), kernels,
                   FlashStats.for_layers(cfg.n_layers, cfg.ffn_dim), bundle_reader(layout, threads=threads),
                   stream_settings(layout), down_bias, overlap, lookahead, verbose)

    @classmethod
    def exact_gate(cls, cfg: ModelConfig, layout, plan, calibration, down_bias=None,
                   resident_layers: int | None = None, down_scales=None, threads: int | None = None,
                   verbose: bool = False, reads=None) -> "FlashFFN":
        """The exact gate (ExactGate) over a FlashLayout with the split parts (layout.parts): the down rows through
        the neuron cache, or read whole. reads: the budget.TokenReads that pins the hot rows and says per layer how a
        token's down rows are read (None: the hottest rows pinned, a layer streamed when more than a third of it is
        not cached)."""
        down = layout.parts["down"]
        kernels = SplitKernels(layout.parts["gate_up"], down, cfg.act, cfg.relu_threshold, down_scales)
        stats = FlashStats.for_layers(cfg.n_layers, cfg.ffn_dim)
        gate = ExactGate(cfg, layout, plan, calibration, kernels, stats, resident_layers, threads)
        return cls(cfg, down, plan, gate, kernels.layers, stats, BundleReader(down, threads=threads),
                   stream_settings(layout), down_bias, verbose=verbose, reads=reads)

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[0]
        if layer == 0:                  # a forward pass starts
            self._pass_lookups = self.stats.hits + self.stats.misses
            self._pass_streamed = False
        if self.selector.coefficients_first:
            y, n_active = self.gated(layer, x)
        else:
            y, n_active = self.selected(layer, x)
        if self.down_bias[layer] is not None:
            y += self.down_bias[layer]
        self.stats.rows[layer] += T
        self.stats.active[layer] += n_active
        if layer == self.cfg.n_layers - 1:
            self._close_pass(T, decoded=self._pass_streamed)
        return y

    # -- Predicted: the named neurons' bundles ------------------------------------------------------------------------
    def active_ids(self, layer: int, x: np.ndarray) -> list[np.ndarray]:
        """Per row of x [T, d]: sorted bundle ids to compute."""
        t0 = time.perf_counter()
        mask = self.selector.select(layer, x)
        self.stats.predictor_s += time.perf_counter() - t0
        return [np.sort(self.selector.bundle_of[layer][np.flatnonzero(m)]) for m in mask]

    def selected(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, int]:
        """(the FFN of x's rows over the neurons the selector names, how many fired)."""
        T = x.shape[0]
        ids = self.active_ids(layer, x)
        y = np.empty_like(x)
        union = np.unique(np.concatenate(ids)) if T > 1 else np.zeros(0, np.int64)
        if T > 1 and self.prefer_streaming(layer, ids):
            self.stream_layer(layer, x, y, ids)
            self.stats.streamed_layers += 1
            n_active = T * self.layout.n_neurons[layer]
        elif union.size and np.all(self.cache.slot_of(layer)[union] >= 0):
            n_active = self.cached_rows(layer, x, y, ids, union)
        elif union.size and union.size <= self.plan.window_rows:
            # Partly cached and the union fits the window: one read of its misses, then every row in one pass
            self.cache.start_fetch(layer, union).finish()
            n_active = self.cached_rows(layer, x, y, ids, union, looked_up=union.size)
        else:
            n_active = 0
            for t in range(T):
                n_active += self.decode_row(layer, x[t], ids[t], y[t])
        return y, n_active


    def decode_row(self, layer: int, x: np.ndarray, ids: np.ndarray, out: np.ndarray) -> int:
        """out[:] = sparse FFN of one token over `ids` (sorted); returns how many neurons actually fired.

        The sum runs over `ids` in sorted order whatever the cache holds (SparseFFN.accumulate): a set larger than
        the window is computed in window-sized pieces accumulated one after the other, and with overlap the rows
        already in DRAM get their coefficients while the misses are read. Neither changes a bit of the output, so
        the budget, -t and overlap do not change the tokens (tests/test_runtime.py)."""
        out[:] = 0.0
        fired = 0
        cap = self.plan.window_rows
        X, Y = x[None, :], out[None, :]
        for start in range(0, len(ids), cap):
            f = self.cache.start_fetch(layer, ids[start:start + cap])
            if self.lookahead is not None and start == 0 and layer + 1 < self.cfg.n_layers:
                self._prefetch_next(layer + 1, x)
            coef = self._coef[: len(f.slots)][None, :]
            if self.overlap and f.reading:
                # The misses are in flight: the cached rows' coefficients meanwhile (threads.beside_reads: how
                # many threads compute beside the reader)
                with beside_reads(self.reader.engine):
                    self._coefficients(layer, f.slots, np.flatnonzero(~f.new), X, coef)
                f.finish()
                self._coefficients(layer, f.slots, np.flatnonzero(f.new), X, coef)
            else:
                f.finish()
                self._coefficients(layer, f.slots, None, X, coef)
            t0 = time.perf_counter()
            self.kernels[layer].accumulate(self.cache.matrix(layer), f.slots, coef, Y)
            self.stats.compute_s += time.perf_counter() - t0
            fired += int(np.count_nonzero(coef))   # 0 = did not fire
        return fired

    def _prefetch_next(self, layer: int, x: np.ndarray) -> None:
        """Queue the reads of the next layer's guessed set behind this layer's: they run during this layer's compute
        and the next layer's attention."""
        t0 = time.perf_counter()
        guess = self.lookahead(layer, x[None, :])[0]
        self.stats.predictor_s += time.perf_counter() - t0
        self.cache.prefetch(layer, np.sort(self.selector.bundle_of[layer][np.flatnonzero(guess)]))

    def _coefficients(self, layer: int, slots: np.ndarray, js, X: np.ndarray, coef: np.ndarray,
                      sel: np.ndarray | None = None, B: np.ndarray | None = None) -> None:
        """coef[:, js] for bundle rows slots[js] of B (default: the layer's cache matrix). SwiGLU neurons under the
        calibrated magnitude threshold count as not fired, inside the kernel."""
        if js is not None and not len(js):
            return
        t0 = time.perf_counter()
        t = self.selector.act_threshold[layer]
        t = t if t > 0 else -1.0
        self.kernels[layer].coefficients(self.cache.matrix(layer) if B is None else B, slots, js, X, coef, sel=sel,
                                 act_threshold=t)
        self.stats.compute_s += time.perf_counter() - t0

    def cached_rows(self, layer: int, x: np.ndarray, y: np.ndarray, ids: list[np.ndarray], union: np.ndarray,
                    looked_up: int = 0) -> int:
        """The FFN of all rows of x at once when the cache holds every neuron they selected (`union`, sorted): each
        row's coefficients over the union (0 where it did not select), then each row's sum in bundle order, zeros
        skipped: stream_layer's kernels and order on the cache's rows instead of a chunk read from flash, so the bits
        are decode_row's. One kernel pass per layer instead of one per row (a 4,000-token prompt with the whole model
        pinned went row by row). `looked_up`: how many of the selections a fetch of the union already counted as a
        hit or a miss (each of the union's neurons once). Returns how many neurons fired."""
        selected = np.zeros((x.shape[0], union.size), np.uint8)
        for t, row in enumerate(ids):
            selected[t, np.searchsorted(union, row)] = 1
        rows = self.cache.slot_of(layer)[union].astype(np.int32)   # int32 like the cache's: the same compiled kernel
        coef = np.empty((x.shape[0], union.size), np.float32)
        self._coefficients(layer, rows, None, x, coef, sel=selected)
        y[:] = 0.0
        t0 = time.perf_counter()
        self.kernels[layer].accumulate(self.cache.matrix(layer), rows, coef, y)
        self.stats.compute_s += time.perf_counter() - t0
        self.stats.hits += sum(map(len, ids)) - looked_up   # every other selection found its neuron cached
        return int(np.count_nonzero(coef))

    def stream_layer(self, layer: int, x: np.ndarray, y: np.ndarray, ids: list[np.ndarray]) -> None:
        """The FFN of all rows of x over each row's selected bundle ids, reading the layer's bundles in large
        sequential chunks: the same function the cache path computes, only the reads differ."""
        L = self.layout
        selected = np.zeros((x.shape[0], L.n_neurons[layer]), bool)   # [T, n] by bundle id
        for t, row in enumerate(ids):
            selected[t, row] = True
        y[:] = 0.0
        chunk_rows = np.arange(self.stream.rows, dtype=np.int32)   # int32 like the cache's rows: the same kernel
        for start, B, rs, waited in self.stream.chunks(layer):
            m = B.shape[0]
            self.stats.read_s += waited     # the wait for a read in flight (the next ones go on meanwhile)
            self.stats.io_s += rs.io_s
            if self.decoding:
                self.stats.read_bytes += rs.read_bytes
            else:
                self.stats.prefill_bytes_read += rs.read_bytes
            # The decode path's kernel and order: each row's selected neurons in bundle order, chunk after chunk,
            # accumulated into the same y[t] (its down bias stays out: it is added once per layer).
            coef = np.empty((x.shape[0], m), np.float32)
            self._coefficients(layer, chunk_rows[:m], None, x, coef,
                               sel=np.ascontiguousarray(selected[:, start:start + m]).view(np.uint8), B=B)
            t2 = time.perf_counter()
            self.kernels[layer].accumulate(B, chunk_rows[:m], coef, y)
            self.stats.compute_s += time.perf_counter() - t2

    # -- ExactGate: every coefficient first, then the down rows of those that count ----------------------------------
    def gated(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, int]:
        """(the FFN of x's rows: the selector's coefficients, then the down rows of the neurons any row needs, how many
        (row, neuron) coefficients counted)."""
        T = x.shape[0]
        if self.stream.primed < 0 and self.streams_again(layer):
            self.stream.prime(layer)     # its first chunks come during the coefficients
        coef = self.selector.coefficients(layer, x)
        if self.selector.observe is not None:
            self.selector.observe(layer, coef)
        ids = np.flatnonzero(coef[0] if T == 1 else coef.any(axis=0))     # bundle ids any row needs, ascending
        y = np.zeros(x.shape, np.float32)
        self.kernels[layer].begin(coef)
        self.streamed[layer] = True
        decode = T == 1 or self.decoding
        if not decode and self.prefer_streaming(layer, [ids]):
            self.stream_down(layer, coef, y)
            self.stats.streamed_layers += 1
        elif decode and self.stream_decode(layer, ids):
            self.stream_down(layer, coef, y, decode=True)
            self._pass_streamed = True
        else:
            self.streamed[layer] = False
            if self.stream.primed == layer:
                self.stream.cancel()
            self.accumulate_rows(layer, ids, coef, y)
        self.kernels[layer].finish(y)
        self._dropped()
        return y, int(np.count_nonzero(coef))


    def streams_again(self, layer: int) -> bool:
        """Whether layer `layer`'s down rows will likely be read whole again: they were last time, and the cache cannot
        hold the layer."""
        return self.streamed[layer] and self.cache.matrix(layer).shape[0] < self.layout.n_neurons[layer]

    def _dropped(self) -> None:
        """Count the bytes of primed chunks that were read and not used (a layer that did not stream after all)."""
        for s in (self.stream, self.selector.gate_up_stream):
            if s is not None and s.dropped.read_bytes:
                self.stats.read_bytes += s.dropped.read_bytes
                s.dropped = FlashStats()

    def stream_decode(self, layer: int, ids: np.ndarray) -> bool:
        """Read a decoded token's down rows with the whole layer, in large sequential chunks, when the cache cannot
        hold the layer anyway (a budget below the FFN: its rows would not stay) and more than a third of it is not
        cached: a gated model's token needs most of its rows (~60% at sparsity 0.4), and random reads of them move
        bytes several times slower than sequential ones (fio on this machine's SSD: 0.5-0.9 GB/s at 7 KiB, 4.5 GB/s
        sequential). On the 7B shape at 75% of its q4_0 GGUF the cache path read 1.98 GB per token in 4.3 s."""
        n = self.layout.n_neurons[layer]
        if self.cache.matrix(layer).shape[0] >= n:      # its pinned rows and window hold the whole layer
            return False
        if self.reads is not None:                      # the plan's choice, priced on the device's rates
            return self.reads.down[layer] == "stream"
        uncached = ids.size - np.count_nonzero(self.cache.slot_of(layer)[ids] >= 0)
        return uncached > n / 3

    def accumulate_rows(self, layer: int, ids: np.ndarray, coef: np.ndarray, Y: np.ndarray) -> None:
        """Y[t] += the down rows of `ids` (ascending) weighted by coef[t, ids], through the neuron cache in
        window-sized pieces accumulated one after the other. Each row's sum skips its zero coefficients and adds the
        rest in bundle order, so a token gives the same bits alone or in a prompt, in one piece or many (ffn.sparse)."""
        if self.cache.pinned_whole(layer):   # in RAM: the rows a fetch would give, without its bookkeeping
            self.stats.hits += ids.size
            t0 = time.perf_counter()
            self.kernels[layer].accumulate(self.cache.matrix(layer), self.cache.slot_of(layer)[ids],
                                           np.ascontiguousarray(coef[:, ids]), Y)
            self.stats.compute_s += time.perf_counter() - t0
            return
        cap = self.plan.window_rows
        for start in range(0, len(ids), cap):
            piece = ids[start:start + cap]
            f = self.cache.start_fetch(layer, piece)
            f.finish()
            t0 = time.perf_counter()
            self.kernels[layer].accumulate(self.cache.matrix(layer), f.slots, np.ascontiguousarray(coef[:, piece]), Y)
            self.stats.compute_s += time.perf_counter() - t0

    def stream_down(self, layer: int, coef: np.ndarray, y: np.ndarray, decode: bool = False) -> None:
        """The down sum reading the layer's down rows in large sequential chunks, rows in bundle order (zero
        coefficients skipped): the sum the cache path computes. decode: a decoded token's (its bytes count as the
        decode path's reads), else a prompt's."""
        fired = coef.any(axis=0)
        for start, D, rs, waited in self.stream.chunks(layer):
            m = D.shape[0]
            self.stats.read_s += waited
            self.stats.io_s += rs.io_s
            if decode:
                self.stats.read_bytes += rs.read_bytes
                self.stats.requested_bytes += rs.requested_bytes
            else:
                self.stats.prefill_bytes_read += rs.read_bytes
            t1 = time.perf_counter()
            # only the rows some token needs, in bundle order: the kernel skips zero coefficients anyway (the same
            # terms in the same order, the same bits), but it walks and prefetches every row it is given
            rows = np.flatnonzero(fired[start:start + m]).astype(np.int32)
            self.kernels[layer].accumulate(D, rows, np.ascontiguousarray(coef[:, start + rows]), y)
            self.stats.compute_s += time.perf_counter() - t1
        following = (layer + 1) % self.cfg.n_layers     # the next layer's (the next token's first, after the last)
        if self.streams_again(following):
            self.stream.prime(following)

    # -- both --------------------------------------------------------------------------------------------------------

    def _close_pass(self, T: int, decoded: bool = False) -> None:
        """Count the pass's T tokens as decode-path tokens if any went through the neuron cache, or were decoded
        reading their layers whole (decoded: stream_decode). Token boundaries come from the pass, not from
        decode_row: a batched prompt calls decode_row T times per layer."""
        if decoded or self.stats.hits + self.stats.misses > self._pass_lookups:
            self.stats.tokens += T

    # -- prefill streaming ------------------------------------------------------------------------------------------
    def prefer_streaming(self, layer: int, ids: list[np.ndarray]) -> bool:
        """Stream the whole layer when the rows' distinct uncached neurons exceed a third of it: random bundle reads
        move bytes 2-3x slower than large sequential ones on the SSDs measured here."""
        union = np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)
        cached = self.cache.slot_of(layer)[union] >= 0 if union.size else np.zeros(0, bool)
        uncached = int(union.size - np.count_nonzero(cached))
        choice = uncached > self.layout.n_neurons[layer] / 3
        if self.verbose and layer == 0:
            how = "streaming whole layers" if choice else "through the neuron cache"
            print(f"prefill of {len(ids)} tokens: {uncached} uncached neurons in layer 0 -> {how}", file=sys.stderr)
        return choice
