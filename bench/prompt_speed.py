#!/usr/bin/env python3
"""A prompt's speed, llama.cpp against flashinfer-lite in RAM: the same GGUF, the same prompt tokens (issue #47).

    PYTHONPATH=. python bench/prompt_speed.py -m A.gguf [-m B.gguf] [--prompt-tokens 512,4000] [--rounds 2] [--md FILE]
        [--cap-fraction 0.5]

Per GGUF and prompt length, each round runs llama.cpp (harness.measure_llama: eval of the prompt's ids, no repacked
buffers) and flashinfer-lite (harness.load_model's dense FFN in RAM, generate's Session, greedy) one after the other,
the order alternating from round to round, each its own process (harness.run_row; no memory cap without
--cap-fraction). The prompt is the first --prompt-tokens tokens of --prompt-file (WikiText-2's validation text by
default). A row: prompt ms/token, flashinfer-lite's time to first token (the prompt, then the sampling), decode P50
over -n greedy tokens, and whether the greedy tokens agree with llama.cpp's. The table gives each engine's median
over the rounds and their ratio.
--cap-fraction F: both engines under a memory cgroup of F times the GGUF's size (page cache included), flashinfer-lite
with --ffn auto and --dram-budget auto (what the cgroup leaves it: the exact gate from flash), llama.cpp's mapped file
evicted and read again as it runs.
Needs llama-cpp-python (the `bench` extra).
"""
# Only the standard library and numpy at the top: the llama.cpp worker must not load numba and LLVM into its memory.
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import harness as h

ENGINES = ("llama.cpp", "flashinfer-lite")
ROW_FIELDS = ("engine", "model", "prompt_tokens", "round", "load_s", "prompt_ms", "prompt_ms_per_token",
              "prompt_cpu_ms_per_token", "first_token_ms", "decode_steps", "p50_ms", "gen_tokens", "peak_rss_bytes", "loadavg", "wall_s")


# ----------------------------------------------------------------------------------------------------------------------
# Workers: one row in this process

def measure_flash(job: dict) -> dict:
    """flashinfer-lite's generate path on the GGUF: in RAM the dense FFN, every weight in its block format; under a
    cap --ffn auto within --dram-budget auto."""
    from flashinfer_lite.generate import Sampler, Session
    t0 = time.perf_counter()
    capped = {"dram_budget": "auto"} if job.get("cap_bytes") else {}
    model, tokenizer, _ = h.load_model(job["gguf"], "auto" if capped else "dense", threads=job["threads"],
                                       ctx=job["ctx"], **capped)
    load_s = time.perf_counter() - t0
    session = Session(model, tokenizer, job["ctx"])
    steps = session.generate(job["prompt_ids"], job["n_gen"], Sampler(temp=0.0), ignore_eos=True)
    c0 = time.process_time()
    out = [next(steps)]
    CPU.append(time.process_time() - c0)
    out += list(steps)
    t = session.timings
    return {"engine": "flashinfer-lite", "load_s": round(load_s, 3), "gen_tokens": out,
            "first_token_ms": round(t.first_token_ms, 3), **h.step_stats(t.prompt_ms, t.prompt_tokens, t.token_ms, 0)}


CPU: list[float] = []    # seconds of this process's CPU time (all its threads) for the prompt, then each step


def timed_evals() -> None:
    """llama.cpp's evals (the prompt's, then each step's) with their CPU time in CPU."""
    import llama_cpp
    ev = llama_cpp.Llama.eval

    def timed(self, tokens):
        c0 = time.process_time()
        ev(self, tokens)
        CPU.append(time.process_time() - c0)
    llama_cpp.Llama.eval = timed


def measure(a) -> dict:
    """A row; CPU time beside the wall time, as the machine may be shared: a second engine's threads waiting for a
    core lengthen its wall time, not its CPU time (llama.cpp's spinning threads count in it, though)."""
    job = json.loads(Path(a.job).read_text())
    if a.worker == "llama.cpp":
        timed_evals()
        res = h.measure_llama(job)
        res["first_token_ms"] = res["prompt_ms"]         # the prompt's eval, then one argmax
    else:
        res = measure_flash(job)
    res["prompt_cpu_ms_per_token"] = round(CPU[0] * 1e3 / len(job["prompt_ids"]), 3)
    return res


# ----------------------------------------------------------------------------------------------------------------------
# Driver

def prompt_of(gguf: Path, path: Path, n: int) -> list[int]:
    from flashinfer_lite.model import open_any
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read(16 * n)                         # more than enough text for n tokens
    ids = open_any(gguf).tokenizer().encode(text)[:n]
    if len(ids) < n:
        raise SystemExit(f"prompt_speed: {path} holds only {len(ids)} tokens, fewer than {n}")
    return ids


