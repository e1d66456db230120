"""The io_uring ring's watcher (storage.reader.Ring with stamps): compiled, so it runs without the GIL and stamps a
completion within tens of microseconds of its posting, whatever the Python threads are doing. Numba is loaded, and
the watcher compiled (or taken from the cache), by the first ring with stamps, not when this module is imported."""
from __future__ import annotations

CLOCK_MONOTONIC = 1          # time.perf_counter's clock on Linux
_read = _clock = _compiled = None


def _watch(efd, tail, stamps, seen, count, ts):
    """Until seen[1] is set: sleep on the eventfd (the kernel signals it as it posts completions), then stamp every
    completion slot from seen[0] to the ring's tail with the time, and publish that tail in seen[0]. count and ts:
    scratch for the eventfd's counter and the clock's timespec."""
    mask = stamps.size - 1
    while True:
        if _read(efd, count.ctypes.data, 8) < 0:     # EINTR: a signal; read again
            continue
        _clock(CLOCK_MONOTONIC, ts.ctypes.data)
        if seen[1]:
            return
        t = ts[0] + ts[1] * 1e-9
        end = tail[0] + 0
        pos = seen[0]
        while (end - pos) & 0xFFFFFFFF:
            stamps[pos & mask] = t
            pos = (pos + 1) & 0xFFFFFFFF
        seen[0] = pos


def watcher():
    """The watcher, compiled: watcher()(efd, tail uint32[1], stamps float64[n], seen int64[2], uint64[1], int64[2])."""
    global _read, _clock, _compiled
    if _compiled is None:
        from numba import njit, types
        # libc's, linked by name (so the compiled function caches, which ctypes pointers would prevent)
        _read = types.ExternalFunction("read", types.intp(types.int32, types.voidptr, types.uintp))
        _clock = types.ExternalFunction("clock_gettime", types.int32(types.int32, types.voidptr))
        _compiled = njit("void(int32, uint32[:], float64[:], int64[:], uint64[:], int64[:])", cache=True,
                         nogil=True)(_watch)
    return _compiled
