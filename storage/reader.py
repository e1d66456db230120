"""BundleReader: read sets of neuron bundles from ffn.bin straight into caller-provided rows, with O_DIRECT.

Why it is built this way:
- O_DIRECT: the page cache would hide the flash cost we are budgeting, and would double the DRAM used for weights.
- io_uring (Ring, below): a request's reads go into one ring with a few numpy operations and one system call,
  so a small-request device sees its full queue depth (64+) at a fraction of a core, and no thread switches.
- Fallback where io_uring is refused: a persistent pool of threads, each looping over its own batch of preadv calls
  (Python dispatch per read, one executor future each, caps at ~25k IOPS); it keeps only `threads` reads in flight.
- Coalescing: bundles whose file gap is at most `coalesce_gap` bundles are fetched by one readv whose iovecs scatter
  into the destination rows; gap bundles land in a scratch buffer and count as over-read. Both engines run the
  same plan (ReadPlan), with the same retry (once) and the same errors.
- Packed bundles (a stride that is not a multiple of 512: FLASHDIRs with down columns, storage.format.PACKED_ALIGN):
  each op reads its run widened to 512-byte boundaries into a staging buffer of the request, and wait() copies the
  bundles into their rows. The file holds no padding; a lone bundle reads at most 1023 bytes more than itself.

FlashStats (the last section) is the record of those reads, which the neuron cache and the FFN add to.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import platform
import queue
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from storage.errors import UserError

from ._watch import watcher
from .checksums import drop_from_page_cache
from .format import BUNDLE_ALIGN, FlashLayout, read_layout
from .profile import ENGINES, reader_defaults

IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
MAX_READ_BYTES = 1 << 20      # a dense run is read as ops of at most this size, spread over the queue
HUGE_PAGE = 2 << 20           # a transparent huge page on x86-64 (aligned_empty(huge=True))
_warned_buffered = False


def aligned_empty(shape, dtype=np.uint8, align: int = 4096, huge: bool = False) -> np.ndarray:
    """An uninitialised C-contiguous array whose first byte sits on an `align` boundary (O_DIRECT needs this).

    huge: in 2 MiB pages where the kernel has them (transparent huge pages, asked for with madvise), for large reads
    straight into it: a device takes a request's memory as a list of segments, a 4 KiB page each unless the pages are
    contiguous, and this one (virtio, 254 segments) split each 2.65 MB expert read into 3 requests of 4 KiB pages;
    into huge pages one request, which with one read in flight ran 1.7x as fast (issue #30)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
        raw = np.frombuffer(m, np.uint8)
        start = (-raw.ctypes.data) % HUGE_PAGE
        return raw[start:start + nbytes].view(dtype).reshape(shape)
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


MADV_POPULATE_WRITE = 23        # Linux 5.14+
# The expert cache's slots, and flash_bench.expert_rate's probe of the device for them, in 4 KiB pages: in huge pages a
# chunk's read is one request, not 3, but their first touch (direct compaction, THP defrag "madvise") costs more than
# it saves: bench/moe_vs_llama_cpp.py's 48-layer 50% row ran its prompt 2.3x slower in them
SLOTS_IN_HUGE_PAGES = False
_madvise = None


def populate(a: np.ndarray) -> bool:
    """Fault in a's pages as a write would, without writing to them (madvise MADV_POPULATE_WRITE), so that a read into
    them does not: an O_DIRECT read pins its destination's pages when it is submitted, and pages never touched are
    allocated then, inside the read's time. False where the kernel refuses (before 5.14, or not Linux: they fault on
    first use)."""
    global _madvise
    if not sys.platform.startswith("linux"):
        return False
    if _madvise is None:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    first = a.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    return a.nbytes == 0 or _madvise(first, a.ctypes.data + a.nbytes - first, MADV_POPULATE_WRITE) == 0


def open_direct(path, flags: int, align: int = BUNDLE_ALIGN) -> tuple[int, bool]:
    """(fd, direct): `path` opened with `flags`, and O_DIRECT when the filesystem accepts it, checked with a real
    aligned I/O of `align` bytes at offset 0 (some accept the flag but refuse the I/O): a read, and first a write of
    zeros when `flags` open for writing. Else buffered. An error other than O_DIRECT's refusal (EINVAL) is raised."""
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            probe = aligned_empty((align,), np.uint8)
            probe[:] = 0
            try:
                if flags & (os.O_WRONLY | os.O_RDWR):
                    os.pwrite(fd, memoryview(probe), 0)
                os.preadv(fd, [memoryview(probe)], 0)
                return fd, True
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EINVAL:
                    raise
    return os.open(path, flags), False


def open_for_reads(path: Path) -> tuple[int, bool]:
    """(fd, direct): open_direct for reading; buffered reads are said once per process."""
    global _warned_buffered
    try:
        fd, direct = open_direct(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UserError(f"{path}: cannot open ({e.strerror})") from None
    if direct:
        return fd, True
    if not _warned_buffered:
        _warned_buffered = True
        print(f"flashinfer-lite: O_DIRECT refused for {path}; using buffered reads + posix_fadvise(DONTNEED)",
              file=sys.stderr)
    return fd, False


class BundleReader:
    """reader.read(layer, bundle_ids, dest, slots) reads bundle bundle_ids[j] of `layer` into dest[slots[j]].

    dest: uint8 [slots, stride], C-contiguous, base 512-aligned (use aligned_empty, above).
    Bundle ids are positions in the file; layout.order[layer][bundle_id] is the original neuron id.
    engine ("io_uring" or "threads"), depth (io_uring reads in flight), threads (the thread engine's) and
    coalesce_gap (in bundles; < 0 disables coalescing, 0 merges only adjacent bundles) default to the device profile
    saved by `flashinfer-lite flash-bench`, else to built-in defaults. Where the kernel refuses io_uring (old
    kernels, sandboxes, not Linux on x86-64) the reader uses threads and says why in describe().
    stamps: the ring's completions are stamped when they are posted (Ring), so each read's
    PendingRead.landed is when it landed, not when the caller next reaped the ring (see busy_seconds).
    """

    def __init__(self, layout_or_flashdir, threads: int | None = None, coalesce_gap: int | None = None,
                 max_read_bytes: int = MAX_READ_BYTES, engine: str | None = None, depth: int | None = None,
                 stamps: bool = False):
        self.layout = layout_or_flashdir if isinstance(layout_or_flashdir, FlashLayout) \
            else read_layout(layout_or_flashdir)
        self.path = self.layout.ffn_path
        stride = self.layout.stride
        prof = reader_defaults(self.path, stride)
        self.settings_source = prof.source
        self.threads = max(1, int(threads if threads is not None else prof.threads))
        self.coalesce_gap = int(coalesce_gap if coalesce_gap is not None else prof.gap_bytes // stride)
        engine = engine or prof.engine
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
        # A dense run is still split so that a big request spreads over the threads.
        self.max_read_bundles = max(1, max_read_bytes // stride)
        self.max_read_bytes = max(BUNDLE_ALIGN, max_read_bytes // BUNDLE_ALIGN * BUNDLE_ALIGN)
        # a region off a 512-byte boundary too (a resident matrix's rows: format.FlashCheckpoint.rows_layout)
        self.packed = stride % BUNDLE_ALIGN != 0 or any(o % BUNDLE_ALIGN for o in self.layout.offset)
        self.fd, self.direct = open_for_reads(self.path)
        self._scratch = aligned_empty((max(self.coalesce_gap, 1) * stride,), np.uint8)
        self._lock = threading.Lock()       # read_ops plans from any thread
        self.fallback_reason = ""
        self._engine = None
        if engine == "io_uring":
            try:
                self._engine = RingQueue(self.fd, max(1, int(depth if depth is not None else prof.depth)), stamps)
            except OSError as e:
                self.fallback_reason = unavailable(e)
        if self._engine is None:
            self._engine = ThreadPool(self.fd, self.threads)
        self.engine = self._engine.name

    def describe(self) -> str:
        """One line: the engine and settings this reader uses, and where they come from."""
        why = f" ({self.fallback_reason})" if self.fallback_reason else ""
        return (f"reader: {self._engine.describe()}{why}, coalescing gap {self.coalesce_gap} rows, "
                f"O_DIRECT {self.direct}; settings from the {self.settings_source}")

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
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
    def read_ops(self, layer: int, bundle_ids, dest: np.ndarray, slots) -> tuple["ReadPlan", int, int]:
        """Turn a request into readv ops (a ReadPlan), requested bytes and read bytes."""
        L = self.layout
        stride = L.stride
        if not 0 <= layer < L.n_layers:
            raise ValueError(f"layer {layer} out of range 0..{L.n_layers - 1}")
        ids, slots = request_rows(bundle_ids, slots, dest, stride)
        if dest.ctypes.data % BUNDLE_ALIGN:
            raise ValueError("dest must start on a 512-byte boundary (allocate it with storage.reader.aligned_empty)")
        if ids.size == 0:
            return ReadPlan.empty(), 0, 0
        n = L.n_neurons[layer]
        if ids.min() < 0 or ids.max() >= n:
            raise ValueError(f"bundle ids must be in 0..{n - 1} for layer {layer}")
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

        # An op starts at a run break, and every max_read_bundles bundles of file within a run (so that a big dense
        # request still spreads over the queue).
        run_first = ids[new_run][np.cumsum(new_run) - 1]
        piece = (ids - run_first) // self.max_read_bundles
        starts = new_run.copy()
        starts[1:] |= piece[1:] != piece[:-1]
        hole = np.zeros(ids.size, np.int64)
        hole[1:] = step - 1
        if self.packed:
            return self._packed_ops(L.offset[layer], ids, slots, starts, dest)
        follows = np.zeros(ids.size, bool)
        follows[1:] = np.diff(slots) == 1                   # the next row of dest is also next in the file
        while True:
            to_scratch = ~starts & (hole > 0)               # the hole before this bundle is read into scratch
            new_extent = starts | to_scratch | ~follows     # this bundle begins a new destination extent
            # The plan's iovecs in file order: per bundle, its hole (if read), then its extent (if it begins one).
            has = np.empty(2 * ids.size, bool)
            has[0::2], has[1::2] = to_scratch, new_extent
            ahead = np.cumsum(has) - has
            op_first = ahead[2 * np.flatnonzero(starts)]
            if np.diff(np.append(op_first, has.sum())).max() <= IOV_MAX:
                break
            # Thousands of scattered rows in one run: also start an op every IOV_MAX - 2 iovecs (one more iovec
            # at most per new start: the extent it forces).
            block = (ahead[1::2] - op_first[np.cumsum(starts) - 1]) // (IOV_MAX - 2)
            starts[1:] |= block[1:] != block[:-1]
        s_idx = np.flatnonzero(starts)
        e_idx = np.append(s_idx[1:], ids.size) - 1
        e_at = np.flatnonzero(new_extent)
        iov = np.empty((2 * ids.size, 2), np.uint64)
        iov[0::2, 0], iov[0::2, 1] = self._scratch.ctypes.data, hole * stride
        rows = iov[1::2]
        rows[e_at, 0] = dest.ctypes.data + slots[e_at] * stride
        rows[e_at, 1] = np.diff(np.append(e_at, ids.size)) * stride      # an extent runs to the next one
        plan = ReadPlan(L.offset[layer] + ids[s_idx] * stride, (ids[e_idx] - ids[s_idx] + 1) * stride,
                        np.append(op_first, has.sum()), iov[has], dest)
        return plan, ids.size * stride, int(plan.nbytes.sum())

    def _packed_ops(self, region: int, ids, slots, starts, dest) -> tuple["ReadPlan", int, int]:
        """read_ops for packed bundles: op k reads its run [first, last] widened to BUNDLE_ALIGN boundaries into its
        own aligned span of a staging buffer; the plan's copies say where each bundle then sits in it."""
        stride = self.layout.stride
        s_idx = np.flatnonzero(starts)
        e_idx = np.append(s_idx[1:], ids.size) - 1
        lo = region + ids[s_idx] * stride
        a0 = lo // BUNDLE_ALIGN * BUNDLE_ALIGN
        size = -(-(region + (ids[e_idx] + 1) * stride) // BUNDLE_ALIGN) * BUNDLE_ALIGN - a0
        pos = np.cumsum(size) - size
        staging = aligned_empty((int(size.sum()),), np.uint8)
        op = np.cumsum(starts) - 1                          # each bundle's op
        iov = np.stack([staging.ctypes.data + pos.astype(np.uint64), size.astype(np.uint64)], axis=1)
        plan = ReadPlan(a0, size, np.arange(len(s_idx) + 1), iov, dest)
        plan.copies = (staging, pos[op] + region + ids * stride - a0[op], slots)
        return plan, ids.size * stride, int(size.sum())

    # -- reading -----------------------------------------------------------------------------------------------------
    def submit(self, layer: int, bundle_ids, dest: np.ndarray, slots) -> "PendingRead":
        """Start a read and return at once; the rows are valid after .wait(). The caller computes meanwhile.

        bundle_ids and slots may be reused as soon as this returns (they are planned into iovecs here); dest rows
        must not be touched until wait(). Requests from several submits share the threads or the ring in order.
        """
        t0 = time.perf_counter()
        with self._lock:
            plan, requested, read_bytes = self.read_ops(layer, bundle_ids, dest, slots)
        req = Request(self, layer, plan, FlashStats(requested_bytes=requested, read_bytes=read_bytes), t0)
        if len(plan):
            self._engine.start(req)
        return PendingRead(req)

    def read(self, layer: int, bundle_ids, dest: np.ndarray, slots) -> FlashStats:
        return self.submit(layer, bundle_ids, dest, slots).wait()

    def submit_rows(self, layer: int, first: int, rows: int, buf: np.ndarray) -> tuple["PendingRead", np.ndarray]:
        """Start reading bundles [first, first + rows) of `layer` as one sequential span, its bytes widened to 512-byte
        boundaries straight into buf (uint8, 512-aligned, at least span_bytes(rows)), in ops of at most
        max_read_bytes. Returns (the read, the bundles' rows in buf [rows, stride]): no staging nor copy, whatever
        the stride (packed bundles start up to 511 bytes into buf)."""
        L, t0 = self.layout, time.perf_counter()
        if not (0 <= layer < L.n_layers and 0 <= first and 0 < rows and first + rows <= L.n_neurons[layer]):
            raise ValueError(f"rows {first}..{first + rows - 1} are not in layer {layer}")
        lo = L.offset[layer] + first * L.stride
        a0 = lo // BUNDLE_ALIGN * BUNDLE_ALIGN
        end = -(-(lo + rows * L.stride) // BUNDLE_ALIGN) * BUNDLE_ALIGN
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes < end - a0 or buf.ctypes.data % BUNDLE_ALIGN:
            raise ValueError(f"buf must be a 512-aligned uint8 vector of at least {end - a0} bytes")
        off = np.arange(a0, end, self.max_read_bytes, dtype=np.int64)
        nbytes = np.minimum(self.max_read_bytes, end - off)
        iov = np.stack([buf.ctypes.data + (off - a0).astype(np.uint64), nbytes.astype(np.uint64)], axis=1)
        plan = ReadPlan(off, nbytes, np.arange(len(off) + 1), iov, buf)
        req = Request(self, layer, plan, FlashStats(requested_bytes=rows * L.stride, read_bytes=end - a0), t0)
        self._engine.start(req)
        return PendingRead(req), buf[lo - a0: lo - a0 + rows * L.stride].reshape(rows, L.stride)

    def span_bytes(self, rows: int) -> int:
        """The most bytes submit_rows reads for `rows` bundles: their span widened to 512-byte boundaries."""
        stride = self.layout.stride
        return span_bytes(rows, stride) + (BUNDLE_ALIGN if self.packed and stride % BUNDLE_ALIGN == 0 else 0)

    def failure(self, req: "Request", k: int, got: int) -> UserError:
        """The error for op k of a request whose retry returned `got` bytes (or -errno)."""
        off, nbytes = int(req.plan.off[k]), int(req.plan.nbytes[k])
        if got < 0:
            return UserError(f"{self.path}: read of {nbytes} bytes at offset {off} (layer {req.layer}) "
                             f"failed: {os.strerror(-got)}")
        return UserError(f"{self.path}: short read at offset {off} (layer {req.layer}): got {got} of {nbytes} "
                         f"bytes; the file is truncated or damaged")


def request_rows(bundle_ids, slots, dest: np.ndarray, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """A request's bundle ids and destination rows as int64 vectors, checked against each other and dest (C-contiguous
    uint8 [rows, stride], every slot one of its rows)."""
    ids = np.asarray(bundle_ids, dtype=np.int64).ravel()
    slots = np.asarray(slots, dtype=np.int64).ravel()
    if ids.shape != slots.shape:
        raise ValueError(f"{ids.size} bundle ids but {slots.size} slots")
    if dest.dtype != np.uint8 or dest.ndim != 2 or dest.shape[1] != stride or not dest.flags.c_contiguous:
        raise ValueError(f"dest must be C-contiguous uint8 [slots, {stride}], got {dest.dtype} {dest.shape}")
    if slots.size and (slots.min() < 0 or slots.max() >= dest.shape[0]):
        raise ValueError(f"slots must be in 0..{dest.shape[0] - 1}")
    return ids, slots


def busy_seconds(started: np.ndarray, landed: np.ndarray) -> float:
    """The time at least one of these reads was in flight: the length of the union of [started[i], landed[i]]."""
    if not len(started):
        return 0.0
    order = np.argsort(started, kind="stable")
    s, reach = started[order], np.maximum.accumulate(landed[order])
    # A stretch of busy time begins at a read that starts after every earlier one has landed.
    new = np.flatnonzero(np.r_[True, s[1:] > reach[:-1]])
    return float((reach[np.r_[new[1:] - 1, len(s) - 1]] - s[new]).sum())


def in_flight_seconds(reads) -> tuple[float, float]:
    """(busy, summed) of landed reads (PendingRead-s): the time at least one of their ops was in flight
    (busy_seconds), and the ops' times in flight added up (over busy: the mean in flight)."""
    s = np.concatenate([p.started for p in reads])
    t = np.concatenate([p.landed for p in reads])
    return busy_seconds(s, t), float((t - s).sum())


class PartsReader:
    """BundleReader's interface over a layout whose bundles live only in the split parts (FlashLayout.bundled False:
    gate_up.bin and down.bin, no ffn.bin): each request reads its bundles' rows from both parts, then assembles whole
    bundles into the caller's rows (BundleGeometry.assemble), so the neuron cache and the bundle kernels see ffn.bin's
    rows. A bundle costs two reads instead of one, and its staging rows (budget.read_staging_bytes) until wait(). Why no
    ffn.bin: it would hold the FFN a second time (#27: a Q4_K_M FLASHDIR 1.57x its GGUF with both), and on a SwiGLU
    model, where these modes read nearly every neuron anyway, the exact gate reads the parts."""

    def __init__(self, layout_or_flashdir, **kw):
        self.layout = layout_or_flashdir if isinstance(layout_or_flashdir, FlashLayout) \
            else read_layout(layout_or_flashdir)
        self.parts = [(P, BundleReader(P, **kw)) for P in self.layout.parts.values()]
        first = self.parts[-1][1]                       # down.bin: the settings a neuron's own read uses
        self.engine, self.threads, self.coalesce_gap = first.engine, first.threads, first.coalesce_gap
        self.direct, self.settings_source = first.direct, first.settings_source

    def describe(self) -> str:
        return f"{self.parts[-1][1].describe()}; bundles assembled from {len(self.parts)} split parts"

    def close(self) -> None:
        for _, r in self.parts:
            r.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def submit(self, layer: int, bundle_ids, dest: np.ndarray, slots) -> "AssembledRead":
        """BundleReader.submit: bundle_ids[j] of `layer` into dest[slots[j]] once wait() returns."""
        ids, slots = request_rows(bundle_ids, slots, dest, self.layout.stride)
        rows = np.arange(ids.size)
        reads = []
        for P, r in self.parts:
            staging = aligned_empty((ids.size, P.stride), np.uint8, BUNDLE_ALIGN)
            reads.append((P.geometry_of(layer), staging, r.submit(layer, ids, staging, rows)))
        return AssembledRead(self.layout.geometry_of(layer), reads, dest, slots)

    def read(self, layer: int, bundle_ids, dest: np.ndarray, slots) -> FlashStats:
        return self.submit(layer, bundle_ids, dest, slots).wait()

    def submit_rows(self, layer: int, first: int, rows: int, buf: np.ndarray) -> tuple["AssembledRead", np.ndarray]:
        """BundleReader.submit_rows: the parts' spans read into buf, then (wait) assembled into the bundle rows the
        call returns, which sit in buf after them (span_bytes counts all three)."""
        reads, at = [], 0
        for P, r in self.parts:
            n = r.span_bytes(rows)
            pending, view = r.submit_rows(layer, first, rows, buf[at:at + n])
            reads.append((P.geometry_of(layer), view, pending))
            at += n
        out = buf[at:at + rows * self.layout.stride].reshape(rows, self.layout.stride)
        return AssembledRead(self.layout.geometry_of(layer), reads, out, None), out

    def span_bytes(self, rows: int) -> int:
        return parts_span_bytes(self.layout, rows)


class AssembledRead:
    """PartsReader's read in flight: wait() waits for every part's read, assembles the bundles, and returns the
    parts' FlashStats summed (io_s: the longest)."""

    def __init__(self, geometry, reads, dest, slots):
        self.geometry, self.reads, self.dest, self.slots = geometry, reads, dest, slots

    def ready(self) -> bool:
        return all(p.ready() for _, _, p in self.reads)

    def wait(self) -> FlashStats:
        stats = FlashStats()
        for _, _, p in self.reads:
            s = p.wait()
            stats.requested_bytes += s.requested_bytes
            stats.read_bytes += s.read_bytes
            stats.n_reads += s.n_reads
            stats.io_s = max(stats.io_s, s.io_s)
        if self.reads:
            self.geometry.assemble([(g, R) for g, R, _ in self.reads], self.dest, self.slots)
            self.reads = []
        return stats


def bundle_reader(layout, **kw):
    """The reader of a layout's bundles: BundleReader on ffn.bin, or PartsReader where only the split parts hold
    them. kw: BundleReader's."""
    return BundleReader(layout, **kw) if layout.bundled else PartsReader(layout, **kw)


def parts_span_bytes(layout, rows: int) -> int:
    """The most bytes a reader's submit_rows reads into its buffer for `rows` bundles of `layout`: their span widened
    to 512-byte boundaries, or (bundles in the split parts) each part's span and the assembled rows."""
    if layout.bundled:
        return span_bytes(rows, layout.stride)
    return sum(span_bytes(rows, P.stride) for P in layout.parts.values()) + rows * layout.stride


def span_bytes(rows: int, stride: int) -> int:
    """The most bytes `rows` consecutive bundles of `stride` bytes span once widened to 512-byte boundaries."""
    return -(-rows * stride // BUNDLE_ALIGN) * BUNDLE_ALIGN + (BUNDLE_ALIGN if stride % BUNDLE_ALIGN else 0)


class RowStream:
    """A layer's bundles read whole and in order, `rows` at a time (a chunk), with `depth` chunks in flight: while the
    caller computes on one chunk the next depth - 1 are being read, and its buffer is refilled as soon as the caller
    asks for the next one. A stream can be started early (prime) so that its first chunks are read during other
    work (attention, another stream's compute). The buffers (depth x span_bytes(rows)) are allocated on first use
    and kept: budget.stream_buffer_bytes counts them.

    follow(layer) -> the layer streamed after `layer` (-1: none): a buffer freed after a layer's last chunk went out
    reads the following layer's first rows, so the device never waits for the caller to prime the next layer and
    the stream runs depth chunks ahead across layers (and tokens: the last layer's follower is a next token's first).

    With one chunk in flight a 7B layer's rows read at 0.6-0.8 GB/s against the device's several GB/s sequential
    (issue #29): the device idled while each chunk was computed, and one 2 MiB request is too little queue."""

    def __init__(self, reader: BundleReader, rows: int, depth: int, follow=None):
        self.reader, self.rows, self.depth = reader, max(1, int(rows)), max(1, int(depth))
        self.follow = follow
        self._buffers: list[np.ndarray] = []
        self._free: list[np.ndarray] = []   # buffers no read is going into
        self._layer = -1              # the layer whose rows are being submitted, or -1
        self._queue: collections.deque = collections.deque()   # (layer, first row, pending, rows view, buffer)
        self._next = 0                # the next row of self._layer not yet submitted
        self.dropped = FlashStats()   # reads of primed chunks that were not used (their bytes were still read)

    def describe(self, source: str = "") -> str:
        """One line: the chunk, the chunks in flight and (source) where those come from."""
        chunk = self.rows * self.reader.layout.stride
        return (f"streams: chunks of {self.rows} rows ({chunk / 2**20:.1f} MiB), {self.depth} in flight"
                + (", running on into the following layers" if self.follow is not None else "")
                + (f"; settings from the {source}" if source else ""))

    def _submit(self, buf: np.ndarray) -> None:
        """Read the next chunk into buf: the current layer's next rows, else the follower's first ones; else buf is
        free."""
        n = self.reader.layout.n_neurons
        if self._layer >= 0 and self._next >= n[self._layer]:
            following = self.follow(self._layer) if self.follow is not None else -1
            self._layer, self._next = (following, 0) if following >= 0 else (-1, 0)
        if self._layer < 0:
            self._free.append(buf)
            return
        m = min(self.rows, n[self._layer] - self._next)
        pending, view = self.reader.submit_rows(self._layer, self._next, m, buf)
        self._queue.append((self._layer, self._next, pending, view, buf))
        self._next += m

    def prime(self, layer: int) -> None:
        """Start reading `layer`'s first chunks now (nothing if a stream is already under way)."""
        if self._queue or self._layer >= 0:
            return
        if not self._buffers:
            self._buffers = [aligned_empty((self.reader.span_bytes(self.rows),), np.uint8) for _ in range(self.depth)]
            self._free = list(self._buffers)
        self._layer, self._next = layer, 0
        free, self._free = self._free, []
        for buf in free:
            self._submit(buf)

    @property
    def primed(self) -> int:
        """The layer whose chunks come next (in flight), or -1."""
        return self._queue[0][0] if self._queue else self._layer

    def cancel(self) -> None:
        """Wait for the chunks in flight (the kernel writes into the buffers) and forget them; their bytes count in
        self.dropped."""
        self._layer = -1
        while self._queue:
            buf = self._queue[0][4]
            try:
                rs = self._queue.popleft()[2].wait()
            except UserError:        # its reads are over (one failed): nothing writes into the buffer any more
                continue
            finally:
                self._free.append(buf)
            self.dropped.read_bytes += rs.read_bytes
            self.dropped.n_reads += rs.n_reads

    def chunks(self, layer: int):
        """Yield (first row, rows uint8 [m, stride], the read's FlashStats, seconds waited for it) for the layer's
        chunks in order. A chunk's rows stay valid until the caller asks for the next one."""
        if not (self._queue and self._queue[0][:2] == (layer, 0)):
            self.cancel()
            self.prime(layer)
        n = self.reader.layout.n_neurons[layer]
        done = False
        try:
            while not done:
                _, first, pending, view, buf = self._queue.popleft()
                t0 = time.perf_counter()
                try:
                    rs = pending.wait()
                except BaseException:
                    self._free.append(buf)
                    raise
                yield first, view, rs, time.perf_counter() - t0
                done = first + view.shape[0] >= n
                self._submit(buf)
        finally:
            if not done:
                self.cancel()  # a caller that stopped early (an error) leaves no read in flight into the buffers


class ReadPlan:
    """A request's readv ops: op k reads nbytes[k] at file offset off[k] into the iovecs iov[first[k]:first[k+1]]
    (struct iovec pairs: address, length). Holds dest so the rows outlive every read into them."""

    def __init__(self, off, nbytes, first, iov, dest):
        self.off, self.nbytes, self.first, self.iov, self.dest = off, nbytes, first, iov, dest
        self.copies = None      # packed bundles: (staging buffer, each bundle's byte in it, its dest row)
        self.iov_count = np.diff(first)
        self.iov_addr = iov.ctypes.data + 16 * first[:-1].astype(np.uint64)

    @classmethod
    def empty(cls) -> "ReadPlan":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros((0, 2), np.uint64),
                   None)

    def __len__(self) -> int:
        return len(self.off)


class Request:
    """One submit's progress: ops left, reads made (retries included), the first error, when the last op ended;
    per op when it went to the kernel (its first try) and when it landed (its last)."""

    def __init__(self, reader: BundleReader, layer: int, plan: ReadPlan, stats: FlashStats, t0: float):
        self.reader, self.layer, self.plan, self.stats, self.t0 = reader, layer, plan, stats, t0
        self.left, self.error, self.t_end = len(plan), None, t0
        self.started, self.landed = np.zeros(len(plan)), np.zeros(len(plan))
        self.done = threading.Event()
        self.lock = threading.Lock()          # the thread engine's workers finish ops of one request concurrently
        self.serial = 0                       # the ring engine's name for it in completion tags

    def finish(self, k: np.ndarray, got: np.ndarray, n_reads: int, landed: np.ndarray) -> None:
        """Ops k are done, each having read got bytes (or -errno) on its last try, which landed then; n_reads counts
        the tries."""
        self.stats.n_reads += n_reads
        self.landed[k] = landed
        plan, reader = self.plan, self.reader
        bad = got != plan.nbytes[k]
        if not reader.direct:
            for off, n in zip(plan.off[k].tolist(), plan.nbytes[k].tolist()):
                drop_from_page_cache(reader.fd, off, n)
        if bad.any() and self.error is None:
            self.error = reader.failure(self, int(k[bad][0]), int(got[bad][0]))
        self.left -= len(k)
        if not self.left:
            self.t_end = float(self.landed.max())
            self.done.set()


class PendingRead:
    """A read in flight: wait() blocks until every op finished and returns its FlashStats (the reader's fields;
    io_s = submit to last op done, the I/O time, whether or not the caller was waiting)."""

    def __init__(self, req: Request):
        self._req, self.stats = req, req.stats

    def ready(self) -> bool:
        """Every op finished (wait() would not block)."""
        return not self._req.left

    @property
    def started(self) -> np.ndarray:
        """Per op, when it went to the kernel (valid after wait())."""
        return self._req.started

    @property
    def landed(self) -> np.ndarray:
        """Per op, when it landed: stamped as it was posted with stamps, else when it was seen (valid after wait())."""
        return self._req.landed

    def wait(self) -> FlashStats:
        req = self._req
        if req.left:
            req.reader._engine.wait(req)
        self.stats.io_s = req.t_end - req.t0
        if req.error is not None:
            raise req.error
        if req.plan.copies is not None:                    # packed bundles: from the staging buffer into their rows
            staging, at, slots = req.plan.copies
            stride = req.plan.dest.shape[1]
            spans = np.lib.stride_tricks.as_strided(staging, (staging.size - stride + 1, stride), (1, 1),
                                                    writeable=False)
            req.plan.dest[slots] = spans[at]
            req.plan.copies = None
        return self.stats


class ThreadPool:
    """The fallback engine: threads that each issue one blocking preadv at a time, in batches per request."""

    name = "threads"

    def __init__(self, fd: int, threads: int):
        self.fd, self.threads = fd, threads
        self._jobs: list[queue.SimpleQueue] = []
        self._workers: list[threading.Thread] = []
        for i in range(threads):   # all preadv calls happen here, so the caller is free while a read is in flight
            q = queue.SimpleQueue()
            # The threads hold no reference to the reader, so an unclosed reader is still collected (and closed).
            t = threading.Thread(target=_worker, args=(q, fd), name=f"BundleReader-{i}", daemon=True)
            t.start()
            self._jobs.append(q)
            self._workers.append(t)

    def start(self, req: Request) -> None:
        n = len(req.plan)
        k = min(self.threads, n)
        # Round-robin keeps the batches balanced in bytes for the mostly equal-sized ops of one request.
        for w in range(k):
            self._jobs[w].put((req, range(w, n, k)))

    def wait(self, req: Request) -> None:
        req.done.wait()

    def describe(self) -> str:
        return f"{self.threads} threads of preadv"

    def close(self) -> None:
        for q in self._jobs:
            q.put(None)
        for t in self._workers:
            t.join()
        self._jobs, self._workers = [], []


def _worker(jobs: queue.SimpleQueue, fd: int) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        req, ops = job
        plan = req.plan
        got, n_reads, started, landed = [], 0, [], []
        for k in ops:
            started.append(time.perf_counter())
            for attempt in (0, 1):     # a short read or EIO gets one retry
                n_reads += 1
                try:
                    n = _preadv(fd, int(plan.iov_addr[k]), int(plan.iov_count[k]), int(plan.off[k]))
                except OSError as e:
                    n = -(e.errno or errno.EIO)
                if n == plan.nbytes[k]:
                    break
            got.append(n)
            landed.append(time.perf_counter())
        with req.lock:
            req.started[ops] = started
            req.finish(np.asarray(ops), np.array(got, np.int64), n_reads, np.array(landed))


_libc = None


def _preadv(fd: int, iov_addr: int, iov_count: int, offset: int) -> int:
    """preadv(2) on a struct iovec array in memory (GIL released); bytes read, or OSError."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
        lib.preadv.restype = ctypes.c_ssize_t
        _libc = lib
    got = _libc.preadv(fd, iov_addr, iov_count, offset)
    if got < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return got


class RingQueue:
    """The io_uring engine: every op goes into one ring from the submitting thread, at most `depth` in flight.

    No threads: submit() fills the ring and returns; wait() reaps completions (for whichever request they belong to)
    and refills the ring from the backlog until its request is done. So a request of more than `depth` reads has
    only `depth` in flight while the caller computes; the rest start at its next submit() or wait(). One lock over
    the ring: a waiter holds it while it sleeps in the kernel, so no waiter sleeps on a completion another one took.
    """

    name = "io_uring"
    wake_every = 16

    def __init__(self, fd: int, depth: int, stamps: bool = False):
        self.fd, self.ring = fd, Ring(depth, stamps)
        self.depth = self.ring.entries
        self._lock = threading.Lock()
        self._backlog: collections.deque = collections.deque()   # [request, first op, end op, retry]
        self._requests: dict[int, Request] = {}
        self._serial = 0
        self._in_flight = 0

    def start(self, req: Request) -> None:
        with self._lock:
            self._serial = (self._serial + 1) & 0xFFFFFFFF
            req.serial = self._serial
            # Completion tags: request serial << 32 | op << 1 | retry.
            req.tags = (np.arange(len(req.plan), dtype=np.uint64) << np.uint64(1)) | np.uint64(req.serial << 32)
            self._requests[req.serial] = req
            self._reap()       # the ring moves on only when called: whatever finished since makes room now
            self._backlog.append([req, 0, len(req.plan), 0])
            self._fill()
            self.ring.submit()

    def _fill(self) -> None:
        """Move ops from the backlog into the ring while there is room (the next enter submits them)."""
        while self._backlog and self._in_flight < self.depth:
            item = self._backlog[0]
            req, lo, hi, retry = item
            k = min(hi - lo, self.depth - self._in_flight)
            p, tags = req.plan, req.tags[lo:lo + k]
            self.ring.push(self.fd, p.off[lo:lo + k], p.iov_addr[lo:lo + k], p.iov_count[lo:lo + k],
                           tags | np.uint64(1) if retry else tags)
            if not retry:           # every caller of _fill enters the kernel next: the ops start now
                req.started[lo:lo + k] = time.perf_counter()
            self._in_flight += k
            item[1] += k
            if item[1] == hi:
                self._backlog.popleft()

    def _reap(self) -> None:
        """Take the ready completions, refill the slots they free before anything else (so the device idles least
        while Python accounts), then account them; retries go to the front of the backlog."""
        tags, res, when = self.ring.reap()
        if not len(tags):
            return
        self._in_flight -= len(tags)
        self._fill()
        self.ring.submit()
        serial = tags >> np.uint64(32)
        one = serial[0] == serial[-1] and (serial == serial[0]).all()   # the usual case: a single request
        for s in [int(serial[0])] if one else np.unique(serial).tolist():
            mine = slice(None) if one else serial == s
            req, t, got, at = self._requests[s], tags[mine], res[mine], when[mine]
            k = ((t & np.uint64(0xFFFFFFFF)) >> np.uint64(1)).astype(np.int64)
            again = got != req.plan.nbytes[k]
            if again.any():                  # a short read or EIO gets one retry
                again &= (t & np.uint64(1)) == 0
                for j in k[again].tolist():
                    self._backlog.appendleft([req, j, j + 1, 1])
                k, got, at = k[~again], got[~again], at[~again]
            req.finish(k, got, len(t), at)
            if not req.left:
                del self._requests[s]

    def wait(self, req: Request) -> None:
        with self._lock:
            while True:
                self._reap()
                self._fill()
                if not req.left:
                    self.ring.submit()         # retries of other requests
                    return
                # Submit and sleep in one call. With reads waiting for a slot, until 1/wake_every of those in flight
                # are done: the queue stays full even when this thread waits for a core after its wake-up, while far
                # fewer system calls wake it than one per read. With none waiting, until this request is done.
                n = req.left if not self._backlog else max(1, min(self._in_flight // self.wake_every, req.left))
                self.ring.submit(wait_for=n)

    def describe(self) -> str:
        return f"io_uring, {self.depth} reads in flight"

    def close(self) -> None:
        with self._lock:
            while self._in_flight:          # the kernel may still write into rows: let every read land first
                self._reap()
                if self._in_flight:
                    self.ring.submit(wait_for=1)
        self.ring.close()


# ----------------------------------------------------------------------------------------------------------------------
# Ring: a minimal io_uring (Linux 5.1+) over the raw system calls, for many reads in flight at little CPU each.
#
# Why raw calls through ctypes rather than a binding: the PyPI binding (`liburing`) needs Linux 6.14+, is alpha, and
# prepares one SQE per Python call; here a whole request's reads are written into the mapped submission queue with a
# few numpy operations, and the two system calls (setup, enter) release the GIL like any ctypes call.
#
# Memory ordering: the kernel publishes a completion's entry before its tail (store-release) and reads our entries
# after the io_uring_enter call that submits them. x86-64 keeps loads in order and stores in order, so plain numpy
# loads and stores through the mapping are enough; other architectures would need acquire/release fences Python
# cannot express, so Ring refuses them (the caller falls back to threads).

SYS_IO_URING_SETUP, SYS_IO_URING_ENTER = 425, 426      # the same numbers on every architecture since Linux 5.1
IORING_OFF_SQ_RING, IORING_OFF_CQ_RING, IORING_OFF_SQES = 0, 0x8000000, 0x10000000
SYS_IO_URING_REGISTER = 427
IORING_OP_READV = 1
IORING_ENTER_GETEVENTS = 1
IORING_SETUP_COOP_TASKRUN = 1 << 8
IORING_REGISTER_EVENTFD = 4

SQE_WORDS, CQE_WORDS = 8, 2   # 64-byte submission and 16-byte completion entries, seen as rows of uint64 words
# A READV entry's words: 0 = opcode | flags << 8 | ioprio << 16 | fd << 32; 1 = file offset; 2 = iovec array address;
# 3 = iovec count | rw_flags << 32; 4 = user_data; 5-7 = zero. A completion's: 0 = user_data; 1 = res | flags << 32.


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
                ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                # sq_off: head tail ring_mask ring_entries flags dropped array resv1 user_addr (2 words)
                # cq_off: head tail ring_mask ring_entries overflow cqes flags resv1 user_addr (2 words)
                ("sq_off", ctypes.c_uint32 * 10), ("cq_off", ctypes.c_uint32 * 10)]


_ring_libc = None


def _syscall(*args) -> int:
    """A system call that releases the GIL; raises OSError on failure."""
    global _ring_libc
    if _ring_libc is None:
        _ring_libc = ctypes.CDLL(None, use_errno=True)
        _ring_libc.syscall.restype = ctypes.c_long
    while True:
        r = _ring_libc.syscall(*[ctypes.c_long(a) for a in args])
        if r >= 0:
            return r
        e = ctypes.get_errno()
        if e != errno.EINTR:
            raise OSError(e, os.strerror(e))


def setup(entries: int, flags: int = 0) -> tuple[int, _Params]:
    """io_uring_setup: (ring fd, params). OSError ENOSYS on old kernels, EPERM where a sandbox or sysctl refuses it."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise OSError(errno.ENOSYS, f"io_uring through numpy needs Linux on x86-64, not {platform.system()} "
                                    f"{platform.machine()}")
    p = _Params(flags=flags)
    return _syscall(SYS_IO_URING_SETUP, entries, ctypes.addressof(p)), p


class Ring:
    """One submission and one completion queue. Not thread-safe: the caller serialises push/submit/reap.

    push() writes READV entries; submit() hands them to the kernel; wait(n) blocks (GIL released) until at least
    n completions are ready; reap() returns (user_data, res, when) of every ready completion.

    when: with stamps=True, the time (time.perf_counter's clock) each completion was posted, taken by a watcher
    thread that sleeps on an eventfd the kernel signals as it posts completions, and runs compiled code without the
    GIL, so it stamps within tens of microseconds while the caller computes. Without stamps (or for a completion
    the watcher has not stamped yet) it is the time of reap(): the caller may have computed meanwhile.
    """

    def __init__(self, entries: int, stamps: bool = False):
        # Without stamps, completions are posted by the submitting thread's next entry to the kernel (or timer tick),
        # not by an interrupt of it while it computes: fewer interruptions, and the reader enters the kernel to reap
        # anyway. Stamps need them posted when the read lands, so that the watcher sees them then.
        flags = 0 if stamps else IORING_SETUP_COOP_TASKRUN
        try:
            self.fd, p = setup(entries, flags)
        except OSError as e:        # before Linux 5.19: no cooperative task running
            if e.errno != errno.EINVAL or not flags:
                raise
            self.fd, p = setup(entries)
        self._maps = []
        self._watcher = None
        try:
            sq, cq = p.sq_off, p.cq_off
            sq_map = self._map(sq[6] + p.sq_entries * 4, IORING_OFF_SQ_RING)
            cq_map = self._map(cq[5] + p.cq_entries * 8 * CQE_WORDS, IORING_OFF_CQ_RING)
            sqe_map = self._map(p.sq_entries * 8 * SQE_WORDS, IORING_OFF_SQES)
        except BaseException:
            self.close()
            raise
        u32 = lambda m, off, n=1: np.frombuffer(m, np.uint32, n, off)   # noqa: E731
        self.entries = p.sq_entries
        self._sq_tail, self._sq_mask = u32(sq_map, sq[1]), int(u32(sq_map, sq[2])[0])
        self._sq_head = u32(sq_map, sq[0])
        u32(sq_map, sq[6], p.sq_entries)[:] = np.arange(p.sq_entries)   # slot i of the array names entry i, forever
        self._sqes = np.frombuffer(sqe_map, np.uint64).reshape(p.sq_entries, SQE_WORDS)
        self._sqes[:] = 0                                # push writes only the words a READV needs
        self._cq_head, self._cq_tail = u32(cq_map, cq[0]), u32(cq_map, cq[1])
        self._cq_mask = int(u32(cq_map, cq[2])[0])
        self._cqes = np.frombuffer(cq_map, np.uint64, p.cq_entries * CQE_WORDS, cq[5]).reshape(-1, CQE_WORDS)
        self._res = self._cqes.view(np.int32)[:, 2]      # res, the low half of word 1 (little-endian x86-64)
        self._unsubmitted = 0
        if stamps:
            try:
                self._watch(cq_map, cq[1], p.cq_entries)
            except BaseException:
                self.close()
                raise

    def _watch(self, cq_map, tail_at: int, n: int) -> None:
        """Start the watcher: _stamps[i] is when completion slot i was last seen posted; _seen[0] the tail it has
        stamped up to (written after the stamps, and x86 keeps stores in order)."""
        self._efd = os.eventfd(0, os.EFD_CLOEXEC)
        self._stamps = np.zeros(n, np.float64)
        self._seen = np.zeros(2, np.int64)          # [stamped tail, stop]
        self._seen[0] = int(self._cq_tail[0])
        efd = ctypes.c_int32(self._efd)
        _syscall(SYS_IO_URING_REGISTER, self.fd, IORING_REGISTER_EVENTFD, ctypes.addressof(efd), 1)
        tail = np.frombuffer(cq_map, np.uint32, 1, tail_at)
        self._watcher = threading.Thread(target=watcher(), args=(self._efd, tail, self._stamps, self._seen,
                                                             np.zeros(1, np.uint64), np.zeros(2, np.int64)),
                                         name="Ring-watcher", daemon=True)
        self._watcher.start()

    def _map(self, length: int, offset: int) -> mmap.mmap:
        m = mmap.mmap(self.fd, length, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self._maps.append(m)
        return m

    def space(self) -> int:
        """Free submission entries."""
        return self.entries - ((int(self._sq_tail[0]) - int(self._sq_head[0])) & 0xFFFFFFFF)

    def push(self, fd: int, offsets, iov_addrs, iov_counts, user_data) -> None:
        """Queue READVs: op i reads iov_counts[i] iovecs (struct iovec array at iov_addrs[i]) from file offset
        offsets[i]. At most space() ops; the iovec arrays must stay alive until the op's completion is reaped."""
        n = len(offsets)
        tail = int(self._sq_tail[0])
        start = tail & self._sq_mask
        head = np.uint64(IORING_OP_READV | fd << 32)
        done = 0
        while done < n:      # at most two slices: up to the end of the entry array, then from its start
            k = min(n - done, self.entries - start)
            e = self._sqes[start:start + k]
            e[:, 0], e[:, 1], e[:, 2] = head, offsets[done:done + k], iov_addrs[done:done + k]
            e[:, 3], e[:, 4] = iov_counts[done:done + k], user_data[done:done + k]
            done, start = done + k, 0
        self._sq_tail[0] = (tail + n) & 0xFFFFFFFF     # entries first, then the tail: x86 keeps stores in order
        self._unsubmitted += n

    def submit(self, wait_for: int = 0) -> None:
        """Hand the pushed entries to the kernel; with wait_for > 0 also block until that many completions are
        ready (one system call either way)."""
        if self._unsubmitted or wait_for:
            flags = IORING_ENTER_GETEVENTS if wait_for else 0
            done = _syscall(SYS_IO_URING_ENTER, self.fd, self._unsubmitted, wait_for, flags, 0, 0)
            self._unsubmitted -= min(done, self._unsubmitted)

    def wait(self, n: int) -> None:
        """Block (GIL released) until at least n completions are ready; submits nothing."""
        _syscall(SYS_IO_URING_ENTER, self.fd, 0, n, IORING_ENTER_GETEVENTS, 0, 0)

    def reap(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(user_data uint64[k], res int32[k], when float64[k]) of the ready completions (see the class), which are
        then released to the kernel."""
        now = time.perf_counter()
        head, tail = int(self._cq_head[0]), int(self._cq_tail[0])
        n = (tail - head) & 0xFFFFFFFF
        start = head & self._cq_mask
        end = start + n
        if end <= len(self._cqes):      # copies: the slots are the kernel's again after this
            ud, res = self._cqes[start:end, 0].copy(), self._res[start:end].copy()
            at = np.arange(start, end)
        else:
            at = np.r_[start:len(self._cqes), 0:end - len(self._cqes)]
            ud, res = self._cqes[at, 0], self._res[at]
        when = np.full(n, now)
        if self._watcher is not None and n:
            ahead = (int(self._seen[0]) - head) & 0xFFFFFFFF     # the watcher's tail past ours (else it lags)
            stamped = min(ahead, n) if ahead <= len(self._cqes) else 0
            when[:stamped] = np.minimum(self._stamps[at[:stamped]], now)
        self._cq_head[0] = tail
        return ud, res, when

    def close(self) -> None:
        if self._watcher is not None:
            self._seen[1] = 1
            os.eventfd_write(self._efd, 1)
            self._watcher.join()
            os.close(self._efd)
            self._watcher = None
        self._sq_tail = self._sq_head = self._sqes = self._cq_head = self._cq_tail = self._cqes = self._res = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:     # a numpy view still exported: the mapping goes with the process
                pass
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def unavailable(e: OSError) -> str:
    return f"io_uring unavailable: {e.strerror or e}"


def refused() -> str:
    """Why this kernel (or sandbox) refuses io_uring, "" if it does not."""
    try:
        Ring(1).close()
    except OSError as e:
        return unavailable(e)
    return ""


# ----------------------------------------------------------------------------------------------------------------------
# FlashStats: the one record of what the flash path did, filled as a read flows reader -> neuron cache -> runtime.
#
#   reader        requested_bytes, read_bytes, n_reads, io_s           (one request: PendingRead.wait() returns them)
#   neuron cache  hits, misses, evictions, moved, prefetched, prefetch_used, lookup_s, read_s
#   expert cache  the same, and read_busy_s, read_busy_bytes, read_op_s, first_touch_s
#   runtime       tokens (counted per forward pass), rows/active per layer, streamed_layers, prefill_bytes_read,
#                 predictor_s, compute_s
#
# Records add with +=, so one request's, one token's and the run's totals are the same type. The runtime hands its
# record to the neuron cache, which adds each finished read to it: nothing is copied field by field.

@dataclass
class FlashStats:
    # reader
    requested_bytes: int = 0        # bundles asked for x stride
    read_bytes: int = 0             # fetched from the file: requested + coalescing over-read (+ lookahead guesses)
    n_reads: int = 0                # preadv calls, retries included
    io_s: float = 0.0               # reads in flight, overlapped with compute or not
    # neuron cache
    hits: int = 0
    misses: int = 0
    evictions: int = 0              # rows deleted (window expiry + overflow)
    moved: int = 0                  # rows copied to keep the window dense (deletions no newcomer filled)
    prefetched: int = 0             # rows read ahead on a lookahead guess
    prefetch_used: int = 0          # of those, rows the exact set then needed
    lookup_s: float = 0.0           # bookkeeping: slot lookup, evictions, row moves
    read_s: float = 0.0             # the caller blocked waiting for reads
    read_busy_s: float = 0.0        # expert cache: per layer, the time its misses' reads were in flight (at least one
                                    # of them: submitted to the kernel, not yet landed, as the ring's stamps say)
    read_busy_bytes: int = 0        # the bytes of those reads: over read_busy_s, the rate the device gave them
    read_op_s: float = 0.0          # the same reads' times in flight, summed: over read_busy_s, the mean in flight
    first_touch_s: float = 0.0      # expert cache: faulting in the pages of slots used for the first time
    # runtime
    tokens: int = 0                 # tokens whose FFNs went through the neuron cache (the decode path)
    streamed_layers: int = 0        # layer passes served by prefill streaming of whole layers
    prefill_bytes_read: int = 0     # bytes of that streaming (not in read_bytes)
    predictor_s: float = 0.0
    compute_s: float = 0.0          # the sparse FFN kernels
    rows: np.ndarray | None = None     # [L] token rows through each layer's FFN
    active: np.ndarray | None = None   # [L] neurons that fired, summed over those rows
    n_neurons: int = 0              # per layer: what active_share divides by (a size, not a count: never summed)

    @classmethod
    def for_layers(cls, n_layers: int, n_neurons: int) -> "FlashStats":
        return cls(rows=np.zeros(n_layers, np.int64), active=np.zeros(n_layers, np.int64), n_neurons=n_neurons)

    def __iadd__(self, o: "FlashStats") -> "FlashStats":
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(o, f.name)
            if b is None or f.name == "n_neurons":
                continue
            setattr(self, f.name, b.copy() if a is None and isinstance(b, np.ndarray) else a + b)
        return self

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    def active_share(self) -> np.ndarray:
        """[L] share of each layer's neurons that fired per token row."""
        return self.active / np.maximum(self.rows * max(self.n_neurons, 1), 1)

    def as_dict(self) -> dict:
        tok = max(self.tokens, 1)
        share = float(self.active_share().mean()) if self.rows is not None else 0.0
        return {"active_share": round(share, 4), "hit_rate": round(self.hit_rate, 4),
                "mb_read": round(self.read_bytes / 2**20, 3),
                "mb_read_per_token": round(self.read_bytes / 2**20 / tok, 3),
                "prefill_mb_read": round(self.prefill_bytes_read / 2**20, 3),
                "read_mb_per_s": round((self.read_bytes + self.prefill_bytes_read) / 2**20 / self.io_s, 1)
                if self.io_s else 0.0,
                "read_wait_ms_per_token": round(self.read_s * 1e3 / tok, 3),
                "read_in_flight_ms_per_token": round(self.io_s * 1e3 / tok, 3),
                "overlapped_share": round(max(0.0, 1 - self.read_s / self.io_s), 4) if self.io_s else 0.0,
                "predictor_ms": round(self.predictor_s * 1e3, 3), "lookup_ms": round(self.lookup_s * 1e3, 3),
                "read_ms": round(self.read_s * 1e3, 3), "io_ms": round(self.io_s * 1e3, 3),
                "compute_ms": round(self.compute_s * 1e3, 3),
                "decode_tokens": self.tokens, "streamed_layers": self.streamed_layers,
                "prefetched_rows": self.prefetched, "prefetch_used_rows": self.prefetch_used}
