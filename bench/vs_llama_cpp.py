#!/usr/bin/env python3
"""llama.cpp against flashinfer-lite: the same GGUF, the same prompt tokens, the same memory caps (issue #13).

    PYTHONPATH=. python bench/vs_llama_cpp.py [-m GGUF] [--flash FLASHDIR] [-n 32] [--caps none,base+50%,min] [--md FILE]
    PYTHONPATH=. python bench/vs_llama_cpp.py --quick      # smoke test: the default model, 6 tokens, ~1 minute

Needs llama-cpp-python (`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36`, the `bench` extra) and
tools/memcap.py (root, cgroup v1). The prompt is tokenized once by flashinfer-lite's tokenizer (with the chat template)
and both engines get those ids. Every row is its own process under tools/memcap.py after drop_caches, with --threads
compute threads (default 2), greedy:
  llama.cpp         llama_cpp.Llama(GGUF, use_mmap=True, logits_all=False): eval(prompt), then eval([argmax]) per token
  llama.cpp-passive the same with OMP_WAIT_POLICY=passive (--llama-omp active,passive): llama.cpp's OpenMP threads
                    spin between ops, which costs it several times its speed when other processes share the cores
  flash-dense       flashinfer-lite --ffn dense on the GGUF: every weight in DRAM in the GGUF's blocks (uncapped only)
  flash-auto        flashinfer-lite --ffn auto on FLASHDIR, what `generate` runs by default: the whole model fits, so
                    dense over the FLASHDIR's own blocks (ffn.resident.ResidentFFN) (uncapped only)
  flash-predicted   flashinfer-lite --ffn predicted on FLASHDIR: --dram-budget auto uncapped, cap - --slack under a cap
Caps (--caps, comma-separated):
  none       uncapped (the cgroup limit is physical RAM)
  300M       a size;  40%: a share of the GGUF file
  base+50%   llama.cpp's own baseline (its uncapped memcap peak minus the GGUF: interpreter, libraries, KV cache,
             compute buffers) plus that share of the GGUF: the room llama.cpp has for half its weights
  min        flashinfer-lite's minimum DRAM budget for FLASHDIR (load_runtime's refusal names it; probed in a fresh
             process) plus --slack
FLASHDIR defaults to flashinfer-lite's own conversion of the GGUF (float16, made on first use in the user cache, as
`flashinfer-lite generate -m GGUF` does), with predictors trained on first use when it has none (generate's
runtime.train_on_first_use). --quick instead converts the default model into a temp dir and trains a predictor for one layer
only (the other layers select every neuron), so the flash rows run predicted mode in seconds.
Per row: load time; prompt ms/token; decode ms/token P50 and P99 and tokens/s over the decode steps (the first token
comes from the prompt's pass); bytes read from storage per decode step (/proc/self/io read_bytes: page-cache misses,
mmap faults and O_DIRECT reads of every thread); peak RSS (VmHWM) and the cgroup's peak (RSS + page cache); the greedy
tokens, and how many leading ones equal llama.cpp's uncapped row. They need not: llama.cpp multiplies Q4_1 blocks by
8-bit-quantized activations, flash-dense and flash-auto the dequantized weights in float32 (flash-auto's down
vectors requantized to Q8_0 by convert), flash-predicted those of FLASHDIR and skips neurons. The load average (os.getloadavg) is recorded before every row: the machine is shared.
llama.cpp runs with use_extra_bufts=False (llama.cpp's --no-repack): on the 2-vCPU VM the bench was written on, its
AMX matmul (an extra buffer type) segfaults on the first decode; for Q4_1 weights the CPU repack has no layout, so
this turns off only AMX. --llama-extra-bufts turns them back on.
Prints one JSON document (stdout) and a markdown table (stderr, and --md FILE).
"""
from __future__ import annotations

