"""`flashinfer-lite flash-bench`: random-read bandwidth of the flash device, chunk size x threads (LLM in a Flash Fig. 2b).

Reads go through BundleReader (O_DIRECT, one persistent thread pool) on a scratch file, so the numbers are what the
runtime can get, not what a C tool gets. From the table it saves a device profile (best threads and coalescing gap per
request size, see storage/profile.py) that BundleReader uses by default. With -m FLASHDIR it also reads random neuron
sets of that model's real bundles.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from storage.errors import UserError

from .format import BUNDLE_ALIGN, FlashLayout, drop_from_page_cache, read_layout
from storage.sizes import human, parse_size  # noqa: F401  (re-exported for bench scripts)

from .cache import cache_dir
from .profile import device_key, save_profile
from .reader import BundleReader, aligned_empty

DEST_BYTES = 64 << 20          # destination buffer per measurement
OPS_PER_THREAD = 32            # reads per thread per call: amortises the hand-off to the pool
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=".", help="directory on the device to measure (scratch file goes here)")
    parser.add_argument("--size", default="2GiB", help="scratch file size (default 2GiB)")
    parser.add_argument("--chunks", default="4K,16K,64K,256K,1M", help="read sizes, multiples of 512")
    parser.add_argument("--threads", default="1,2,4,8,16,32", help="reader thread counts")
    parser.add_argument("--seconds", type=float, default=1.0, help="measuring time per (chunk, threads) cell")
    parser.add_argument("-m", "--model", help="also read random neuron sets of this flash directory")
    parser.add_argument("--out", help="where CSV/JSON/PNG go (default: <cache dir>/flash-bench)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 64MiB file, 3 chunks, 2 thread counts, 0.2 s; never saves the profile")
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


def measure(reader: BundleReader, n_bundles: int, batch: int, seconds: float, rng, layer: int = 0) -> dict:
    """Random reads of `batch` distinct bundles per call for `seconds`; returns bytes, reads and wall time."""
    stride = reader.layout.stride
    dest = aligned_empty((batch, stride), np.uint8)
    requested = read = n_reads = calls = 0
    t0 = time.perf_counter()
    while True:
        ids = np.unique(rng.integers(0, n_bundles, batch))
        st = reader.read(layer, ids, dest, np.arange(ids.size))
        requested += st.requested_bytes
        read += st.read_bytes
        n_reads += st.n_reads
        calls += 1
        el = time.perf_counter() - t0
        if el >= seconds:
            break
    return {"requested_bytes": requested, "read_bytes": read, "n_reads": n_reads, "calls": calls, "seconds": el}


def bench_grid(path: Path, size: int, chunks: list[int], threads: list[int], seconds: float) -> list[dict]:
    rng = np.random.default_rng(1)
    rows = []
    cells = [(c, t) for c in chunks for t in threads]
    for c, t in tqdm(cells, desc="flash-bench", unit="cell", file=sys.stderr, leave=False):
        drop_caches(path)
        with BundleReader(synthetic_layout(path, c, size), threads=t, coalesce_gap=-1) as r:
            if not r.direct:
                raise UserError(f"{path.parent}: O_DIRECT is refused here (tmpfs?); flash-bench measures devices")
            batch = max(t, min(t * OPS_PER_THREAD, DEST_BYTES // c, size // c // 4))
            m = measure(r, size // c, batch, seconds, rng)
        rows.append({"chunk": c, "threads": t, "MBps": m["read_bytes"] / m["seconds"] / 1e6,
                     "IOPS": m["n_reads"] / m["seconds"], "reads": m["n_reads"], "seconds": m["seconds"]})
    return rows


def derive_profile(rows: list[dict]) -> list[dict]:
    """Per chunk: the fewest threads within 5% of the best MB/s, and the widest gap worth reading through.

    A request of s bytes occupies the device for time(s) = 1 / IOPS(s) at the best thread count. Reading two
    bundles of size c and the g bytes between them as one request pays off while time(2c + g) <= 2 time(c).
    time(s) is interpolated in log2(s) between measured chunks and extended linearly in s (bandwidth bound) past them.
    """
    best = {}
    for c in sorted({r["chunk"] for r in rows}):
        cands = [r for r in rows if r["chunk"] == c]
        top = max(r["MBps"] for r in cands)
        pick = min((r for r in cands if r["MBps"] >= 0.95 * top), key=lambda r: r["threads"])
        best[c] = pick
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
        entries.append({"chunk": c, "threads": best[c]["threads"], "gap_bytes": g, "MBps": round(best[c]["MBps"], 1),
                        "IOPS": round(best[c]["IOPS"], 1)})
    return entries


def bench_model(flashdir, seconds: float) -> list[dict]:
    """Random neuron sets of a real flash directory, with the (just saved) profile defaults and without coalescing."""
    layout = read_layout(flashdir)
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
                    m = measure(r, layout.n_neurons[layer], batch, per_layer, rng, layer)
                    for k in tot:
                        tot[k] += m[k]
                rows.append({"fraction": frac, "mode": label, "threads": r.threads, "coalesce_gap": r.coalesce_gap,
                             "neurons_per_call": batch, "stride": layout.stride,
                             "useful_MBps": round(tot["requested_bytes"] / tot["seconds"] / 1e6, 1),
                             "read_MBps": round(tot["read_bytes"] / tot["seconds"] / 1e6, 1),
                             "over_read": round(tot["read_bytes"] / max(tot["requested_bytes"], 1) - 1, 3),
                             "reads_per_call": round(tot["n_reads"] / tot["calls"], 1),
                             "ms_per_call": round(1e3 * tot["seconds"] / tot["calls"], 3)})
    return rows


def print_table(rows: list[dict], chunks: list[int], threads: list[int]) -> None:
    cell = {(r["chunk"], r["threads"]): r for r in rows}
    print("MB/s (IOPS) of random O_DIRECT reads, chunk x threads")
    print(f"{'chunk':>6} " + " ".join(f"{f'{t} thr':>17}" for t in threads))
    for c in chunks:
        print(f"{human(c):>6} " + " ".join(
            f"{cell[c, t]['MBps']:8.1f} ({cell[c, t]['IOPS']:6.0f})" for t in threads))


def plot(rows: list[dict], chunks: list[int], threads: list[int], png: Path, entries: list[dict] | None = None,
         title: str = "") -> bool:
    """MB/s per chunk size, one line per thread count; a star on the setting the profile chose for each chunk."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the chart (pip install 'flashinfer-lite[plot]')", file=sys.stderr)
        return False
    cell = {(r["chunk"], r["threads"]): r["MBps"] for r in rows}
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in threads:
        ax.plot([c / 1024 for c in chunks], [cell[c, t] for c in chunks], marker="o", label=f"{t} threads")
    if entries:
        chosen = [(e["chunk"], e["threads"]) for e in entries if (e["chunk"], e["threads"]) in cell]
        ax.plot([c / 1024 for c, _ in chosen], [cell[k] for k in chosen], linestyle="none", marker="*",
                markersize=14, color="black", label="chosen (threads per chunk)")
        for c, t in chosen:
            ax.annotate(f"{t}", (c / 1024, cell[c, t]), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size (KiB)")
    ax.set_ylabel("random read MB/s")
    ax.set_title(title or "flash random-read bandwidth (O_DIRECT)", fontsize=9)
    ax.legend()
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
        rows = bench_grid(scratch, size, chunks, threads, args.seconds)
    finally:   # also on Ctrl-C / SIGTERM: never leave gigabytes behind
        scratch.unlink(missing_ok=True)
        signal.signal(signal.SIGTERM, old_term)

    print_table(rows, chunks, threads)
    entries = derive_profile(rows)
    result = {"dir": str(d.resolve()), "device": device_key(d), "size": size, "seconds": args.seconds,
              "grid": rows, "profile": entries}
    if args.quick:
        print("--quick: a smoke run; the device profile is left as it was")
    elif not args.no_save_profile:
        p = save_profile(d, {"dir": str(d.resolve()), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                             "entries": entries})
        print(f"device profile saved to {p}")
    print("profile (chunk: threads, coalescing gap): " + ", ".join(
        f"{human(e['chunk'])}: {e['threads']} thr, gap {human(e['gap_bytes'])}" for e in entries))
    if args.model:
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
    charted = plot(rows, chunks, threads, out / "flash_bench.png", entries, title)
    print(f"wrote {out / 'flash_bench.csv'}, {out / 'flash_bench.json'}" + (
        f", {out / 'flash_bench.png'}" if charted else ""))
    return 0
