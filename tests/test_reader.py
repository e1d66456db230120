"""BundleReader: any set of bundles lands in the right destination rows, bit-exact with the file and equal to the
source weights (f32/f16 exactly, int8 within half a quantisation step); errors name file, offset and layer.
Every test of reading runs both engines: io_uring (where this kernel allows it) and the thread fallback."""
from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_fixtures import assert_stored_equal, bundle_vectors, write_random_flashdir
from storage.errors import UserError
from storage import reader as reader_mod
from storage.format import read_layout, unpack_bundles, verify
from storage.reader import aligned_empty, populate
from storage.reader import BundleReader

N = 300
ENGINES = ("io_uring", "threads")


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


def check_engine(r: BundleReader, engine: str) -> None:
    """The reader runs the engine asked for, unless this kernel refuses io_uring: then the test covers threads."""
    if r.engine != engine:
        assert engine == "io_uring" and r.fallback_reason.startswith("io_uring unavailable"), r.describe()
        pytest.skip(r.fallback_reason)


@pytest.fixture(scope="module")
def flashdirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("flash")
    return {dt: (root / dt, write_random_flashdir(root / dt, dt, n=N)) for dt in ("f32", "f16", "int8")}


@pytest.fixture(scope="module")
def readers(flashdirs):
    rs = {}
    for dt, (path, _) in flashdirs.items():
        for gap in (-1, 0, 2, 40):
            for threads in (1, 3):     # threads 1: the thread engine; 3: io_uring with 3 reads in flight
                rs[dt, gap, threads] = BundleReader(path, threads=threads, coalesce_gap=gap, max_read_bytes=16 << 10,
                                                    engine="threads" if threads == 1 else "io_uring", depth=threads)
    yield rs
    for r in rs.values():
        r.close()


