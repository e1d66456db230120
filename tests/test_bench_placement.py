"""bench/placement.py counts what the runtime would do: its request counts are the real reader's plan, its windowed
sets are the real NeuronCache's misses, and its co-activation order keeps neurons that always fire together adjacent.
No timing is asserted."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from flashinfer_lite.neuron_cache import NeuronCache
from storage.format import FlashLayout
from storage.reader import BundleReader, CountedRead, aligned_empty
from storage.stats import FlashStats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import placement  # noqa: E402


@pytest.fixture
def ffn_file(tmp_path):
    n, stride = 300, 512
    layout = FlashLayout(d=1, dtype="f32", vectors=("up", "down"), biases=(), stride=stride, offset=[0],
                         n_neurons=[n], order=[np.arange(n)], checksum=[""], ffn_size=n * stride,
                         files={"ffn": "ffn.bin", "resident": "-", "tokenizer": "-"}, flashdir=tmp_path)
    (tmp_path / "ffn.bin").write_bytes(bytes(n * stride))
    return layout


@pytest.mark.parametrize("gap", [-1, 0, 1, 3])
def test_count_runs_is_the_readers_plan(ffn_file, gap):
    rng = np.random.default_rng(gap + 5)
    dest = aligned_empty((ffn_file.n_neurons[0], ffn_file.stride), np.uint8)
    with BundleReader(ffn_file, threads=1, coalesce_gap=gap) as r:
        for density in (0.05, 0.3, 0.8):
            ids = np.flatnonzero(rng.random(ffn_file.n_neurons[0]) < density)
            ops, _, read_bytes = r.read_ops(0, ids, dest, np.arange(ids.size))
            assert placement.count_runs(ids, gap) == (len(ops), read_bytes // ffn_file.stride)


def test_windowed_sets_are_the_caches_misses():
    rng = np.random.default_rng(0)
    T, n, window = 40, 64, 3
    active = rng.random((T, n)) < 0.25
    hot = np.array([1, 7, 30])

    class Recorder:          # a reader that records what the cache asks for
        def __init__(self):
            self.asked = []

        def submit(self, layer, bundle_ids, dest=None, slots=None):
            self.asked.append(np.sort(np.asarray(bundle_ids)))
            return CountedRead(FlashStats())

    rec = Recorder()
    cache = NeuronCache([n], 8, rec, capacity=n, window=window, hot=[hot])
    misses = []
    for t in range(T):
        before = len(rec.asked)
        cache.fetch(0, np.flatnonzero(active[t]))
        misses.append(rec.asked[-1] if len(rec.asked) > before else np.zeros(0, np.int64))
    expected = placement.to_read(active, hot, window)
    for t in range(T):
        assert np.array_equal(misses[t], expected[t]), t


def test_coactivation_order_puts_groups_that_fire_together_side_by_side():
    rng = np.random.default_rng(1)
    n, group = 96, 4
    groups = rng.permutation(n).reshape(-1, group)            # planted: the 4 neurons of a group always fire together
    active = np.zeros((500, n), bool)
    for t in range(active.shape[0]):
        for g in rng.choice(len(groups), 3, replace=False):
            active[t, groups[g]] = True
    order = placement.coactivation_order(active, hot=0)
    assert np.array_equal(np.sort(order), np.arange(n))
    pos = np.argsort(order)
    for g in groups:
        assert pos[g].max() - pos[g].min() == group - 1, g
    hot_first = placement.coactivation_order(active, hot=8)
    assert np.array_equal(hot_first[:8], placement.frequency_order(active)[:8])
