#!/usr/bin/env python3
"""Real GGUFs in a small budget (issue #43): per GGUF, its size, the minimum --dram-budget at -c 512, 2048 and 8192
with its split, the dense run's peak RSS and warm load time, and llama.cpp's on the same file.

    PYTHONPATH=. python bench/real_ggufs.py [GGUF ...] [--md FILE]     # no GGUF: the default model's

Every figure comes from a process of its own (a row never sees another's pages or compiled code):
- minimum: the one `generate -m GGUF --dram-budget 1M -c N` refuses with, computed as it does in the first second
  (runtime.refuse_below_minimum, --ffn auto: the plan of the FFN from flash; no conversion), split into the process
  base (warmup.base_estimate_bytes), the resident weights (modes.resident_bytes_of), the KV cache
  (KVCache.nbytes_for) and the rest: the FFN's buffers and row window, the streams and the heap's slack;
- dense: `flashinfer-lite generate -m GGUF -p hi -n 1 --json` with no budget, run twice; the second run's load time
  (warm: kernels compiled, the file in the page cache) and its peak RSS (VmHWM of the generate process);
- llama.cpp: llama-cpp-python on the same file (mmap, use_extra_bufts=False as harness.llama_model loads it), the
  same prompt's tokens and one more, run twice: the second's load time and its peak RSS. Without llama-cpp-python
  those columns say so and the rest runs.
No memory cap and no page-cache drop: warm loads are what is timed. Times measure the machine as it is: the JSON
keeps each row's load average.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import harness as h

CONTEXTS = (512, 2048, 8192)
PROMPT = "hi"
MIB = 2**20


# ----------------------------------------------------------------------------------------------------------------------
# Workers: one row in this process

def measure_minimum(gguf: str, contexts) -> dict:
    """Per context, the minimum the early refusal names, and its split."""
    from flashinfer_lite.budget import BelowMinimum
    from flashinfer_lite.model import KVCache
    from flashinfer_lite.modes import resident_bytes_of
    from flashinfer_lite.runtime import context_size, model_facts, refuse_below_minimum
    from flashinfer_lite.warmup import base_estimate_bytes
    cfg, layout, kinds = model_facts(gguf)
    base = base_estimate_bytes(layout, cfg.vocab_size)
    resident = resident_bytes_of(cfg, layout, kinds)
    out = {}
    for ctx in contexts:
        try:
            context_size(ctx, cfg)
            refuse_below_minimum(gguf, "auto", 1, ctx, base)
            out[str(ctx)] = {"error": "a 1-byte budget was not refused"}
        except BelowMinimum as e:
            kv = KVCache.nbytes_for(cfg, ctx)
            out[str(ctx)] = {"minimum_bytes": e.minimum_bytes, "base_bytes": base, "resident_bytes": resident,
                             "kv_bytes": kv, "rest_bytes": e.minimum_bytes - base - resident - kv}
        except Exception as e:               # noqa: BLE001  (a context past the model's: the row says so)
            out[str(ctx)] = {"error": str(e)}
    return {"minimum": out, "n_layers": cfg.n_layers, "vocab_size": cfg.vocab_size, "ffn_dtype": layout.dtype}


def measure_llama(gguf: str, threads: int) -> dict:
    """Load (timed), then the prompt's tokens and one token more: the weights' pages a one-token generate touches."""
    t0 = time.perf_counter()
    llm = h.llama_model(gguf, 512, threads)
    load_s = time.perf_counter() - t0
    ids = llm.tokenize(PROMPT.encode(), add_bos=True)
    llm.eval(ids)
    return {"load_s": round(load_s, 3), "prompt_tokens": len(ids)}


# ----------------------------------------------------------------------------------------------------------------------
# Driver

def worker_row(mode: str, gguf: Path, work: Path, extra: list[str]) -> dict:
    """`this script --worker mode` as its own process (harness.worker: the result and its VmHWM)."""
    out = work / f"{mode}-{os.getpid()}-{time.monotonic_ns()}.json"
    load = os.getloadavg()
    p = subprocess.run([sys.executable, __file__, "--worker", mode, "--out", str(out), "--file", str(gguf), *extra],
                       env={**os.environ, "PYTHONPATH": str(h.REPO)}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    res = json.loads(out.read_text()) if out.exists() else {
        "error": f"worker exited {p.returncode} without a result: {p.stderr.strip()[-2000:]}"}
    out.unlink(missing_ok=True)
    return dict(res, loadavg=load)


def dense_row(gguf: Path, threads: int) -> dict:
    """`flashinfer-lite generate -m GGUF` with no budget, as a user runs it: its --json timings and peak RSS."""
    load = os.getloadavg()
    p = subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(gguf), "-p", PROMPT, "-n", "1",
                        "--temp", "0", "-t", str(threads), "--json"],
                       env={**os.environ, "PYTHONPATH": str(h.REPO)}, capture_output=True, text=True)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1], "loadavg": load}
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    return {"load_s": round(doc["timings"]["load_ms"] / 1e3, 3), "peak_rss_bytes": int(doc["peak_rss_mb"] * MIB),
            "loadavg": load, "ffn": next((ln for ln in p.stderr.splitlines() if ln.startswith("ffn: ")), None)}


def twice(run) -> dict:
    """The second of two runs (warm), with the first's load time beside it."""
    first = run()
    second = run()
    return dict(second, first_load_s=first.get("load_s"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="*", type=Path, help="GGUF files (default: the default model's)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of both engines (default 2)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp's rows")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="the -c of the minimums, comma-separated "
                    f"(default {','.join(map(str, CONTEXTS))})")
    h.add_arguments(ap, "--file")
    a = ap.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    if a.worker:
        return h.worker(a.out, a.worker, lambda: measure_minimum(a.file, contexts) if a.worker == "minimum" else
                        measure_llama(a.file, a.threads))

    from flashinfer_lite.default_model import ensure_default_model
    paths = [p.expanduser().resolve() for p in a.gguf] or [ensure_default_model().resolve()]
    for p in paths:
        if not p.is_file():
            sys.exit(f"error: {p} is not a file")
    llama = ("skipped (--no-llama)" if a.no_llama else None if find_spec("llama_cpp") else
             "llama-cpp-python is not installed (pip install 'flashinfer-lite[bench]')")
    t_start, mach = time.perf_counter(), h.machine()
    work = h.work_dir(a, "real-ggufs-")
    models = []
    for p in paths:
        print(f"real_ggufs: {p.name} ({p.stat().st_size / MIB:.1f} MiB)", file=sys.stderr)
        m = {"gguf": str(p), "file_bytes": p.stat().st_size}
        m.update(worker_row("minimum", p, work, ["--contexts", a.contexts]))
        m["dense"] = twice(lambda: dense_row(p, a.threads))
        m["llama_cpp"] = {"skipped": llama} if llama else \
            twice(lambda: worker_row("llama.cpp", p, work, ["--threads", str(a.threads)]))
        models.append(m)
    doc = {"models": models, "contexts": contexts, "threads": a.threads, "prompt": PROMPT,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": mach,
           "seconds": round(time.perf_counter() - t_start, 1), "command": h.command("real_ggufs.py", argv)}
    return h.emit(doc, markdown, a.md, None if a.keep else work)


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"{doc['command']}; {m['cpus']} CPUs; {doc['date']}; load avg {m['load_avg_start'][0]:.2f} -> "
             f"{m['load_avg_end'][0]:.2f}. Minimum: --ffn auto's plan, as `generate --dram-budget` refuses below it, "
             f"MiB (process base + resident weights + KV + the rest: buffers, row window, streams); dense: "
             f"`generate -m GGUF` with no budget, second of two runs; llama.cpp: mmap, the same prompt", ""]
    rows = []
    for r in doc["models"]:
        f = r["file_bytes"]
        mins = []
        for c in map(str, doc["contexts"]):
            x = r.get("minimum", {}).get(c, {})
            mins.append(h.failed(x)[:60] if "minimum_bytes" not in x else
                        f"{x['minimum_bytes'] / MIB:.0f} ({x['minimum_bytes'] / f:.2f}x): "
                        + " + ".join(f"{x[k] / MIB:.0f}" for k in ("base_bytes", "resident_bytes", "kv_bytes",
                                                                   "rest_bytes")))
        d, ll = r["dense"], r["llama_cpp"]

        def peak(x):
            return (f"{x['peak_rss_bytes'] / MIB:.0f} ({x['peak_rss_bytes'] / f:.2f}x)" if "load_s" in x else
                    x.get("skipped") or h.failed(x)[:80])
        rows.append([Path(r["gguf"]).name, f"{f / MIB:.0f}", *mins, peak(d), h.fmt(d.get("load_s"), 2), peak(ll),
                     h.fmt(ll.get("load_s"), 2), f"{d['loadavg'][0]:.1f}"])
    lines += h.table(["GGUF", "file MiB", *(f"minimum -c {c} MiB (/file): base + resident + KV + rest"
                                            for c in doc["contexts"]),
                      "dense peak RSS MiB (/file)", "dense warm load s", "llama.cpp peak RSS MiB (/file)",
                      "llama.cpp warm load s", "load avg"], rows)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