# Bundle id sets built from runs (start, length) and single ids: covers adjacent runs, short gaps and long gaps.
id_sets = st.lists(st.tuples(st.integers(0, N - 1), st.integers(1, 40)), min_size=1, max_size=8).map(
    lambda runs: np.unique(np.concatenate([np.arange(s, min(s + n, N)) for s, n in runs])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=id_sets, dtype=st.sampled_from(["f32", "f16", "int8"]), gap=st.sampled_from([-1, 0, 2, 40]),
       threads=st.sampled_from([1, 3]), layer=st.integers(0, 1), seed=st.integers(0, 2**32 - 1))
def test_any_bundle_set_reads_back_the_source_weights(flashdirs, readers, ids, dtype, gap, threads, layer, seed):
    path, ckpt = flashdirs[dtype]
    r = readers[dtype, gap, threads]
    L = r.layout
    rng = np.random.default_rng(seed)
    ids = rng.permutation(ids)                                  # request order is arbitrary
    dest = aligned_empty((len(ids) + 5, L.stride), np.uint8)
    dest[:] = 0xA5
    slots = rng.permutation(dest.shape[0])[:len(ids)]           # arbitrary rows, some contiguous by chance
    stats = r.read(layer, ids, dest, slots)

    # Bit-exact against the file, read independently with plain buffered I/O.
    raw = np.fromfile(path / "ffn.bin", np.uint8)[L.offset[layer]:L.offset[layer] + N * L.stride].reshape(N, L.stride)
    assert np.array_equal(dest[slots], raw[ids])
    # Rows nobody asked for are untouched: coalesced gap bundles went to scratch.
    untouched = np.setdiff1d(np.arange(dest.shape[0]), slots)
    assert (dest[untouched] == 0xA5).all()

    # Equal to the source weights (identity order: bundle id == neuron id).
    vecs, biases = unpack_bundles(L, dest[slots])
    src = np.stack([bundle_vectors(ckpt, layer, i) for i in ids])
    assert_stored_equal(vecs, src, dtype)
    src_b = np.stack([ckpt.tensors[f"layers.{layer}.ffn.{v}.bias"][ids] for v in ("gate", "up")], axis=1)
    assert np.array_equal(biases, src_b)                         # biases are always float32

    assert stats.requested_bytes == len(ids) * L.stride
    assert stats.read_bytes >= stats.requested_bytes
    if gap < 0:
        assert stats.read_bytes == stats.requested_bytes and stats.n_reads == len(ids)
    else:
        holes = np.diff(np.sort(ids)) - 1
        over = holes[(holes > 0) & (holes <= gap)].sum() * L.stride
        # Every hole within the gap is read through, unless a read was split at max_read_bytes / IOV_MAX there.
        assert stats.read_bytes <= stats.requested_bytes + over


def test_iov_max_and_many_rows(tmp_path, engine):
    """3000 bundles with 1-bundle holes and scattered rows need > IOV_MAX iovecs per run: the reader must split."""
    path = tmp_path / "f"
    ckpt = write_random_flashdir(path, "f32", d=8, n=6200, n_layers=1, bias=False)
    ids = np.arange(0, 6000, 2)
    rng = np.random.default_rng(0)
    slots = rng.permutation(len(ids))
    with BundleReader(path, threads=2, coalesce_gap=1, max_read_bytes=1 << 30, engine=engine, depth=4) as r:
        check_engine(r, engine)
        dest = aligned_empty((len(ids), r.layout.stride), np.uint8)
        ops, _, _ = r.read_ops(0, ids, dest, slots)
        # Each bundle needs two iovecs (its row, the hole after it): runs must be cut just below IOV_MAX.
        assert ops.iov_count.max() <= reader_mod.IOV_MAX
        assert len(ops) >= -(-2 * len(ids) // reader_mod.IOV_MAX)
        stats = r.read(0, ids, dest, slots)
        assert stats.n_reads == len(ops)
        vecs, _ = unpack_bundles(r.layout, dest[slots])
    assert np.array_equal(vecs, np.stack([bundle_vectors(ckpt, 0, i) for i in ids]))


def test_bad_requests_are_refused(flashdirs):
    path, _ = flashdirs["f32"]
    with BundleReader(path, threads=1) as r:
        dest = aligned_empty((4, r.layout.stride), np.uint8)
        with pytest.raises(ValueError, match="duplicate"):
            r.read(0, [3, 3], dest, [0, 1])
        with pytest.raises(ValueError, match="bundle ids"):
            r.read(0, [N], dest, [0])
        with pytest.raises(ValueError, match="slots"):
            r.read(0, [1], dest, [4])
        with pytest.raises(ValueError, match="512-byte"):
            r.read(0, [1], aligned_empty((5 * r.layout.stride + 64,), np.uint8)[64:].reshape(5, -1), [0])
        assert r.read(0, [], dest, []).read_bytes == 0


def refuse_o_direct(monkeypatch) -> None:
    """os.open as on a filesystem that refuses O_DIRECT (EINVAL), as tmpfs before Linux 6.6 and some FUSE do."""
    real_open = os.open

    def open_refusing_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a)
    monkeypatch.setattr(reader_mod.os, "open", open_refusing_direct)


def test_buffered_fallback_when_o_direct_is_refused(flashdirs, monkeypatch, capsys, engine):
    """Filesystems that refuse O_DIRECT (tmpfs before Linux 6.6, some FUSE) get buffered reads + DONTNEED."""
    path, ckpt = flashdirs["f16"]
    advised = []
    monkeypatch.setattr(reader_mod, "_warned_buffered", False)
    refuse_o_direct(monkeypatch)
    monkeypatch.setattr(reader_mod.os, "posix_fadvise", lambda fd, off, n, adv: advised.append((off, n, adv)))
    r1, r2 = BundleReader(path, threads=2, engine=engine), BundleReader(path, threads=1, engine=engine)
    check_engine(r1, engine)
    assert not r1.direct and not r2.direct
    assert capsys.readouterr().err.count("O_DIRECT refused") == 1     # said once, not per reader
    ids = np.array([0, 1, 5, 299])
    dest = aligned_empty((4, r1.layout.stride), np.uint8)
    stats = r1.read(1, ids, dest, np.arange(4))
    vecs, _ = unpack_bundles(r1.layout, dest)
    src = np.stack([bundle_vectors(ckpt, 1, i) for i in ids])
    assert np.array_equal(vecs, src.astype(np.float16).astype(np.float32))
    assert sum(n for _, n, _ in advised) == stats.read_bytes            # every byte read is dropped from the cache
    assert {a for _, _, a in advised} == {os.POSIX_FADV_DONTNEED}
    r1.close(), r2.close()


def test_truncated_file_under_a_reader_names_file_offset_and_layer(tmp_path, engine):
    path = tmp_path / "f"
    write_random_flashdir(path, "f32", n=N)
    with BundleReader(path, threads=1, coalesce_gap=-1, engine=engine) as r:
        check_engine(r, engine)
        L = r.layout
        os.truncate(path / "ffn.bin", L.offset[1] + 10 * L.stride)
        dest = aligned_empty((1, L.stride), np.uint8)
        r.read(1, [9], dest, [0])                                  # still inside the file
        with pytest.raises(UserError, match=rf"ffn\.bin.*offset {L.offset[1] + 20 * L.stride}.*layer 1"):
            r.read(1, [20], dest, [0])
        # One bundle of a request past the end: the request waits for all its reads, then names the short one.
        dest = aligned_empty((3, L.stride), np.uint8)
        with pytest.raises(UserError, match=rf"short read at offset {L.offset[1] + 20 * L.stride} .*got 0 of"):
            r.read(1, [0, 3, 20], dest, [0, 1, 2])
        raw = np.fromfile(path / "ffn.bin", np.uint8)[L.offset[1]:].reshape(-1, L.stride)
        assert np.array_equal(dest[:2], raw[[0, 3]])


def inject_eio(monkeypatch, engine: str, failures: dict, short_by: int = 0) -> None:
    """The next failures["left"] reads fail with EIO (short_by > 0: come back short_by bytes short instead): the
    thread engine's preadv raises (returns less), the ring's completion says -EIO (less): what the kernel reports for
    a bad sector (a read cut short by a signal or a device reset)."""
    if engine == "threads":
        real = reader_mod._preadv

        def flaky(fd, iov_addr, n, off):
            if failures["left"] > 0:
                failures["left"] -= 1
                if not short_by:
                    raise OSError(errno.EIO, "Input/output error")
                return real(fd, iov_addr, n, off) - short_by
            return real(fd, iov_addr, n, off)
        monkeypatch.setattr(reader_mod, "_preadv", flaky)
    else:
        real = reader_mod.Ring.reap

        def flaky(ring):
            tags, res, when = real(ring)
            k = min(failures["left"], len(res))
            res[:k] = res[:k] - short_by if short_by else -errno.EIO
            failures["left"] -= k
            return tags, res, when
        monkeypatch.setattr(reader_mod.Ring, "reap", flaky)


@pytest.mark.parametrize("short_by", [0, 512], ids=["EIO", "short read"])
def test_a_failed_read_is_retried_once_then_reported(flashdirs, monkeypatch, engine, short_by):
    path, ckpt = flashdirs["f32"]
    failures = {"left": 1}
    with BundleReader(path, threads=1, engine=engine) as r:
        check_engine(r, engine)
        stride = r.layout.stride
        dest = aligned_empty((1, stride), np.uint8)
        inject_eio(monkeypatch, engine, failures, short_by)
        stats = r.read(0, [5], dest, [0])                          # one failure: the retry reads it whole
        assert stats.n_reads == 2
        assert np.array_equal(unpack_bundles(r.layout, dest)[0][0], bundle_vectors(ckpt, 0, 5))
        failures["left"] = 2
        why = (rf"short read at offset \d+ \(layer 0\): got {stride - short_by} of {stride} bytes" if short_by else
               r"offset \d+ \(layer 0\) failed: Input/output error")
        with pytest.raises(UserError, match=why):
            r.read(0, [5], dest, [0])
        dest = aligned_empty((2, stride), np.uint8)
        r.read(0, [5, 9], dest, [0, 1])                            # and the reader goes on
        assert np.array_equal(unpack_bundles(r.layout, dest)[0], np.stack([bundle_vectors(ckpt, 0, i) for i in (5, 9)]))


@pytest.mark.parametrize("errno_", [errno.ENOSYS, errno.EPERM])
def test_thread_fallback_where_io_uring_is_refused(flashdirs, monkeypatch, errno_):
    """Old kernels (ENOSYS), seccomp sandboxes and io_uring_disabled (EPERM): same bytes, through threads, and
    describe() (printed once by -v) says which engine and why."""
    path, ckpt = flashdirs["f16"]

    def refused(*args):
        raise OSError(errno_, os.strerror(errno_))
    monkeypatch.setattr(reader_mod, "setup", refused)
    with BundleReader(path, threads=2, engine="io_uring") as r:
        assert r.engine == "threads"
        assert f"2 threads of preadv (io_uring unavailable: {os.strerror(errno_)})" in r.describe()
        ids = np.array([0, 1, 5, 299])
        dest = aligned_empty((4, r.layout.stride), np.uint8)
        r.read(1, ids, dest, np.arange(4))
        raw = np.fromfile(path / "ffn.bin", np.uint8)[r.layout.offset[1]:].reshape(-1, r.layout.stride)
        assert np.array_equal(dest, raw[ids])


def test_ring_without_cooperative_task_running(flashdirs, monkeypatch):
    """Before Linux 5.19 io_uring_setup refuses IORING_SETUP_COOP_TASKRUN with EINVAL: the ring is set up without it
    and reads the same bytes."""
    path, _ = flashdirs["f16"]
    real, asked = reader_mod.setup, []

    def old_kernel(entries, flags=0):
        asked.append(flags)
        if flags:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(entries, flags)
    monkeypatch.setattr(reader_mod, "setup", old_kernel)
    with BundleReader(path, engine="io_uring", depth=4) as r:
        check_engine(r, "io_uring")
        assert asked == [reader_mod.IORING_SETUP_COOP_TASKRUN, 0]
        ids = np.array([3, 0, 7, 150, 299, 42])
        dest = aligned_empty((6, r.layout.stride), np.uint8)
        r.read(1, ids, dest, np.arange(6))
        raw = np.fromfile(path / "ffn.bin", np.uint8)[r.layout.offset[1]:].reshape(-1, r.layout.stride)
        assert np.array_equal(dest, raw[ids])


def test_reader_refuses_a_truncated_flashdir_at_open(tmp_path):
    path = tmp_path / "f"
    write_random_flashdir(path, "f16", n=N)
    size = os.path.getsize(path / "ffn.bin")
    os.truncate(path / "ffn.bin", size - 4096)
    with pytest.raises(UserError, match="truncated"):
        BundleReader(path)
    assert read_layout(path, check_size=False).ffn_size == size


def test_buffered_reads_where_posix_fadvise_does_not_exist(flashdirs, monkeypatch):
    """macOS has no posix_fadvise and no O_DIRECT: the reader (and verify) still read the right bytes."""
    path, ckpt = flashdirs["f16"]
    monkeypatch.setattr(reader_mod, "_warned_buffered", True)
    refuse_o_direct(monkeypatch)
    monkeypatch.delattr(os, "posix_fadvise")
    r = BundleReader(path, threads=2)
    assert not r.direct
    ids = np.array([3, 7, 298])
    dest = aligned_empty((3, r.layout.stride), np.uint8)
    r.read(0, ids, dest, np.arange(3))
    vecs, _ = unpack_bundles(r.layout, dest)
    src = np.stack([bundle_vectors(ckpt, 0, i) for i in ids])
    assert np.array_equal(vecs, src.astype(np.float16).astype(np.float32))
    verify(path)                                                         # checksums stream through the same path


def test_requests_in_flight_together_finish_in_any_order(flashdirs, engine):
    """Several submits before any wait (the neuron cache's lookahead does this), more ops than the ring holds, waited
    in reverse order and from two threads: every request gets its own bytes."""
    path, _ = flashdirs["int8"]
    with BundleReader(path, threads=2, coalesce_gap=-1, engine=engine, depth=4) as r:
        check_engine(r, engine)
        L = r.layout
        raw = np.fromfile(path / "ffn.bin", np.uint8)
        rng = np.random.default_rng(3)
        reqs = []
        for k in range(6):
            layer = k % 2
            ids = rng.choice(N, 25, replace=False)
            dest = aligned_empty((25, L.stride), np.uint8)
            reqs.append((layer, ids, dest, r.submit(layer, ids, dest, np.arange(25))))
        waiter = threading.Thread(target=lambda: [p.wait() for *_, p in reqs[::2]])
        waiter.start()
        for *_, p in reqs[::-1]:
            p.wait()
        waiter.join()
        for layer, ids, dest, p in reqs:
            rows = raw[L.offset[layer]:L.offset[layer] + N * L.stride].reshape(N, L.stride)
            assert np.array_equal(dest, rows[ids])
            assert p.wait().n_reads == 25


@pytest.mark.parametrize("rows, depth", [(7, 3), (1, 1), (N, 2)])
def test_a_stream_reads_each_layer_whole_in_order_with_chunks_in_flight(flashdirs, engine, rows, depth):
    """RowStream: a layer's bundles chunk after chunk (spans straight into its buffers, also for strides that are not
    multiples of 512), the file's bytes; a stream primed for one layer and asked for another reads the other."""
    for dt in ("f32", "f16", "int8"):
        path = flashdirs[dt][0]
        with BundleReader(path, threads=2, engine=engine, depth=4, max_read_bytes=4096) as r:
            check_engine(r, engine)
            L = r.layout
            raw = np.fromfile(path / "ffn.bin", np.uint8)
            s = reader_mod.RowStream(r, rows, depth)
            s.prime(0)
            for layer in (1, 0, 1):
                got, starts = [], []
                for first, B, rs, _ in s.chunks(layer):
                    starts.append(first)
                    got.append(B.copy())
                    assert rs.requested_bytes == B.nbytes and rs.read_bytes >= B.nbytes
                want = raw[L.offset[layer]:L.offset[layer] + L.n_neurons[layer] * L.stride].reshape(-1, L.stride)
                assert starts == list(range(0, L.n_neurons[layer], rows))
                assert np.array_equal(np.concatenate(got), want), (dt, layer)
            assert s.dropped.read_bytes > 0 and s.primed == -1          # layer 0's primed chunks, read and unused


def test_a_stream_past_the_end_of_a_truncated_file_names_it(tmp_path, engine):
    path = tmp_path / "f"
    write_random_flashdir(path, "f32", n=N)
    with BundleReader(path, engine=engine) as r:
        check_engine(r, engine)
        L = r.layout
        os.truncate(path / "ffn.bin", L.offset[1] + 10 * L.stride)
        s = reader_mod.RowStream(r, 64, 2)
        with pytest.raises(UserError, match=r"ffn\.bin.*short read.*layer 1"):
            for _ in s.chunks(1):
                pass
        assert s.primed == -1


@pytest.mark.parametrize("short_by", [0, 512], ids=["EIO", "short read"])
def test_a_streams_failed_read_is_retried_once_then_reported(flashdirs, monkeypatch, engine, short_by):
    """A stream's reads are the reader's: one failure is retried and the rows are the file's; two fail the stream
    with one error, no read left in flight, and the next stream of that reader reads the file."""
    path = flashdirs["f32"][0]
    raw = np.fromfile(path / "ffn.bin", np.uint8)
    failures = {"left": 1}
    with BundleReader(path, threads=1, engine=engine, depth=2, max_read_bytes=1 << 20) as r:
        check_engine(r, engine)
        L = r.layout
        want = raw[L.offset[0]:L.offset[0] + L.n_neurons[0] * L.stride].reshape(-1, L.stride)
        s = reader_mod.RowStream(r, 50, 2)
        inject_eio(monkeypatch, engine, failures, short_by)
        assert np.array_equal(np.concatenate([B.copy() for _, B, _, _ in s.chunks(0)]), want)
        assert failures["left"] == 0
        failures["left"] = 2
        s = reader_mod.RowStream(r, 50, 1)           # one read in flight: both failures are the same read's
        with pytest.raises(UserError, match=r"ffn\.bin.*layer 0"):
            for _ in s.chunks(0):
                pass
        assert s.primed == -1
        assert np.array_equal(np.concatenate([B.copy() for _, B, _, _ in s.chunks(0)]), want)


@settings(max_examples=200, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), min_size=0, max_size=25))
def test_busy_seconds_is_the_length_of_the_union_of_the_intervals(spans):
    """Against unit cells: intervals with whole-number ends cover cell [i, i + 1) or not; the union's length is the
    number of cells covered."""
    from storage.reader import busy_seconds
    s = np.array([a for a, _ in spans], float)
    t = s + np.array([n for _, n in spans], float)
    covered = np.zeros(81, bool)
    for a, b in zip(s.astype(int), t.astype(int)):
        covered[a:b] = True
    assert busy_seconds(s, t) == covered.sum()


