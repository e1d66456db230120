#!/usr/bin/env python3
"""Decode on a busy machine (issue #29): llama.cpp and flashinfer-lite on the same GGUF, quiet and beside a process
that spins on one core.

    PYTHONPATH=. python bench/busy_decode.py [-m GGUF] [-n 64] [--rounds 3] [--threads 2] [--pin] [--md FILE]

Each round runs llama.cpp (harness.measure_llama) and flashinfer-lite (the GGUF in RAM, --ffn dense, generate's
Session: its per-step thread choice, flashinfer_lite/threads.py) back to back, in alternating order, as worker
processes (harness.run_row), first with nothing of ours running beside them ("quiet"), then beside one spinning
process ("busy"; --pin pins it to CPU 0). flashinfer-lite gets -t --threads, llama.cpp --llama-threads (default the
same). Every row carries the load average at its start. Prints JSON (stdout) and a markdown table (stderr): ms/token
and P50 per row, per load flashinfer-lite / llama.cpp per round and each engine's P50 spread (max / min) over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness as h

from storage.errors import UserError  # noqa: E402  (leaf module: no numba)

PROMPT = "Write a short story about a robot who learns to paint."
SPIN = "import os, sys\nif len(sys.argv) > 1: os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"


def measure_flash(job: dict) -> dict:
    """generate's path: load (GGUF in RAM, dense FFN), Session.generate greedy; the steps' thread counts."""
    from flashinfer_lite.generate import Sampler, Session
    t0 = time.perf_counter()
    model, tokenizer, _ = h.load_model(job["gguf"], "dense", threads=job["threads"], ctx=job["ctx"])
    load_s = time.perf_counter() - t0
    session = Session(model, tokenizer, job["ctx"])
    out = list(session.generate(job["prompt_ids"], job["n_gen"], Sampler(temp=0.0), ignore_eos=True))
    t = session.timings
    return {"engine": "flashinfer-lite", "load_s": round(load_s, 3), "gen_tokens": out,
            "steps_at_threads": {str(k): v for k, v in sorted(session.threads.steps.items())},
            **h.step_stats(t.prompt_ms, t.prompt_tokens, t.token_ms, 0)}


def measure(a) -> dict:
    job = json.loads(Path(a.job).read_text())
    if a.worker == "llama.cpp":
        return h.measure_llama(dict(job, threads=job["llama_threads"]))
    return measure_flash(job)


def spinner(pin: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SPIN, *(["0"] if pin else [])])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="GGUF (default: the default model, fetched on first use)")
    ap.add_argument("-p", "--prompt", default=PROMPT)
    ap.add_argument("-n", "--tokens", type=int, default=64, help="greedy tokens per row (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per load (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="flashinfer-lite's -t: at most this many (default 2)")
    ap.add_argument("--llama-threads", type=int, help="llama.cpp's threads (default --threads)")
    ap.add_argument("--loads", default="quiet,busy", help="comma-separated: quiet, busy (default both)")
    ap.add_argument("--pin", action="store_true", help="pin the spinning process to CPU 0")
    h.add_arguments(ap, "--job")
    a = ap.parse_args(argv)
    if a.worker:
        return h.worker(a.out, a.worker, lambda: measure(a))
    loads = a.loads.split(",")
    if not set(loads) <= {"quiet", "busy"} or a.rounds < 1 or a.tokens < 2:
        raise UserError(f"--loads takes quiet and/or busy, --rounds >= 1, -n >= 2 (got {a.loads!r}, {a.rounds}, "
                        f"{a.tokens})")

    from flashinfer_lite.default_model import ensure_default_model
    from flashinfer_lite.generate import prompt_ids
    from flashinfer_lite.model import open_any
    t_start, mach = time.perf_counter(), h.machine()
    work = h.work_dir(a, "busy-decode-")
    gguf = Path(a.model or ensure_default_model()).resolve()
    ids = prompt_ids(open_any(gguf).tokenizer(), a.prompt, None, use_template=True)
    ctx = len(ids) + a.tokens + 1
    (work / "job.json").write_text(json.dumps({"gguf": str(gguf), "prompt_ids": ids, "n_gen": a.tokens, "ctx": ctx,
                                               "threads": a.threads, "llama_threads": a.llama_threads or a.threads,
                                               "llama_extra_bufts": False}))
    results = []
    for load in loads:
        spin = spinner(a.pin) if load == "busy" else None
        try:
            for rnd in range(1, a.rounds + 1):
                order = ["llama.cpp", "flashinfer-lite"][::1 if rnd % 2 else -1]
                for engine in order:
                    r = h.run_row(__file__, engine, f"{load}-{engine}-{rnd}", None, work, ["--job", work / "job.json"])
                    results.append(dict(r, load=load, round=rnd))
        finally:
            if spin is not None:
                spin.kill()
                spin.wait()
    doc = {"gguf": str(gguf), "prompt_ids": ids, "tokens": a.tokens, "threads": a.threads,
           "llama_threads": a.llama_threads or a.threads, "rounds": a.rounds, "spinner_pinned": a.pin, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": mach,
           "results": results, "summary": summary(results, loads, a.rounds),
           "seconds": round(time.perf_counter() - t_start, 1), "command": h.command("busy_decode.py", argv)}
    return h.emit(doc, markdown, a.md, None if a.keep else work)


def ms_per_token(r: dict) -> float | None:
    return round(1e3 / r["tokens_per_s"], 3) if r.get("tokens_per_s") else None


def summary(results: list[dict], loads: list[str], rounds: int) -> dict:
    """Per load: flashinfer-lite / llama.cpp in ms/token and P50 per round, and each engine's P50 spread (max/min)."""
    out = {}
    for load in loads:
        row = lambda e, n: next((r for r in results if (r["load"], r["mode"], r["round"]) == (load, e, n)  # noqa
                                 and "p50_ms" in r), None)
        ratio, p50_ratio, p50s = [], [], {"llama.cpp": [], "flashinfer-lite": []}
        for n in range(1, rounds + 1):
            ll, fl = row("llama.cpp", n), row("flashinfer-lite", n)
            for e, r in (("llama.cpp", ll), ("flashinfer-lite", fl)):
                if r:
                    p50s[e].append(r["p50_ms"])
            ratio.append(round(ms_per_token(fl) / ms_per_token(ll), 3) if ll and fl else None)
            p50_ratio.append(round(fl["p50_ms"] / ll["p50_ms"], 3) if ll and fl else None)
        out[load] = {"ms_per_token_ratio": ratio, "p50_ratio": p50_ratio,
                     "p50_spread": {e: round(max(v) / min(v), 3) if v else None for e, v in p50s.items()}}
    return out


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"{Path(doc['gguf']).name}, {doc['tokens']} greedy tokens, flashinfer-lite -t {doc['threads']}, llama.cpp "
             f"{doc['llama_threads']} threads, spinner "
             f"{'pinned to CPU 0' if doc['spinner_pinned'] else 'unpinned'}; {m['cpus']} CPUs; {doc['date']}, "
             f"load avg {m['load_avg_start'][0]:.2f} -> {m['load_avg_end'][0]:.2f}", ""]
    rows = []
    for r in doc["results"]:
        head = [r["load"], r["round"], r["mode"]]
        if "p50_ms" not in r:
            rows.append(head + [h.failed(r), "", "", ""])
            continue
        rows.append(head + [h.fmt(ms_per_token(r)), h.fmt(r["p50_ms"]), json.dumps(r.get("steps_at_threads", "-")),
                            f"{r['loadavg'][0]:.2f}"])
    lines += h.table(["load", "round", "engine", "ms/token", "P50 ms", "steps at thread count", "load avg"], rows)
    lines += ["", "flashinfer-lite / llama.cpp per round, and the P50 spread across rounds (max / min)", ""]
    lines += h.table(["load", "ms/token ratio", "P50 ratio", "P50 spread llama.cpp", "P50 spread flashinfer-lite"],
                     [[load, *(" / ".join(h.fmt(v, 3) for v in s[k]) for k in ("ms_per_token_ratio", "p50_ratio")),
                       *(h.fmt(s["p50_spread"][e], 3) for e in ("llama.cpp", "flashinfer-lite"))]
                      for load, s in doc["summary"].items()])
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        sys.exit(f"error: {e}")
