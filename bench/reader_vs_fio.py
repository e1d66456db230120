"""BundleReader vs fio: random O_DIRECT reads per request size, threads and queue depth, with CPU cost. Prints JSON.

    PYTHONPATH=. python bench/reader_vs_fio.py [--dir DIR] [--size 2GiB] [--chunks 4K,7K,8K,16K,24K,64K]
                            [--threads 1,4,16,64] [--depths 16,64,128,256] [--seconds 2] [--rounds 1]

Pairs run back to back on one scratch file, alternating which tool goes first, because this (shared, virtual) disk
drifts over minutes: fio psync (numjobs=T) against the reader's T threads, fio io_uring (one job, iodepth=D) against
the reader's ring of depth D; fio libaio (iodepth=D) runs beside them, so "fio's best" is the best of three engines.
Each cell reports its median over --rounds repeats of the grid, so that no single lucky cell decides a best. CPU is
user + system time of the whole process (fio's threads, the reader's threads or ring, the kernel's work for them),
from getrusage; "cores" is CPU seconds per second. Compare ratios within one run; record `loadavg` with them.
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


def run_fio(path: Path, size: int, chunk: int, engine: str, n: int, seconds: float) -> dict:
    """fio with `engine`: psync with n jobs, or one job of iodepth n (io_uring, libaio)."""
    queue = [f"--numjobs={n}"] if engine == "psync" else ["--numjobs=1", f"--iodepth={n}"]
    cmd = ["fio", "--name=randread", f"--filename={path}", "--rw=randread", f"--bs={chunk}", "--direct=1",
           f"--ioengine={engine}", *queue, "--thread", "--group_reporting", "--time_based",
           f"--runtime={seconds}s", f"--size={size}", "--randrepeat=0", "--output-format=json"]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    rd = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]["read"]
    return cell(rd["iops"], rd["bw_bytes"], cpu, rd["runtime"] / 1e3 or seconds)


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
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".")
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--chunks", default="4K,7K,8K,16K,24K,64K")
    ap.add_argument("--threads", default="1,4,16,64", help="fio psync jobs = reader threads")
    ap.add_argument("--depths", default="16,64,128,256", help="fio io_uring/libaio iodepth = reader ring depth")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=1, help="repeats of the grid; each cell reports its median")
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
    runs = {}       # (chunk, tool, engine, n) -> one cell per round
    load_start = loadavg()
    try:
        write_scratch(path, size)
        grid = [(c, p) for c in chunks for p in pairs]
        for i, (c, (fio_engine, reader_engine, n)) in enumerate(g for _ in range(args.rounds) for g in grid):
            tools = [("fio", fio_engine)] + ([("reader", reader_engine)] if reader_engine else [])
            for tool, engine in (tools if i % 2 == 0 else tools[::-1]):
                out = run_fio(path, size, c, engine, n, args.seconds) if tool == "fio" \
                    else run_reader(path, size, c, engine, n, args.seconds, rng)
                out["loadavg"] = loadavg()
                runs.setdefault((c, tool, engine, n), []).append(out)
                print(f"{c / 1024:5g} KiB {tool:>6} {engine:>8} x {n:3d}: {out['IOPS']:7d} IOPS "
                      f"{out['MBps']:7.1f} MB/s, {out['cores']:.2f} cores, {out['cpu_s_per_GB']:.2f} CPU s/GB "
                      f"(load {out['loadavg']})", file=sys.stderr)
    finally:
        path.unlink(missing_ok=True)
    cells = [{"chunk_KiB": c / 1024, "tool": tool, "engine": engine,
              "threads" if engine in ("psync", "threads") else "depth": n,
              **sorted(rs, key=lambda x: x["IOPS"])[len(rs) // 2], "IOPS_rounds": [x["IOPS"] for x in rs]}
             for (c, tool, engine, n), rs in runs.items()]
    best = []
    for c in chunks:
        of = lambda tool: [x for x in cells if x["chunk_KiB"] == c / 1024 and x["tool"] == tool]  # noqa: E731
        fio, rd = max(of("fio"), key=lambda x: x["IOPS"]), max(of("reader"), key=lambda x: x["IOPS"])
        same = {x["depth"]: round(x["IOPS"] / max(f["IOPS"], 1), 3) for x in of("reader") for f in of("fio")
                if x["engine"] == f["engine"] == "io_uring" and x["depth"] == f["depth"]}
        best.append({"chunk_KiB": c / 1024, "fio_best": fio, "reader_best": rd,
                     "IOPS_ratio": round(rd["IOPS"] / max(fio["IOPS"], 1), 3), "io_uring_ratio_per_depth": same})
    print(json.dumps({"file_bytes": size, "seconds_per_cell": args.seconds, "rounds": args.rounds,
                      "io_uring": refused or "available", "loadavg_start": load_start, "loadavg_end": loadavg(),
                      "best_per_chunk": best, "cells": cells}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
