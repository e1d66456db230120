"""NeuronCache: which FFN neurons sit in DRAM, in which row, and fetching the missing ones from flash.

Per layer one preallocated page-aligned bundle matrix uint8[n_hot + capacity, stride]:
  rows [0, n_hot)              static hot region (PowerInfer): the most frequently active neurons, read once at
                               start and never again;
  rows [n_hot, n_hot + n_win)  sliding window (LLM in a Flash §3.3): a cold neuron stays while it was active in any
                               of the last `window` tokens. A neuron leaving the window leaves a hole; this token's
                               newcomers are read straight into the holes (lowest first), then appended; holes left
                               over are filled by moving the last rows into them (swap-delete). So the rows stay
                               dense, nothing is reallocated, and rows are copied only when the window shrinks:
                               in steady state arrivals fill departures and no row moves at all.
Overflow policy: if a token's misses do not fit in `capacity`, whole groups of the oldest tokens are evicted early
(the window shrinks for that layer, never below the current token). Only if the current token's cold neurons alone
exceed `capacity` does fetch() raise UserError. So at any time, for each layer,
  cached cold neurons == union of the active sets of tokens max(horizon, t - window + 1) .. t, minus the pinned,
where `horizon` only moves forward when the window overflows.

Ids here are bundle ids (file positions in the layer region, as the reader takes them); neuron frequencies indexed
by original neuron id map to bundle ids with `freq[layout.order[layer]]`.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange

from storage.errors import UserError
from storage.reader import FlashStats, aligned_empty

# per-layer scalar state, int64[5]
_T, _HORIZON, _NWIN, _CALL, _NHOLES = 0, 1, 2, 3, 4
# codes returned by _admit
_OK, _BAD_ID, _DUPLICATE, _TOO_MANY = 0, -1, -2, -3


# The lookahead staging matrix's rows at most (NeuronCache's staging_rows): a guess larger than this is read in part,
# the rest on demand. The DRAM plan counts the same rows (budget).
STAGING_MAX_ROWS = 256


def staging_rows(max_active: int) -> int:
    """Rows of the lookahead staging matrix for a layer set of at most max_active neurons."""
    return min(max_active, STAGING_MAX_ROWS)


def select_hot(freqs: list[np.ndarray], stride: int | list[int], budget_bytes: int) -> list[np.ndarray]:
    """Greedy PowerInfer placement: neurons of all layers by activation frequency per byte, highest first, until
    `budget_bytes` is full. freqs[layer][bundle_id] -> float. Returns per layer the sorted pinned bundle ids."""
    strides = [stride] * len(freqs) if np.isscalar(stride) else list(stride)
    layer = np.concatenate([np.full(len(f), i, np.int32) for i, f in enumerate(freqs)])
    ident = np.concatenate([np.arange(len(f)) for f in freqs])
    size = np.asarray(strides, np.int64)[layer]
    score = np.concatenate([np.asarray(f, np.float64) for f in freqs]) / size
    order = np.argsort(-score, kind="stable")
    # Take the best-scoring neurons while they fit; with equal strides this is an exact top-N prefix.
    fits = np.cumsum(size[order]) <= budget_bytes
    chosen = order[fits]
    return [np.sort(ident[chosen[layer[chosen] == i]]) for i in range(len(freqs))]


@njit(cache=True)
def _remove(slot, slot_of, neuron_at, holes, state):
    """Delete the neuron in window row `slot`: the row becomes a hole (filled or compacted before _admit returns)."""
    slot_of[neuron_at[slot]] = -1
    neuron_at[slot] = -1
    holes[state[_NHOLES]] = slot
    state[_NHOLES] += 1


@njit(cache=True)
def _compact(lo, M, slot_of, neuron_at, state, n_hot):
    """Swap-delete: move the last live rows into the empty rows at or above `lo`, so the window is dense again."""
    hi = n_hot + state[_NWIN] - 1
    moved = 0
    while True:
        while lo <= hi and neuron_at[lo] >= 0:
            lo += 1
        while hi >= lo and neuron_at[hi] < 0:
            hi -= 1
        if lo >= hi:
            break
        i = neuron_at[hi]
        M[lo, :] = M[hi, :]
        neuron_at[lo] = i
        slot_of[i] = lo
        neuron_at[hi] = -1
        moved += 1
    state[_NWIN] = hi + 1 - n_hot if hi >= n_hot else 0
    state[_NHOLES] = 0
    return moved


@njit(cache=True, parallel=True, nogil=True)
def _copy_rows(dst, dst_rows, src, src_rows):
    """dst[dst_rows[j]] = src[src_rows[j]]: staged rows into the window at memcpy speed (numpy fancy indexing
    moved them at a fraction of DRAM bandwidth)."""
    for j in prange(dst_rows.shape[0]):
        dst[dst_rows[j], :] = src[src_rows[j], :]


@njit(cache=True)
def _evict_group(s, ring, ring_len, k, last_used, slot_of, neuron_at, holes, state, n_hot):
    """Evict the neurons whose latest activity was token s (their entry in s's ring list is the live one)."""
    g = s % k
    n = 0
    for j in range(ring_len[g]):
        i = ring[g, j]
        if last_used[i] == s and slot_of[i] >= n_hot:
            _remove(slot_of[i], slot_of, neuron_at, holes, state)
            n += 1
    return n


@njit(cache=True)
def _admit(ids, M, slot_of, neuron_at, last_used, seen, ring, ring_len, holes, state, n_hot, cap, k,
           out_slots, out_new, miss_ids, miss_slots, counts):
    """One token of one layer: give every id a row of the layer's matrix, return it in out_slots (out_new[j] = 1: being read).

    Misses get rows (holes first, then appended) and are listed in miss_ids / miss_slots for the caller to read.
    counts <- [n_miss, n_evicted, n_moved]. Returns _OK or an error code (the state is untouched on error).
    """
    n_ids = ids.shape[0]
    n_neurons = slot_of.shape[0]
    # Pass 0, read-only: validate and count the cold neurons this token needs.
    state[_CALL] += 1
    call = state[_CALL]
    n_cold = 0
    for j in range(n_ids):
        i = ids[j]
        if i < 0 or i >= n_neurons:
            return _BAD_ID
        if seen[i] == call:
            return _DUPLICATE
        seen[i] = call
        if not (0 <= slot_of[i] < n_hot):
            n_cold += 1
    if n_cold > cap:
        counts[0] = n_cold
        return _TOO_MANY
    t = state[_T] + 1
    state[_T] = t
    # Pass 1: mark activity first, so that expiry below spares neurons active again now.
    for j in range(n_ids):
        last_used[ids[j]] = t
    evicted = 0
    if t - k >= state[_HORIZON]:
        evicted += _evict_group(t - k, ring, ring_len, k, last_used, slot_of, neuron_at, holes, state, n_hot)
    g = t % k
    n = 0
    n_miss = 0
    for j in range(n_ids):
        i = ids[j]
        if not (0 <= slot_of[i] < n_hot):
            ring[g, n] = i
            n += 1
            if slot_of[i] < 0:
                n_miss += 1
    ring_len[g] = n
    # Overflow: drop whole oldest token groups until the misses fit (the current token always fits: n_cold <= cap).
    s = max(state[_HORIZON], t - k + 1)
    while state[_NWIN] - state[_NHOLES] + n_miss > cap and s < t:
        evicted += _evict_group(s, ring, ring_len, k, last_used, slot_of, neuron_at, holes, state, n_hot)
        s += 1
        state[_HORIZON] = s
    if state[_NWIN] - state[_NHOLES] + n_miss > cap:  # cannot happen (n_cold <= cap); guards the row writes below
        return _TOO_MANY
    # Newcomers take the lowest holes, so the holes left over lie above every newcomer: compaction then moves only
    # rows that hold data, never a row whose read is still to come.
    nh = state[_NHOLES]
    if nh > 1:
        holes[:nh] = np.sort(holes[:nh])
    m = 0
    for j in range(n_ids):
        i = ids[j]
        out_new[j] = 0
        if slot_of[i] < 0:
            out_new[j] = 1
            if m < nh:
                r = holes[m]
            else:
                r = n_hot + state[_NWIN]
                state[_NWIN] += 1
            slot_of[i] = r
            neuron_at[r] = i
            miss_ids[m] = i
            miss_slots[m] = r
            m += 1
    moved = 0
    if nh > m:
        moved = _compact(holes[m], M, slot_of, neuron_at, state, n_hot)
    state[_NHOLES] = 0
    # Rows are final only now: compaction may have moved hits.
    for j in range(n_ids):
        out_slots[j] = slot_of[ids[j]]
    counts[0] = n_miss
    counts[1] = evicted
    counts[2] = moved
    return _OK


class Fetch:
    """The result of NeuronCache.start_fetch: rows for every id; the misses' rows are valid after finish()."""

    def __init__(self, cache, L, slots, new, reading_rows, pending):
        self.cache, self._L, self.slots, self.new = cache, L, slots, new   # new[j]: slots[j] is being read
        self._rows, self._pending = reading_rows, pending

    @property
    def reading(self) -> bool:
        """A read is in flight (finish() not yet called and there were misses to read)."""
        return self._pending is not None

    def finish(self) -> None:
        """Wait for the misses' read (no-op without misses). A failed read rolls its rows back and raises."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        t0 = time.perf_counter()
        try:
            rs = pending.wait()
        except BaseException:
            NeuronCache._forget_misses(self._L, self._rows)
            raise
        st = self.cache.stats
        st += rs                                  # the reader's bytes, preadv calls and time in flight
        st.read_s += time.perf_counter() - t0


# The maps a layer keeps per neuron (bundle id) and their types: what budget.plan_budget counts per neuron.
NEURON_MAPS = {"slot_of": np.int32, "last_used": np.int64, "seen": np.int64, "out_slots": np.int32, "out_new": np.uint8}
MAP_BYTES_PER_NEURON = sum(np.dtype(t).itemsize for t in NEURON_MAPS.values())


class _Layer:
    """Arrays of one layer (see module docstring)."""

    def __init__(self, n_neurons: int, stride: int, hot: np.ndarray, capacity: int, window: int):
        self.n_hot = len(hot)
        self.capacity = capacity
        self.matrix = aligned_empty((self.n_hot + capacity, stride), np.uint8)  # [rows, stride]
        maps = NEURON_MAPS
        self.slot_of = np.full(n_neurons, -1, maps["slot_of"])   # bundle id -> row, -1 absent
        self.neuron_at = np.full(self.n_hot + capacity, -1, np.int32)  # row -> bundle id, -1 empty
        self.last_used = np.full(n_neurons, -(1 << 40), maps["last_used"])  # token of last activity
        self.seen = np.zeros(n_neurons, maps["seen"])            # duplicate check stamp
        self.ring = np.zeros((window, max(capacity, 1)), np.int32)  # cold ids active at each of the last k tokens
        self.ring_len = np.zeros(window, np.int64)
        self.state = np.zeros(5, np.int64)                       # t, horizon, n_win, call counter, n_holes
        self.holes = np.zeros(max(capacity, 1), np.int64)        # rows freed during one _admit
        self.out_slots = np.zeros(n_neurons, maps["out_slots"])
        self.out_new = np.zeros(n_neurons, maps["out_new"])      # 1 = the row is being read by this fetch
        self.miss_ids = np.zeros(max(capacity, 1), np.int64)
        self.miss_slots = np.zeros(max(capacity, 1), np.int64)
        self.counts = np.zeros(3, np.int64)                      # misses, evictions, rows moved
        self.hot = np.asarray(hot, np.int64)
        self.slot_of[self.hot] = np.arange(self.n_hot, dtype=np.int32)
        self.neuron_at[: self.n_hot] = self.hot

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.matrix, self.slot_of, self.neuron_at, self.last_used, self.seen,
                                      self.ring, self.ring_len, self.holes, self.out_slots, self.out_new,
                                      self.miss_ids, self.miss_slots))


class NeuronCache:
    """Bundle rows of all layers of one model, with sliding-window + hot/cold placement.

    cache = NeuronCache(layout.n_neurons, layout.stride, reader, capacity=plan.window_rows, window=5, hot=hot_ids)
    stats = cache.new_token()          # or pass stats=: the runtime's run-long record, added to as reads finish
    for layer ...: slots = cache.fetch(layer, active_bundle_ids); kernel(cache.matrix(layer), slots, x, y)

    reader: storage.reader.BundleReader, or anything with `submit(layer, bundle_ids, dest=..., slots=...)`
    returning an object whose wait() gives a storage.reader.FlashStats with the reader's fields.
    """

    def __init__(self, n_neurons: list[int], stride: int, reader, capacity: int | list[int], window: int = 5,
                 hot: list[np.ndarray] | None = None, staging_rows: int = 0, stats: FlashStats | None = None):
        if window < 1:
            raise UserError(f"window must be at least 1 token, got {window}")
        n_layers = len(n_neurons)
        caps = [int(capacity)] * n_layers if np.isscalar(capacity) else [int(c) for c in capacity]
        hot = hot if hot is not None else [np.zeros(0, np.int64)] * n_layers
        if len(caps) != n_layers or len(hot) != n_layers:
            raise UserError(f"capacity and hot sets must be given for each of the {n_layers} layers")
        self.stride, self.window, self.reader = stride, window, reader
        self.layers = []
        for i in range(n_layers):
            h = np.unique(np.asarray(hot[i], np.int64))
            if h.size and (h[0] < 0 or h[-1] >= n_neurons[i]):
                raise UserError(f"hot neuron ids of layer {i} out of range 0..{n_neurons[i] - 1}")
            if caps[i] < 0:
                raise UserError(f"window capacity of layer {i} is negative")
            self.layers.append(_Layer(n_neurons[i], stride, h, caps[i], window))
        self.stats = stats if stats is not None else FlashStats()
        # lookahead reads land here first: a wrong guess must not displace rows of the window
        self.staging = aligned_empty((staging_rows, stride), np.uint8) if staging_rows else None
        self._staged = None
        self._load_hot()

    def _load_hot(self) -> None:
        """The one and only read of the pinned neurons: one batched call per layer."""
        for i, L in enumerate(self.layers):
            if L.n_hot:
                self.reader.submit(i, L.hot, dest=L.matrix, slots=np.arange(L.n_hot)).wait()

    # -- per token ---------------------------------------------------------------------------------------------------
    def new_token(self) -> FlashStats:
        """Start counting afresh: returns the new record that fetch() fills in (one token's, if called per token)."""
        self.stats = FlashStats()
        return self.stats

    def fetch(self, layer: int, ids) -> np.ndarray:
        """Make the neurons `ids` (unique bundle ids) of `layer` cached; one token of that layer's window.

        Returns int32 rows of matrix(layer), aligned with ids (a view valid until the next fetch of this layer).
        Misses are read with ONE reader call, straight into their rows.
        """
        f = self.start_fetch(layer, ids)
        f.finish()
        return f.slots

    def start_fetch(self, layer: int, ids) -> "Fetch":
        """fetch() in two halves: the rows are assigned and the misses' read is in flight when this returns, so the
        caller can compute on the cached rows (slots[~fetch.new]) before fetch.finish()."""
        t0 = time.perf_counter()
        L = self.layers[layer]
        ids = np.asarray(ids, np.int64).ravel()
        rc = _admit(ids, L.matrix, L.slot_of, L.neuron_at, L.last_used, L.seen, L.ring, L.ring_len, L.holes,
                    L.state, L.n_hot, L.capacity, self.window, L.out_slots, L.out_new, L.miss_ids, L.miss_slots,
                    L.counts)
        if rc != _OK:
            if rc == _TOO_MANY:
                raise UserError(f"layer {layer}: one token needs {int(L.counts[0])} cold neuron rows but the window "
                                f"holds {L.capacity}; raise --dram-budget or lower the predictor's active count")
            what = "duplicate" if rc == _DUPLICATE else "out-of-range"
            raise ValueError(f"layer {layer}: {what} neuron id in fetch()")
        n_miss, n_evicted = int(L.counts[0]), int(L.counts[1])
        t1 = time.perf_counter()
        st = self.stats
        st.moved += int(L.counts[2])
        st.hits += ids.size - n_miss
        st.misses += n_miss
        st.evictions += n_evicted
        st.lookup_s += t1 - t0
        miss_ids, miss_slots = L.miss_ids[:n_miss], L.miss_slots[:n_miss]
        new = L.out_new[: ids.size].view(bool)
        if self._staged is not None and n_miss:
            miss_ids, miss_slots = self._take_staged(layer, L, miss_ids, miss_slots, new)
        pending = None
        if miss_ids.size:
            try:
                pending = self.reader.submit(layer, miss_ids, dest=L.matrix, slots=miss_slots)
            except BaseException:
                self._forget_misses(L, miss_slots)
                raise
        return Fetch(self, L, L.out_slots[: ids.size], new, miss_slots, pending)

    # -- speculative reads (lookahead) ------------------------------------------------------------------------------
    def prefetch(self, layer: int, ids) -> int:
        """Start reading the uncached neurons among `ids` (a lookahead guess of `layer`'s next set, sorted bundle
        ids) into the staging rows, before the layer's exact set is known. The next start_fetch(layer) copies the
        rows it needs from there instead of reading them; the rest of the guess is dropped. Returns rows requested."""
        if self.staging is None:
            return 0
        self._land_staged()       # an unconsumed guess's read must land before the staging rows are reused
        L = self.layers[layer]
        ids = np.sort(np.asarray(ids, np.int64).ravel())
        guess = ids[L.slot_of[ids] < 0][: self.staging.shape[0]]
        if not guess.size:
            return 0
        pending = self.reader.submit(layer, guess, dest=self.staging, slots=np.arange(guess.size))
        self._staged = (layer, guess, pending)
        return int(guess.size)

    def _land_staged(self):
        """Wait for the last guess's read and count it; returns (layer, guess ids), or None if there was none or its
        read failed (an exact read of those rows then reports the I/O error properly)."""
        if self._staged is None:
            return None
        layer, guess, pending = self._staged
        self._staged = None
        t0 = time.perf_counter()
        try:
            rs = pending.wait()
        except Exception:
            return None
        st = self.stats
        st.read_s += time.perf_counter() - t0
        st.io_s += rs.io_s
        st.read_bytes += rs.read_bytes          # not requested_bytes: nothing asked for these rows yet
        st.n_reads += rs.n_reads
        st.prefetched += guess.size
        return layer, guess

    def _take_staged(self, layer, L, miss_ids, miss_slots, new):
        """Copy the misses the last prefetch guessed from the staging rows; return the misses still to read."""
        landed = self._land_staged()
        if landed is None or landed[0] != layer:
            return miss_ids, miss_slots
        guess = landed[1]
        pos = np.minimum(np.searchsorted(guess, miss_ids), guess.size - 1)
        have = guess[pos] == miss_ids
        _copy_rows(L.matrix, miss_slots[have], self.staging, pos[have])
        self.stats.prefetch_used += int(have.sum())
        # the misses are the ids flagged new, in the same order (_admit lists them as it flags them)
        new[np.flatnonzero(new)[have]] = False
        return miss_ids[~have], miss_slots[~have]

    @staticmethod
    def _forget_misses(L: _Layer, rows: np.ndarray) -> None:
        """A failed read leaves its rows undefined: empty them and close the gaps (swap-delete)."""
        L.slot_of[L.neuron_at[rows]] = -1
        L.neuron_at[rows] = -1
        _compact(int(rows.min()), L.matrix, L.slot_of, L.neuron_at, L.state, L.n_hot)

    # -- inspection --------------------------------------------------------------------------------------------------
    def matrix(self, layer: int) -> np.ndarray:
        """The bundle matrix uint8[n_hot + capacity, stride] the kernels read (rows from fetch())."""
        return self.layers[layer].matrix

    def cached(self, layer: int) -> np.ndarray:
        """Bundle ids in DRAM now (pinned first, then window rows in row order)."""
        L = self.layers[layer]
        return L.neuron_at[: L.n_hot + int(L.state[_NWIN])].copy()

    def hot(self, layer: int) -> np.ndarray:
        return self.layers[layer].hot

    def window_rows(self, layer: int) -> int:
        return int(self.layers[layer].state[_NWIN])

    def pinned_whole(self, layer: int) -> bool:
        """Every neuron of `layer` is pinned: its rows are slot_of(layer), nothing is looked up, read or evicted."""
        L = self.layers[layer]
        return L.n_hot == L.slot_of.size

    def slot_of(self, layer: int) -> np.ndarray:
        """Read-only view: bundle id -> row (-1 absent)."""
        v = self.layers[layer].slot_of.view()
        v.flags.writeable = False
        return v

    @property
    def nbytes(self) -> int:
        """DRAM held by the cache: matrices plus bookkeeping arrays."""
        return sum(L.nbytes for L in self.layers) + (self.staging.nbytes if self.staging is not None else 0)

    def reset(self) -> None:
        """Forget the window (a new sequence); the hot region stays."""
        self._land_staged()
        for L in self.layers:
            L.slot_of[:] = -1
            L.slot_of[L.hot] = np.arange(L.n_hot, dtype=np.int32)
            L.neuron_at[L.n_hot:] = -1
            L.last_used[:] = -(1 << 40)
            L.ring_len[:] = 0
            L.state[_T] = L.state[_HORIZON] = L.state[_NWIN] = L.state[_NHOLES] = 0
