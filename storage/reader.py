"""BundleReader: read sets of neuron bundles from ffn.bin straight into caller-provided rows, with O_DIRECT.

Why it is built this way:
- O_DIRECT: the page cache would hide the flash cost we are budgeting, and would double the DRAM used for weights.
- A persistent pool of threads, each looping over its own batch of os.preadv calls: Python dispatch per read (one
  executor future each) caps at ~25k IOPS, while per-thread batches keep the device queue full from 16 KiB up.
- Coalescing: bundles whose file gap is at most `coalesce_gap` bundles are fetched by one preadv whose iovecs scatter
  into the destination rows; gap bundles land in a scratch buffer and count as over-read.
"""
from __future__ import annotations

import errno
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np

from storage.errors import UserError

from .format import BUNDLE_ALIGN, FlashLayout, drop_from_page_cache, read_layout
from .profile import reader_defaults
from .stats import FlashStats

IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
_warned_buffered = False


def aligned_empty(shape, dtype=np.uint8, align: int = 4096) -> np.ndarray:
    """An uninitialised C-contiguous array whose first byte sits on an `align` boundary (O_DIRECT needs this)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def open_for_reads(path: Path) -> tuple[int, bool]:
    """(fd, direct): O_DIRECT if the filesystem accepts it (checked with a real aligned read), else buffered."""
    global _warned_buffered
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise UserError(f"{path}: cannot open ({e.strerror})")
        else:
            probe = aligned_empty((BUNDLE_ALIGN,), np.uint8)
            try:
                os.preadv(fd, [memoryview(probe)], 0)   # some filesystems accept the flag but refuse the read
                return fd, True
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EINVAL:
                    raise UserError(f"{path}: cannot read ({e.strerror})")
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise UserError(f"{path}: cannot open ({e.strerror})")
    if not _warned_buffered:
        _warned_buffered = True
        print(f"flashinfer-lite: O_DIRECT refused for {path}; using buffered reads + posix_fadvise(DONTNEED)",
              file=sys.stderr)
    return fd, False


class BundleReader:
    """reader.read(layer, bundle_ids, dest, slots) reads bundle bundle_ids[j] of `layer` into dest[slots[j]].

    dest: uint8 [slots, stride], C-contiguous, base 512-aligned (use aligned_empty, above).
    Bundle ids are positions in the file; layout.order[layer][bundle_id] is the original neuron id.
    threads / coalesce_gap (in bundles; < 0 disables coalescing, 0 merges only adjacent bundles) default to the
    device profile saved by `flashinfer-lite flash-bench`, else to built-in defaults.
    """

    def __init__(self, layout_or_flashdir, threads: int | None = None, coalesce_gap: int | None = None,
                 max_read_bytes: int = 1 << 20):
        self.layout = layout_or_flashdir if isinstance(layout_or_flashdir, FlashLayout) \
            else read_layout(layout_or_flashdir)
        self.path = self.layout.ffn_path
        stride = self.layout.stride
        prof_threads, prof_gap_bytes, self.settings_source = reader_defaults(self.path, stride)
        self.threads = max(1, int(threads if threads is not None else prof_threads))
        self.coalesce_gap = int(coalesce_gap if coalesce_gap is not None else prof_gap_bytes // stride)
        # A dense run is still split so that a big request spreads over the threads.
        self.max_read_bundles = max(1, max_read_bytes // stride)
        self.fd, self.direct = open_for_reads(self.path)
        self._scratch = aligned_empty((max(self.coalesce_gap, 1) * stride,), np.uint8)
        self._scratch_mv = memoryview(self._scratch)
        self._jobs: list[queue.SimpleQueue] = []
        self._workers: list[threading.Thread] = []
        for i in range(self.threads):   # all preadv calls happen here, so the caller is free while a read is in flight
            q = queue.SimpleQueue()
            # The threads hold no reference to self, so an unclosed reader is still collected (and closed).
            t = threading.Thread(target=_worker, args=(q,), name=f"BundleReader-{i}", daemon=True)
            t.start()
            self._jobs.append(q)
            self._workers.append(t)
        self._lock = threading.Lock()       # read_ops uses the shared scratch views; requests queue in order

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        for q in self._jobs:
            q.put(None)
        for t in self._workers:
            t.join()
        self._jobs, self._workers = [], []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- read ops ----------------------------------------------------------------------------------------------------
    def read_ops(self, layer: int, bundle_ids, dest: np.ndarray, slots) -> tuple[list, int, int]:
        """Turn a request into preadv ops [(file offset, iovecs, nbytes)], requested bytes and read bytes."""
        L = self.layout
        stride = L.stride
        if not 0 <= layer < L.n_layers:
            raise ValueError(f"layer {layer} out of range 0..{L.n_layers - 1}")
        ids = np.asarray(bundle_ids, dtype=np.int64).ravel()
        slots = np.asarray(slots, dtype=np.int64).ravel()
        if ids.shape != slots.shape:
            raise ValueError(f"{ids.size} bundle ids but {slots.size} slots")
        if dest.dtype != np.uint8 or dest.ndim != 2 or dest.shape[1] != stride or not dest.flags.c_contiguous:
            raise ValueError(f"dest must be C-contiguous uint8 [slots, {stride}], got {dest.dtype} {dest.shape}")
        if dest.ctypes.data % BUNDLE_ALIGN:
            raise ValueError("dest must start on a 512-byte boundary (allocate it with storage.reader.aligned_empty)")
        if ids.size == 0:
            return [], 0, 0
        n = L.n_neurons[layer]
        if ids.min() < 0 or ids.max() >= n:
            raise ValueError(f"bundle ids must be in 0..{n - 1} for layer {layer}")
        if slots.min() < 0 or slots.max() >= dest.shape[0]:
            raise ValueError(f"slots must be in 0..{dest.shape[0] - 1}")
        order = np.argsort(ids, kind="stable")
        ids, slots = ids[order], slots[order]
        step = np.diff(ids)
        if (step == 0).any():
            raise ValueError("duplicate bundle ids in one read")
        gap = self.coalesce_gap
        # A new run starts where the hole to the previous bundle is wider than the allowed gap.
        new_run = np.empty(ids.size, bool)
        new_run[0] = True
        new_run[1:] = (step - 1 > gap) if gap >= 0 else True

        mv = memoryview(dest).cast("B")
        scratch = self._scratch_mv
        base = L.offset[layer]
        ops = []
        read_bytes = 0
        iov: list = []
        run_start = prev = 0
        cur_slot = cur_len = -1   # pending destination extent: cur_len rows starting at row cur_slot
        for i, s, nr in zip(ids.tolist(), slots.tolist(), new_run.tolist()):
            hole = i - prev - 1
            # Close the current op at a run break, at IOV_MAX (pending extent + maybe a hole + the new row),
            # or when it would grow past max_read_bundles.
            if iov or cur_len > 0:
                if nr or len(iov) + 3 > IOV_MAX or i + 1 - run_start > self.max_read_bundles:
                    if cur_len > 0:
                        iov.append(mv[cur_slot * stride:(cur_slot + cur_len) * stride])
                    nbytes = (prev + 1 - run_start) * stride
                    ops.append((base + run_start * stride, iov, nbytes))
                    read_bytes += nbytes
                    iov, cur_len, run_start = [], -1, i
                elif hole > 0:
                    iov.append(mv[cur_slot * stride:(cur_slot + cur_len) * stride])
                    iov.append(scratch[:hole * stride])
                    cur_len = -1
            else:
                run_start = i
            if cur_len > 0 and s == cur_slot + cur_len:
                cur_len += 1                      # next row of dest is also next in the file: one iovec
            else:
                if cur_len > 0:
                    iov.append(mv[cur_slot * stride:(cur_slot + cur_len) * stride])
                cur_slot, cur_len = s, 1
            prev = i
        iov.append(mv[cur_slot * stride:(cur_slot + cur_len) * stride])
        nbytes = (prev + 1 - run_start) * stride
        ops.append((base + run_start * stride, iov, nbytes))
        read_bytes += nbytes
        return ops, ids.size * stride, read_bytes

    # -- reading -----------------------------------------------------------------------------------------------------
    def submit(self, layer: int, bundle_ids, dest: np.ndarray, slots) -> "PendingRead":
        """Start a read and return at once; the rows are valid after .wait(). The caller computes meanwhile.

        bundle_ids and slots may be reused as soon as this returns (they are planned into iovecs here); dest rows
        must not be touched until wait(). Requests from several submits queue on the same threads in order.
        """
        t0 = time.perf_counter()
        with self._lock:
            ops, requested, read_bytes = self.read_ops(layer, bundle_ids, dest, slots)
        done: queue.SimpleQueue = queue.SimpleQueue()
        k = min(self.threads, len(ops))
        # Round-robin keeps the batches balanced in bytes for the mostly equal-sized ops of one request.
        for w in range(k):
            self._jobs[w].put((self.fd, self.direct, self.path, layer, ops[w::k], done))
        return PendingRead(done, k, FlashStats(requested_bytes=requested, read_bytes=read_bytes), t0)

    def read(self, layer: int, bundle_ids, dest: np.ndarray, slots) -> FlashStats:
        return self.submit(layer, bundle_ids, dest, slots).wait()


class PendingRead:
    """A read in flight: wait() blocks until every batch finished and returns its FlashStats (the reader's fields;
    io_s = submit to last batch done, the I/O time, whether or not the caller was waiting)."""

    def __init__(self, done: queue.SimpleQueue, n_batches: int, stats: FlashStats, t0: float):
        self._done, self._left, self.stats, self._t0 = done, n_batches, stats, t0
        self._end = t0

    def wait(self) -> FlashStats:
        err = None
        while self._left:
            n, e, t_end = self._done.get()
            self._left -= 1
            self.stats.n_reads += n
            self._end = max(self._end, t_end)
            err = err or e
        self.stats.io_s = self._end - self._t0
        if err is not None:
            raise err
        return self.stats


def _worker(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        *batch, done = job
        try:
            n = _run_batch(*batch)
            done.put((n, None, time.perf_counter()))
        except BaseException as e:
            done.put((0, e, time.perf_counter()))


def _run_batch(fd: int, direct: bool, path: Path, layer: int, ops: list) -> int:
    """Issue the preadv ops one after another; returns the number of calls made."""
    n_reads = 0
    for off, iov, nbytes in ops:
        for attempt in (0, 1):   # a short read or EIO gets one retry
            n_reads += 1
            try:
                got = os.preadv(fd, iov, off)
            except OSError as e:
                if attempt:
                    raise UserError(f"{path}: read of {nbytes} bytes at offset {off} (layer {layer}) "
                                    f"failed: {e.strerror}")
                continue
            if got == nbytes:
                break
            if attempt:
                raise UserError(f"{path}: short read at offset {off} (layer {layer}): got {got} of {nbytes} "
                                f"bytes; the file is truncated or damaged")
        if not direct:
            drop_from_page_cache(fd, off, nbytes)
    return n_reads


class CountingReader:
    """A reader with no file: counts `stride` bytes per bundle and copies nothing. For replaying recorded active sets
    through a NeuronCache (bench/cache_window.py, bench/lookahead.py), where only the accounting matters."""

    def __init__(self, stride: int):
        self.stride = stride

    def submit(self, layer: int, bundle_ids, dest=None, slots=None) -> "CountedRead":
        b = len(bundle_ids) * self.stride
        return CountedRead(FlashStats(requested_bytes=b, read_bytes=b, n_reads=1))

    def read(self, layer: int, bundle_ids, dest=None, slots=None) -> FlashStats:
        return self.submit(layer, bundle_ids).wait()


class CountedRead:
    def __init__(self, stats: FlashStats):
        self.stats = stats

    def wait(self) -> FlashStats:
        return self.stats
