"""ExpertFFN: a mixture of experts whose experts stay on flash, read whole into an expert cache as the router asks.

Per layer the cache has `slots` expert-sized rows (budget.plan_experts sizes them from --dram-budget): `pinned` of
them hold the layer's most routed experts on calibration text for the whole run, the others an LRU over recent
tokens. A miss is one O_DIRECT read of the expert's chunk (storage.experts: gate, up and down back to back) straight
into its slot, and the slot's bytes are the expert's matrices (views, no copy). The reads of a layer's misses are
submitted before the experts already in DRAM are computed; those are handed over as one batch (ffn.dense.ExpertBatch:
the layer's slots and which expert is in which, so ffn.dense.MixtureOfExperts computes them in one kernel call), then
each read as it lands with every other one already done. MixtureOfExperts sums the outputs in expert order
afterwards, so the bits never depend on what was cached or which experts shared a call.

Split chunks (storage.experts: gate|up rows, then down columns) run the dense exact gate inside each expert
(ffn.gate, the same kernels: ffn.flash.SplitKernels): a miss reads the expert's gate|up rows into its slot, its
coefficients are computed, and only the down columns of the neurons whose |coefficient| clears the layer's threshold
are read (the ones the slot does not hold yet), as coalesced runs, then summed in neuron order. A threshold of 0 is
exact (only zero coefficients skipped: a ReLU-family expert's); where that skips nothing (a SiLU expert at 0) a miss
reads the whole chunk in one request instead. Either way the output is one function of x, whatever was read.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from storage.blocks import BLOCK_BYTES
from storage.config import EXACT_GATE_ACTS, ModelConfig
from storage.experts import MATRICES
from storage.format import expert_chunks, expert_parts
from storage.reader import (SLOTS_IN_HUGE_PAGES, BundleReader, FlashStats, aligned_empty, in_flight_seconds,
                            populate)

from .dense import ExpertBatch, FeedForward, MixtureOfExperts
from ..kernels.blocks import QuantMatrix
from ..kernels.neurons import QUANT_FFN_ACTS
from .flash import SplitKernels


def stacks(cfg: ModelConfig, E) -> bool:
    """Whether a batch of experts' decode rows computes in one kernel call over their slots (ffn.dense.ExpertBatch's
    stack): every matrix in a block format, an activation quant_ffn has, whole chunks (not split)."""
    return all(t in BLOCK_BYTES for t in E.dtypes) and cfg.act in QUANT_FFN_ACTS and not E.split


def expert_ffn(cfg: ModelConfig, E, buf: np.ndarray, layer: int, e: int) -> FeedForward:
    """Expert e of `layer` over its chunk's bytes buf (E: the ExpertLayout): the matrices as the dense path keeps
    them (float16 / float32 arrays, QuantMatrix blocks), so both compute with the same kernels."""
    p = f"layers.{layer}.ffn.experts.{e}."
    w = {}
    for m, (kind, a) in zip(MATRICES, E.matrices(buf)):
        w[f"{p}{m}.weight"] = QuantMatrix(a, kind, E.shape(m)[1]) if a.dtype == np.uint8 else a
    return FeedForward(cfg, w, layer, p)


class ExpertCache:
    """slots whole experts per layer; cache(layer, ids) yields ExpertBatch-es covering ids: the ones in DRAM first,
    then the misses as their reads land. Counts expert hits and misses, and the bytes read, into stats."""

    def __init__(self, cfg: ModelConfig, layout, slots: int, pinned: list[np.ndarray] | None = None,
                 threads: int | None = None, stats: FlashStats | None = None, overlap: bool = True):
        E = self.experts_layout = layout.experts
        self.cfg, self.overlap = cfg, overlap
        self.slots = slots
        self.stacked = stacks(cfg, E)
        self.reader = BundleReader(expert_chunks(layout), threads=threads, stamps=True)   # stamps: read_busy_s
        if E.split:
            parts = expert_parts(layout)     # regions: (layer, expert) pairs; rows: neurons
            self.kernels = SplitKernels(parts["gate_up"], parts["down"], cfg.act, cfg.relu_threshold)
            self.head_reader = BundleReader(parts["heads"], threads=threads, stamps=True)
            self.column_reader = BundleReader(parts["down"], threads=threads)
            self.have = np.zeros((cfg.n_layers, slots, E.n), bool)   # the down columns each slot holds
        self.thresholds = [0.0] * cfg.n_layers   # split: per layer |coefficient| <= t does not count (0: exact)
        self.observe = None      # split: observe(layer, coef [T, n]) sees each expert's coefficients (calibration)
        self.fired = 0           # split: (row, neuron) coefficients that cleared the threshold, summed
        self.stats = stats if stats is not None else FlashStats.for_layers(cfg.n_layers, cfg.n_experts)
        self.buf = aligned_empty((cfg.n_layers, slots, E.chunk), np.uint8, huge=SLOTS_IN_HUGE_PAGES)
        self.slot_of = [dict() for _ in range(cfg.n_layers)]           # expert -> slot
        self.lru = [collections.OrderedDict() for _ in range(cfg.n_layers)]   # unpinned experts, oldest first
        self.free = [list(range(slots - 1, -1, -1)) for _ in range(cfg.n_layers)]
        self.pinned = [set() for _ in range(cfg.n_layers)]
        self.early = [dict() for _ in range(cfg.n_layers)]    # expert -> its read started on a guess, not yet waited
        self.on_submitted = None     # called with the layer once its misses' reads are queued (ExpertFFN's guess)
        for layer, ids in enumerate(pinned or []):
            ids = [int(e) for e in ids][:slots]
            if ids:
                got = [self.free[layer].pop() for _ in ids]
                st = self.reader.read(layer, ids, self.buf[layer], got)
                self.stats.read_bytes += st.read_bytes           # loaded once, before any token: no miss
                if E.split:
                    self.have[layer, got] = True
                self.slot_of[layer].update(zip(ids, got))
                self.pinned[layer].update(ids)

    def reads_columns(self, layer: int) -> bool:
        """split: whether a miss of `layer` reads the gate|up rows alone, then its firing neurons' down columns
        (a threshold above 0, or a ReLU-family expert: its coefficients are often exactly 0), not the whole chunk."""
        return self.experts_layout.split and (self.thresholds[layer] > 0 or self.cfg.act not in EXACT_GATE_ACTS)

    def expert(self, layer: int, e: int) -> FeedForward:
        """Expert e of `layer` over its slot's bytes (expert_ffn)."""
        return expert_ffn(self.cfg, self.experts_layout, self.buf[layer, self.slot_of[layer][e]], layer, e)

    def _victim(self, layer: int, keep: set) -> int | None:
        """A slot to read into: a free one, else the least recently used unpinned expert's not in keep. A free slot
        was never used: its pages are faulted in here (first_touch_s), not by the read (it would count in read_busy_s).
        Where the cache fills during decode (bench/moe_vs_llama_cpp.py's 48 layers at their 50% cap) that is 62 MiB a
        token of page faults, costly on a VM whose host backs a page anew after the guest frees it."""
        if self.free[layer]:
            slot, t0 = self.free[layer].pop(), time.perf_counter()
            populate(self.buf[layer, slot])
            self.stats.first_touch_s += time.perf_counter() - t0
            return slot
        for e in self.lru[layer]:
            if e not in keep:
                del self.lru[layer][e]
                return self.slot_of[layer].pop(e)
        return None

    def _start(self, layer: int, e: int, keep: set):
        """Submit the read of expert e into a slot; None when every slot holds an expert still needed."""
        slot = self._victim(layer, keep)
        if slot is None:
            return None
        self.slot_of[layer][e] = slot
        if not self.reads_columns(layer):
            if self.experts_layout.split:
                self.have[layer, slot] = True
            pending = self.reader.submit(layer, [e], self.buf[layer], [slot])
        else:
            E = self.experts_layout
            self.have[layer, slot] = False
            head = self.buf[layer, slot, :E.columns_at].reshape(1, E.columns_at)
            pending = self.head_reader.submit(layer * E.n_experts + e, [0], head, [0])
        return pending

    def _land(self, layer: int, e: int, pending) -> None:
        self._count(pending)
        self.lru[layer][e] = None                 # most recent

    def _count(self, pending):
        """Wait for a read; its bytes and time into the stats; its FlashStats."""
        t0 = time.perf_counter()
        st = pending.wait()
        self.stats.read_s += time.perf_counter() - t0
        self.stats.read_bytes += st.read_bytes
        self.stats.requested_bytes += st.requested_bytes
        self.stats.n_reads += st.n_reads
        self.stats.io_s += st.io_s
        return st

    def _busy(self, reads: list) -> None:
        """The time these landed reads were in flight (read_busy_s), their bytes and their summed times in flight."""
        busy, summed = in_flight_seconds(reads)
        self.stats.read_busy_s += busy
        self.stats.read_busy_bytes += sum(p.stats.read_bytes for p in reads)
        self.stats.read_op_s += summed

    def prefetch(self, layer: int, ids) -> None:
        """Start reading the experts of a guess (the next layer's router applied early) into slots of LRU experts; the
        exact router still decides what is computed, so a wrong guess costs only its bytes (and the evicted
        experts)."""
        for e in (int(e) for e in ids):
            if e in self.slot_of[layer]:
                continue
            pending = self._start(layer, e, set())
            if pending is None:
                return
            self.early[layer][e] = pending
            self.stats.prefetched += 1

    def __call__(self, layer: int, ids: np.ndarray):
        ids = [int(e) for e in ids]
        slot_of, lru, early = self.slot_of[layer], self.lru[layer], self.early[layer]
        for e in list(early):                    # reads started on a guess: land them all (their slots settle)
            self._land(layer, e, early.pop(e))
            if e in ids:
                self.stats.prefetch_used += 1
        hits = [e for e in ids if e in slot_of]
        misses = collections.deque(e for e in ids if e not in slot_of)
        self.stats.hits += len(hits)
        self.stats.misses += len(misses)
        for e in hits:
            if e in lru:
                lru.move_to_end(e)
        waiting = set(ids)                        # not yet computed: their slots must stay
        inflight, submitted = collections.deque(), []

        def refill():
            while misses and (self.overlap or not inflight):
                pending = self._start(layer, misses[0], waiting)
                if pending is None:
                    break
                inflight.append((misses.popleft(), pending))
                submitted.append(pending)

        def landed():
            """The first read in flight, waited for, and every other one already done (one batch)."""
            got = []
            while inflight and (not got or inflight[0][1].ready()):
                e, pending = inflight.popleft()
                self._land(layer, e, pending)
                got.append(e)
            return got
        refill()                                  # the misses' reads run while the hits compute
        if self.on_submitted is not None:
            self.on_submitted(layer)
        if self.overlap and hits:
            yield self.batch(layer, hits)
            waiting.difference_update(hits)
            refill()
        while inflight:
            got = landed()
            yield self.batch(layer, got)          # computed now: its slots may take the next misses
            waiting.difference_update(got)
            refill()
        if submitted:
            self._busy(submitted)
        if hits and not self.overlap:             # without overlap: the hits after the reads
            yield self.batch(layer, hits)
        assert not misses, "an expert cache needs at least one slot per layer"

    def batch(self, layer: int, ids: list[int]) -> ExpertBatch:
        """Experts ids of `layer`, all in slots: stacked for the row kernel when their matrices are in blocks."""
        if self.experts_layout.split:
            return ExpertBatch(ids, lambda e: (lambda x: self.gated(layer, [e], [x])[0]),
                               run=lambda ids, xs: self.gated(layer, ids, xs))
        return ExpertBatch(ids, lambda e: self.expert(layer, e), self.buf[layer] if self.stacked else None,
                           [self.slot_of[layer][e] for e in ids], self.experts_layout)

    def gated(self, layer: int, ids: list[int], xs: list[np.ndarray]) -> list[np.ndarray]:
        """Split chunks: experts ids of `layer` on their rows xs[i] [T_i, d] through the exact gate (ffn.gate's
        kernels): every neuron's coefficient from the slot's gate|up rows, the layer's threshold, the reads of the
        firing neurons' down columns the slot lacks (all the experts' in flight together, while the next expert's
        coefficients compute), then each sum in neuron order (zero coefficients skipped), so the bits do not depend
        on which columns were read."""
        k = self.cfg.n_experts_used          # experts in flight at once: the plan counts their arrays and staging
        if len(ids) > k:
            return self.gated(layer, ids[:k], xs[:k]) + self.gated(layer, ids[k:], xs[k:])
        E, work = self.experts_layout, []
        for e, x in zip(ids, xs):
            slot = self.slot_of[layer][e]
            buf, region = self.buf[layer, slot], layer * E.n_experts + e
            x = np.ascontiguousarray(x, dtype=np.float32)
            coef = np.empty((x.shape[0], E.n), np.float32)
            self.kernels.coefficients(E.heads(buf), x, coef, self.thresholds[layer], region)
            if self.observe is not None:
                self.observe(layer, coef)
            fire = np.flatnonzero(coef.any(axis=0)).astype(np.int32)
            missing = fire[~self.have[layer, slot, fire]]
            pending = self.column_reader.submit(region, missing, E.columns(buf), missing) if missing.size else None
            self.have[layer, slot, missing] = True
            self.fired += int(np.count_nonzero(coef))
            work.append((buf, region, x, coef, fire, pending))
        out = []
        for buf, region, x, coef, fire, pending in work:
            if pending is not None:
                self._count(pending)
            y = np.zeros_like(x)
            self.kernels.accumulate(E.columns(buf), fire, np.ascontiguousarray(coef[:, fire]), y, region)
            out.append(y)
        return out


