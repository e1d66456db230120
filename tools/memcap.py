#!/usr/bin/env python3
"""Run any command under a Linux cgroup-v1 memory cap that also covers its page cache.

    python tools/memcap.py --limit 300M [--drop-caches] [--json FILE] -- COMMAND [ARGS...]

The cap applies to the command and all its children, and to the page cache they fill, so "a model bigger than RAM"
is real: mmap'd weights that do not fit are evicted and read again. Needs root and the v1 memory controller
(/sys/fs/cgroup/memory); exits 3 with a message where they are missing. Exits with the command's exit code; the
summary (peak usage, failcnt, OOM kills) goes to stderr as one JSON line, and to --json FILE if given.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from storage.errors import UserError  # noqa: E402
from flashinfer_lite.process import drop_caches  # noqa: E402
from storage.sizes import parse_size  # noqa: E402

ROOT = Path("/sys/fs/cgroup/memory")
UNAVAILABLE = 3


def available() -> str | None:
    """None when a cap can be set here, else why not."""
    if not (ROOT / "memory.limit_in_bytes").exists():
        return "the cgroup v1 memory controller is not mounted at /sys/fs/cgroup/memory"
    if os.geteuid() != 0:
        return "setting a memory cgroup needs root"
    return None


def read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", required=True, help="cap, e.g. 300M or 1.5G (covers RSS and page cache)")
    ap.add_argument("--drop-caches", action="store_true", help="sync and drop the page cache first (cold start)")
    ap.add_argument("--json", help="also write the summary to this file")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given")
    why = available()
    if why:
        print(f"memcap: {why}", file=sys.stderr)
        return UNAVAILABLE
    try:
        limit = parse_size(args.limit)
    except UserError as e:
        ap.error(str(e))
    # pid and time: a cgroup left behind by a killed run (its finally never ran) may hold a reused pid's name
    cg = ROOT / f"flashinfer-lite-{os.getpid()}-{time.monotonic_ns()}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        if (cg / "memory.memsw.limit_in_bytes").exists():  # no swapping around the cap either
            (cg / "memory.memsw.limit_in_bytes").write_text(str(limit))
        if args.drop_caches:
            drop_caches()
        procs = str(cg / "cgroup.procs")
        t0 = time.perf_counter()
        # The child joins the cgroup before exec, so everything it loads is charged to the cap.
        child = subprocess.Popen(cmd, preexec_fn=lambda: Path(procs).write_text(str(os.getpid())))
        code = child.wait()
        oom = dict(line.split() for line in (cg / "memory.oom_control").read_text().splitlines())
        summary = {"limit_bytes": limit, "peak_bytes": read_int(cg / "memory.max_usage_in_bytes"),
                   "failcnt": read_int(cg / "memory.failcnt"), "oom_kills": int(oom.get("oom_kill", 0)),
                   "exit_code": code, "seconds": round(time.perf_counter() - t0, 3)}
    finally:
        for _ in range(50):  # the cgroup can be removed once its last task is gone
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    line = json.dumps(summary)
    print(f"memcap: {line}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