# Only the standard library and numpy at the top: the llama.cpp worker must not load numba and LLVM into its memory.
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from storage.errors import UserError  # noqa: E402  (leaf modules: no numba)
from storage.sizes import parse_size  # noqa: E402

MEMCAP = REPO / "tools" / "memcap.py"
CORPUS = REPO / "tests" / "data" / "corpus"
PROMPT = "Write a short story about a robot who learns to paint."
SLACK = "32M"            # under a cap, the flash row's DRAM budget is the cap minus this (heap, page cache in flight)
ROW_FIELDS = ("mode", "engine", "cap", "cap_bytes", "load_s", "prompt_tokens", "prompt_ms_per_token", "decode_steps",
              "p50_ms", "p99_ms", "tokens_per_s", "decode_MB_per_token", "peak_rss_bytes", "memcap", "gen_tokens",
              "agree_prefix", "loadavg", "round")


def proc_field(path: str, key: str) -> int:
    """An integer field of a /proc/self file (the first number after `key`). Here rather than bench.e2e's
    proc_read_bytes and budget.peak_rss_bytes, whose modules load numba: the llama.cpp worker stays without it."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def read_bytes() -> int:
    return proc_field("/proc/self/io", "read_bytes:")


def peak_rss() -> int:
    return proc_field("/proc/self/status", "VmHWM:") * 1024


# ----------------------------------------------------------------------------------------------------------------------
# Workers: one row in this process

def llama_model(gguf, n_ctx: int, threads: int, extra_bufts: bool = False):
    """llama_cpp.Llama on the GGUF, mmap'ed, greedy-ready. Llama() takes no flag for extra buffer types, so with
    extra_bufts False the model params it starts from (llama_model_default_params) are patched for the call."""
    import llama_cpp
    import llama_cpp.llama_cpp as C
    default = C.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = extra_bufts
        return p
    C.llama_model_default_params = params
    try:
        return llama_cpp.Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, use_mmap=True,
                               logits_all=False, verbose=False)
    finally:
        C.llama_model_default_params = default


def step_stats(prompt_ms: float, n_prompt: int, step_ms: list[float], io_bytes: int) -> dict:
    steps = len(step_ms)
    q = (lambda p: round(float(np.percentile(step_ms, p)), 3)) if steps else (lambda p: None)
    return {"prompt_tokens": n_prompt, "prompt_ms": round(prompt_ms, 3),
            "prompt_ms_per_token": round(prompt_ms / n_prompt, 3), "decode_steps": steps, "p50_ms": q(50),
            "p99_ms": q(99), "tokens_per_s": round(steps / sum(step_ms) * 1e3, 3) if steps else None,
            "decode_MB_per_token": round(io_bytes / max(steps, 1) / 1e6, 3)}


def measure_llama(job: dict) -> dict:
    """eval(prompt ids), then one eval per generated token; argmax of the last logits row (llama_get_logits_ith)."""
    import llama_cpp
    t0 = time.perf_counter()
    llm = llama_model(job["gguf"], job["ctx"], job["threads"], job["llama_extra_bufts"])
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))
    ids = job["prompt_ids"]
    t0 = time.perf_counter()
    llm.eval(ids)
    prompt_ms = 1e3 * (time.perf_counter() - t0)
    out, step_ms, io0 = [argmax()], [], read_bytes()
    while len(out) < job["n_gen"]:
        t0 = time.perf_counter()
        llm.eval([out[-1]])
        step_ms.append(1e3 * (time.perf_counter() - t0))
        out.append(argmax())
    res = {"engine": "llama.cpp", "load_s": round(load_s, 3), "gen_tokens": out,
           **step_stats(prompt_ms, len(ids), step_ms, read_bytes() - io0),
           "llama_cpp": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip(),
           # llama.cpp's own tokenizer on the text of the ids: the same ids, or the prompts would differ
           "same_ids_by_llama_tokenizer": llm.tokenize(llm.detokenize(ids, special=True), add_bos=False,
                                                       special=True) == ids}
    return res


def measure_flash(ffn: str, budget: str, job: dict) -> dict:
    """flashinfer-lite's generate path (load, Session.generate, greedy) on the GGUF (dense) or FLASHDIR."""
    from bench.smollm2_modes import Counters
    from flashinfer_lite.generate import Sampler, Session
    from flashinfer_lite.runtime import load
    path = job["gguf"] if ffn == "dense" else job["flash"]
    loaded, tokenizer = load(path, budget, ffn, job["ctx"], job["threads"])
    model, runtime, load_ms = loaded.transformer, loaded.runtime, loaded.load_ms
    session = Session(model, tokenizer, job["ctx"])
    out, c = [], None
    for tok in session.generate(job["prompt_ids"], job["n_gen"], Sampler(temp=0.0), ignore_eos=True):
        if c is None:
            c = Counters(runtime)                                      # after the prompt: decode steps only
        out.append(tok)
    t = session.timings
    res = {"engine": "flashinfer-lite", "ffn": ffn, "load_s": round(load_ms / 1e3, 3), "gen_tokens": out,
           **step_stats(t.prompt_ms, t.prompt_tokens, t.token_ms, 0)}
    d = c.since(len(t.token_ms))
    res.update(decode_MB_per_token=d["MB_per_token"], reader_MB_per_token=d["reader_MB_per_token"],
               hit_rate=d["hit_rate"])
    if runtime is not None:
        res.update(budget_bytes=runtime.plan.budget_bytes, minimum_bytes=runtime.plan.minimum_bytes,
                   plan=runtime.plan.table(), active_share=round(float(runtime.stats.active_share().mean()), 4))
    return res