def test_stamps_say_when_a_read_landed_not_when_it_was_reaped(flashdirs, engine):
    """A stamped reader's reads carry when each op went to the kernel and when it landed. With the ring, the watcher
    stamps a completion while the caller keeps the GIL and never enters the kernel: the stamp is earlier than the
    caller's wait(), where an unstamped ring would have said the time of that wait. The bytes are the file's."""
    path, _ = flashdirs["f32"]
    with BundleReader(path, threads=1, engine=engine, stamps=True, coalesce_gap=-1) as r:
        check_engine(r, engine)
        L = r.layout
        dest = aligned_empty((3, L.stride), np.uint8)
        t0 = time.perf_counter()
        pending = r.submit(1, [2, 7, 9], dest, [0, 1, 2])
        if engine == "io_uring":
            seen = r._engine.ring._seen
            first = int(seen[0])
            while int(seen[0]) - first < 3 and time.perf_counter() - t0 < 60:   # busy in Python, no system call
                pass
            assert int(seen[0]) - first == 3, "the watcher stamped no completion"
        else:
            while not pending.ready():        # the thread engine's workers stamp each op as its preadv returns
                time.sleep(0.001)
        t_seen = time.perf_counter()
        st = pending.wait()
        assert len(pending.started) == len(pending.landed) == st.n_reads == 3
        assert (t0 <= pending.started).all() and (pending.started <= pending.landed).all()
        assert (pending.landed <= t_seen).all()
        raw = np.fromfile(path / "ffn.bin", np.uint8)[L.offset[1]:].reshape(-1, L.stride)
        assert np.array_equal(dest, raw[[2, 7, 9]])


