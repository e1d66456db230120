#!/usr/bin/env python3
"""Real GGUFs in a small budget (issue 43): per GGUF (default: the default model's), its size, the minimum
--dram-budget at -c 512, 2048 and 8192 split into process base, resident weights, KV and the rest (what `generate
--dram-budget 1M -c N` refuses with; no conversion), the dense run's peak RSS, its goal (file + KV at the default
context + the process base -v prints, + 5%) and load time (`generate -m GGUF --json -v`, no budget) and llama.cpp's (harness.llama_model: mmap, "hi" evaluated): each its own process, the second of two (warm).
    PYTHONPATH=. python bench/real_ggufs.py [GGUF ...] [--contexts 512,2048,8192] [--md FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import harness as h

MIB = 2**20
SPLIT = ("base_bytes", "resident_bytes", "kv_bytes", "rest_bytes")
ENV = dict(os.environ, PYTHONPATH=str(h.REPO))


def measure_minimum(gguf: str, contexts: list[int]) -> dict:
    from flashinfer_lite import budget, kv_pages, modes, runtime, warmup
    cfg, layout, kinds = runtime.model_facts(gguf)
    warmup.drop_llvm_pages()    # as open_model_files does before its early refusal (an estimate of this RSS)
    base = warmup.base_estimate_bytes(layout, cfg.vocab_size)
    resident, out = modes.resident_bytes_of(cfg, layout, kinds, on_flash=True), {}
    for ctx in contexts:
        try:
            runtime.refuse_below_minimum(gguf, "auto", 1, ctx, base)       # raises: no model runs in 1 byte
        except budget.BelowMinimum as e:
            kv = budget.kv_minimum_bytes(cfg, ctx)     # the KV's part of the minimum: pages go to flash
            out[str(ctx)] = dict(zip(("minimum_bytes", *SPLIT),
                                     (e.minimum_bytes, base, resident, kv, e.minimum_bytes - base - resident - kv)))
        except Exception as e:  # noqa: BLE001  (a context past the model's maximum: the row says so)
            out[str(ctx)] = {"error": str(e)}
    # a dense run's KV cache (generate's default context): its peak's goal is file + KV + process base + 5%
    dense_kv = kv_pages.all_bytes(cfg, runtime.context_size(0, cfg), kv_pages.KVOptions())    # every page in DRAM
    return {"minimum": out, "dense_kv_bytes": dense_kv}


def measure_llama(gguf: str, threads: int) -> dict:
    t0 = time.perf_counter()
    llm = h.llama_model(gguf, 512, threads)
    load_s = time.perf_counter() - t0
    llm.eval(llm.tokenize(b"hi", add_bos=True))       # the pages a one-token generate touches
    return {"load_s": round(load_s, 3)}


def worker_row(mode: str, gguf: Path, work: Path, extra: list[str]) -> dict:
    out, load = work / f"{mode}-{time.monotonic_ns()}.json", os.getloadavg()
    p = subprocess.run([sys.executable, __file__, "--worker", mode, "--out", str(out), "--file", str(gguf), *extra],
                       env=ENV, capture_output=True, text=True)
    return dict(json.loads(out.read_text()) if out.exists() else {"error": p.stderr.strip()[-2000:]}, loadavg=load)


def dense_row(gguf: Path, threads: int) -> dict:       # the load average as the run ends: beside its figures
    p = subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(gguf), "-p", "hi", "-n", "1",
                        "-t", str(threads), "--json", "-v"], env=ENV, capture_output=True, text=True)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1], "loadavg": os.getloadavg()}
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    base = re.search(r"^process base +([\d.]+) MiB", p.stderr, re.M)     # what -v prints
    return {"load_s": round(doc["timings"]["load_ms"] / 1e3, 3), "peak_rss_bytes": int(doc["peak_rss_mb"] * MIB),
            "base_bytes": int(float(base[1]) * MIB) if base else None, "loadavg": os.getloadavg()}


def twice(measure) -> dict:
    first = measure()       # compiles the kernels, brings the file into the page cache
    return dict(measure(), first_load_s=first.get("load_s"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="*", type=Path, help="GGUF files (default: the default model's)")
    ap.add_argument("--contexts", default="512,2048,8192", help="-c of the minimums (default 512,2048,8192)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of both engines (default 2)")
    h.add_arguments(ap, "--file")
    a = ap.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    if a.worker:
        return h.worker(a.out, a.worker, lambda: measure_minimum(a.file, contexts) if a.worker == "minimum" else
                        measure_llama(a.file, a.threads))
    from flashinfer_lite.default_model import ensure_default_model
    paths = [p.expanduser().resolve() for p in a.gguf] or [ensure_default_model().resolve()]
    if missing := [str(p) for p in paths if not p.is_file()]:
        sys.exit(f"error: not a file: {', '.join(missing)}")
    llama = None if find_spec("llama_cpp") else "llama-cpp-python is not installed (the bench extra)"
    t0, mach, work, models = time.perf_counter(), h.machine(), h.work_dir(a, "real-ggufs-"), []
    for p in paths:
        print(f"real_ggufs: {p.name} ({p.stat().st_size / MIB:.1f} MiB)", file=sys.stderr)
        models.append({"gguf": str(p), "file_bytes": p.stat().st_size,
                       **worker_row("minimum", p, work, ["--contexts", a.contexts]),
                       "dense": twice(lambda: dense_row(p, a.threads)),
                       "llama_cpp": {"skipped": llama} if llama else
                       twice(lambda: worker_row("llama.cpp", p, work, ["--threads", str(a.threads)]))})
    doc = {"models": models, "contexts": contexts, "threads": a.threads, "machine": mach,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.perf_counter() - t0, 1),
           "command": h.command("real_ggufs.py", argv)}
    return h.emit(doc, markdown, a.md, None if a.keep else work)


def minimum_cell(x: dict, f: int) -> str:
    return (f"{x['minimum_bytes'] / MIB:.0f} ({x['minimum_bytes'] / f:.2f}x): " + " + ".join(
        f"{x[k] / MIB:.0f}" for k in SPLIT)) if "minimum_bytes" in x else h.failed(x)[:60]


def peak_cell(x: dict, f: int) -> str:
    return f"{x['peak_rss_bytes'] / MIB:.0f} ({x['peak_rss_bytes'] / f:.2f}x)" if "load_s" in x else \
        (x.get("skipped") or h.failed(x))[:80]


def goal_cell(r: dict) -> str:
    """The dense peak's goal, file + KV + process base + 5%, and its parts (MiB)."""
    kv, base = r.get("dense_kv_bytes"), r["dense"].get("base_bytes")
    if kv is None or base is None:
        return "?"
    return f"{1.05 * (r['file_bytes'] + kv + base) / MIB:.0f}: {r['file_bytes'] / MIB:.0f} + {kv / MIB:.0f} + " \
           f"{base / MIB:.0f}"


