"""Ring: a minimal io_uring (Linux 5.1+) over the raw system calls, for many reads in flight at little CPU each.

Why raw calls through ctypes rather than a binding: the PyPI binding (`liburing`) needs Linux 6.14+, is alpha, and
prepares one SQE per Python call; here a whole request's reads are written into the mapped submission queue with a
few numpy operations, and the two system calls (setup, enter) release the GIL like any ctypes call.

Memory ordering: the kernel publishes a completion's entry before its tail (store-release) and reads our entries
after the io_uring_enter call that submits them. x86-64 keeps loads in order and stores in order, so plain numpy
loads and stores through the mapping are enough; other architectures would need acquire/release fences Python
cannot express, so Ring refuses them (the caller falls back to threads).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import threading
import time

import numpy as np

from ._watch import watcher

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


_libc = None


def _syscall(*args) -> int:
    """A system call that releases the GIL; raises OSError on failure."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    while True:
        r = _libc.syscall(*[ctypes.c_long(a) for a in args])
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