def median(rows: list[dict], engine: str, field: str):
    v = [r[field] for r in rows if r.get("engine") == engine and r.get(field) is not None]
    return statistics.median(v) if v else None


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"`{doc['command']}`", "",
             f"{doc['threads']} threads, {doc['rounds']} rounds, {doc['tokens']} greedy tokens a row; load average "
             f"{m['load_avg_start'][0]:.2f} at the start, {m['load_avg_end'][0]:.2f} at the end "
             f"({m['cpus']} CPUs)." + (f" Memory cgroup: {doc['cap_fraction']:g} x each GGUF's size."
                                          if doc.get("cap_fraction") else " No memory cap."), ""]
    rows = []
    for case in doc["cases"]:
        rs = case["rows"]
        ok = [r for r in rs if "prompt_ms_per_token" in r]
        per = {e: [r["prompt_ms_per_token"] for r in ok if r["engine"] == e] for e in ENGINES}
        lm, fm = median(ok, ENGINES[0], "prompt_ms_per_token"), median(ok, ENGINES[1], "prompt_ms_per_token")
        ref = next((r["gen_tokens"] for r in ok if r["engine"] == ENGINES[0]), None)
        agree = all(r["gen_tokens"] == ref for r in ok) if ref is not None and len(ok) > 1 else None
        bad = [f"{r.get('engine', r.get('mode'))}: {h.failed(r)}" for r in rs if "prompt_ms_per_token" not in r]
        lc, fc = median(ok, ENGINES[0], "prompt_cpu_ms_per_token"), median(ok, ENGINES[1], "prompt_cpu_ms_per_token")
        rows.append([case["model"], case["prompt_tokens"], ", ".join(h.fmt(v, 2) for v in per[ENGINES[0]]) or "-",
                     ", ".join(h.fmt(v, 2) for v in per[ENGINES[1]]) or "-",
                     h.fmt(fm / lm, 2) if lm and fm else "-",
                     f"{h.fmt(lc, 2)} / {h.fmt(fc, 2)}", h.fmt(fc / lc, 2) if lc and fc else "-",
                     h.fmt(median(ok, ENGINES[1], "first_token_ms") / 1e3, 2)
                     if median(ok, ENGINES[1], "first_token_ms") else "-",
                     f"{h.fmt(median(ok, ENGINES[0], 'p50_ms'))} / {h.fmt(median(ok, ENGINES[1], 'p50_ms'))}",
                     {True: "yes", False: "no", None: "-"}[agree] + (f" ({'; '.join(bad)})" if bad else "")])
    lines += h.table(["model", "prompt tokens", "llama.cpp prompt ms/token", "flashinfer-lite prompt ms/token",
                      "ratio (medians)", "CPU ms/token (llama.cpp / ours)", "CPU ratio",
                      "flashinfer-lite first token s", "decode P50 ms (llama.cpp / ours)",
                      "greedy tokens agree"], rows)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", type=Path, default=[], help="a GGUF (repeatable)")
    ap.add_argument("--prompt-file", type=Path, default=h.CORPUS / "wikitext2_valid.txt")
    ap.add_argument("--prompt-tokens", default="512,4000", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=4, help="greedy tokens a row (decode P50, agreement)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--cap-fraction", type=float, default=None,
                    help="run both engines under a memory cgroup of this fraction of the GGUF's size")
    h.add_arguments(ap, "--job")
    a = ap.parse_args(argv)
    if a.worker:
        return h.worker(a.out, a.worker, lambda: measure(a))
    try:
        lengths = [int(v) for v in a.prompt_tokens.split(",")]
    except ValueError:
        ap.error(f"--prompt-tokens takes comma-separated counts, not {a.prompt_tokens!r}")
    if not a.model:
        ap.error("give at least one GGUF with -m")
    if a.cap_fraction is not None and not 0 < a.cap_fraction <= 1:
        ap.error(f"--cap-fraction takes a fraction in (0, 1], not {a.cap_fraction}")
    for g in a.model:
        if not g.is_file():
            ap.error(f"no such GGUF: {g}")
    mach, work = h.machine(), h.work_dir(a, "prompt-speed-")
    cases = []
    for gguf in a.model:
        for n in lengths:
            ids = prompt_of(gguf, a.prompt_file, n)
            cap = int(a.cap_fraction * gguf.stat().st_size) if a.cap_fraction else None
            job = {"gguf": str(gguf.resolve()), "prompt_ids": ids, "n_gen": a.tokens, "ctx": n + a.tokens + 1,
                   "threads": a.threads, "llama_extra_bufts": False, "cap_bytes": cap}
            jp = work / f"{gguf.stem}-{n}.job.json"
            jp.write_text(json.dumps(job))
            print(f"prompt_speed: {gguf.name}, {n} prompt tokens", file=sys.stderr)
            rows = []
            for r in range(a.rounds):
                for engine in (ENGINES if r % 2 == 0 else ENGINES[::-1]):
                    res = h.run_row(__file__, engine, f"{gguf.stem}-{n}-{engine}-{r}", cap, work, ["--job", jp])
                    res.update(engine=res.get("engine", engine), model=gguf.name, round=r)
                    rows.append({k: res[k] for k in ROW_FIELDS if k in res}
                                | {k: res[k] for k in ("error", "below_minimum") if k in res})
            cases.append({"model": gguf.name, "prompt_tokens": n, "cap_bytes": cap, "rows": rows})
    doc = {"command": h.command("prompt_speed.py", argv), "threads": a.threads, "rounds": a.rounds,
           "cap_fraction": a.cap_fraction,
           "tokens": a.tokens, "machine": mach, "cases": cases}
    return h.emit(doc, markdown, a.md, None if a.keep else work)


if __name__ == "__main__":
    sys.exit(main())
