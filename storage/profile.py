"""The device profile: reader engine, queue depth, threads and coalescing gap per request size, measured by
`flashinfer-lite flash-bench`.

Stored as JSON in the user cache dir ($FLASHINFER_LITE_CACHE, else $XDG_CACHE_HOME/flashinfer-lite, else
~/.cache/flashinfer-lite), one entry per block device (st_dev), so a profile of the SSD is not applied to tmpfs.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

from .cache import cache_dir

PROFILE_NAME = "device_profile.json"
MAX_PROFILE_BYTES = 1 << 20

# Used when no profile exists for the device: enough requests in flight for an SSD, and a gap small enough that the
# over-read (a few tens of KiB at ~1 GB/s) costs less than the ~100 us of one more request.
# io_uring (where the kernel allows it) with 256 reads in flight: the one thread that refills the ring keeps the
# device's queue full even when it waits for a core after a wake-up (fio keeps 64 full by refilling one at a time);
# on a shared virtio disk 256 came near fio's best at 4-8 KiB where 64 did not (issue #29).
DEFAULT_THREADS = 8
DEFAULT_GAP_BYTES = 16 << 10
DEFAULT_ENGINE = "io_uring"
DEFAULT_DEPTH = 256
ENGINES = ("io_uring", "threads")
# Streams (a layer's rows read whole, in order: storage.reader.RowStream): chunks of this size, this many in flight
# (the one computed on included). One 2 MiB chunk at a time, read while nothing else was in flight, ran at 0.6-0.8 GB/s
# on the 7B shape (issue #29). Several chunks in flight read faster than one, and of the settings that hold 16 MiB
# (2 MiB x 4, 4 MiB x 4, 8 MiB x 2) 8 MiB x 2 costs the least CPU per token: fewer kernel calls and parallel regions
# per layer (flash-bench measures a device's own; bench/README.md, "Figures behind the library's comments").
DEFAULT_STREAM_CHUNK_BYTES = 8 << 20
DEFAULT_STREAM_DEPTH = 2


# The device's rates where flash-bench has not measured it, for the read planner (budget.plan_reads): sequential, a
# layer read whole in large chunks (flash-bench's 2 MiB stream cells on the SSD the defaults were set on: 1.2-1.4 GB/s;
# fio at 4 MiB x 16 there: 1.5-4.5 GB/s), and random reads at depth by request size (there: 0.5-0.9 GB/s at 4-8 KiB).
DEFAULT_SEQ_MBPS = 1300.0
DEFAULT_RANDOM_MBPS = ((4096, 500.0), (65536, 1000.0), (1 << 20, 1300.0))


class ReaderSettings(NamedTuple):
    threads: int        # the thread engine's threads
    gap_bytes: int      # coalescing gap
    engine: str         # "io_uring" or "threads"
    depth: int          # io_uring reads in flight
    source: str         # where these come from, for -v


class StreamSettings(NamedTuple):
    chunk_bytes: int    # a stream's chunk: what one compute step takes, and one buffer
    depth: int          # chunks in flight (each in its own buffer)
    source: str         # where these come from, for -v


class DeviceRates(NamedTuple):
    """What reading costs on a device, in bytes per second: seq_Bps a stream's (a layer read whole), random
    (request bytes, bytes per second of such requests at depth) by ascending size."""
    seq_Bps: float
    random: tuple[tuple[int, float], ...]
    source: str         # where these come from, for -v

    def random_Bps(self, request_bytes: int) -> float:
        """The rate of random requests of this size: interpolated in log2(size) between the measured sizes; below the
        smallest, as many requests a second as at the smallest (a small read costs a request, not its bytes); above
        the largest, the largest's rate; never above the sequential rate."""
        sizes = [s for s, _ in self.random]
        rates = [r for _, r in self.random]
        s = max(1, int(request_bytes))
        if s <= sizes[0]:
            rate = rates[0] * s / sizes[0]
        elif s >= sizes[-1]:
            rate = rates[-1]
        else:
            k = next(i for i in range(1, len(sizes)) if s <= sizes[i])
            w = (math.log2(s) - math.log2(sizes[k - 1])) / (math.log2(sizes[k]) - math.log2(sizes[k - 1]))
            rate = rates[k - 1] + w * (rates[k] - rates[k - 1])
        return min(rate, self.seq_Bps)


def profile_path() -> Path:
    return cache_dir() / PROFILE_NAME


def device_key(path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def load_profiles() -> dict:
    """{device_key: {"dir": ..., "entries": [{"chunk", "threads", "gap_bytes", ...}]}}; {} if absent or unreadable."""
    p = profile_path()
    try:
        if p.stat().st_size > MAX_PROFILE_BYTES:
            raise ValueError("too large")
        data = json.loads(p.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
            raise ValueError("no devices")
        return data["devices"]
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        print(f"flashinfer-lite: ignoring unreadable device profile {p} ({e})", file=sys.stderr)
        return {}


def save_profile(path_on_device, entry: dict) -> Path:
    """Store `entry` as the profile of the device holding `path_on_device` (atomic write)."""
    devices = load_profiles()
    devices[device_key(path_on_device)] = entry
    p = profile_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"devices": devices}, indent=1))
    os.replace(tmp, p)
    return p


