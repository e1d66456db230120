"""GateFFN: the exact-gate FFN of a GLU model over the split layout (an FFNFn, model.py).

Per layer and token: every neuron's coefficient act(gate.x) * (up.x) from its gate|up row (kept in DRAM; a layer whose
rows do not fit the budget is read as one sequential stream), the calibrated magnitude threshold (|c| <= t: the
neuron does not count), then the down rows of the neurons that cleared it, through the neuron cache from down.bin.
No predictor: the set is the thresholded model's own, so the output is one function of x whatever the budget.

Why gate AND up in DRAM (docs/PREDICTORS.md, bench/exact_gate.py): on SmolLM2 a gate-only score (CATS) costs +15%
perplexity at 40% of the neurons dropped, the product |act(g) * u| +1.5%; the product needs the up row, and with both
rows resident only the down row (a third of a bundle's weights) is read for the neurons that count.

One summation order (ffn.sparse): the coefficients are per neuron, computed by the same kernel for any T; the down
rows are added in bundle order, whatever the cache holds, the pieces or the prefill strategy.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
from tqdm import tqdm

from storage.errors import UserError
from storage.checksums import drop_from_page_cache
from storage.profile import stream_settings, stream_shape
from storage.reader import BundleReader, RowStream
from storage.stats import FlashStats

from ..neuron_cache import NeuronCache
from .flash import FlashFFN
from .split import SplitKernels


class GateFFN(FlashFFN):
    """The exact-gate FFN of every layer (see the module docstring).

    layout: a FlashLayout with the split parts (layout.parts); plan: the budget.BudgetPlan sizing the down rows' neuron
    cache; calibration: storage.gate_file.GateCalibration (per layer the |coefficient| threshold, and the neuron
    frequencies that choose the pinned hot rows);
    resident_layers: how many layers, from the first, keep their gate|up rows in DRAM (the rest are streamed).
    FlashFFN's prefill choice (stream whole layers or go through the cache) and statistics apply unchanged.
    """

    def __init__(self, cfg, layout, plan, calibration, down_bias=None, resident_layers: int | None = None,
                 down_scales=None, threads: int | None = None, verbose: bool = False):
        self.cfg, self.plan, self.verbose = cfg, plan, verbose
        self.gate_up, self.layout = layout.parts["gate_up"], layout.parts["down"]
        self.thresholds = list(calibration.thresholds)
        self.stats = FlashStats.for_layers(cfg.n_layers, cfg.ffn_dim)
        self.down_bias = list(down_bias) if down_bias is not None else [None] * cfg.n_layers
        self.reader = BundleReader(self.layout, threads=threads)
        hot = plan.hot_neurons(list(calibration.freq)) if plan.hot_bytes else None
        self.cache = NeuronCache(self.layout.n_neurons, self.layout.stride, self.reader, capacity=plan.window_rows,
                                 window=plan.window, hot=hot, stats=self.stats)
        self.kernels = SplitKernels(self.gate_up, self.layout, cfg.act, cfg.relu_threshold, down_scales)
        k = plan.gate_layers if resident_layers is None else resident_layers
        self.heads = [self._read_gate_up(i) if i < k else None for i in range(cfg.n_layers)]
        # Two streams, each with its chunks in flight while one is computed: the gate|up rows of the layers not
        # resident (reading their own file), and down rows read whole (stream_decode, or a prompt's streaming).
        # Each starts its next layer as soon as it is done with one, so reads go on during attention and the other
        # stream's compute.
        st = stream_settings(layout)
        self.gate_up_reader = BundleReader(self.gate_up, threads=threads) if k < cfg.n_layers else None
        self.gate_up_stream = RowStream(self.gate_up_reader, *stream_shape(self.gate_up, st.chunk_bytes, st.depth)) \
            if self.gate_up_reader else None
        self.stream = RowStream(self.reader, *stream_shape(self.layout, st.chunk_bytes, st.depth))
        self.streamed = [False] * cfg.n_layers    # per layer: whether its down rows were read whole last time
        self._pass_lookups = 0
        self.observe = None     # observe(layer, coef [T, n]): calibration's view of every coefficient

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

    def streams_again(self, layer: int) -> bool:
        """Whether layer `layer`'s down rows will likely be read whole again: they were last time, and the cache cannot
        hold the layer."""
        return self.streamed[layer] and self.cache.matrix(layer).shape[0] < self.layout.n_neurons[layer]

    def _next_streamed(self, layer: int) -> int:
        """The layer after `layer` whose gate|up rows are not resident (the next token's first, after the last)."""
        n = self.cfg.n_layers
        return next(i % n for i in range(layer + 1, layer + 1 + n) if self.heads[i % n] is None)

    def _dropped(self) -> None:
        """Count the bytes of primed chunks that were read and not used (a layer that did not stream after all)."""
        for s in (self.stream, self.gate_up_stream):
            if s is not None and s.dropped.read_bytes:
                self.stats.read_bytes += s.dropped.read_bytes
                s.dropped = FlashStats()

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[0]
        if layer == 0:
            self._pass_lookups = self.stats.hits + self.stats.misses
            self._pass_streamed = False
        if self.stream.primed < 0 and self.streams_again(layer):
            self.stream.prime(layer)     # its first chunks come during the coefficients
        coef = self.coefficients(layer, x)
        if self.observe is not None:
            self.observe(layer, coef)
        ids = np.flatnonzero(coef.any(axis=0))          # bundle ids any row needs, ascending
        y = np.zeros_like(x)
        self.streamed[layer] = True
        if T > 1 and self.prefer_streaming(layer, [ids]):
            self.stream_down(layer, coef, y)
            self.stats.streamed_layers += 1
        elif T == 1 and self.stream_decode(layer, ids):
            self.stream_down(layer, coef, y, decode=True)
            self._pass_streamed = True
        else:
            self.streamed[layer] = False
            if self.stream.primed == layer:
                self.stream.cancel()
            self.accumulate_rows(layer, ids, coef, y)
        self._dropped()
        if self.down_bias[layer] is not None:
            y += self.down_bias[layer]
        self.stats.rows[layer] += T
        self.stats.active[layer] += int(np.count_nonzero(coef))
        if layer == self.cfg.n_layers - 1:
            self._close_pass(T, decoded=self._pass_streamed)
        return y

    def stream_decode(self, layer: int, ids: np.ndarray) -> bool:
        """Read a decoded token's down rows with the whole layer, in large sequential chunks, when the cache cannot
        hold the layer anyway (a budget below the FFN: its rows would not stay) and more than a third of it is not
        cached: a gated model's token needs most of its rows (~60% at sparsity 0.4), and random reads of them move
        bytes several times slower than sequential ones (fio on this machine's SSD: 0.5-0.9 GB/s at 7 KiB, 4.5 GB/s
        sequential). On the 7B shape at 75% of its q4_0 GGUF the cache path read 1.98 GB per token in 4.3 s."""
        n = self.layout.n_neurons[layer]
        if self.cache.matrix(layer).shape[0] >= n:      # its pinned rows and window hold the whole layer
            return False
        uncached = ids.size - np.count_nonzero(self.cache.slot_of(layer)[ids] >= 0)
        return uncached > n / 3

    def accumulate_rows(self, layer: int, ids: np.ndarray, coef: np.ndarray, Y: np.ndarray) -> None:
        """Y[t] += the down rows of `ids` (ascending) weighted by coef[t, ids], through the neuron cache in
        window-sized pieces accumulated one after the other. Each row's sum skips its zero coefficients and adds the
        rest in bundle order, so a token gives the same bits alone or in a prompt, in one piece or many (ffn.sparse)."""
        cap = self.plan.window_rows
        for start in range(0, len(ids), cap):
            piece = ids[start:start + cap]
            f = self.cache.start_fetch(layer, piece)
            f.finish()
            t0 = time.perf_counter()
            self.kernels.accumulate(self.cache.matrix(layer), f.slots, np.ascontiguousarray(coef[:, piece]), Y, layer)
            self.stats.compute_s += time.perf_counter() - t0

    def stream_down(self, layer: int, coef: np.ndarray, y: np.ndarray, decode: bool = False) -> None:
        """The down sum reading the layer's down rows in large sequential chunks, rows in bundle order (zero
        coefficients skipped): the sum the cache path computes. decode: a decoded token's (its bytes count as the
        decode path's reads), else a prompt's."""
        slots = np.arange(self.stream.rows, dtype=np.int32)
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
            self.kernels.accumulate(D, slots[:m], np.ascontiguousarray(coef[:, start:start + m]), y, layer)
            self.stats.compute_s += time.perf_counter() - t1
        following = (layer + 1) % self.cfg.n_layers     # the next layer's (the next token's first, after the last)
        if self.streams_again(following):
            self.stream.prime(following)


# ----------------------------------------------------------------------------------------------------------------------
# The thresholds: calibrated on text, in memory that does not grow with it

CALIBRATION_TOKENS = 1024
CALIBRATION_CTX = 256
# A magnitude's bin: the top 14 bits of its float32 pattern (sign 0, the exponent, 5 mantissa bits). The patterns of
# non-negative floats sort as the floats do, so bins are ordered intervals, each at most 1/32 of its values wide (the
# second pass keeps a bin's magnitudes: narrower bins keep fewer, but their counts take 4 bytes each per layer).
BIN_SHIFT = 17
BINS = 1 << 14


class LayerMagnitudes:
    """One layer's |coefficients| [tokens, n] over two passes of the same tokens: count() every row in the first,
    keep() in the second; then result(s): np.quantile(all, s), and per neuron the share of tokens above it.
    Held: a histogram of BINS counts, per sparsity n counts and the magnitudes of (usually) two bins."""

    def __init__(self, n: int, sparsities):
        self.n, self.sparsities, self.tokens = n, tuple(sparsities), 0
        self.hist = np.zeros(BINS, np.int32)     # at most tokens x n per bin: 11 M for 1,024 tokens of a 7B
        self.order = {}     # s -> (k, gamma, bin of order statistic k, bin of k + 1, how many magnitudes lie below)

    @staticmethod
    def nbytes(n: int, sparsities) -> int:
        """What one layer's LayerMagnitudes holds (the bins' kept magnitudes aside: a few thousand)."""
        return BINS * 4 + len(sparsities) * n * 8

    def count(self, mags: np.ndarray) -> None:
        assert mags.dtype == np.float32     # the bins are float32 bit patterns
        self.hist += np.bincount((mags.view(np.uint32) >> BIN_SHIFT).ravel(), minlength=BINS)
        self.tokens += mags.shape[0]

    def _locate(self) -> None:
        """After the first pass: where np.quantile's two order statistics of each sparsity lie."""
        cum = np.cumsum(self.hist)
        last = int(cum[-1]) - 1
        for s in self.sparsities:
            h = last * s                       # np.quantile's 'linear' virtual index
            k = int(np.floor(h))
            lo, hi = (int(np.searchsorted(cum, i, side="right")) for i in (k, min(k + 1, last)))
            self.order[s] = (k, h - k, lo, hi, int(cum[lo - 1]) if lo else 0)
        self.above = {s: np.zeros(self.n, np.int64) for s in self.sparsities}
        self.kept = {s: [] for s in self.sparsities}

    def keep(self, mags: np.ndarray) -> None:
        if not self.order:
            self._locate()
        b = mags.view(np.uint32) >> BIN_SHIFT
        for s, (_, _, lo, hi, _) in self.order.items():
            self.above[s] += np.count_nonzero(b > hi, axis=0)
            r, c = np.nonzero((b >= lo) & (b <= hi))
            self.kept[s].append((mags[r, c], c))

    def result(self, s: float) -> tuple[float, np.ndarray]:
        """(the threshold: np.quantile(all, s), per neuron the share of tokens whose magnitude is above it)."""
        k, gamma, _, _, below = self.order[s]
        vals = np.concatenate([v for v, _ in self.kept[s]])
        cols = np.concatenate([c for _, c in self.kept[s]])
        pair = np.sort(vals)[k - below: k - below + 2]   # order statistics k and k + 1 (one at the very top)
        t = float(np.quantile(pair, gamma)) if len(pair) == 2 else float(pair[0])
        return t, (self.above[s] + np.bincount(cols[vals > t], minlength=self.n)) / self.tokens


def measure_thresholds(model, ffn: GateFFN, windows, sparsities, progress: bool = False) -> dict:
    """{s: (thresholds [L], freq [L][n])}: per layer the s-quantile of every |coefficient| the windows (token id
    lists) give with no threshold, and per neuron the share of tokens above it. The magnitudes of 1,024 tokens would
    be 4 bytes x tokens x neurons x layers (189 MiB on the default model, 1.4 GiB on a 7B) beside the model, so the
    windows go through twice (LayerMagnitudes): a histogram, then only the bins that hold the order statistics."""
    cfg = ffn.cfg
    ffn.thresholds = [-1.0] * cfg.n_layers         # every coefficient counts
    layers = [LayerMagnitudes(cfg.ffn_dim, sparsities) for _ in range(cfg.n_layers)]
    kv = model.new_cache(max(map(len, windows)))
    bar = tqdm(total=2 * len(windows), desc="calibrate gate", unit="window", disable=not progress, file=sys.stderr)
    for first in (True, False):     # the same tokens twice: the coefficients are the same bits both times
        ffn.observe = ((lambda layer, coef: layers[layer].count(np.abs(coef))) if first else
                       (lambda layer, coef: layers[layer].keep(np.abs(coef))))
        for w in windows:
            kv.reset()
            model.forward(w, kv)
            bar.update()
    bar.close()
    ffn.observe = None
    out = {}
    for s in sparsities:
        th, freq = zip(*(m.result(s) for m in layers))
        out[s] = (list(th), list(freq))
    return out