def test_reads_land_whole_in_huge_page_rows(flashdirs, engine):
    """aligned_empty(huge=True) (the expert cache's slots): 2 MiB-aligned rows that take O_DIRECT reads like any
    others: the file's bytes land in the rows asked for, the rest stay as they were."""
    path, _ = flashdirs["f32"]
    with BundleReader(path, threads=2, engine=engine, coalesce_gap=-1) as r:
        check_engine(r, engine)
        L = r.layout
        dest = aligned_empty((6, L.stride), np.uint8, huge=True)
        assert dest.ctypes.data % reader_mod.HUGE_PAGE == 0 and dest.shape == (6, L.stride)
        dest[:] = 0xA5
        r.read(0, [4, 1, 30], dest, [5, 0, 2])
        raw = np.fromfile(path / "ffn.bin", np.uint8)[L.offset[0]:].reshape(-1, L.stride)
        assert np.array_equal(dest[[5, 0, 2]], raw[[4, 1, 30]]) and (dest[[1, 3, 4]] == 0xA5).all()


# ----------------------------------------------------------------------------------------------------------------------
# PartsReader: the bundles of a FLASHDIR that keeps them only in the split parts (no ffn.bin)

@pytest.fixture(scope="module")
def parted(tmp_path_factory, flashdirs):
    """The same random checkpoints written twice: as ffn.bin's bundles (flashdirs) and as the split parts alone. The
    f32 one's parts are 512-aligned down rows and packed gate|up rows; the q4_1 one's (down columns) both packed."""
    root = tmp_path_factory.mktemp("parts")
    out = {}
    for dt in ("f32", "int8", "q4_1"):
        kw = {"d": 64} if dt == "q4_1" else {}
        ckpt = write_random_flashdir(root / dt, dt, n=N, ffn_layout="parts", seed=7, **kw)
        write_random_flashdir(root / f"{dt}-bundles", dt, n=N, seed=7, **kw)
        out[dt] = (root / dt, root / f"{dt}-bundles", ckpt)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=id_sets, dtype=st.sampled_from(["f32", "int8", "q4_1"]), gap=st.sampled_from([-1, 0, 40]),
       layer=st.integers(0, 1), seed=st.integers(0, 2**32 - 1))
