#!/usr/bin/env python3
"""llama.cpp against flashinfer-lite: the same GGUF, the same prompt tokens, the same memory caps (issue #13).

    PYTHONPATH=. python bench/vs_llama_cpp.py [-m GGUF] [--flash FLASHDIR] [-n 32] [--caps none,base+50%,min] [--md FILE]
    PYTHONPATH=. python bench/vs_llama_cpp.py --quick      # smoke test: the default model, 6 tokens, ~1 minute
    PYTHONPATH=. python bench/vs_llama_cpp.py --prompt-file CORPUS.txt --prompt-tokens 4000 --ctx 8192 -n 2 --caps none
                                              # prompt speed: 4,000 tokens of text, prompt ms/token per engine
    PYTHONPATH=. python bench/vs_llama_cpp.py -m GGUF --caps none,75%,50% --capped-ffn auto --floor
                                              # issue 44: a SwiGLU GGUF at 75% and 50% of its size, each row's floor

Needs llama-cpp-python (the `bench` extra). Rows (bench/README.md, "llama.cpp itself"): llama.cpp[-passive]
(harness.measure_llama), flash-dense, flash-auto and flash-predicted (harness.load_model, generate's Session, greedy),
each its own process under tools/memcap.py with --threads threads. Caps: none, a size, P% of the GGUF, base+P%
(llama.cpp's uncapped peak minus the GGUF, plus P% of the GGUF) and min (flashinfer-lite's minimum, probed in a fresh
process, plus --slack). --floor: every round also measures the device's sequential rate (a stream of the FLASHDIR's
largest FFN file, O_DIRECT, storage.flash_bench.bench_streams), and each row gets its read rate (bytes read per token
over its P50) and its floor, max(its engine's uncapped P50: the compute, the bytes it reads per token / that rate).
FLASHDIR defaults to flashinfer-lite's own conversion of the GGUF with predictors trained on
first use; --quick converts the default model into a temp dir with a predictor for the last layer only.
llama.cpp runs with use_extra_bufts=False (llama.cpp's --no-repack): on the 2-vCPU VM the bench was written on, its
AMX matmul (an extra buffer type) segfaults on the first decode; --llama-extra-bufts turns them back on.
"""
from __future__ import annotations

# Only the standard library and numpy at the top: the llama.cpp worker must not load numba and LLVM into its memory.
import argparse
import json
import os
import sys
import time
from pathlib import Path

import harness as h

from storage.errors import UserError  # noqa: E402  (leaf modules: no numba)
from storage.sizes import parse_size  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."
SLACK = "32M"            # under a cap, the flash row's DRAM budget is the cap minus this (heap, page cache in flight)
ROW_FIELDS = ("mode", "engine", "cap", "cap_bytes", "load_s", "prompt_tokens", "prompt_ms_per_token", "decode_steps",
              "p50_ms", "p99_ms", "tokens_per_s", "decode_MB_per_token", "peak_rss_bytes", "memcap", "gen_tokens",
              "agree_prefix", "loadavg", "round")


# ----------------------------------------------------------------------------------------------------------------------
# Workers: one row in this process

def measure_flash(ffn: str, budget: str, job: dict) -> dict:
    """flashinfer-lite's generate path (open_model, Session.generate, greedy) on the GGUF (dense) or FLASHDIR."""
    from flashinfer_lite.generate import Sampler, Session
    t0 = time.perf_counter()
    model, tokenizer, runtime = h.load_model(job["gguf"] if ffn == "dense" else job["flash"], ffn,
                                             threads=job["threads"], ctx=job["ctx"],
                                             dram_budget="auto" if budget == "auto" else int(budget))
    load_ms = 1e3 * (time.perf_counter() - t0)
    session = Session(model, tokenizer, job["ctx"])
    out, c = [], None
    for tok in session.generate(job["prompt_ids"], job["n_gen"], Sampler(temp=0.0), ignore_eos=True):
        if c is None:
            c = h.Counters(runtime)                                    # after the prompt: decode steps only
        out.append(tok)
    t = session.timings
    res = {"engine": "flashinfer-lite", "ffn": ffn, "load_s": round(load_ms / 1e3, 3), "gen_tokens": out,
           **h.step_stats(t.prompt_ms, t.prompt_tokens, t.token_ms, 0)}
    d = c.since(len(t.token_ms))
    res.update(decode_MB_per_token=d["MB_per_token"], reader_MB_per_token=d["reader_MB_per_token"],
               hit_rate=d["hit_rate"])
    if runtime is not None:
        res.update(budget_bytes=runtime.plan.budget_bytes, minimum_bytes=runtime.plan.minimum_bytes,
                   plan=runtime.plan.table(), active_share=round(float(runtime.stats.active_share().mean()), 4))
    return res


