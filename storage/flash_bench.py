"""`flashinfer-lite flash-bench`: random-read bandwidth of the flash device, chunk size x reads in flight, for both
reader engines: threads (1 read in flight per thread) and io_uring (queue depth) (LLM in a Flash Fig. 2b).

Reads go through BundleReader (O_DIRECT) on a scratch file, so the numbers are what the runtime can get, not what a C
tool gets; each cell also records the CPU seconds per GB it cost. From the table it saves a device profile (engine,
queue depth, threads and coalescing gap per request size, see storage/profile.py) that BundleReader uses by default.
With -m FLASHDIR it also reads random neuron sets of that model's real bundles (of a mixture of experts: random whole
expert chunks, expert_rate). Then sequential streams (a layer read whole, storage.reader.RowStream) per chunk size and
chunks in flight: the profile's "stream" entry, which the exact gate's and prefill's streams use
(storage.profile.stream_defaults).
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import math
import os
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from storage.errors import UserError

from .checksums import drop_from_page_cache
from .files import remove_quietly
from .format import BUNDLE_ALIGN, FlashLayout, expert_chunks, read_layout
from storage.sizes import human, parse_size  # noqa: F401  (re-exported for bench scripts)

from .cache import cache_dir
from .profile import DEFAULT_DEPTH, DEFAULT_THREADS, device_key, save_profile
from .reader import SLOTS_IN_HUGE_PAGES, BundleReader, RowStream, aligned_empty, in_flight_seconds, populate
from .reader import refused as ring_refused

STREAM_CHUNKS = (1 << 20, 2 << 20, 4 << 20, 8 << 20)   # a stream's chunk sizes and chunks in flight measured
STREAM_DEPTHS = (1, 2, 4, 8)
STREAM_ROW = 4096              # the scratch file's rows in a stream (any multiple of 512: the spans are the same)
STREAM_LAYER_BYTES = 256 << 20   # a stream reads this much of the scratch file whole, again and again
STREAM_SHARE = 0.9             # the stream entry: the fewest bytes in flight within this share of the best rate
DEST_BYTES = 64 << 20          # destination buffer per measurement
OPS_PER_THREAD = 32            # reads per thread (or per ring slot) per call: amortises the hand-off
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=".", help="directory on the device to measure (scratch file goes here)")
    parser.add_argument("--size", default="2GiB", help="scratch file size (default 2GiB)")
    parser.add_argument("--chunks", default="4K,16K,64K,256K,1M", help="read sizes, multiples of 512")
    parser.add_argument("--threads", default="1,2,4,8,16,32", help="thread counts of the thread engine")
    parser.add_argument("--depths", default="8,16,32,64,128,256",
                        help="queue depths of the io_uring engine (skipped where the kernel refuses io_uring)")
    parser.add_argument("--seconds", type=float, default=1.0, help="measuring time per cell")
    parser.add_argument("-m", "--model", help="also read random neuron sets (a mixture of experts: expert chunks) "
                                              "of this flash directory")
    parser.add_argument("--out", help="where CSV/JSON/PNG go (default: <cache dir>/flash-bench)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 64MiB file, 3 chunks, 2 thread counts, 2 depths, 0.2 s; never saves the "
                             "profile")
    parser.add_argument("--no-save-profile", action="store_true", help="do not write the device profile")


def drop_caches(path: Path) -> bool:
    """Evict `path` from the page cache (and all caches if we may). O_DIRECT does not need it; buffered fallback does."""
    try:
        fd = os.open(path, os.O_RDONLY)
        drop_from_page_cache(fd)
        os.close(fd)
    except OSError:
        pass
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def write_scratch(path: Path, size: int) -> None:
    """Random (incompressible, non-dedupable) bytes, so the device cannot shortcut the reads."""
    rng = np.random.default_rng(0)
    chunk = 16 << 20
    with open(path, "wb") as f, tqdm(total=size, unit="B", unit_scale=True, desc="scratch file", file=sys.stderr,
                                     leave=False) as bar:
        done = 0
        while done < size:
            n = min(chunk, size - done)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            done += n
            bar.update(n)
        f.flush()
        os.fsync(f.fileno())


def synthetic_layout(path: Path, chunk: int, size: int) -> FlashLayout:
    """The scratch file seen as one layer of `size // chunk` bundles of `chunk` bytes."""
    n = size // chunk
    layout = FlashLayout(d=1, dtype="f32", vectors=("up", "down"), biases=(), stride=chunk, offset=[0],
                         n_neurons=[n], order=[np.arange(n)], checksum=[""], ffn_size=size,
                         files={"ffn": path.name, "resident": "-", "tokenizer": "-"}, flashdir=path.parent)
    return layout


def measure(reader: BundleReader, n_bundles: int, batch: int, seconds: float, rng, layer: int = 0,
            in_flight: int = 2, huge: bool = False) -> dict:
    """Random reads of `batch` distinct bundles per call for `seconds`; returns bytes, reads, wall time, the time
    reads were in flight (busy_s, storage.reader.busy_seconds) and their times in flight summed (op_s).

    `in_flight` calls at once: with 2 the next is submitted before the last is waited for, as a reader fed ahead of
    its consumer is used, so the queue does not drain between calls and planning overlaps the reads. huge: the
    destination in huge pages (aligned_empty). The destinations' pages are faulted in first (populate), as the expert
    cache does for a slot before its first read: the reads' times are the device's."""
    stride = reader.layout.stride
    dests = [aligned_empty((batch, stride), np.uint8, huge=huge) for _ in range(in_flight)]
    for d in dests:
        populate(d)
    tot = {"requested_bytes": 0, "read_bytes": 0, "n_reads": 0}
    pending, landed = collections.deque(), []
    calls = 0
    t0 = time.perf_counter()
    while True:
        ids = np.unique(rng.integers(0, n_bundles, batch))
        pending.append(reader.submit(layer, ids, dests[calls % in_flight], np.arange(ids.size)))
        calls += 1
        # Past the time, the calls still in flight are waited for and counted: their reads were made in it.
        done = time.perf_counter() - t0 >= seconds
        while pending and (done or len(pending) == in_flight):
            p = pending.popleft()
            st = p.wait()
            for k in tot:
                tot[k] += getattr(st, k)
            landed.append(p)
        if done:
            busy, summed = in_flight_seconds(landed)
            return {**tot, "calls": calls, "seconds": time.perf_counter() - t0, "busy_s": busy, "op_s": summed}


def bench_streams(path: Path, size: int, seconds: float, chunks=STREAM_CHUNKS,
                  depths=STREAM_DEPTHS) -> list[dict]:
    """One row per (chunk, depth): MB/s and CPU seconds per GB of a stream reading the scratch file's first
    STREAM_LAYER_BYTES whole, chunk after chunk, `depth` chunks in flight (nothing computed between)."""
    layer = min(size, STREAM_LAYER_BYTES) // STREAM_ROW * STREAM_ROW
    rows = []
    with BundleReader(synthetic_layout(path, STREAM_ROW, layer)) as reader:
        for chunk in [c for c in chunks if c <= layer]:
            for depth in depths:
                stream = RowStream(reader, chunk // STREAM_ROW, depth)
                nbytes, cpu0, t0 = 0, cpu_seconds(), time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    for _, _, rs, _ in stream.chunks(0):
                        nbytes += rs.read_bytes
                dt, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
                rows.append({"chunk": chunk, "depth": depth, "MBps": nbytes / dt / 1e6,
                             "cpu_s_per_GB": cpu / max(nbytes / 1e9, 1e-9)})
    return rows


def derive_stream(rows: list[dict]) -> dict:
    """The profile's stream entry: the fewest bytes in flight (chunk x depth; the DRAM budget pays for them) whose
    rate is within STREAM_SHARE of the best, the smaller chunk on a tie."""
    best = max(r["MBps"] for r in rows)
    pick = min((r for r in rows if r["MBps"] >= STREAM_SHARE * best),
               key=lambda r: (r["chunk"] * r["depth"], r["chunk"]))
    return {"chunk": pick["chunk"], "depth": pick["depth"], "MBps": round(pick["MBps"], 1)}


def cpu_seconds() -> float:
    """User + system CPU of this process, all threads (the thread engine's and the kernel's work for our reads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bench_grid(path: Path, size: int, chunks: list[int], threads: list[int], seconds: float,
               depths: list[int] = ()) -> list[dict]:
    """One row per (chunk, engine, threads or depth): MB/s, IOPS and CPU seconds per GB of random reads."""
    rng = np.random.default_rng(1)
    rows = []
    cells = [(c, "threads", t) for c in chunks for t in threads] + [(c, "io_uring", d) for c in chunks for d in depths]
    for c, engine, n in tqdm(cells, desc="flash-bench", unit="cell", file=sys.stderr, leave=False):
        drop_caches(path)
        with BundleReader(synthetic_layout(path, c, size), threads=n, depth=n, engine=engine, coalesce_gap=-1) as r:
            if not r.direct:
                raise UserError(f"{path.parent}: O_DIRECT is refused here (tmpfs?); flash-bench measures devices")
            batch = max(n, min(n * OPS_PER_THREAD, DEST_BYTES // c, size // c // 4))
            cpu0 = cpu_seconds()
            m = measure(r, size // c, batch, seconds, rng)
            cpu = cpu_seconds() - cpu0
        rows.append({"chunk": c, "engine": engine, "threads": n if engine == "threads" else 0,
                     "depth": n if engine == "io_uring" else 0, "MBps": m["read_bytes"] / m["seconds"] / 1e6,
                     "IOPS": m["n_reads"] / m["seconds"], "reads": m["n_reads"], "seconds": m["seconds"],
                     "cpu_s_per_GB": cpu / max(m["read_bytes"], 1) * 1e9})
    return rows


def derive_profile(rows: list[dict]) -> list[dict]:
    """Per chunk: the engine setting within 5% of the best MB/s that costs the least CPU (then the fewest reads in
    flight), the fewest threads within 5% of the best thread cell (the fallback's), and the widest gap worth reading
    through.

    A request of s bytes occupies the device for time(s) = 1 / IOPS(s) at the best thread count. Reading two
    bundles of size c and the g bytes between them as one request pays off while time(2c + g) <= 2 time(c).
    time(s) is interpolated in log2(s) between measured chunks and extended linearly in s (bandwidth bound) past them.
    """
    best, fewest_threads = {}, {}
    for c in sorted({r["chunk"] for r in rows}):
        cands = [r for r in rows if r["chunk"] == c]
        top = max(r["MBps"] for r in cands)
        # Within 5% of the best: the cheapest in CPU, then the fewest reads in flight.
        best[c] = min((r for r in cands if r["MBps"] >= 0.95 * top),
                      key=lambda r: (r.get("cpu_s_per_GB", 0.0), r["threads"] or r.get("depth", 0)))
        pool = [r for r in cands if r.get("engine", "threads") == "threads"]
        if pool:   # the fallback's setting, should the kernel refuse io_uring later
            top = max(r["MBps"] for r in pool)
            fewest_threads[c] = min(r["threads"] for r in pool if r["MBps"] >= 0.95 * top)
    sizes = sorted(best)
    log_s = np.log2(sizes)
    t_req = np.array([1.0 / max(best[c]["IOPS"], 1e-9) for c in sizes])

    def time_of(s: float) -> float:
        if s >= sizes[-1]:
            return t_req[-1] * s / sizes[-1]
        return float(np.interp(math.log2(s), log_s, t_req))

    entries = []
    for c in sizes:
        g = 0
        while g + c <= 256 * c and time_of(2 * c + (g + c)) <= 2 * time_of(c):
            g += c     # one more bundle of gap still pays off
        b = best[c]
        entries.append({"chunk": c, "engine": b.get("engine", "threads"),
                        "threads": fewest_threads.get(c, DEFAULT_THREADS), "depth": b.get("depth") or DEFAULT_DEPTH,
                        "gap_bytes": g, "MBps": round(b["MBps"], 1), "IOPS": round(b["IOPS"], 1)})
    return entries


def bench_model(flashdir, seconds: float) -> list[dict]:
    """Random neuron sets of a real flash directory, with the (just saved) profile defaults and without coalescing."""
    layout = read_layout(flashdir)
    if not layout.bundled:        # bundles only in the split parts: the exact gate's reads of one neuron, down rows
        layout = layout.parts["down"]
    rng = np.random.default_rng(2)
    rows = []
    for frac in (0.05, 0.1, 0.25, 0.5):
        for label, gap in (("profile", None), ("no-coalescing", -1)):
            with BundleReader(layout, coalesce_gap=gap) as r:
                n = min(layout.n_neurons)
                batch = max(1, int(frac * n))
                tot = {"requested_bytes": 0, "read_bytes": 0, "n_reads": 0, "calls": 0, "seconds": 0.0}
                per_layer = max(seconds / layout.n_layers, 0.01)
                for layer in range(layout.n_layers):
                    drop_caches(layout.ffn_path)
                    m = measure(r, layout.n_neurons[layer], batch, per_layer, rng, layer, in_flight=1)
                    for k in tot:
                        tot[k] += m[k]
                rows.append({"fraction": frac, "mode": label, "engine": r.engine, "threads": r.threads,
                             "depth": getattr(r._engine, "depth", 0), "coalesce_gap": r.coalesce_gap,
                             "neurons_per_call": batch, "stride": layout.stride,
                             "useful_MBps": round(tot["requested_bytes"] / tot["seconds"] / 1e6, 1),
                             "read_MBps": round(tot["read_bytes"] / tot["seconds"] / 1e6, 1),
                             "over_read": round(tot["read_bytes"] / max(tot["requested_bytes"], 1) - 1, 3),
                             "reads_per_call": round(tot["n_reads"] / tot["calls"], 1),
                             "ms_per_call": round(1e3 * tot["seconds"] / tot["calls"], 3)})
    return rows


EXPERT_PROBES = ((1, 1), (2, 1), (4, 1), (8, 1), (8, 2))   # (chunks a call, calls in flight)
BUSY_MEASURE = ("bytes over busy time: the time at least one of the reads was in flight, each read from its "
                "submission to the kernel (io_uring_enter) to its completion as the kernel posted it (stamped by the "
                "ring's watcher thread); in flight: the reads' times summed over busy time")


def expert_rate(flashdir, seconds: float) -> dict:
    """The device's rate for a mixture of experts' reads as its expert cache makes them (bench/moe_vs_llama_cpp.py):
    random whole chunks of a random layer into pages of the slots' kind (reader.SLOTS_IN_HUGE_PAGES), k distinct ones
    a call (a layer's misses), then wait, as EXPERT_PROBES says.
    Per probe: MBps (bytes over wall time), busy_MBps (over the time reads were in flight, the expert cache's
    measure: FlashStats.read_busy_s), in_flight (the mean reads in flight over that time), and on the disk's own
    busy clock (disk_stat: every process's requests) disk_MBps and disk_read_share, as expert_reads has them."""
    layout = read_layout(flashdir)
    E = layout.experts
    probes = []
    with BundleReader(expert_chunks(layout), stamps=True) as r:
        for k, calls in EXPERT_PROBES:
            rng, nb = np.random.default_rng(3), r.layout.n_neurons[0]
            d0 = disk_stat(flashdir)
            m = measure(r, nb, k, seconds / len(EXPERT_PROBES), rng, int(rng.integers(0, E.n_layers)), calls,
                        SLOTS_IN_HUGE_PAGES)
            probes.append({"chunks": k, "calls": calls, "MBps": round(m["read_bytes"] / m["seconds"] / 1e6, 1),
                           "busy_MBps": round(m["read_bytes"] / m["busy_s"] / 1e6, 1),
                           "in_flight": round(m["op_s"] / m["busy_s"], 2),
                           **disk_rates(m["read_bytes"], d0, disk_stat(flashdir))})
    return {"chunk_bytes": E.chunk, "measure": BUSY_MEASURE, "probes": probes,
            "summary": f"{E.chunk}-byte chunks, MB/s busy (in flight): "
            + ", ".join(f"{p['busy_MBps']:.0f} ({p['in_flight']:.1f})" for p in probes)}


def disk_stat(path) -> tuple[int, int] | None:
    """(bytes read, milliseconds with requests in flight) since boot of the block device holding `path` (its stat in
    sysfs: sectors read, io_ticks; every process's requests), or None where there is no such device."""
    st = os.stat(path)
    try:
        f = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat").read_text().split()
        return int(f[2]) * 512, int(f[9])
    except (OSError, IndexError, ValueError):
        return None


def reads_mark(stats, flashdir) -> dict:
    """The expert cache's read counters (storage.reader.FlashStats) and the disk's busy time now, for expert_reads."""
    return {"busy_s": stats.read_busy_s, "bytes": stats.read_busy_bytes, "op_s": stats.read_op_s,
            "touch_s": stats.first_touch_s, "tokens": stats.tokens, "disk": disk_stat(flashdir), "flashdir": flashdir}


def expert_reads(stats, mark: dict) -> dict:
    """The expert cache's miss reads since `mark` (reads_mark): expert_read_MBps, their bytes over the time they were
    in flight (read_busy_s: per layer call, the union of its reads' intervals from submission to the kernel to the
    completion's stamp) and expert_reads_in_flight, the mean in flight over that time. Beside it the same bytes over
    the disk's own busy time (sysfs io_ticks): a lower bound, as every process's requests count (disk_read_share says
    what share of the disk's bytes read were these). first_touch_ms_per_token: the time slots used for the first time
    took to fault their pages in (not in the reads' time)."""
    busy, nbytes = stats.read_busy_s - mark["busy_s"], stats.read_busy_bytes - mark["bytes"]
    if busy <= 0:
        return {}
    disk = disk_rates(nbytes, mark["disk"], disk_stat(mark["flashdir"]))
    return {"expert_read_MBps": round(nbytes / busy / 1e6, 1),
            "expert_reads_in_flight": round((stats.read_op_s - mark["op_s"]) / busy, 2),
            "expert_read_MBps_disk_busy": disk["disk_MBps"], "disk_read_share": disk["disk_read_share"],
            "first_touch_ms_per_token": round(1e3 * (stats.first_touch_s - mark["touch_s"])
                                              / max(stats.tokens - mark["tokens"], 1), 2)}


def disk_rates(nbytes: int, then, now) -> dict:
    """nbytes over the disk's busy time between two disk_stat readings (disk_MBps), and their share of its bytes read
    then (disk_read_share: below 1, other processes' reads count in its busy time, and disk_MBps is a lower bound)."""
    disk_bytes, disk_ms = (now[0] - then[0], now[1] - then[1]) if now and then else (0, 0)
    return {"disk_MBps": round(nbytes / disk_ms / 1e3, 1) if disk_ms > 0 else None,
            "disk_read_share": round(nbytes / disk_bytes, 3) if disk_bytes > 0 else None}


def device_share(row: dict, device: dict) -> dict:
    """A row's expert reads (expert_reads) beside the device's rate for the chunks at as many in flight (expert_rate's
    probes, busy MB/s linear in their mean in flight), the share of it they got, and both in one line."""
    if not row.get("expert_read_MBps"):
        return {}
    probes = sorted(device["probes"], key=lambda p: p["in_flight"])
    at = float(np.interp(row["expert_reads_in_flight"], [p["in_flight"] for p in probes],
                         [p["busy_MBps"] for p in probes]))
    share = row["expert_read_MBps"] / at
    out = {"device_MBps": round(at, 1), "share_of_device": round(share, 3),
           "expert_reads": f"{row['expert_read_MBps']:.0f} ({row['expert_reads_in_flight']:.1f}): "
                           f"{share:.2f} of {at:.0f}"}
    if row.get("expert_read_MBps_disk_busy") and all(p.get("disk_MBps") for p in probes):   # the same on its clock
        disk = float(np.interp(row["expert_reads_in_flight"], [p["in_flight"] for p in probes],
                               [p["disk_MBps"] for p in probes]))
        out.update(device_disk_MBps=round(disk, 1),
                   share_of_device_disk=round(row["expert_read_MBps_disk_busy"] / disk, 3))
        out["expert_reads"] += f"; disk clock {out['share_of_device_disk']:.2f} of {disk:.0f}"
    return out


def columns(rows: list[dict]) -> list[tuple[str, int]]:
    """(engine, threads or depth) of the grid, thread cells first."""
    return sorted({(r.get("engine", "threads"), r["threads"] or r.get("depth", 0)) for r in rows},
                  key=lambda k: (k[0] != "threads", k[1]))


def label(col: tuple[str, int]) -> str:
    return f"{col[1]} thr" if col[0] == "threads" else f"ring {col[1]}"


def print_table(rows: list[dict], chunks: list[int]) -> None:
    cols = columns(rows)
    cell = {(r["chunk"], r.get("engine", "threads"), r["threads"] or r.get("depth", 0)): r for r in rows}
    print("MB/s (IOPS) of random O_DIRECT reads, chunk x (threads | io_uring queue depth)")
    print(f"{'chunk':>6} " + " ".join(f"{label(k):>17}" for k in cols))
    for c in chunks:
        print(f"{human(c):>6} " + " ".join(
            f"{cell[c, e, n]['MBps']:8.1f} ({cell[c, e, n]['IOPS']:6.0f})" for e, n in cols))


def plot(rows: list[dict], chunks: list[int], png: Path, entries: list[dict] | None = None, title: str = "") -> bool:
    """MB/s per chunk size, one line per thread count and queue depth; a star on the setting the profile chose."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the chart (pip install 'flashinfer-lite[plot]')", file=sys.stderr)
        return False
    cell = {(r["chunk"], r.get("engine", "threads"), r["threads"] or r.get("depth", 0)): r["MBps"] for r in rows}
    fig, ax = plt.subplots(figsize=(6, 4))
    for e, n in columns(rows):
        ax.plot([c / 1024 for c in chunks], [cell[c, e, n] for c in chunks], marker="o",
                linestyle="-" if e == "threads" else "--", label=label((e, n)))
    if entries:
        chosen = [(e["chunk"], e["engine"], e["threads"] if e["engine"] == "threads" else e["depth"])
                  for e in entries]
        chosen = [k for k in chosen if k in cell]
        ax.plot([c / 1024 for c, _, _ in chosen], [cell[k] for k in chosen], linestyle="none", marker="*",
                markersize=14, color="black", label="chosen per chunk")
        for k in chosen:
            ax.annotate(label(k[1:]), (k[0] / 1024, cell[k]), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size (KiB)")
    ax.set_ylabel("random read MB/s")
    ax.set_title(title or "flash random-read bandwidth (O_DIRECT)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def _interrupt(signum, frame):
    raise KeyboardInterrupt   # SIGTERM unwinds like Ctrl-C, so the scratch file is removed


def run(args) -> int:
    if args.quick:
        args.size, args.chunks, args.threads, args.seconds = "64MiB", "4K,64K,1M", "1,4", min(args.seconds, 0.2)
        args.depths = "8,64"
    size = parse_size(args.size)
    chunks = sorted({parse_size(c) for c in args.chunks.split(",") if c.strip()})
    try:
        threads = sorted({int(t) for t in args.threads.split(",") if t.strip()})
    except ValueError:
        raise UserError(f"--threads must be a comma-separated list of integers, got {args.threads!r}")
    if not chunks or any(c <= 0 or c % BUNDLE_ALIGN for c in chunks):
        raise UserError(f"--chunks must be positive multiples of {BUNDLE_ALIGN} bytes, got {args.chunks!r}")
    if not threads or min(threads) < 1 or max(threads) > 256:
        raise UserError("--threads must be between 1 and 256")
    try:
        depths = sorted({int(t) for t in args.depths.split(",") if t.strip()})
    except ValueError:
        raise UserError(f"--depths must be a comma-separated list of integers, got {args.depths!r}")
    if depths and (min(depths) < 1 or max(depths) > 4096):
        raise UserError("--depths must be between 1 and 4096")
    if args.seconds <= 0:
        raise UserError("--seconds must be positive")
    size = size // max(chunks) * max(chunks)
    if size < 4 * max(chunks):
        raise UserError(f"--size must be at least 4 x the largest chunk ({human(4 * max(chunks))})")
    d = Path(args.dir).expanduser()
    if not d.is_dir():
        raise UserError(f"--dir {d} is not a directory")
    if shutil.disk_usage(d).free < size + (256 << 20):
        raise UserError(f"not enough free space in {d} for a {args.size} scratch file")
    out = Path(args.out).expanduser() if args.out else cache_dir() / "flash-bench"
    out.mkdir(parents=True, exist_ok=True)

    scratch = d / f".flashinfer-lite-bench-{os.getpid()}.tmp"
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        write_scratch(scratch, size)
        refused = ring_refused() if depths else ""
        if refused:
            print(f"{refused}: measuring the thread engine only", file=sys.stderr)
            depths = []
        rows = bench_grid(scratch, size, chunks, threads, args.seconds, depths)
        streams = bench_streams(scratch, size, args.seconds, *((STREAM_CHUNKS[:2], (1, 4)) if args.quick else ()))
    finally:   # also on Ctrl-C / SIGTERM: never leave gigabytes behind (nor hide why, on a read-only --dir)
        remove_quietly(scratch)
        signal.signal(signal.SIGTERM, old_term)

    print_table(rows, chunks)
    entries = derive_profile(rows)
    stream = derive_stream(streams) if streams else None
    result = {"dir": str(d.resolve()), "device": device_key(d), "size": size, "seconds": args.seconds,
              "grid": rows, "profile": entries, "streams": streams, "stream": stream}
    if args.quick:
        print("--quick: a smoke run; the device profile is left as it was")
    elif not args.no_save_profile:
        p = save_profile(d, {"dir": str(d.resolve()), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                             "entries": entries, **({"stream": stream} if stream else {})})
        print(f"device profile saved to {p}")
    print("profile (chunk: engine, coalescing gap): " + ", ".join(
        f"{human(e['chunk'])}: " + (f"io_uring depth {e['depth']}" if e["engine"] == "io_uring" else
                                    f"{e['threads']} thr") + f", gap {human(e['gap_bytes'])}" for e in entries))
    print("streams (a layer read whole), MB/s by chunk and chunks in flight: " + ", ".join(
        f"{human(r['chunk'])} x {r['depth']}: {r['MBps']:.0f}" for r in streams))
    if stream:
        print(f"stream profile: {human(stream['chunk'])} chunks, {stream['depth']} in flight "
              f"({stream['MBps']:.0f} MB/s)")
    if args.model and read_layout(args.model).experts is not None:   # a mixture of experts: whole chunks, no bundles
        rate = expert_rate(args.model, args.seconds * len(EXPERT_PROBES))
        result["model"] = {"flashdir": str(args.model), "experts": rate}
        print(f"random expert chunks of {args.model}: {rate['summary']}")
    elif args.model:
        result["model"] = {"flashdir": str(args.model), "reads": bench_model(args.model, args.seconds)}
        print(f"random neuron sets of {args.model}:")
        for r in result["model"]["reads"]:
            print(f"  {r['fraction']:>5.0%} {r['mode']:>14}: {r['useful_MBps']:8.1f} MB/s useful, "
                  f"{r['read_MBps']:8.1f} MB/s read, over-read {r['over_read']:.1%}, {r['ms_per_call']:.3f} ms/layer")

    with open(out / "flash_bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "flash_bench.json").write_text(json.dumps(result, indent=1))
    title = (f"random O_DIRECT reads on {d.resolve()}\ndevice {result['device']}, {size / 2**20:.0f} MiB file, "
             f"{args.seconds:g} s per cell, {time.strftime('%Y-%m-%d %H:%M')}"
             + (", --quick (profile not saved)" if args.quick else ""))
    charted = plot(rows, chunks, out / "flash_bench.png", entries, title)
    print(f"wrote {out / 'flash_bench.csv'}, {out / 'flash_bench.json'}" + (
        f", {out / 'flash_bench.png'}" if charted else ""))
    return 0