def worker_main(a) -> int:
    job = json.loads(Path(a.job).read_text())
    res = {"mode": a.worker, "loadavg": os.getloadavg()}
    try:
        if a.worker.startswith("llama.cpp"):
            res.update(measure_llama(job))
        elif a.worker == "probe":
            from bench.smollm2_modes import probe_minimum
            res.update(probe_minimum(argparse.Namespace(worker="probe-predicted", model=job["flash"],
                                                        ctx_run=job["ctx"])))
        else:
            res.update(measure_flash(a.worker.split("-")[1], a.budget, job))
    except Exception as e:  # the row records why it could not run; the other rows go on
        from bench.smollm2_modes import MINIMUM_RE
        res["below_minimum" if MINIMUM_RE.search(str(e)) else "error"] = f"{str(e) or type(e).__name__}"[:2000]
    res["peak_rss_bytes"] = peak_rss()
    tmp = Path(a.out + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.rename(a.out)
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# Driver

def run_row(mode: str, cap: str, cap_bytes: int | None, work: Path, budget: str = "auto", tag: str = "") -> dict:
    """One row as a subprocess under tools/memcap.py, page cache dropped first."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if mode.endswith("-passive"):
        env["OMP_WAIT_POLICY"] = "passive"
    name = f"{mode}@{cap}{tag}"
    out, capjson = work / f"{name}.json", work / f"{name}.memcap.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--out", str(out), "--job",
           str(work / "job.json"), "--budget", budget]
    limit = cap_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    full = [sys.executable, str(MEMCAP), "--limit", str(limit), "--drop-caches", "--json", str(capjson), "--", *cmd]
    t0 = time.perf_counter()
    p = subprocess.run(full, env=env, stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text()) if out.exists() else {"mode": mode, "error": f"worker exited {p.returncode} "
                                                            "without a result"}
    if capjson.exists():
        res["memcap"] = json.loads(capjson.read_text())
        if res["memcap"]["oom_kills"]:
            res["error"] = f"OOM-killed under the {limit / 2**20:.0f} MiB cap ({res.get('error', '')})"
    elif p.returncode == 3:
        res["error"] = "memory cgroup unavailable (tools/memcap.py exit 3)"
    res.update(cap=cap, cap_bytes=cap_bytes, wall_s=round(time.perf_counter() - t0, 1))
    what = (f"P50 {res['p50_ms']} ms, {res['decode_MB_per_token']} MB/token" if "p50_ms" in res else
            f"minimum {res['minimum_bytes'] / 2**20:.1f} MiB" if "minimum_bytes" in res else
            res.get("below_minimum") or res.get("error", "?"))
    print(f"  {name}: {what} ({res['wall_s']} s)", file=sys.stderr)
    return res


def default_flashdir(gguf: Path) -> str:
    """flashinfer-lite's own FLASHDIR for the GGUF, with predictors: what `generate -m GGUF --ffn predicted` uses."""
    from flashinfer_lite.runtime import train_on_first_use
    from flashinfer_lite.predictor_set import has_trained_predictors
    from storage.cache import flashdir_for
    flash = flashdir_for(gguf, progress=sys.stderr.isatty())
    if not has_trained_predictors(flash):
        train_on_first_use(flash)
    return flash


def prepare_quick(gguf: Path, work: Path) -> str:
    """A float16 FLASHDIR of the GGUF in `work` with a predictor in the last layer only: the others are dense layers
    (predicted mode reads all their neurons through the neuron cache), so training takes seconds, not minutes."""
    from flashinfer_lite.loader import open_any
    from predictors.collect import collect
    from predictors.train import train
    from storage.convert import convert
    cal = work / "cal.txt"
    cal.write_bytes((CORPUS / "wikitext2_valid.txt").read_bytes()[:12_000])
    flash = convert(gguf, work / "quick.flash", dtype="f16", progress=False)
    collect(gguf, [cal], 128, work / "acts", ctx=64, rows=128, progress=False)
    n_layers = open_any(gguf).config.n_layers
    train(work / "acts", flash, sparsity=0.5, rank=8, max_rank=8, steps=20, dense_layers=n_layers - 1, progress=False)
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
    ap.add_argument("-n", "--tokens", type=int, default=32, help="greedy tokens per row (default 32; the decode "
                                                                 "steps are one fewer)")
    ap.add_argument("--caps", default="none,base+50%,min", help="comma-separated: none, SIZE, P%% of the GGUF, "
                    "base+P%% (llama.cpp's baseline + P%% of the GGUF), min (flashinfer-lite's minimum + --slack)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of both engines (default 2)")
    ap.add_argument("--slack", default=SLACK, help=f"cap minus DRAM budget of the flash rows (default {SLACK})")
    ap.add_argument("--llama-omp", default="active", help="llama.cpp rows per cap: active (OpenMP's default "
                    "spinning), passive (OMP_WAIT_POLICY=passive) or both (active,passive)")
    ap.add_argument("--llama-extra-bufts", action="store_true", help="let llama.cpp use extra buffer types (AMX, "
                                                                     "repack); off by default, see the docstring")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every row (the machine is shared: the "
                    "markdown adds each row's best round)")
    ap.add_argument("--quick", action="store_true", help="smoke test: default model, tiny predictors, 6 tokens")
    ap.add_argument("--keep", type=Path, help="keep the work directory (worker outputs) here")
    ap.add_argument("--md", type=Path, help="also write the markdown table here")
    for hidden in ("--worker", "--out", "--job", "--budget"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main(a)

    from flashinfer_lite.default_model import ensure_default_model
    from flashinfer_lite.generate import prompt_ids
    from flashinfer_lite.loader import open_any
    from storage.format import read_layout
    if not set(a.llama_omp.split(",")) <= {"active", "passive"}:
        ap.error(f"--llama-omp takes active, passive or both, not {a.llama_omp!r}")
    for spec in a.caps.split(","):                       # a misspelt cap fails now, not after the first rows
        cap_bytes_for(spec, 100, 0, 0, 0)
    t_start, load_start = time.perf_counter(), os.getloadavg()
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="vs-llama-cpp-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    gguf = Path(a.model or ensure_default_model()).resolve()
    if a.quick:
        a.tokens, a.caps = 6, "none,min"
        flash = prepare_quick(gguf, work)
    else:
        flash = a.flash or default_flashdir(gguf)
    tokenizer = open_any(gguf).tokenizer()
    ids = prompt_ids(tokenizer, a.prompt, None, use_template=True)
    ctx = len(ids) + a.tokens + 1
    job = {"gguf": str(gguf), "flash": str(flash), "prompt_ids": ids, "n_gen": a.tokens, "ctx": ctx,
           "threads": a.threads, "llama_extra_bufts": a.llama_extra_bufts}
    (work / "job.json").write_text(json.dumps(job))
    gguf_bytes, slack = gguf.stat().st_size, parse_size(a.slack)
    L = read_layout(flash)
    flash_files = {"ffn_bytes": os.path.getsize(L.ffn_path),
                   "resident_bytes": os.path.getsize(Path(flash) / L.files["resident"]), "dtype": L.dtype}
    print(f"vs_llama_cpp: {gguf.name} ({gguf_bytes / 2**20:.1f} MiB), FLASHDIR {flash}; {len(ids)} prompt tokens, "
          f"{a.tokens} tokens per row; work dir {work}", file=sys.stderr)

    llamas = ["llama.cpp" if w == "active" else f"llama.cpp-{w}" for w in a.llama_omp.split(",")]
    results, ref, minimum, llama_base = [], None, None, None
    for rnd in range(1, a.repeat + 1):
        def row(mode, spec, cap, budget="auto"):
            return dict(run_row(mode, spec, cap, work, budget, f"#{rnd}"), round=rnd)
        results += [row(m, "none", None) for m in llamas]
        if ref is None:                                  # round 1: the reference tokens and llama.cpp's baseline
            ref = results[0]
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
            fr = row("flash-predicted", spec, cap, "auto" if cap is None else str(cap - slack))
            if spec == "min" and "below_minimum" in fr:  # its own process measured more than the probe's
                from bench.smollm2_modes import minimum_in
                need = minimum_in(fr["below_minimum"])
                fr = dict(row("flash-predicted", spec, need + slack, str(need)), first_attempt=fr["below_minimum"])
            results.append(fr)

    # leading greedy tokens equal to llama.cpp's uncapped row's, and to flash-dense's (same engine, every neuron)
    dense = next((r for r in results if r["mode"] == "flash-dense" and "gen_tokens" in r), {})
    for r in results:
        if "gen_tokens" in r and "gen_tokens" in ref:
            r["agree_prefix"] = agree_prefix(r["gen_tokens"], ref["gen_tokens"])
        if "gen_tokens" in r and dense:
            r["agree_prefix_flash_dense"] = agree_prefix(r["gen_tokens"], dense["gen_tokens"])
    doc = {"gguf": str(gguf), "gguf_bytes": gguf_bytes, "flash": str(flash), "flash_files": flash_files,
           "prompt": a.prompt, "prompt_ids": ids, "tokens": a.tokens, "ctx": ctx, "threads": a.threads,
           "caps": a.caps.split(","), "slack_bytes": slack, "llama_baseline_bytes": llama_base,
           "flash_minimum_bytes": minimum, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": {"cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                       "load_avg_start": load_start, "load_avg_end": os.getloadavg()},
           "repeat": a.repeat, "results": results, "seconds": round(time.perf_counter() - t_start, 1),
           "command": " ".join(["python", "bench/vs_llama_cpp.py", *(argv if argv is not None else sys.argv[1:])])}
    return emit(doc, markdown(doc), a.md, None if a.keep else work)


def emit(doc: dict, md: str, md_path: Path | None, remove: Path | None) -> int:
    """The bench's output: the JSON document on stdout, the markdown on stderr (and md_path); `remove` the work dir."""
    print(json.dumps(doc, indent=1))
    print(md, file=sys.stderr)
    if md_path:
        md_path.write_text(md + "\n")
    if remove:
        shutil.rmtree(remove, ignore_errors=True)
    return 0


def _f(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def markdown(doc: dict) -> str:
    mib, m = 2**20, doc["machine"]
    ff = doc["flash_files"]
    base, mini = doc["llama_baseline_bytes"], doc["flash_minimum_bytes"]
    lines = [f"{Path(doc['gguf']).name}: {doc['gguf_bytes'] / mib:.1f} MiB; FLASHDIR {ff['dtype']}: ffn.bin "
             f"{ff['ffn_bytes'] / mib:.1f} MiB + resident {ff['resident_bytes'] / mib:.1f} MiB; llama.cpp baseline "
             f"{_f(base and base / mib)} MiB; flashinfer-lite minimum budget {_f(mini and mini / mib)} MiB; "
             f"{len(doc['prompt_ids'])} prompt tokens, {doc['tokens']} greedy tokens; {doc['threads']} threads; "
             f"{m['cpus']} CPUs; {doc['date']}, load avg {m['load_avg_start'][0]:.2f} -> {m['load_avg_end'][0]:.2f}",
             "",
             "| round | cap | cap MiB | engine | DRAM budget MiB | load s | prompt ms/tok | decode ms/tok P50 | P99 | "
             "tok/s | MB read/tok | peak RSS MiB | memcap peak MiB | = llama.cpp (first k) | = flash-dense | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if r["mode"] == "probe":
            continue
        cap = "-" if r.get("cap_bytes") is None else f"{r['cap_bytes'] / mib:.0f}"
        budget = f"{r['budget_bytes'] / mib:.1f}" if r.get("budget_bytes") else "-"
        head = f"| {r['round']} | {r['cap']} | {cap} | {r['mode']} | {budget} |"
        if "p50_ms" not in r:
            lines.append(f"{head} {(r.get('below_minimum') or r.get('error', '?')).splitlines()[0][:300]} |"
                         + " |" * 10)
            continue
        mc = r.get("memcap", {})
        lines.append(f"{head} {r['load_s']:.2f} | {_f(r['prompt_ms_per_token'])} | {_f(r['p50_ms'])} | "
                     f"{_f(r['p99_ms'])} | {_f(r['tokens_per_s'], 2)} | {_f(r['decode_MB_per_token'], 2)} | "
                     f"{r['peak_rss_bytes'] / mib:.0f} | {mc.get('peak_bytes', 0) / mib:.0f} | "
                     f"{r.get('agree_prefix', '-')}/{len(r['gen_tokens'])} | "
                     f"{r.get('agree_prefix_flash_dense', '-')}/{len(r['gen_tokens'])} | {r['loadavg'][0]:.2f} |")
    if doc["repeat"] > 1:
        lines += ["", f"Best of {doc['repeat']} rounds (the round with the lowest P50: the least disturbed by other "
                  "processes)", "", "| cap | engine | P50 per round | best P50 | its P99 | its tok/s | its MB read/tok |",
                  "|---|---|---|---|---|---|---|"]
        runs: dict[tuple, list] = {}
        for r in doc["results"]:
            if "p50_ms" in r:
                runs.setdefault((r["cap"], r["mode"]), []).append(r)
        for (cap, mode), rs in runs.items():
            b = min(rs, key=lambda r: r["p50_ms"])
            lines.append(f"| {cap} | {mode} | {' / '.join(_f(r['p50_ms']) for r in rs)} | {_f(b['p50_ms'])} | "
                         f"{_f(b['p99_ms'])} | {_f(b['tokens_per_s'], 2)} | {_f(b['decode_MB_per_token'], 2)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        sys.exit(f"error: {e}")