def measure_sequential(job: dict, seconds: float = 3.0) -> dict:
    """The device's sequential rate now: the FLASHDIR's largest FFN file streamed whole (O_DIRECT), 8 MiB chunks, 8
    in flight (flash-bench's stream cell, nothing computed between)."""
    from storage.flash_bench import bench_streams
    from storage.format import read_layout
    path = max((F.ffn_path for F in read_layout(job["flash"]).ffn_files), key=os.path.getsize)
    rows = bench_streams(Path(path), os.path.getsize(path), seconds, chunks=(8 << 20,), depths=(8,))
    return {"engine": "device", "seq_MBps": round(rows[0]["MBps"], 1), "file": str(path)}


def measure(a) -> dict:
    job = json.loads(Path(a.job).read_text())
    if a.worker.startswith("llama.cpp"):
        return h.measure_llama(job)
    if a.worker == "sequential":
        return measure_sequential(job)
    if a.worker == "probe":
        return h.probe_minimum(job["flash"], job["capped_ffn"], job["ctx"])
    return measure_flash(a.worker.split("-")[1], a.budget, job)


# ----------------------------------------------------------------------------------------------------------------------
# Driver

def run_row(mode: str, cap: str, cap_bytes: int | None, work: Path, budget: str = "auto", tag: str = "") -> dict:
    """One row as a subprocess under tools/memcap.py, page cache dropped first."""
    r = h.run_row(__file__, mode, f"{mode}@{cap}{tag}", cap_bytes, work,
                  ["--job", work / "job.json", "--budget", budget],
                  {"OMP_WAIT_POLICY": "passive"} if mode.endswith("-passive") else None)
    return dict(r, cap=cap)


def default_flashdir(gguf: Path, predictors: bool = True) -> str:
    """flashinfer-lite's own FLASHDIR for the GGUF, with predictors (unless not `predictors`: --capped-ffn auto runs a
    SiLU model's exact gate): what `generate -m GGUF --ffn predicted` uses."""
    from flashinfer_lite.runtime import train_on_first_use
    from flashinfer_lite.predictor_set import has_trained_predictors
    from storage.cache import flashdir_for
    flash = flashdir_for(gguf, progress=sys.stderr.isatty())
    if predictors and not has_trained_predictors(flash):
        train_on_first_use(flash)
    return flash


def prepare_quick(gguf: Path, work: Path) -> str:
    """A float16 FLASHDIR of the GGUF in `work` with a predictor in the last layer only: the others are dense layers
    (predicted mode reads all their neurons through the neuron cache), so training takes seconds, not minutes."""
    from flashinfer_lite.model import open_any
    cal = work / "cal.txt"
    cal.write_bytes((h.CORPUS / "wikitext2_valid.txt").read_bytes()[:12_000])
    n_layers = open_any(gguf).config.n_layers
    flash, _ = h.trained_flashdir(gguf, work, "f16", [cal], 128, dict(ctx=64, rows=128), sparsity=0.5, rank=8,
                                  max_rank=8, steps=20, dense_layers=n_layers - 1)
    return str(flash)