def test_parts_assemble_the_bundles_ffn_bin_would_hold(parted, ids, dtype, gap, layer, seed):
    """Any bundle set read through the parts equals, byte for byte, the same bundles read from an ffn.bin written from
    the same weights, and (f32) the source weights; rows nobody asked for are untouched."""
    path, bundled, ckpt = parted[dtype]
    rng = np.random.default_rng(seed)
    ids = rng.permutation(ids)
    with reader_mod.bundle_reader(read_layout(path), coalesce_gap=gap) as r, BundleReader(bundled) as b:
        assert isinstance(r, reader_mod.PartsReader) and not r.layout.bundled and not (path / "ffn.bin").exists()
        assert r.layout.stride == b.layout.stride
        got = aligned_empty((len(ids) + 3, r.layout.stride), np.uint8)
        want = aligned_empty(got.shape, np.uint8)
        got[:] = want[:] = 0xA5
        slots = rng.permutation(got.shape[0])[:len(ids)]
        stats = r.read(layer, ids, got, slots)
        b.read(layer, ids, want, slots)
    assert np.array_equal(got, want)
    parts = r.layout.parts.values()
    assert stats.requested_bytes == len(ids) * sum(P.stride for P in parts)
    if dtype == "f32":
        vecs, _ = unpack_bundles(r.layout, got[slots])
        assert np.array_equal(vecs, np.stack([bundle_vectors(ckpt, layer, i) for i in ids]))


