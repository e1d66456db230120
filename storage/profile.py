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
    """(bundles a stream's chunk holds, chunks in flight) for `layout`: chunk_bytes of bundles, never more than a
    layer has, and no more chunks than a layer fills (more would hold a second layer's rows)."""
    rows = min(max(1, chunk_bytes // layout.stride), max(layout.n_neurons))
    return rows, max(1, min(int(depth), -(-max(layout.n_neurons) // rows)))