def cap_bytes_for(spec: str, gguf_bytes: int, llama_base: int | None, minimum: int | None, slack: int) -> int | None:
    if spec == "none":
        return None
    if spec == "min":
        return minimum + slack
    try:
        if spec.startswith("base+") and spec.endswith("%"):
            return int(llama_base + gguf_bytes * float(spec[5:-1]) // 100)
        if spec.endswith("%"):
            return int(gguf_bytes * float(spec[:-1]) // 100)
    except ValueError:
        raise UserError(f"cannot read the cap {spec!r} (examples: none, 300M, 40%, base+50%, min)") from None
    return parse_size(spec)


def agree_prefix(xs: list[int], ref: list[int]) -> int:
    """How many leading tokens equal the reference's."""
    k = 0
    while k < min(len(xs), len(ref)) and xs[k] == ref[k]:
        k += 1
    return k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="GGUF (default: the default model, fetched on first use)")
    ap.add_argument("--flash", help="FLASHDIR of the same model with predictors (default: flashinfer-lite's own "
                                    "conversion of the GGUF, predictors trained on first use)")
    ap.add_argument("-p", "--prompt", default=PROMPT)
    ap.add_argument("--prompt-file", type=Path, help="the prompt is the first --prompt-tokens tokens of this text "
                                                     "file, raw (no chat template): prompt speed on a long prompt")
    ap.add_argument("--prompt-tokens", type=int, default=4000, help="with --prompt-file (default 4000)")
    ap.add_argument("--ctx", type=int, help="context of both engines (default: the prompt, the tokens and one)")
    ap.add_argument("-n", "--tokens", type=int, default=32, help="greedy tokens per row (default 32; the decode "
                                                                 "steps are one fewer)")
    ap.add_argument("--caps", default="none,base+50%,min", help="comma-separated: none, SIZE, P%% of the GGUF, "
                    "base+P%% (llama.cpp's baseline + P%% of the GGUF), min (flashinfer-lite's minimum + --slack)")
    ap.add_argument("--capped-ffn", default="predicted", choices=("predicted", "auto"), help="--ffn of the flash "
                    "rows under the caps (default predicted; auto: a SiLU model's exact gate, needing no predictors)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of both engines (default 2)")
    ap.add_argument("--slack", default=SLACK, help=f"cap minus DRAM budget of the flash rows (default {SLACK})")
    ap.add_argument("--llama-omp", default="active", help="llama.cpp rows per cap: active (OpenMP's default "
                    "spinning), passive (OMP_WAIT_POLICY=passive) or both (active,passive)")
    ap.add_argument("--llama-extra-bufts", action="store_true", help="let llama.cpp use extra buffer types (AMX, "
                                                                     "repack); off by default, see the docstring")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every row (the machine is shared: the "
                    "markdown adds each row's best round)")
    ap.add_argument("--floor", action="store_true", help="measure the device's sequential rate each round; each "
                    "row's read rate and floor (see the docstring)")
    ap.add_argument("--quick", action="store_true", help="smoke test: default model, tiny predictors, 6 tokens")
    h.add_arguments(ap, "--job", "--budget")
    a = ap.parse_args(argv)
    if a.worker:
        return h.worker(a.out, a.worker, lambda: measure(a))

    from flashinfer_lite.default_model import ensure_default_model
    from flashinfer_lite.generate import prompt_ids
    from flashinfer_lite.model import open_any
    from storage.format import read_layout
    if not set(a.llama_omp.split(",")) <= {"active", "passive"}:
        ap.error(f"--llama-omp takes active, passive or both, not {a.llama_omp!r}")
    for spec in a.caps.split(","):                       # a misspelt cap fails now, not after the first rows
        cap_bytes_for(spec, 100, 0, 0, 0)
    t_start, mach = time.perf_counter(), h.machine()
    work = h.work_dir(a, "vs-llama-cpp-")
    gguf = Path(a.model or ensure_default_model()).resolve()
    if a.quick:
        a.tokens, a.caps = 6, "none,min"
        flash = prepare_quick(gguf, work)
    else:
        flash = a.flash or default_flashdir(gguf, predictors=a.capped_ffn != "auto")
    tokenizer = open_any(gguf).tokenizer()
    if a.prompt_file:
        with open(a.prompt_file, encoding="utf-8", errors="replace") as f:
            a.prompt = f.read(16 * a.prompt_tokens)         # more than enough text for that many tokens
        ids = tokenizer.encode(a.prompt)[:a.prompt_tokens]
    else:
        ids = prompt_ids(tokenizer, a.prompt, None, use_template=True)
    ctx = a.ctx or len(ids) + a.tokens + 1
    job = {"gguf": str(gguf), "flash": str(flash), "prompt_ids": ids, "n_gen": a.tokens, "ctx": ctx,
           "threads": a.threads, "llama_extra_bufts": a.llama_extra_bufts, "capped_ffn": a.capped_ffn}
    (work / "job.json").write_text(json.dumps(job))
    gguf_bytes, slack = gguf.stat().st_size, parse_size(a.slack)
    L = read_layout(flash)
    flash_files = {"ffn_bytes": sum(os.path.getsize(F.ffn_path) for F in L.ffn_files),
                   "resident_bytes": os.path.getsize(Path(flash) / L.files["resident"]), "dtype": L.dtype}
    print(f"vs_llama_cpp: {gguf.name} ({gguf_bytes / 2**20:.1f} MiB), FLASHDIR {flash}; {len(ids)} prompt tokens, "
          f"{a.tokens} tokens per row; work dir {work}", file=sys.stderr)

    llamas = ["llama.cpp" if w == "active" else f"llama.cpp-{w}" for w in a.llama_omp.split(",")]
    results, ref, minimum, llama_base = [], None, None, None
    for rnd in range(1, a.repeat + 1):
        def row(mode, spec, cap, budget="auto"):
            return dict(run_row(mode, spec, cap, work, budget, f"#{rnd}"), round=rnd)
        if a.floor:
            results.append(row("sequential", "none", None))
        results += [row(m, "none", None) for m in llamas]
        if ref is None:                                  # round 1: the reference tokens and llama.cpp's baseline
            ref = next(r for r in results if r["mode"] == llamas[0])
            llama_base = ref["memcap"]["peak_bytes"] - gguf_bytes if "memcap" in ref else None
        for spec in a.caps.split(","):
            if spec == "min" and minimum is None:
                probe = row("probe", "none", None)
                minimum = probe.get("minimum_bytes")
                results.append(probe)
                if minimum is None:
                    continue
            if spec.startswith("base+") and llama_base is None:
                continue                                 # the llama.cpp row failed: it says why
            cap = cap_bytes_for(spec, gguf_bytes, llama_base, minimum, slack)
            if spec != "none":
                results += [row(m, spec, cap) for m in llamas]
            else:
                results += [row("flash-dense", spec, None), row("flash-auto", spec, None)]
            if spec == "none" and a.capped_ffn == "auto":
                continue                                 # flash-auto's uncapped row is above
            fr = row(f"flash-{a.capped_ffn}", spec, cap, "auto" if cap is None else str(cap - slack))
            if spec == "min" and "below_minimum" in fr:  # its own process measured more than the probe's
                need = h.retry_bytes(fr)
                fr = dict(row(fr["mode"], spec, need + slack, str(need)), first_attempt=fr["below_minimum"])
            results.append(fr)

    # leading greedy tokens equal to llama.cpp's uncapped row's, and to flash-dense's (same engine, every neuron)
    dense = next((r for r in results if r["mode"] == "flash-dense" and "gen_tokens" in r), {})
    for r in results:
        if "gen_tokens" in r and "gen_tokens" in ref:
            r["agree_prefix"] = agree_prefix(r["gen_tokens"], ref["gen_tokens"])
        if "gen_tokens" in r and dense:
            r["agree_prefix_flash_dense"] = agree_prefix(r["gen_tokens"], dense["gen_tokens"])
    if a.floor:
        add_floors(results, a.capped_ffn)
    doc = {"gguf": str(gguf), "gguf_bytes": gguf_bytes, "flash": str(flash), "flash_files": flash_files,
           "prompt": a.prompt, "prompt_ids": ids, "tokens": a.tokens, "ctx": ctx, "threads": a.threads,
           "caps": a.caps.split(","), "slack_bytes": slack, "llama_baseline_bytes": llama_base,
           "flash_minimum_bytes": minimum, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": mach,
           "repeat": a.repeat, "results": results, "seconds": round(time.perf_counter() - t_start, 1),
           "command": h.command("vs_llama_cpp.py", argv)}
    return h.emit(doc, markdown, a.md, None if a.keep else work)


def add_floors(results: list[dict], capped_ffn: str) -> None:
    """Each measured row's read rate (MB read per token over its P50) and floor: max(its engine's uncapped P50 in the
    same round, its bytes per token at the sequential rate measured in that round); and, under a cap, llama.cpp's
    P50 at that cap in that round over its own (how many times faster). A capped llama.cpp row that read under 1 MB a
    token was not held to its cap (a dense model under a cap below its file reads much of it every token; the GGUF's
    pages sat in the page cache charged to another process's cgroup, as on a shared machine where others read the
    same file): it is marked unbound and no ratio is taken to it."""
    by = {(r["round"], r["mode"], r["cap"]): r for r in results if "p50_ms" in r or "seq_MBps" in r}
    for r in results:
        if "p50_ms" not in r:
            continue
        seq = by.get((r["round"], "sequential", "none"), {}).get("seq_MBps")
        engine = r["mode"] if r["cap"] == "none" or r["mode"].startswith("llama") else f"flash-{capped_ffn}"
        ram = by.get((r["round"], engine, "none"), {}).get("p50_ms")
        mb = r["decode_MB_per_token"]
        r["read_GBps"] = round(mb / r["p50_ms"], 3)
        if seq and ram:
            r["floor_ms"] = round(max(ram, 1e3 * mb / seq), 1)
            r["over_floor"] = round(r["p50_ms"] / r["floor_ms"], 2)
        if r["mode"].startswith("llama") and r["cap"] != "none" and mb < 1.0:
            r["unbound"] = True
        llama = by.get((r["round"], "llama.cpp", r["cap"]))
        held = r["cap"] == "none" or (llama or {}).get("decode_MB_per_token", 0.0) >= 1.0
        if llama and held and not r["mode"].startswith("llama"):
            r["x_llama"] = round(llama["p50_ms"] / r["p50_ms"], 2)


def markdown(doc: dict) -> str:
    mib, m = 2**20, doc["machine"]
    ff = doc["flash_files"]
    base, mini = doc["llama_baseline_bytes"], doc["flash_minimum_bytes"]
    lines = [f"{Path(doc['gguf']).name}: {doc['gguf_bytes'] / mib:.1f} MiB; FLASHDIR {ff['dtype']}: ffn.bin "
             f"{ff['ffn_bytes'] / mib:.1f} MiB + resident {ff['resident_bytes'] / mib:.1f} MiB; llama.cpp baseline "
             f"{h.fmt(base and base / mib)} MiB; flashinfer-lite minimum budget {h.fmt(mini and mini / mib)} MiB; "
             f"{len(doc['prompt_ids'])} prompt tokens, {doc['tokens']} greedy tokens; {doc['threads']} threads; "
             f"{m['cpus']} CPUs; {doc['date']}, load avg {m['load_avg_start'][0]:.2f} -> {m['load_avg_end'][0]:.2f}",
             ""]
    rows = []
    seq = [f"{r['seq_MBps'] / 1e3:.2f}" for r in doc["results"] if "seq_MBps" in r]
    if seq:
        lines += [f"Sequential rate of the device in this run (8 MiB x 8 in flight, O_DIRECT), per round: "
                  f"{' / '.join(seq)} GB/s. Floor: max(the engine's uncapped P50 in the round, MB read per token / "
                  f"that round's rate); x llama.cpp: llama.cpp's P50 at the cap in the round over the row's.", ""]
    for r in doc["results"]:
        if r["mode"] in ("probe", "sequential"):
            continue
        cap = "-" if r.get("cap_bytes") is None else f"{r['cap_bytes'] / mib:.0f}"
        budget = f"{r['budget_bytes'] / mib:.1f}" if r.get("budget_bytes") else "-"
        head = [r["round"], r["cap"], cap, r["mode"], budget]
        if "p50_ms" not in r:
            rows.append(head + [h.failed(r)] + [""] * (10 + 4 * bool(seq)))
            continue
        n = len(r["gen_tokens"])
        rows.append(head + [f"{r['load_s']:.2f}", *(h.fmt(r[k]) for k in ("prompt_ms_per_token", "p50_ms", "p99_ms")),
                            h.fmt(r["tokens_per_s"], 2), h.fmt(r["decode_MB_per_token"], 2),
                            f"{r['peak_rss_bytes'] / mib:.0f}", f"{r.get('memcap', {}).get('peak_bytes', 0) / mib:.0f}",
                            f"{r.get('agree_prefix', '-')}/{n}", f"{r.get('agree_prefix_flash_dense', '-')}/{n}",
                            f"{r['loadavg'][0]:.2f}"]
                    + ([h.fmt(r.get("read_GBps"), 2), h.fmt(r.get("floor_ms")), h.fmt(r.get("over_floor"), 2),
                        "cap unbound" if r.get("unbound") else h.fmt(r.get("x_llama"), 2)] if seq else []))
    lines += h.table(["round", "cap", "cap MiB", "engine", "DRAM budget MiB", "load s", "prompt ms/tok",
                      "decode ms/tok P50", "P99", "tok/s", "MB read/tok", "peak RSS MiB", "memcap peak MiB",
                      "= llama.cpp (first k)", "= flash-dense", "load avg"]
                     + (["read GB/s", "floor ms", "P50 / floor", "x llama.cpp"] if seq else []), rows)
    if doc["repeat"] > 1:
        runs: dict[tuple, list] = {}
        for r in doc["results"]:
            if "p50_ms" in r:
                runs.setdefault((r["cap"], r["mode"]), []).append(r)
        best = [(cap, mode, min(rs, key=lambda r: r["p50_ms"]), rs) for (cap, mode), rs in runs.items()]
        lines += ["", f"Best of {doc['repeat']} rounds (the round with the lowest P50: the least disturbed by other "
                  "processes)", ""]
        lines += h.table(["cap", "engine", "P50 per round", "best P50", "its P99", "its tok/s", "its MB read/tok"],
                         [[cap, mode, " / ".join(h.fmt(r["p50_ms"]) for r in rs), h.fmt(b["p50_ms"]),
                           h.fmt(b["p99_ms"]), h.fmt(b["tokens_per_s"], 2), h.fmt(b["decode_MB_per_token"], 2)]
                          for cap, mode, b, rs in best])
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        sys.exit(f"error: {e}")
