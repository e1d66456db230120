"""BundleReader vs fio: random O_DIRECT reads, chunk x threads, cold cache, one scratch file, one run. Prints JSON.

    PYTHONPATH=. python bench/reader_vs_fio.py [--dir DIR] [--size 1GiB] [--chunks 16K,...,1M] [--threads 1,...,32]
                                                [--seconds 2]

fio runs the same access pattern the reader issues: psync engine (one synchronous pread per job at a time),
numjobs = threads, direct=1, random offsets aligned to the chunk. The two tools alternate which goes first per cell,
because absolute numbers on this virtual disk drift 2-3x over minutes; compare ratios, not absolutes across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage.sizes import parse_size  # noqa: E402
from storage.flash_bench import drop_caches, measure, synthetic_layout, write_scratch  # noqa: E402
from storage.reader import BundleReader  # noqa: E402


def run_fio(path: Path, size: int, chunk: int, threads: int, seconds: float) -> dict:
    cmd = ["fio", "--name=randread", f"--filename={path}", "--rw=randread", f"--bs={chunk}", "--direct=1",
           "--ioengine=psync", f"--numjobs={threads}", "--thread", "--group_reporting", "--time_based",
           f"--runtime={seconds}s", f"--size={size}", "--invalidate=1", "--randrepeat=0", "--output-format=json"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]["read"]
    return {"MBps": job["bw_bytes"] / 1e6, "IOPS": job["iops"]}


def run_reader(path: Path, size: int, chunk: int, threads: int, seconds: float, rng) -> dict:
    with BundleReader(synthetic_layout(path, chunk, size), threads=threads, coalesce_gap=-1) as r:
        assert r.direct, "O_DIRECT refused: put --dir on a real device"
        batch = max(threads, min(threads * 32, (64 << 20) // chunk))
        m = measure(r, size // chunk, batch, seconds, rng)
    return {"MBps": m["read_bytes"] / m["seconds"] / 1e6, "IOPS": m["n_reads"] / m["seconds"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--chunks", default="16K,32K,64K,128K,256K,512K,1M")
    ap.add_argument("--threads", default="1,2,4,8,16,32")
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    if shutil.which("fio") is None:
        print(json.dumps({"error": "fio not installed (apt-get install fio)"}))
        return 1
    size = parse_size(args.size)
    chunks = [parse_size(c) for c in args.chunks.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    size = size // max(chunks) * max(chunks)
    path = Path(args.dir).resolve() / f".reader-vs-fio-{os.getpid()}.tmp"
    rng = np.random.default_rng(0)
    cells = []
    try:
        write_scratch(path, size)
        for i, (c, t) in enumerate((c, t) for c in chunks for t in threads):
            out = {}
            for tool in (("fio", "reader") if i % 2 == 0 else ("reader", "fio")):
                drop_caches(path)
                out[tool] = run_fio(path, size, c, t, args.seconds) if tool == "fio" \
                    else run_reader(path, size, c, t, args.seconds, rng)
            cells.append({"chunk_KiB": c // 1024, "threads": t,
                          "fio_MBps": round(out["fio"]["MBps"], 1), "reader_MBps": round(out["reader"]["MBps"], 1),
                          "fio_IOPS": round(out["fio"]["IOPS"]), "reader_IOPS": round(out["reader"]["IOPS"]),
                          "ratio": round(out["reader"]["MBps"] / max(out["fio"]["MBps"], 1e-9), 3)})
            print(f"{c // 1024:5d} KiB x {t:2d} thr: fio {cells[-1]['fio_MBps']:8.1f} MB/s, "
                  f"reader {cells[-1]['reader_MBps']:8.1f} MB/s ({cells[-1]['ratio']:.0%})", file=sys.stderr)
    finally:
        path.unlink(missing_ok=True)
    best = []
    for c in chunks:
        row = [x for x in cells if x["chunk_KiB"] == c // 1024]
        f, r = max(x["fio_MBps"] for x in row), max(x["reader_MBps"] for x in row)
        best.append({"chunk_KiB": c // 1024, "fio_best_MBps": f, "reader_best_MBps": r, "ratio": round(r / f, 3)})
    ratios = [x["ratio"] for x in cells]
    print(json.dumps({"file_bytes": size, "seconds_per_cell": args.seconds, "cells": cells, "best_per_chunk": best,
                      "ratio_min": min(ratios), "ratio_median": float(np.median(ratios)),
                      "cells_at_or_above_80pct": sum(r >= 0.8 for r in ratios), "n_cells": len(ratios)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
