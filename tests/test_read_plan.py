"""budget.plan_reads: the exact gate's reads of a token planned for time from the device's rates and the model's
activation frequencies; and storage.reader.RowStream running on into the following layers."""
from types import SimpleNamespace

import numpy as np
import pytest

from flashinfer_lite.budget import SPARSE_PIECE_S, plan_reads
from storage import reader as reader_mod
from storage.profile import DeviceRates

from test_reader import check_engine, flashdirs, engine  # noqa: F401  (fixtures)

N, STRIDE, GU_STRIDE, WINDOW = 8192, 1152, 2304, 512     # a real layer's rows (the 1.5B: 8,960)


def part(stride: int, layers: int):
    """What plan_reads asks of a split part: rows per layer, the row size, a layer's bytes."""
    return SimpleNamespace(n_neurons=[N] * layers, stride=stride, region_bytes=lambda i: N * stride)


def rates(seq_mbps: float, random_mbps: float) -> DeviceRates:
    return DeviceRates(seq_mbps * 1e6, ((4096, random_mbps * 1e6), (1 << 20, seq_mbps * 1e6)), "test")


def mixed_freq(layers: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.uniform(0.0, 0.1 if i % 2 else 1.0, N) for i in range(layers)]


def test_the_plan_is_one_function_of_the_profile_the_budget_and_the_statistics():
    """The same profile, budget and frequencies give the same plan, call after call (its sampled tokens have a
    fixed seed); every layer is read one of three ways and the printed plan names them."""
    L = 6
    args = (part(GU_STRIDE, L), part(STRIDE, L), 2, WINDOW, 700, mixed_freq(L), rates(1300, 500), 3)
    a, b = plan_reads(*args), plan_reads(*args)
    assert a.down == b.down and a.gate_up == b.gate_up and a.seconds == b.seconds and a.placement == b.placement
    assert all(np.array_equal(x, y) for x, y in zip(a.pinned, b.pinned))
    assert a.gate_up == ("resident",) * 2 + ("stream",) * 4
    assert set(a.down) <= {"resident", "stream", "sparse"} and "sparse" in a.down and "stream" in a.down
    assert sum(p.size for p in a.pinned) <= 700
    text = a.describe()
    assert "gate|up resident: layers 0-1; streamed: layers 2-5" in text and "down stream: layers" in text
    # the streams run on to the next streamed layer, the last one's to the next token's first
    first = a.down.index("stream")
    assert a.following("down", len(a.down) - 1) == first and a.following("gate_up", 5) == 2


