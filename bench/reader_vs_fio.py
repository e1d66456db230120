"""BundleReader vs fio: random O_DIRECT reads per request size, threads and queue depth, with CPU cost. Prints JSON.

    PYTHONPATH=. python bench/reader_vs_fio.py [--dir DIR] [--size 2GiB] [--chunks 4K,7K,8K,16K,24K,64K]
                                                [--threads 1,4,16,64] [--depths 16,32,64,128] [--seconds 2]

Pairs run back to back on one scratch file, alternating which tool goes first, because this (shared, virtual) disk
drifts over minutes: fio psync with numjobs=T against the reader's thread engine with T threads, fio io_uring
(one job, iodepth=D) against the reader's io_uring engine at depth D; fio libaio at each depth runs beside them so
that "fio's best" is the best of its three engines. CPU is user + system time of the whole process (fio's threads,
the reader's threads or ring, the kernel's work on their behalf), from getrusage; "cores" is CPU seconds per second.
Compare ratios within one run, not absolutes across runs; record `loadavg` with the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage.sizes import parse_size  # noqa: E402
from storage import uring  # noqa: E402
from storage.flash_bench import cpu_seconds, measure, synthetic_layout, write_scratch  # noqa: E402
from storage.reader import BundleReader  # noqa: E402


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_fio(path: Path, size: int, chunk: int, engine: str, n: int, seconds: float) -> dict:
    """fio with `engine`: psync with n jobs, or one job of iodepth n (io_uring, libaio)."""
    queue = [f"--numjobs={n}"] if engine == "psync" else ["--numjobs=1", f"--iodepth={n}"]
    cmd = ["fio", "--name=randread", f"--filename={path}", "--rw=randread", f"--bs={chunk}", "--direct=1",
           f"--ioengine={engine}", *queue, "--thread", "--group_reporting", "--time_based",
           f"--runtime={seconds}s", f"--size={size}", "--randrepeat=0", "--output-format=json"]
    cpu0 = children_cpu()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    cpu = children_cpu() - cpu0
    job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
    secs = job["read"]["runtime"] / 1e3 or seconds
    return cell(job["read"]["iops"], job["read"]["bw_bytes"], cpu, secs)


def run_reader(path: Path, size: int, chunk: int, engine: str, n: int, seconds: float, rng) -> dict:
    with BundleReader(synthetic_layout(path, chunk, size), threads=n, depth=n, engine=engine, coalesce_gap=-1) as r:
        assert r.direct, "O_DIRECT refused: put --dir on a real device"
        assert r.engine == engine, r.describe()
        batch = max(n, min(n * 32, (64 << 20) // chunk))
        cpu0 = cpu_seconds()
        m = measure(r, size // chunk, batch, seconds, rng)
        cpu = cpu_seconds() - cpu0
    return cell(m["n_reads"] / m["seconds"], m["read_bytes"] / m["seconds"], cpu, m["seconds"])


def cell(iops: float, bytes_per_s: float, cpu_s: float, seconds: float) -> dict:
    return {"IOPS": round(iops), "MBps": round(bytes_per_s / 1e6, 1), "cores": round(cpu_s / seconds, 3),
            "cpu_s_per_GB": round(cpu_s / max(bytes_per_s * seconds, 1) * 1e9, 3)}


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".")
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--chunks", default="4K,7K,8K,16K,24K,64K")
    ap.add_argument("--threads", default="1,4,16,64", help="fio psync jobs = reader threads")
    ap.add_argument("--depths", default="16,32,64,128", help="fio io_uring/libaio iodepth = reader ring depth")
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    if shutil.which("fio") is None:
        print(json.dumps({"error": "fio not installed (apt-get install fio)"}))
        return 1
    size = parse_size(args.size)
    chunks = [parse_size(c) for c in args.chunks.split(",")]
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    refused = uring.refused()
    if refused:
        print(f"{refused}: the reader's thread engine only", file=sys.stderr)
    size = size // max(chunks) * max(chunks)
    path = Path(args.dir).resolve() / f".reader-vs-fio-{os.getpid()}.tmp"
    rng = np.random.default_rng(0)
    # (fio engine, reader engine or None, threads or depth)
    pairs = [("psync", "threads", t) for t in threads] + \
        [("io_uring", None if refused else "io_uring", d) for d in depths] + [("libaio", None, d) for d in depths]
    cells = []
    load_start = loadavg()
    try:
        write_scratch(path, size)
        for i, (c, (fio_engine, reader_engine, n)) in enumerate((c, p) for c in chunks for p in pairs):
            tools = [("fio", fio_engine)] + ([("reader", reader_engine)] if reader_engine else [])
            for tool, engine in (tools if i % 2 == 0 else tools[::-1]):
                out = run_fio(path, size, c, engine, n, args.seconds) if tool == "fio" \
                    else run_reader(path, size, c, engine, n, args.seconds, rng)
                cells.append({"chunk_KiB": c / 1024, "tool": tool, "engine": engine,
                              "threads" if engine in ("psync", "threads") else "depth": n, **out})
                print(f"{c / 1024:5g} KiB {tool:>6} {engine:>8} x {n:3d}: {out['IOPS']:7d} IOPS "
                      f"{out['MBps']:7.1f} MB/s, {out['cores']:.2f} cores, {out['cpu_s_per_GB']:.2f} CPU s/GB "
                      f"(load {loadavg()})", file=sys.stderr)
    finally:
        path.unlink(missing_ok=True)
    best = []
    for c in chunks:
        fio = max((x for x in cells if x["chunk_KiB"] == c / 1024 and x["tool"] == "fio"), key=lambda x: x["IOPS"])
        rd = max((x for x in cells if x["chunk_KiB"] == c / 1024 and x["tool"] == "reader"), key=lambda x: x["IOPS"])
        best.append({"chunk_KiB": c / 1024, "fio_best": fio, "reader_best": rd,
                     "IOPS_ratio": round(rd["IOPS"] / max(fio["IOPS"], 1), 3)})
    print(json.dumps({"file_bytes": size, "seconds_per_cell": args.seconds, "io_uring": refused or "available",
                      "loadavg_start": load_start, "loadavg_end": loadavg(), "best_per_chunk": best, "cells": cells},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