class ExpertFFN:
    """The FFNFn of a mixture of experts from flash: per layer its router (and shared expert) in DRAM, its experts
    through the ExpertCache. plan: budget.ExpertPlan; freq: per layer how often each expert was routed on calibration
    text (pins the plan's `pinned` most routed), or None."""

    def __init__(self, cfg: ModelConfig, layout, weights: dict, plan, freq: np.ndarray | None = None,
                 threads: int | None = None, overlap: bool = True, lookahead: bool = False, verbose: bool = False,
                 thresholds=None):
        self.cfg, self.layout, self.plan = cfg, layout, plan
        self.stats = FlashStats.for_layers(cfg.n_layers, cfg.n_experts)
        pinned = None
        if freq is not None and plan.pinned:
            pinned = [np.argsort(-np.asarray(f), kind="stable")[:plan.pinned] for f in freq]
        elif plan.pinned == cfg.n_experts:        # room for every expert: all pinned, read once
            pinned = [np.arange(cfg.n_experts)] * cfg.n_layers
        self.cache = ExpertCache(cfg, layout, plan.slots, pinned, threads, self.stats, overlap)
        if thresholds is not None:
            self.thresholds = thresholds
        self.reader = self.cache.reader
        self.layers = [MixtureOfExperts(cfg, weights, i, experts=self.cache) for i in range(cfg.n_layers)]
        # lookahead: layer l+1's router on layer l's FFN input, re-weighted from layer l's norm to layer l+1's (as
        # runtime.lookahead_selector does for neurons), names the experts whose reads start while layer l computes
        self.norms = [weights.get(f"layers.{i}.ffn_norm.weight") for i in range(cfg.n_layers)]
        self.lookahead = lookahead
        self._x = None
        self.cache.on_submitted = self._guess_next

    @property
    def overlap(self) -> bool:
        return self.cache.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.cache.overlap = on

    @property
    def thresholds(self) -> list[float]:
        """Split chunks: per layer the exact gate's |coefficient| threshold (0: exact; ffn.gate.measure_thresholds
        sets and calibrates them as for a dense model, over every routed expert's coefficients)."""
        return self.cache.thresholds

    @thresholds.setter
    def thresholds(self, t) -> None:
        self.cache.thresholds = [float(v) for v in t]

    @property
    def observe(self):
        return self.cache.observe

    @observe.setter
    def observe(self, fn) -> None:
        self.cache.observe = fn

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        self._x = x
        t0, waited = time.perf_counter(), self.stats.read_s
        y = self.layers[layer](x)
        self.stats.compute_s += time.perf_counter() - t0 - (self.stats.read_s - waited)
        self.stats.rows[layer] += x.shape[0]
        self.stats.active[layer] += x.shape[0] * self.cfg.n_experts_used
        if layer == self.cfg.n_layers - 1:
            self.stats.tokens += x.shape[0]
        return y

    def _guess_next(self, layer: int) -> None:
        nxt = layer + 1
        if not self.lookahead or nxt >= self.cfg.n_layers or self._x is None:
            return
        t0 = time.perf_counter()
        x, w0, w1 = self._x, self.norms[layer], self.norms[nxt]
        if w0 is not None and w1 is not None:
            x = np.divide(x, w0, out=np.zeros_like(x), where=w0 != 0) * w1
        ids, _ = self.layers[nxt].route(x.astype(np.float32))
        self.stats.predictor_s += time.perf_counter() - t0
        self.cache.prefetch(nxt, np.unique(ids))