def reader_defaults(path, request_bytes: int) -> ReaderSettings:
    """The reader's settings for requests of `request_bytes` on the device holding `path`: the profile's entry of the
    nearest chunk size, else the built-in defaults. Profiles saved before flash-bench measured queue depth name no
    engine: their threads serve the fallback, and the engine and depth are the defaults."""
    try:
        prof = load_profiles().get(device_key(path))
        entries = [e for e in prof["entries"] if int(e["chunk"]) > 0] if prof else []
    except (OSError, KeyError, TypeError, ValueError):
        entries = []
    if not entries:
        return ReaderSettings(DEFAULT_THREADS, DEFAULT_GAP_BYTES, DEFAULT_ENGINE, DEFAULT_DEPTH,
                              "built-in defaults (no flash-bench profile of this device)")
    best = min(entries, key=lambda e: abs(math.log(int(e["chunk"]) / max(request_bytes, 1))))
    source = (f"flash-bench profile of {prof.get('dir', '?')} from {prof.get('created', '?')} "
              f"({profile_path()}, {int(best['chunk']) // 1024} KiB row)")
    engine = best.get("engine", DEFAULT_ENGINE)
    if engine not in ENGINES:
        engine = DEFAULT_ENGINE
    return ReaderSettings(max(1, int(best.get("threads", DEFAULT_THREADS))), max(0, int(best["gap_bytes"])), engine,
                          max(1, int(best.get("depth", DEFAULT_DEPTH))), source)


def stream_defaults(path) -> StreamSettings:
    """The stream settings of the device holding `path`: the profile's "stream" entry (flash-bench's sequential
    measurement), else the built-in defaults. The DRAM plan and the FFN both ask this, so they agree."""
    try:
        prof = load_profiles().get(device_key(path)) or {}
        st = prof.get("stream")
        if st:
            return StreamSettings(max(1 << 16, int(st["chunk"])), max(1, int(st["depth"])),
                                  f"flash-bench profile of {prof.get('dir', '?')} from {prof.get('created', '?')}")
    except (OSError, KeyError, TypeError, ValueError):
        pass
    return StreamSettings(DEFAULT_STREAM_CHUNK_BYTES, DEFAULT_STREAM_DEPTH, "built-in defaults")


def stream_settings(layout) -> StreamSettings:
    """The chunk size and depth a FLASHDIR's layers are streamed with (the device's: stream_defaults):
    the FFNs read with them and the DRAM plan counts their buffers."""
    return stream_defaults(layout.device_path if layout.flashdir is not None else None)


def stream_shape(layout, chunk_bytes: int, depth: int) -> tuple[int, int]:
    """(bundles a stream's chunk holds, chunks in flight) for `layout`: chunk_bytes of bundles, and a layer smaller
    than `depth` chunks cut into `depth` chunks of the same buffers' bytes. A layer in one chunk, one in flight, left
    nothing in flight while it was computed (the 0.5B's 3 and 6 MB layers under 8 MiB chunks: 174 ms of waits a token
    at 75% of its file); in depth chunks each chunk's compute has the next one's read beside it, and a stream that runs
    on into the next layer (RowStream follow) reads its first chunk meanwhile."""
    n = max(layout.n_neurons)
    depth = max(1, int(depth))
    rows = max(1, min(chunk_bytes // layout.stride, -(-n // depth)))
    return rows, max(1, min(depth, -(-n // rows)))


def device_rates(path) -> DeviceRates:
    """The read rates of the device holding `path` (None: the built-in defaults): the profile's stream rate and its
    random entries' MB/s per request size, else DEFAULT_SEQ_MBPS and DEFAULT_RANDOM_MBPS."""
    try:
        prof = (load_profiles().get(device_key(path)) if path is not None else None) or {}
        random = tuple(sorted((int(e["chunk"]), float(e["MBps"]) * 1e6) for e in prof.get("entries", [])
                              if int(e["chunk"]) > 0 and float(e.get("MBps", 0)) > 0))
        seq = float(prof["stream"]["MBps"]) * 1e6 if prof.get("stream", {}).get("MBps") else 0.0
        if random and seq > 0:
            return DeviceRates(seq, random, f"flash-bench profile of {prof.get('dir', '?')} from "
                                            f"{prof.get('created', '?')}")
    except (OSError, KeyError, TypeError, ValueError):
        pass
    return DeviceRates(DEFAULT_SEQ_MBPS * 1e6, tuple((c, r * 1e6) for c, r in DEFAULT_RANDOM_MBPS),
                       "built-in defaults")
