"""NeuronCache over a real ffn.bin read by storage.reader.BundleReader, checked against an independent model of
the window rule (and against the file bytes) after every token of long random activation sequences; the DRAM
budget split."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_fixtures import write_random_flashdir
from flashinfer_lite.budget import MIN_WINDOW_ROWS, plan_budget, resident_bytes_for
from storage.errors import UserError
from storage.config import ModelConfig
from flashinfer_lite.neuron_cache import NeuronCache, select_hot
from storage.format import FlashLayout, read_layout
from storage.reader import BundleReader

N, LAYERS = 120, 2


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "flash"
    write_random_flashdir(path, "f16", d=24, n=N, n_layers=LAYERS, glu=True, bias=True)
    layout = read_layout(path)
    raw = np.fromfile(layout.ffn_path, np.uint8)
    # the oracle: each layer's bundles straight from the file, [n, stride]
    source = [raw[o:o + n * layout.stride].reshape(n, layout.stride) for o, n in zip(layout.offset, layout.n_neurons)]
    reader = BundleReader(layout, threads=2, coalesce_gap=1)
    yield layout, source, reader
    reader.close()


class SpyReader:
    """Forwards to the real reader and records every request."""

    def __init__(self, reader):
        self.reader, self.calls = reader, []

    def submit(self, layer, bundle_ids, dest, slots):
        self.calls.append((layer, np.array(bundle_ids)))
        return self.reader.submit(layer, bundle_ids, dest=dest, slots=slots)


def activation_sequence(rng, n_tokens, n, mean_active, stickiness):
    """Per token a sorted set of ids: skewed popularity, and part of each set carried over from the previous one."""
    pop = rng.dirichlet(np.full(n, 0.3))
    prev = np.zeros(0, np.int64)
    seq = []
    for _ in range(n_tokens):
        size = int(np.clip(rng.poisson(mean_active), 1, n))
        keep = prev[rng.random(prev.size) < stickiness]
        fresh = rng.choice(n, size, replace=False, p=pop)
        cur = np.unique(np.concatenate([keep, fresh]))[: max(size, 1)]
        seq.append(rng.permutation(cur))  # fetch order is arbitrary
        prev = cur
    return seq


class WindowModel:
    """The rule, written independently: cold resident set == union of the active sets of tokens
    [max(horizon, t-k+1), t] minus pinned, horizon advancing only when that union would not fit in capacity."""

    def __init__(self, k, cap, pinned):
        self.k, self.cap, self.pinned = k, cap, set(pinned)
        self.hist, self.horizon = [], 0

    def step(self, ids) -> set | None:
        cold = set(ids) - self.pinned
        if len(cold) > self.cap:
            return None  # refused: this token does not happen
        self.hist.append(cold)
        t = len(self.hist) - 1
        h = max(self.horizon, t - self.k + 1)
        while len(set().union(*self.hist[h:])) > self.cap:
            h += 1
        self.horizon = h
        return set().union(*self.hist[h:])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 6), cap=st.integers(8, 80), n_hot=st.integers(0, 30),
       mean_active=st.integers(2, 24), stickiness=st.floats(0, 0.9))
def test_cache_invariants_over_long_sequences(flash, seed, k, cap, n_hot, mean_active, stickiness):
    layout, source, reader = flash
    stride = layout.stride
    rng = np.random.default_rng(seed)
    seqs = [activation_sequence(rng, 150, N, mean_active, stickiness) for _ in range(LAYERS)]
    # hot = the truly most frequent neurons of the sequence (as a calibration profile would say)
    freqs = [np.bincount(np.concatenate(s), minlength=N).astype(float) for s in seqs]
    hot = select_hot(freqs, stride, n_hot * LAYERS * stride)
    spy = SpyReader(reader)
    cache = NeuronCache(layout.n_neurons, stride, spy, capacity=cap, window=k, hot=hot)
    # pinned neurons were read exactly once, at construction, in one call per layer that has any
    assert sorted(c[0] for c in spy.calls) == [i for i in range(LAYERS) if hot[i].size]
    for layer, ids in spy.calls:
        assert np.array_equal(np.sort(ids), hot[layer])
    spy.calls.clear()
    buffers = [cache.matrix(i) for i in range(LAYERS)]
    ptrs = [b.ctypes.data for b in buffers]
    models = [WindowModel(k, cap, hot[i]) for i in range(LAYERS)]

    for t in range(150):
        stats = cache.new_token()
        want_hits = want_misses = 0
        for layer in range(LAYERS):
            ids = seqs[layer][t]
            before = set(cache.cached(layer).tolist())
            n_calls = len(spy.calls)
            expected = models[layer].step(ids)
            if expected is None:
                with pytest.raises(UserError, match="cold neuron rows"):
                    cache.fetch(layer, ids)
                assert set(cache.cached(layer).tolist()) == before
                continue
            slots = cache.fetch(layer, ids)
            M = cache.matrix(layer)
            # the rows handed to the kernel hold exactly the requested bundles
            assert np.array_equal(M[slots], source[layer][ids])
            # every resident row holds its neuron's bundle; maps agree both ways
            res = cache.cached(layer)
            rows = np.arange(res.size)
            assert np.array_equal(M[rows], source[layer][res])
            assert np.array_equal(cache.slot_of(layer)[res], rows)
            assert (cache.slot_of(layer) >= 0).sum() == res.size
            # the window rule, exactly; the hot region untouched
            assert np.array_equal(res[: hot[layer].size], hot[layer])
            assert set(res[hot[layer].size:].tolist()) == expected
            # budget: never more rows than allotted, never a new matrix
            assert cache.window_rows(layer) <= cap
            assert cache.matrix(layer) is buffers[layer] and M.ctypes.data == ptrs[layer]
            # misses: one reader call with exactly the ids that were not resident; pinned never read again
            missing = set(ids.tolist()) - before
            new_calls = spy.calls[n_calls:]
            assert len(new_calls) == (1 if missing else 0)
            if missing:
                assert new_calls[0][0] == layer and set(new_calls[0][1].tolist()) == missing
                assert not set(new_calls[0][1].tolist()) & set(hot[layer].tolist())
            want_misses += len(missing)
            want_hits += ids.size - len(missing)
        assert (stats.hits, stats.misses) == (want_hits, want_misses)
        assert stats.requested_bytes == want_misses * stride and stats.read_bytes >= stats.requested_bytes


def test_fetch_refuses_bad_ids(flash):
    layout, source, reader = flash
    cache = NeuronCache(layout.n_neurons, layout.stride, reader, capacity=10, window=3)
    with pytest.raises(ValueError, match="duplicate"):
        cache.fetch(0, [1, 2, 1])
    with pytest.raises(ValueError, match="out-of-range"):
        cache.fetch(0, [N])
    assert cache.cached(0).size == 0
    slots = cache.fetch(0, [4, 5])
    assert np.array_equal(cache.matrix(0)[slots], source[0][[4, 5]])


@pytest.mark.parametrize("fails_in", ["submit", "wait"])
def test_failed_read_leaves_no_stale_rows(flash, fails_in):
    layout, source, reader = flash

    class FailingWait:
        def wait(self):
            raise OSError("simulated I/O error")

    class Failing:
        fail = False

        def submit(self, layer, bundle_ids, dest, slots):
            if self.fail:
                if fails_in == "submit":
                    raise OSError("simulated I/O error")
                return FailingWait()
            return reader.submit(layer, bundle_ids, dest=dest, slots=slots)

    r = Failing()
    cache = NeuronCache(layout.n_neurons, layout.stride, r, capacity=10, window=3)
    cache.fetch(0, [1, 2])
    r.fail = True
    with pytest.raises(OSError):
        cache.fetch(0, [2, 3, 4])
    assert set(cache.cached(0).tolist()) == {1, 2}
    r.fail = False
    slots = cache.fetch(0, [3, 4])
    assert np.array_equal(cache.matrix(0)[slots], source[0][[3, 4]])


def test_select_hot_takes_top_frequencies_across_layers():
    rng = np.random.default_rng(0)
    freqs = [rng.random(50) for _ in range(3)]
    hot = select_hot(freqs, 1024, 40 * 1024 + 1000)
    flat = np.concatenate(freqs)
    chosen = np.concatenate([f[h] for f, h in zip(freqs, hot)])
    assert chosen.size == 40 and chosen.min() > np.sort(flat)[-41]
    # frequency per byte: a layer with half the stride wins at equal frequency
    hot = select_hot([np.ones(4), np.ones(4)], [1024, 512], 2048)
    assert hot[0].size == 0 and np.array_equal(hot[1], np.arange(4))


# ---------------------------------------------------------------------------------------------------------------
# Budget

def llama_like(**kw):
    base = dict(arch="llama", vocab_size=512, dim=64, n_layers=5, n_heads=8, n_kv_heads=4, head_dim=8, ffn_dim=172,
                act="relu")
    return ModelConfig(**{**base, **kw})


def test_resident_bytes_match_a_real_checkpoint():
    """The resident estimate equals the non-FFN parameters of stories260K (plus nothing else)."""
    from conftest import STORIES
    from storage.checkpoint import open_checkpoint
    ck = open_checkpoint(STORIES)
    ffn = {f"layers.{i}.ffn.{v}.weight" for i in range(ck.config.n_layers) for v in ("gate", "up", "down")}
    assert resident_bytes_for(ck.config) == sum(ck.tensor(n).nbytes for n in ck.names() if n not in ffn)
    from flashinfer_lite.model import half_matrix
    half = sum(half_matrix(ck.tensor(n)).nbytes for n in ck.names() if n not in ffn)
    assert resident_bytes_for(ck.config, half=True) == half < resident_bytes_for(ck.config)


@pytest.mark.parametrize("max_active", [10, 60, 172])
def test_budget_split_and_minimum(flash, max_active):
    cfg = llama_like()
    layout = FlashLayout.create(cfg.dim, [cfg.ffn_dim] * cfg.n_layers, "f16", True, config=cfg.to_dict())
    lo = plan_budget(cfg, layout, 1 << 40, ctx=256, window=4, max_active=max_active).minimum_bytes
    with pytest.raises(UserError, match=f"minimum {lo / 2**20:.1f} MiB"):
        plan_budget(cfg, layout, lo - 1, ctx=256, window=4, max_active=max_active)
    prev = None
    for budget in (lo, lo + 100_000, lo + 2_000_000, lo + 50_000_000):
        p = plan_budget(cfg, layout, budget, ctx=256, window=4, max_active=max_active)
        assert p.used_bytes <= budget and p.minimum_bytes == lo
        assert min(MIN_WINDOW_ROWS, cfg.ffn_dim) <= p.window_rows <= cfg.ffn_dim
        assert p.hot_rows <= cfg.n_layers * cfg.ffn_dim
        if prev is not None:  # more budget never shrinks a part
            assert p.window_rows >= prev.window_rows and p.hot_bytes >= prev.hot_bytes
        prev = p
        assert "minimum" in p.table() and "hot region" in p.table()
    # with room for everything, every neuron of every layer is pinned
    assert prev.hot_rows == cfg.n_layers * cfg.ffn_dim


def test_cache_built_from_plan_stays_inside_it(flash):
    layout, source, reader = flash
    cfg = ModelConfig.from_dict(layout.config)
    for extra in (0, 30_000, 200_000):
        lo = plan_budget(cfg, layout, 1 << 40, ctx=32, window=3, max_active=20).minimum_bytes
        p = plan_budget(cfg, layout, lo + extra, ctx=32, window=3, max_active=20)
        freqs = [np.arange(N, dtype=float)[::-1] for _ in range(LAYERS)]
        hot = p.hot_neurons(freqs)
        assert sum(h.size for h in hot) == p.hot_rows
        cache = NeuronCache(layout.n_neurons, layout.stride, reader, capacity=p.window_rows, window=3, hot=hot)
        assert cache.nbytes <= p.window_bytes + p.hot_bytes + p.buffer_bytes


def test_start_fetch_marks_exactly_the_misses_and_moves_rows_only_when_the_window_shrinks(flash):
    """Overlap relies on `new` naming exactly the rows still being read; swap-delete moves a row only for a deletion
    no newcomer of the same token filled."""
    layout, source, reader = flash
    rng = np.random.default_rng(7)
    cache = NeuronCache(layout.n_neurons, layout.stride, reader, capacity=60, window=3)
    total_moved = 0
    for t, ids in enumerate(activation_sequence(rng, 80, N, 15, 0.5)):
        before = set(cache.cached(0).tolist())
        n_before = cache.window_rows(0)
        st = cache.new_token()
        f = cache.start_fetch(0, ids)
        assert set(ids[f.new].tolist()) == set(ids.tolist()) - before
        # rows not being read already hold their bundles while the read is in flight
        assert np.array_equal(cache.matrix(0)[f.slots[~f.new]], source[0][ids[~f.new]])
        f.finish()
        assert np.array_equal(cache.matrix(0)[f.slots], source[0][ids])
        shrink = n_before - cache.window_rows(0)
        assert st.moved <= max(0, shrink)
        total_moved += st.moved
    assert total_moved < 80 * 15 / 4   # far fewer copies than one per deletion


def test_prefetch_guess_serves_the_misses_it_covers_and_nothing_else(flash):
    layout, source, reader = flash
    spy = SpyReader(reader)
    cache = NeuronCache(layout.n_neurons, layout.stride, spy, capacity=40, window=2, staging_rows=12)
    cache.fetch(1, np.array([0, 1, 2, 3]))
    spy.calls.clear()
    st = cache.new_token()
    # guess: 2 and 3 are resident already, 50..59 are not; the exact set then needs 3, 50..54 and 90, 91
    assert cache.prefetch(1, np.r_[2, 3, 50:60]) == 10
    exact = np.r_[3, 50:55, 90, 91]
    slots = cache.fetch(1, exact)
    assert np.array_equal(cache.matrix(1)[slots], source[1][exact])
    assert st.prefetched == 10 and st.prefetch_used == 5
    # only the guess and the two neurons it missed were read from flash
    assert [(l, ids.tolist()) for l, ids in spy.calls] == [(1, list(range(50, 60))), (1, [90, 91])]
    # the unused part of the guess did not enter the window
    assert set(cache.cached(1).tolist()) == {0, 1, 2, 3, 50, 51, 52, 53, 54, 90, 91}
    # a guess for another layer is dropped, not misapplied
    cache.new_token()
    cache.prefetch(0, np.r_[5:9])
    slots = cache.fetch(1, np.r_[95, 96])
    assert np.array_equal(cache.matrix(1)[slots], source[1][[95, 96]])


def test_a_layer_pinned_whole_gives_its_rows_without_a_fetch(flash):
    """pinned_whole(layer): every neuron pinned, so slot_of(layer)[ids] are the rows a fetch would give (the exact
    gate's in-RAM down sum takes them without one): the file's bundles, nothing read after the pins; a layer with one
    neuron unpinned is not whole."""
    layout, source, reader = flash
    spy = SpyReader(reader)
    hot = [np.arange(N)[::-1], np.arange(N - 1)]        # layer 0 whole (pinned in any order), layer 1 one short
    cache = NeuronCache(layout.n_neurons, layout.stride, spy, capacity=4, window=3, hot=hot)
    assert cache.pinned_whole(0) and not cache.pinned_whole(1)
    pins = len(spy.calls)
    ids = np.array([0, 3, 7, 50, N - 1])
    rows = cache.slot_of(0)[ids]
    assert np.array_equal(cache.matrix(0)[rows], source[0][ids])
    assert np.array_equal(cache.fetch(0, ids), rows) and len(spy.calls) == pins