def test_a_stream_over_the_parts_reads_each_layer_whole(parted, engine):
    """RowStream over a PartsReader: every layer's bundles, chunk after chunk, as ffn.bin's would be."""
    for dt in ("f32", "q4_1"):
        path, bundled, _ = parted[dt]
        with reader_mod.PartsReader(path, engine=engine, depth=4, max_read_bytes=4096) as r, \
                BundleReader(bundled) as b:
            check_engine(r.parts[0][1], engine)
            s = reader_mod.RowStream(r, 37, 2)
            for layer in (1, 0):
                got = np.concatenate([B.copy() for _, B, _, _ in s.chunks(layer)])
                want = aligned_empty(got.shape, np.uint8)
                b.read(layer, np.arange(got.shape[0]), want, np.arange(got.shape[0]))
                assert np.array_equal(got, want), (dt, layer)


def test_a_truncated_part_is_named(tmp_path, engine):
    path = tmp_path / "f"
    write_random_flashdir(path, "f32", n=N, ffn_layout="parts")
    L = read_layout(path)
    with reader_mod.PartsReader(L, engine=engine) as r:
        check_engine(r.parts[0][1], engine)
        D = L.parts["down"]
        os.truncate(D.ffn_path, D.offset[1] + 10 * D.stride)
        dest = aligned_empty((20, L.stride), np.uint8)
        with pytest.raises(UserError, match=r"down\.bin.*short read.*layer 1"):
            r.read(1, np.arange(5, 25), dest, np.arange(20))
    with pytest.raises(UserError, match=r"down\.bin.*truncated"):
        read_layout(path)


def test_populate_faults_pages_in_without_changing_them():
    """After populate, writing every page of a fresh mapping takes (almost) no page faults (getrusage's count: the
    kernel's own), and bytes already written keep their values; without it the same writes fault the pages in (one
    fault a folio: a page, or a few where the kernel allocates anonymous memory in larger folios). No huge pages, so
    that the cold writes fault often enough to compare."""
    import mmap
    import resource
    pages = 2048

    def fresh():
        m = mmap.mmap(-1, pages * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            m.madvise(mmap.MADV_NOHUGEPAGE)
        return np.frombuffer(m, np.uint8).reshape(pages, 4096)

    def faults_writing(a):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a[:, 1] = 7
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    cold_faults = faults_writing(fresh())
    assert cold_faults >= pages // 16
    warm = fresh()
    warm[:8, :] = 5                                   # a read already landed here
    if not populate(warm):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert faults_writing(warm) < cold_faults // 8
    assert (warm[:8, 0] == 5).all() and (warm[:8, 1] == 7).all() and (warm[:8, 2:] == 5).all()