def one_hot_layer(random_mbps: float, window_rows: int):
    """A layer of N rows where every 8th neuron fires on every token and no other does, planned at a random rate
    of random_mbps for 4 KiB reads; (the plan, its sparse time, its stream time) with the times worked out here: a
    token reads N/8 rows of STRIDE bytes, each its own request (no coalescing gap) spanning its 512-byte blocks (one
    more block: a row is off a boundary), at the random rate of that request size (below the smallest measured size:
    as many requests a second as at that size), plus a round trip per window-sized piece; streamed, N x STRIDE
    bytes at the sequential rate."""
    p = np.zeros(N)
    p[::8] = 1.0
    plan = plan_reads(part(GU_STRIDE, 1), part(STRIDE, 1), 1, window_rows, 0, [p], rates(1300, random_mbps), 0)
    span = -(-STRIDE // 512) * 512 + 512
    rows = N // 8
    sparse = rows * span / (random_mbps * 1e6 * span / 4096) + -(-rows // window_rows) * SPARSE_PIECE_S
    return plan, sparse, N * STRIDE / 1.3e9


@pytest.mark.parametrize("random_mbps, window_rows", [(r, w) for r in (50, 150, 300, 600, 1200) for w in (64, 1024)])
def test_a_layer_streams_or_reads_sparse_as_the_arithmetic_says(random_mbps, window_rows):
    """The plan prices both ways as worked out by hand and picks the cheaper, whatever the rates and the window."""
    plan, sparse, stream = one_hot_layer(random_mbps, window_rows)
    assert plan.sparse_s[0] == pytest.approx(sparse) and plan.stream_s[0] == pytest.approx(stream)
    assert plan.down == ("sparse" if sparse < stream else "stream",)


def test_the_rates_move_the_choice_across_the_break_even():
    """The same layer at random rates just under and just over break-even (sparse time = stream time): stream, then
    sparse; and at a rate that reads sparse, a window too small for the set (many pieces) streams again."""
    rows, span, window = N // 8, -(-STRIDE // 512) * 512 + 512, 1024
    stream = N * STRIDE / 1.3e9
    even = rows * 4096 / (stream - SPARSE_PIECE_S) / 1e6          # 4 KiB MB/s where the bytes take what is left
    ways = [one_hot_layer(even * f, window)[0].down[0] for f in (0.97, 1.03)]
    assert ways == ["stream", "sparse"]
    assert one_hot_layer(even * 1.03, 16)[0].down[0] == "stream"


def test_whole_layers_beat_the_hottest_rows_when_every_layer_streams():
    """60% of every layer fires: sparse reads never beat a stream, so pinned rows spread over the layers save
    nothing, while the same rows holding one layer whole (with the window) save its stream."""
    L = 4
    rng = np.random.default_rng(3)
    freq = [rng.uniform(0.5, 0.7, N) for _ in range(L)]      # the hottest rows lie in every layer
    plan = plan_reads(part(GU_STRIDE, L), part(STRIDE, L), 0, WINDOW, N - WINDOW, freq, rates(1300, 300), 3)
    assert plan.placement == "whole layers"
    assert plan.down.count("resident") == 1 and plan.down.count("stream") == L - 1
    assert plan.seconds == pytest.approx((L - 1) * N * STRIDE / 1.3e9 + L * N * GU_STRIDE / 1.3e9)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_stream_with_a_follower_reads_the_next_layers_ahead_and_in_order(flashdirs, engine, depth):  # noqa: F811
    """RowStream(follow=...): after a layer's last chunk went out, its buffers read the following layer's first
    chunks without a prime; every layer's rows are the file's, no primed chunk is dropped, and a stream asked for
    another layer than the one it ran on to starts over there."""
    path = flashdirs["f32"][0]
    with reader_mod.BundleReader(path, engine=engine, depth=4, max_read_bytes=4096) as r:
        check_engine(r, engine)
        L = r.layout
        raw = np.fromfile(path / "ffn.bin", np.uint8)
        rows = L.n_neurons[0] // 3 + 1                 # 3 chunks a layer
        s = reader_mod.RowStream(r, rows, depth, follow=lambda layer: (layer + 1) % L.n_layers)
        for layer in [0, 1, 0, 1]:
            got = [B.copy() for _, B, _, _ in s.chunks(layer)]
            want = raw[L.offset[layer]:L.offset[layer] + L.n_neurons[layer] * L.stride].reshape(-1, L.stride)
            assert np.array_equal(np.concatenate(got), want)
            assert s.primed == (layer + 1) % L.n_layers                   # already reading the next layer
        assert s.dropped.read_bytes == 0
        list(s.chunks(1))                              # it ran on to layer 0: asked for 1, it starts over
        assert s.dropped.read_bytes > 0
        s.cancel()


@pytest.mark.parametrize("n, chunk_rows, depth", [(4864, 8000, 2), (4864, 8000, 3), (8960, 4854, 2), (300, 7, 3),
                                                  (5, 8, 4), (1, 8, 2)])
def test_a_layer_smaller_than_depth_chunks_is_cut_into_depth_chunks(n, chunk_rows, depth):
    """stream_shape: chunks of chunk_bytes while a layer fills depth of them; a smaller layer in depth chunks (so one
    is read while another is computed), never more buffer bytes than depth chunks of chunk_bytes, nor more chunks than
    rows."""
    from storage.profile import stream_shape
    layout = SimpleNamespace(n_neurons=[n, n // 2], stride=STRIDE)
    rows, d = stream_shape(layout, chunk_rows * STRIDE, depth)
    assert rows * d * STRIDE <= max(chunk_rows * depth, depth) * STRIDE and rows <= chunk_rows
    assert d == min(depth, -(-n // rows))                      # the layer spans the chunks in flight
    assert d > 1 or n == 1                                      # one is read while another is computed
    if n >= chunk_rows * depth:
        assert rows == chunk_rows


def test_the_plan_prices_reads_at_the_profiled_rates_else_the_built_in_ones(tmp_path, monkeypatch):
    """device_rates: a flash-bench profile's stream MB/s and its random entries' MB/s by request size for the device
    holding the path; random_Bps interpolates in log2(size), below the smallest size at its requests per second;
    without a profile, the built-in defaults."""
    from storage import profile
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "down.bin"
    f.write_bytes(b"\0" * 4096)
    none = profile.device_rates(f)
    assert none.source == "built-in defaults" and none.seq_Bps == profile.DEFAULT_SEQ_MBPS * 1e6
    profile.save_profile(tmp_path, {"dir": str(tmp_path), "created": "now", "stream": {"chunk": 8 << 20, "depth": 2,
                                                                                       "MBps": 900.0},
                                    "entries": [{"chunk": 4096, "MBps": 200.0, "gap_bytes": 0},
                                                {"chunk": 65536, "MBps": 600.0, "gap_bytes": 0}]})
    r = profile.device_rates(f)
    assert r.seq_Bps == 900e6 and "flash-bench profile" in r.source
    assert r.random_Bps(4096) == 200e6 and r.random_Bps(2048) == 100e6 and r.random_Bps(65536) == 600e6
    assert r.random_Bps(16384) == pytest.approx(400e6)           # halfway in log2 between 4 and 64 KiB
    assert r.random_Bps(1 << 30) == 600e6                        # past the largest size, its rate