def markdown(doc: dict) -> str:
    """Two tables: the minimums, then the dense runs beside llama.cpp's."""
    m, minimums, dense = doc["machine"], [], []
    for r in doc["models"]:
        f, d, ll, name = r["file_bytes"], r["dense"], r["llama_cpp"], Path(r["gguf"]).name
        minimums.append([name, f"{f / MIB:.0f}", *(minimum_cell(r.get("minimum", {}).get(str(c), r), f)
                                                   for c in doc["contexts"])])
        dense.append([name, f"{f / MIB:.0f}", peak_cell(d, f), goal_cell(r), h.fmt(d.get("load_s"), 2),
                      peak_cell(ll, f), h.fmt(ll.get("load_s"), 2), f"{d['loadavg'][0]:.1f}"])
    return "\n".join([f"{doc['command']}; {m['cpus']} CPUs; {doc['date']}; load avg {m['load_avg_start'][0]:.2f} -> "
                      f"{m['load_avg_end'][0]:.2f}. MiB; minimum = base + resident + KV + rest; dense goal = 1.05 x "
                      f"(file + KV + base)", "",
                      *h.table(["GGUF", "file", *(f"minimum -c {c} (/file)" for c in doc["contexts"])], minimums), "",
                      *h.table(["GGUF", "file", "dense peak RSS (/file)", "dense goal: file + KV + base", "dense load s",
                                "llama.cpp peak RSS (/file)", "llama.cpp load s", "load avg"], dense)])


if __name__ == "__main__":
    sys.exit(main())
