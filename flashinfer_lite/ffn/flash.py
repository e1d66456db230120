"""FlashFFN: the FFN of every layer computed from bundles on flash through the neuron cache (an FFNFn, model.py).

Per layer, per token: the neurons to compute (the selector: the predictor, the oracle or a trace), a cache lookup,
one batched read of the misses straight into their cache rows, and the sparse FFN (ffn.sparse) over those rows.
A prompt of many tokens touches most neurons, so prefill can instead stream each layer's whole FFN with large
sequential reads; FlashFFN picks whichever moves fewer bytes.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from storage.profile import stream_settings, stream_shape
from storage.reader import RowStream, bundle_reader
from storage.stats import FlashStats

from storage.config import ModelConfig
from ..neuron_cache import NeuronCache, staging_rows
from ..threads import beside_reads
from ..kernels.neurons import threshold_of
from .quant import sparse_ffns



class FlashFFN:
    """The FFN of every layer, computed from bundles on flash through the neuron cache.

    plan: the budget.BudgetPlan that sizes the neuron cache (window rows, hot bytes, window tokens).
    select(layer, x [T, d]) -> bool [T, n_neurons] by original neuron id: which neurons to compute (the predictor,
    the oracle, or a replayed trace).
    predictors: the PredictorSet of the FLASHDIR, if any: its neuron frequencies choose the pinned hot neurons and its
    act_threshold (per layer) is the SwiGLU magnitude under which a computed neuron counts as not fired.
    down_bias: per layer the FFN down bias (resident; None where the model has none).
    overlap: compute on the cached rows while the misses are read (False: read, then compute; for measuring).
    lookahead(layer, x [1, d]) -> bool [1, n_neurons]: a guess of `layer`'s set from the previous layer's FFN input
    x, so its reads start one layer early (Deja Vu); the exact set still decides, a wrong guess costs only bytes.
    down_scales: per layer the down columns' scale tables (FlashCheckpoint.down_scales), if the bundles have them.
    """

    def __init__(self, cfg: ModelConfig, layout, plan, select, predictors=None, down_bias=None,
                 threads: int | None = None, overlap: bool = True, lookahead=None, verbose: bool = False,
                 down_scales=None):
        self.cfg, self.layout, self.plan, self.select, self.predictors = cfg, layout, plan, select, predictors
        self.verbose, self.overlap, self.lookahead = verbose, overlap, lookahead
        self.stats = FlashStats.for_layers(cfg.n_layers, cfg.ffn_dim)
        self.down_bias = list(down_bias) if down_bias is not None else [None] * cfg.n_layers
        self.bundle_of = layout.bundle_of    # selections speak original neuron ids, the cache bundle ids
        self.act_threshold = [predictors.act_threshold(i) if predictors is not None else 0.0
                              for i in range(cfg.n_layers)]
        self.reader = bundle_reader(layout, threads=threads)
        hot = None
        if predictors is not None and plan.hot_bytes:
            hot = plan.hot_neurons([predictors.neuron_freq(i)[layout.order[i]] for i in range(cfg.n_layers)])
        self.cache = NeuronCache(layout.n_neurons, layout.stride, self.reader, capacity=plan.window_rows,
                                 window=plan.window, hot=hot,
                                 staging_rows=staging_rows(plan.max_active) if lookahead else 0, stats=self.stats)
        self.kernels = sparse_ffns(layout, act=cfg.act, relu_threshold=threshold_of(cfg.act, cfg.relu_threshold),
                                   max_active=max(layout.n_neurons), down_scales=down_scales)   # per layer
        self._coef = np.zeros(max(layout.n_neurons), np.float32)   # one piece's coefficients
        st = stream_settings(layout)      # prefill streaming's buffers (counted in the plan's buffers)
        self.stream = RowStream(self.reader, *stream_shape(layout, st.chunk_bytes, st.depth))
        self._pass_lookups = 0   # hits + misses when the current forward pass began

    # -- choosing neurons ---------------------------------------------------------------------------------------------
    def active_ids(self, layer: int, x: np.ndarray) -> list[np.ndarray]:
        """Per row of x [T, d]: sorted bundle ids to compute."""
        t0 = time.perf_counter()
        mask = self.select(layer, x)
        self.stats.predictor_s += time.perf_counter() - t0
        return [np.sort(self.bundle_of[layer][np.flatnonzero(m)]) for m in mask]

    # -- the FFN ----------------------------------------------------------------------------------------------------
    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[0]
        if layer == 0:                  # a forward pass starts
            self._pass_lookups = self.stats.hits + self.stats.misses
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
        if self.down_bias[layer] is not None:
            y += self.down_bias[layer]
        self.stats.rows[layer] += T
        self.stats.active[layer] += n_active
        if layer == self.cfg.n_layers - 1:
            self._close_pass(T)
        return y

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
        self.cache.prefetch(layer, np.sort(self.bundle_of[layer][np.flatnonzero(guess)]))

    def _coefficients(self, layer: int, slots: np.ndarray, js, X: np.ndarray, coef: np.ndarray,
                      sel: np.ndarray | None = None, B: np.ndarray | None = None) -> None:
        """coef[:, js] for bundle rows slots[js] of B (default: the layer's cache matrix). SwiGLU neurons under the
        calibrated magnitude threshold count as not fired, inside the kernel."""
        if js is not None and not len(js):
            return
        t0 = time.perf_counter()
        t = self.act_threshold[layer] if self.act_threshold[layer] > 0 else -1.0
        self.kernels[layer].coefficients(self.cache.matrix(layer) if B is None else B, slots, js, X, coef, sel=sel,
                                 act_threshold=t)
        self.stats.compute_s += time.perf_counter() - t0

    def _close_pass(self, T: int, decoded: bool = False) -> None:
        """Count the pass's T tokens as decode-path tokens if any went through the neuron cache, or were decoded
        reading their layers whole (decoded: GateFFN.stream_decode). Token boundaries come from the pass, not from
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
            self.stats.prefill_bytes_read += rs.read_bytes
            # The decode path's kernel and order: each row's selected neurons in bundle order, chunk after chunk,
            # accumulated into the same y[t] (its down bias stays out: it is added once per layer).
            coef = np.empty((x.shape[0], m), np.float32)
            self._coefficients(layer, chunk_rows[:m], None, x, coef,
                               sel=np.ascontiguousarray(selected[:, start:start + m]).view(np.uint8), B=B)
            t2 = time.perf_counter()
            self.kernels[layer].accumulate(B, chunk_rows[:m], coef, y)
            self.stats.compute_s += time.perf_counter() - t2
