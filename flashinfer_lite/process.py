"""Probes of this process and the machine it runs on: resident set, its peak, bytes read from storage, the memory
cgroup's room, the page cache, and glibc's allocator. The runtime's budget, the predictors' training and the benches
all measure through here. Standard library only (numpy where an allocator setting needs it): a bench's llama.cpp
worker imports it without numba, and the CLI before numpy, to tell what numpy adds (mark_rss).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup can still give (limit - usage + reclaimable page cache), or None when
    there is no limit. cgroup v2 (memory.max) and v1 (memory.limit_in_bytes)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":                                        # v2
            d = Path(root) / path.lstrip("/")
            names = ("memory.max", "memory.current", "file")
        elif "memory" in controllers.split(","):                     # v1
            d = Path(root) / "memory" / path.lstrip("/")
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
        else:
            continue
        try:
            limit = (d / names[0]).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:
                return None
            usage = int((d / names[1]).read_text())
            stat = dict(ln.split() for ln in (d / "memory.stat").read_text().splitlines() if ln.count(" ") == 1)
            cache = int(stat.get(names[2], 0))
        except (OSError, ValueError):
            return None
        return max(0, int(limit) - usage + cache)
    return None


def rss_bytes() -> int:
    """Resident set of this process now: /proc/self/statm's second field where there is one (what psutil reads; not
    importing psutil keeps its 2 MiB out of the process base), else psutil."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import psutil
        return int(psutil.Process().memory_info().rss)


def room_bytes() -> int:
    """Bytes this process and its children may still take: the machine's available memory (/proc/meminfo's
    MemAvailable, as psutil reads it; psutil where there is none), at most the memory cgroup's room (cgroup_room)."""
    try:
        with open("/proc/meminfo") as f:
            room = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, ValueError, StopIteration):
        import psutil
        room = int(psutil.virtual_memory().available)
    capped = cgroup_room()
    return room if capped is None else min(room, capped)


# The process base's parts as they came (mark_rss): (what, RSS after it). warmup.base_parts reads them.
RSS_MARKS: list[tuple[str, int]] = []


def mark_rss(what: str) -> None:
    """Note the RSS after `what` joined the process (a library imported, the tokenizer built, kernels loaded)."""
    RSS_MARKS.append((what, rss_bytes()))


def peak_rss_bytes() -> int:
    """Peak resident set of this process: the kernel's high-water mark (psutil has none on Linux).

    Linux: VmHWM of /proc/self/status, which starts at this program's exec. Not getrusage's ru_maxrss: Linux carries
    the parent's peak into it across fork + exec, so a generate started by a 600 MiB process would report 600 MiB.
    Elsewhere ru_maxrss (bytes on macOS, KiB on the BSDs).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


# glibc mallopt parameter
M_MMAP_THRESHOLD = -3


def keep_freed_arrays_out_of_rss(threshold: int = 128 << 10) -> None:
    """Give every allocation over `threshold` bytes its own mapping, returned to the system when freed.

    glibc raises its mmap threshold (up to 32 MiB) each time a mapped block is freed, so later arrays of that size
    come from the heap, where freed space mostly stays resident: after a 243-token prompt on an 8 x 16384 x 1024
    model, RSS kept 529 MiB with the adjustment and 444 MiB without it. Setting the threshold turns it off; glibc
    only (elsewhere a no-op), and only allocations made after the call are affected.
    """
    if not sys.platform.startswith("linux"):
        return
    # numpy asks for transparent huge pages on arrays of 4 MiB and more: touching one row of a neuron-cache matrix
    # then makes a whole 2 MiB page resident (measured: +3.7 MiB over the plan on a 2-layer model's hot load).
    import numpy as np
    try:
        np._core.multiarray._set_madvise_hugepage(False)
    except AttributeError:
        pass
    _glibc("mallopt", M_MMAP_THRESHOLD, int(threshold))


def return_freed_heap() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim; elsewhere a no-op): after a model is
    freed in this process (runtime.calibrate_gate), its small allocations' pages otherwise stay resident (9 MiB on
    the default model) and the run planned after it would pass its budget by that much."""
    if sys.platform.startswith("linux"):
        _glibc("malloc_trim", 0)


MADV_DONTNEED = 4


def drop_file_pages(path_part: str) -> int:
    """Unmap this process's resident pages of the files whose path contains `path_part`, where the mapping is
    neither writable nor holds a page the process wrote (Anonymous: 0 in smaps): pages that are the file's own bytes,
    kept by the page cache, read back on a later touch. Returns the bytes dropped from RSS. Linux only (else 0).

    For the LLVM library once the kernels are loaded (warmup.measure_base_bytes): running loaded machine code never
    touches it, only compiling or loading another kernel does, and that would read its pages back in."""
    import ctypes
    import re
    try:
        madvise = ctypes.CDLL(None).madvise
        smaps = open("/proc/self/smaps")
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    header = re.compile(r"([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+ +(\S.*)$")
    found, mapping = [], None       # mapping: [start, end, perms, path, Rss kB, Anonymous kB] of the current header
    with smaps:                     # a line at a time: the whole text would add to the peak this lowers
        for line in smaps:
            m = header.match(line)
            if m:
                mapping = [int(m[1], 16), int(m[2], 16), m[3], m[4], 0, None] if path_part in m[4] else None
                if mapping:
                    found.append(mapping)
            elif mapping and line.startswith(("Rss:", "Anonymous:")):
                mapping[4 if line[0] == "R" else 5] = int(line.split()[1])
    dropped = 0
    for start, end, perms, _, rss, anonymous in found:
        if "w" not in perms and anonymous == 0 and rss and madvise(start, end - start, MADV_DONTNEED) == 0:
            dropped += rss << 10
    return dropped


def _glibc(name: str, *args: int) -> None:
    """Call one of glibc's allocator functions; a no-op where the C library has none (musl, a failed load)."""
    import ctypes
    try:
        getattr(ctypes.CDLL(None), name)(*args)
    except (OSError, AttributeError):
        pass


def read_bytes() -> int:
    """Bytes this process (all threads) caused to be fetched from storage: page-cache misses, mmap faults and
    O_DIRECT reads (read_bytes of /proc/self/io; 0 where there is none)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def drop_caches() -> bool:
    """Write back dirty pages and drop the whole page cache (root only): the next read of any file comes from
    storage. False where it may not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False
