#!/usr/bin/env python3
"""Real-model bench: perplexity and decode speed of every FFN mode of one FLASHDIR (SmolLM2-135M), and a
transformers + accelerate disk-offload baseline, on the same tokens, each in its own process under a memory cap.

    PYTHONPATH=. python bench/smollm2_modes.py -m FLASHDIR [--source GGUF_OR_HF_DIR] [--tokens 4096] [--md FILE]
    PYTHONPATH=. python bench/smollm2_modes.py --quick     # stories260K + predictors built in a temp dir (smoke test)

Rows (each a subprocess under tools/memcap.py, page cache dropped first; "uncapped" = capped at physical RAM):
  dense-ram            load_runtime(--ffn dense): every weight in DRAM as float32, uncapped
  dense-mmap           FFN bundles np.memmap'ed from ffn.bin (llama.cpp's default), all neurons computed by the
                       runtime's SparseFFN kernel; resident weights in DRAM. The runtime has no mmap dense mode, so
                       this row builds one here; it runs under the cap of the smallest flash-predicted row that ran
  flash-oracle-min     load_runtime(--ffn oracle) at its minimum DRAM budget: oracle mode holds the dense gate/up
                       weights to know the true activations, so it is a quality reference, not a memory mode
  flash-predicted-P    load_runtime(--ffn predicted) at a DRAM budget of P% of the model files; a budget under the
                       runtime's minimum is reported with its refusal, and a `min` row then runs at the minimum
  accelerate-disk      transformers from_pretrained(device_map="auto", max_memory={"cpu": M}, offload_folder=...)
                       on --source (a GGUF is loaded by transformers and saved as an HF directory first), same cap
                       as dense-mmap, M = that cap minus ACCEL_BASE
Flash rows run under max(--cap, budget + --slack). The minimum is load_runtime's own (its refusal names it), probed
in a fresh process ("probe-*" workers), because the plan's runtime line is the measured RSS of the process.
Per row, in this order: a greedy generation of --gen tokens from a chat prompt (generate.py's Session), each decode
step timed (P50, P99, tok/s), with the bytes fetched from storage per step (/proc/self/io: page-cache misses and
O_DIRECT) and the neuron cache hit rate; then perplexity over --tokens tokens of the corpus in windows of --ctx tokens,
each from an empty KV cache (predictors/evaluate.py's windows; the runtime rows feed them one token at a time, the
decode path). Peak RSS (VmHWM) and the cgroup's peak (RSS + page cache) cover the whole row.
"Model files" = ffn.bin + resident.safetensors of the FLASHDIR; --cap defaults to half of them.
Prints one JSON document (stdout) and a markdown table (stderr, and --md FILE).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.e2e import proc_read_bytes  # noqa: E402

MEMCAP = REPO / "tools" / "memcap.py"
CORPUS = REPO / "tests" / "data" / "corpus"
STORIES = REPO / "tests" / "data" / "stories260K"
PROMPT = "What is the capital of France?"
WINDOW = 5                                   # neuron cache sliding window, tokens (the runtime's default)
SLACK = "256M"                               # page cache of buffered reads + peak RSS over the DRAM budget
ACCEL_BASE = 512 << 20                       # torch + transformers + activations before any weight (~390-500 MiB seen)


# ----------------------------------------------------------------------------------------------------------------------
# Worker side: one row in this process

class MmapDenseFFN:
    """Dense FFN whose weights are the FLASHDIR's bundles np.memmap'ed from ffn.bin: every neuron of every layer is
    computed (SparseFFN over all rows) and the page cache decides what stays in memory, as with llama.cpp's mmap."""

    def __init__(self, layout, weights: dict):
        from flashinfer_lite.ffn.sparse import SparseFFN
        L = self.layout = layout
        self.B = np.memmap(L.ffn_path, np.uint8, mode="r")
        self.kernel = SparseFFN.from_layout(L, max_active=max(L.n_neurons))       # model's act, no threshold
        self.rows = np.arange(max(L.n_neurons), dtype=np.int32)
        self.down_bias = [weights.get(f"layers.{i}.ffn.down.bias") for i in range(L.n_layers)]
        self.y = np.empty(L.d, np.float32)

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        L = self.layout
        n, off = L.n_neurons[layer], L.offset[layer]
        region = self.B[off:off + n * L.stride].reshape(n, L.stride)                 # [n, stride]
        y = np.empty_like(x, dtype=np.float32)                                       # [T, d]
        for t in range(x.shape[0]):
            self.kernel(region, self.rows[:n], np.ascontiguousarray(x[t], np.float32), self.y)
            y[t] = self.y
        if self.down_bias[layer] is not None:
            y += self.down_bias[layer]
        return y


def load_mode(a):
    """(model, tokenizer, runtime or None, DRAM budget or None) for this worker's row."""
    from flashinfer_lite.runtime import load_runtime
    if a.worker == "dense-ram":
        return (*load_runtime(a.model, "dense"), None)
    if a.worker == "dense-mmap":
        from flashinfer_lite.loader import load_weights
        from flashinfer_lite.model import Transformer
        from storage.format import FlashCheckpoint, ffn_tensor_names
        ck = FlashCheckpoint(a.model)
        L = ck.layout
        bundled = {n for i in range(L.n_layers) for n in ffn_tensor_names(L, i)}
        weights = load_weights(ck, skip=lambda n: n in bundled)
        return Transformer(ck.config, weights, ffn=MmapDenseFFN(L, weights)), ck.tokenizer(), None, None
    ffn = a.worker.split("-")[1]                                   # flash-oracle-B / flash-predicted-B
    budget = int(a.budget)
    return (*load_runtime(a.model, ffn, dram_budget=budget, ctx=a.ctx_run, window=WINDOW), budget)


class Counters:
    """Bytes fetched from storage and neuron-cache counters between two points of this process."""

    def __init__(self, runtime):
        self.rt = runtime
        self.start = self.now()

    def now(self) -> dict:
        s = self.rt.stats if self.rt is not None else None
        return {"io": proc_read_bytes(), "hits": s.hits if s else 0, "misses": s.misses if s else 0,
                "reader": s.read_bytes + s.prefill_bytes_read if s else 0, "pred_s": s.predictor_s if s else 0.0}

    def since(self, n: int) -> dict:
        """Per-step figures over n steps since `start`."""
        e = self.now()
        d = {k: e[k] - self.start[k] for k in e}
        looked = d["hits"] + d["misses"]
        return {"MB_per_token": round(d["io"] / max(n, 1) / 1e6, 3),
                "reader_MB_per_token": round(d["reader"] / max(n, 1) / 1e6, 3) if self.rt else None,
                "hit_rate": round(d["hits"] / looked, 4) if looked else None,
                "predictor_ms_per_token": round(1e3 * d["pred_s"] / max(n, 1), 3) if self.rt else None}


def measure_runtime(a, job: dict) -> dict:
    """Greedy generation then perplexity with the flashinfer-lite model of this row."""
    from flashinfer_lite.generate import Sampler, Session
    from predictors.evaluate import log_softmax_at
    from tqdm import tqdm
    t0 = time.perf_counter()
    model, tokenizer, runtime, budget = load_mode(a)
    res = {"load_s": round(time.perf_counter() - t0, 3), "budget_bytes": budget}
    if runtime is not None:
        res["plan"] = runtime.plan.table()
        res["window_rows"] = runtime.plan.window_rows
        res["hot_neurons"] = runtime.plan.hot_rows

    # 1. greedy generation: the decode steps after the prompt are timed (Session.timings.token_ms)
    session = Session(model, tokenizer, a.ctx_run)
    out, c = [], None
    for tok in session.generate(job["prompt_ids"], job["n_gen"], Sampler(temp=0.0), ignore_eos=True):
        if c is None:
            c = Counters(runtime)                                   # after the prompt: decode steps only
        out.append(tok)
    tim = session.timings.as_dict()
    res.update(gen_tokens=out, prompt_ms=tim["prompt_ms"], decode_steps=tim["eval_tokens"], p50_ms=tim["p50_ms"],
               p99_ms=tim["p99_ms"], tokens_per_s=tim["tokens_per_second"], ms_per_token=tim["ms_per_token"])
    res.update({f"decode_{k}": v for k, v in c.since(tim["eval_tokens"]).items()})

    # 2. perplexity, one token at a time through the decode path (evaluate.py's loop, without its dense twin)
    kv = session.kv
    c = Counters(runtime)
    nll, argmax, t_model = 0.0, [], 0.0
    bar = tqdm(total=sum(len(w) for w in job["segments"]), desc=f"{a.worker} perplexity", unit="tok",
               file=sys.stderr, mininterval=5)
    for w in job["segments"]:
        kv.reset()
        for j in range(len(w) - 1):
            t1 = time.perf_counter()
            logits = model.forward([w[j]], kv)
            t_model += time.perf_counter() - t1
            nll -= log_softmax_at(logits, w[j + 1])
            argmax.append(int(np.argmax(logits)))
            bar.update(1 + (j == len(w) - 2))                       # the window's last token is only a target
    bar.close()
    n = len(argmax)
    res.update(perplexity=float(np.exp(nll / n)), ppl_tokens=n, ppl_ms_per_token=round(1e3 * t_model / n, 3),
               ppl_argmax=argmax, **{f"ppl_{k}": v for k, v in c.since(n).items()})
    if runtime is not None:
        res["active_share"] = round(float(runtime.stats.active_share().mean()), 4)
    return res


def prepare_hf(source: Path, dest: Path) -> dict:
    """An HF directory transformers can offload from: the source itself, or a GGUF loaded by transformers
    (dequantized to float32) and saved with save_pretrained."""
    import torch
    import transformers as tf
    if source.is_dir():
        return {"hf_dir": str(source)}
    model = tf.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # A GGUF-loaded model is plain float32 tensors, but transformers marks it quantized and refuses to save it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(dest)
    return {"hf_dir": str(dest)}


def measure_accelerate(a, job: dict) -> dict:
    """The same generation and perplexity with transformers + accelerate, weights beyond max_memory on disk."""
    import torch
    import transformers as tf
    from flashinfer_lite.generate import Timings
    from tqdm import tqdm
    t0 = time.perf_counter()
    hf = Path(a.hf_dir)
    offload = Path(a.out).with_name("accelerate-offload")
    max_mem = int(a.budget)
    model = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, device_map="auto",
                                                    max_memory={"cpu": max_mem}, offload_folder=str(offload)).eval()
    placed = list((getattr(model, "hf_device_map", None) or {"": "cpu"}).values())
    res = {"load_s": round(time.perf_counter() - t0, 3), "max_memory_cpu_bytes": max_mem,
           "device_map_modules": {d: placed.count(d) for d in sorted(set(map(str, placed)))},
           "torch_threads": torch.get_num_threads(), "transformers": tf.__version__}
    with torch.no_grad():
        ids = torch.tensor([job["prompt_ids"]])
        t1 = time.perf_counter()
        o = model(ids, use_cache=True)
        prompt_ms = 1e3 * (time.perf_counter() - t1)
        out, step_ms = [int(o.logits[0, -1].argmax())], []
        io0 = proc_read_bytes()
        while len(out) < job["n_gen"]:
            t1 = time.perf_counter()
            o = model(torch.tensor([[out[-1]]]), past_key_values=o.past_key_values, use_cache=True)
            step_ms.append(1e3 * (time.perf_counter() - t1))
            out.append(int(o.logits[0, -1].argmax()))
        io = proc_read_bytes() - io0
        tim = Timings(token_ms=step_ms).as_dict()
        res.update(gen_tokens=out, prompt_ms=round(prompt_ms, 3), decode_steps=len(step_ms), p50_ms=tim["p50_ms"],
                   p99_ms=tim["p99_ms"], tokens_per_s=tim["tokens_per_second"], ms_per_token=tim["ms_per_token"],
                   decode_MB_per_token=round(io / max(len(step_ms), 1) / 1e6, 3))
        # perplexity: one forward per window (the causal mask makes it the same sum as token by token)
        nll, argmax, t_model = 0.0, [], 0.0
        io0 = proc_read_bytes()
        for w in tqdm(job["segments"], desc="accelerate perplexity", unit="window", file=sys.stderr, mininterval=5):
            t1 = time.perf_counter()
            logits = model(torch.tensor([w[:-1]])).logits[0]                         # [len-1, V] float32
            t_model += time.perf_counter() - t1
            target = torch.tensor(w[1:])
            for i in range(0, len(target), 32):                  # float64 like log_softmax_at, 32 rows at a time
                logp = torch.log_softmax(logits[i:i + 32].double(), dim=-1)
                nll -= float(logp[torch.arange(len(logp)), target[i:i + 32]].sum())
            argmax += logits.argmax(-1).tolist()
        n = len(argmax)
        res.update(perplexity=float(np.exp(nll / n)), ppl_tokens=n, ppl_ms_per_token=round(1e3 * t_model / n, 3),
                   ppl_argmax=argmax, ppl_MB_per_token=round((proc_read_bytes() - io0) / n / 1e6, 3))
    return res


def probe_minimum(a) -> dict:
    """The runtime's own minimum DRAM budget for this FFN mode and context, from load_runtime itself: it plans (and
    refuses a budget below the minimum) in this fresh process, with its measured runtime line. Only a fresh process
    measures what a row's process will: after a refused load_runtime this one holds ~20 MiB more."""
    from storage.errors import UserError
    from flashinfer_lite.runtime import load_runtime
    ffn = a.worker.split("-")[1]                                   # probe-F / flash-F-B
    try:
        load_runtime(a.model, ffn, dram_budget=1, ctx=a.ctx_run, window=WINDOW)
    except UserError as e:
        m = MINIMUM_RE.search(str(e))
        if m:
            return {"minimum_bytes": minimum_in(str(e)), "message": str(e)}
        raise
    raise RuntimeError("load_runtime accepted a 1-byte DRAM budget")


# load_runtime's refusal names the minimum: "... is below the minimum 381.1 MiB for this model (...)"
MINIMUM_RE = re.compile(r"below the minimum ([0-9.]+) MiB")
MIN_MARGIN = 4 << 20     # a row's process measures its own runtime line: a little more or less RSS than the probe's


def minimum_in(message: str) -> int:
    """Bytes to ask for at the minimum a refusal names (rounded up past the message's 0.1 MiB, plus the margin)."""
    return int((float(MINIMUM_RE.search(message).group(1)) + 0.1) * 2**20) + MIN_MARGIN


def worker_main(a) -> int:
    from storage.errors import UserError
    job = json.loads(Path(a.job).read_text())
    res = {"mode": a.worker}
    try:
        if a.worker.startswith("probe-"):
            res.update(probe_minimum(a))
        elif a.worker == "accelerate-prepare":
            res.update(prepare_hf(Path(a.source), Path(a.hf_dir)))
        elif a.worker == "accelerate-disk":
            res.update(measure_accelerate(a, job))
        else:
            res.update(measure_runtime(a, job))
    except UserError as e:
        key = "below_minimum" if MINIMUM_RE.search(str(e)) else "error"
        res[key] = str(e)
    except Exception as e:  # the row records why it could not run; the other rows go on
        res["error"] = f"{type(e).__name__}: {e}".strip()[:2000]
        res["traceback"] = traceback.format_exc()[-3000:]
    from flashinfer_lite.budget import peak_rss_bytes   # VmHWM: ru_maxrss inherits the parent's peak across exec
    res["peak_rss_bytes"] = peak_rss_bytes()
    tmp = Path(a.out + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.rename(a.out)
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# Driver

def run_row(a, mode: str, cap: int | None, work: Path, extra: list[str]) -> dict:
    """One row as a subprocess under tools/memcap.py (page cache dropped first)."""
    out, capjson = work / f"{mode}.json", work / f"{mode}.memcap.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--out", str(out), "--job",
           str(work / "job.json"), *extra]
    if a.model:
        cmd += ["-m", str(a.model)]
    limit = cap if cap else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    full = [sys.executable, str(MEMCAP), "--limit", str(limit), "--drop-caches", "--json", str(capjson), "--", *cmd]
    t0 = time.perf_counter()
    p = subprocess.run(full, env=dict(os.environ, PYTHONPATH=str(REPO)))
    res = json.loads(out.read_text()) if out.exists() else {"mode": mode, "error": f"worker exited {p.returncode} "
                                                            "without a result"}
    if capjson.exists():
        res["memcap"] = json.loads(capjson.read_text())
        if res["memcap"].get("oom_kills") and "perplexity" not in res:
            res["error"] = f"OOM-killed under the {limit / 2**20:.0f} MiB cap ({res.get('error', '')})"
    elif p.returncode == 3:
        res["error"] = "memory cgroup unavailable (tools/memcap.py exit 3)"
    res["cap_bytes"] = cap
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    what = (f"ppl {res['perplexity']:.3f}, P50 {res['p50_ms']} ms" if "perplexity" in res else
            f"minimum {res['minimum_bytes'] / 2**20:.1f} MiB" if "minimum_bytes" in res else
            f"saved {res['hf_dir']}" if "hf_dir" in res else res.get("below_minimum") or res.get("error", "?"))
    print(f"  {mode}: {what} ({res['wall_s']} s)", file=sys.stderr)
    return res


def model_files(flashdir: Path) -> tuple[int, int, int]:
    """(ffn.bin + resident, ffn.bin, resident) bytes of a FLASHDIR."""
    from storage.format import read_layout
    L = read_layout(flashdir)
    ffn = os.path.getsize(L.ffn_path)
    res = os.path.getsize(Path(flashdir) / L.files["resident"])
    return ffn + res, ffn, res


def make_job(flashdir: Path, corpus: list[Path], n_tokens: int, ctx: int, n_gen: int, prompt: str) -> dict:
    """The tokens every row sees: evaluate.py's windows of the corpus, and the chat prompt as generate builds it."""
    from storage.errors import UserError
    from flashinfer_lite.generate import prompt_ids
    from predictors.acts import read_corpus
    from predictors.collect import token_segments
    from storage.format import FlashCheckpoint
    ck = FlashCheckpoint(flashdir)
    tok = ck.tokenizer()
    text = read_corpus(corpus)
    ctx = min(ctx, ck.config.max_pos)
    windows = [w for w in token_segments(tok, text.text, n_tokens, ctx, ck.config.bos_id) if len(w) > 1]
    if not windows:
        raise UserError(f"the corpus gives too few tokens: {', '.join(text.files)}")
    ids = prompt_ids(tok, prompt, None, use_template=True)
    return {"segments": windows, "prompt_ids": ids, "n_gen": n_gen, "ctx": ctx, "corpus": text.files,
            "replaced_bytes": text.replaced_bytes}


def prepare_quick(work: Path) -> tuple[Path, Path]:
    """stories260K converted to an f32 FLASHDIR with predictors trained on TinyStories (the pipeline of
    tests/test_predictors.py, smaller); f32 so that transformers on the HF source computes the same weights."""
    from predictors.collect import collect
    from predictors.train import train
    from storage.convert import convert
    cal = work / "cal.txt"
    cal.write_bytes((CORPUS / "tinystories_cased_197KB.txt").read_bytes()[:30_000])
    flash = convert(STORIES, work / "quick.flash", dtype="f32", progress=False)
    collect(STORIES, [cal], 800, work / "acts", ctx=64, rows=400, progress=False)
    train(work / "acts", flash, sparsity=0.5, rank=8, max_rank=8, steps=30, progress=False)
    return Path(flash), STORIES


def agree(xs: list[int], ref: list[int]) -> float | None:
    n = min(len(xs), len(ref))
    return round(float(np.mean(np.asarray(xs[:n]) == np.asarray(ref[:n]))), 4) if n else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="FLASHDIR with predictors (convert, collect, train-predictor)")
    ap.add_argument("--source", type=Path, help="the HF dir or GGUF the FLASHDIR came from (accelerate row; "
                                                "omitted: that row says it was skipped)")
    ap.add_argument("--corpus", type=Path, nargs="+", default=[CORPUS / "wikitext2_test.txt"])
    ap.add_argument("--tokens", type=int, default=4096, help="perplexity tokens (default 4096)")
    ap.add_argument("--ctx", type=int, default=256, help="perplexity window (default 256)")
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens generated per row (default 32)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--budgets", default="25,50,75", help="flash-predicted DRAM budgets, %% of the model files; "
                    "`min` = the runtime's minimum (added automatically when a budget is below it)")
    ap.add_argument("--cap", default="half", help="memory cap (RAM + page cache) for the capped rows; default half "
                    "the model files. Rows that need more run under budget + --slack (the cap column says so)")
    ap.add_argument("--slack", default=SLACK, help=f"process memory beyond the DRAM budget (default {SLACK})")
    ap.add_argument("--accel-max-memory", help="accelerate max_memory['cpu'] (default: its cap minus "
                    f"{ACCEL_BASE >> 20} MiB for torch and transformers)")
    ap.add_argument("--modes", default="dense-ram,dense-mmap,oracle,predicted,accelerate",
                    help="subset of dense-ram,dense-mmap,oracle,predicted,accelerate")
    ap.add_argument("--quick", action="store_true", help="stories260K pipeline in a temp dir, small numbers, "
                                                         "< 1 minute (smoke test)")
    ap.add_argument("--keep", type=Path, help="keep the work directory (worker outputs, HF copy) here")
    ap.add_argument("--md", type=Path, help="also write the markdown table here")
    for hidden in ("--worker", "--out", "--job", "--budget", "--hf-dir"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--ctx-run", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main(a)

    from storage.sizes import parse_size
    t_start, load_start = time.perf_counter(), os.getloadavg()
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="smollm2-modes-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    if a.quick:
        a.model, a.source = prepare_quick(work)
        a.tokens, a.ctx, a.gen, a.budgets = 128, 64, 6, "50"
    if not a.model:
        ap.error("-m FLASHDIR is required (or --quick)")
    modes = a.modes.split(",")
    job = make_job(a.model, a.corpus, a.tokens, a.ctx, a.gen, a.prompt)
    (work / "job.json").write_text(json.dumps(job))
    ctx_run = max(job["ctx"], len(job["prompt_ids"]) + a.gen)
    files, ffn_bytes, resident_bytes = model_files(a.model)
    base_cap = files // 2 if a.cap == "half" else parse_size(a.cap)
    slack = parse_size(a.slack)
    print(f"smollm2_modes: {a.model}: model files {files / 2**20:.1f} MiB (ffn.bin {ffn_bytes / 2**20:.1f}, resident "
          f"{resident_bytes / 2**20:.1f}); cap {base_cap / 2**20:.1f} MiB; "
          f"{sum(len(w) for w in job['segments'])} perplexity tokens; work dir {work}", file=sys.stderr)

    def flash_row(ffn: str, name: str, budget: int) -> dict:
        cap = max(base_cap, budget + slack)
        r = run_row(a, f"flash-{ffn}-{name}", cap, work, common + ["--budget", str(budget)])
        return dict(r, budget_bytes=budget, budget_pct=round(100 * budget / files, 1))

    def min_row(ffn: str) -> dict | None:
        """A row at the runtime's minimum for this mode, as a fresh process measures it (the probe); if the row's
        own process measures a larger runtime line (numba compiling, say), once more at the minimum it names."""
        r = run_row(a, f"probe-{ffn}", None, work, common)
        minimums[ffn] = {k: r[k] for k in ("minimum_bytes", "message", "error") if k in r}
        if "minimum_bytes" not in r:
            return None
        row = flash_row(ffn, "min", r["minimum_bytes"])
        if "below_minimum" in row:
            row = dict(flash_row(ffn, "min", minimum_in(row["below_minimum"])), first_attempt=row["below_minimum"])
        return row

    common = ["--ctx-run", str(ctx_run)]
    rows: dict[str, list[dict]] = {m: [] for m in ("dense-ram", "dense-mmap", "oracle", "predicted", "accelerate")}
    minimums: dict[str, dict] = {}
    if "dense-ram" in modes:
        rows["dense-ram"].append(run_row(a, "dense-ram", None, work, common))
    if "predicted" in modes:
        pcts = [p for p in a.budgets.split(",") if p != "min"]
        for p in pcts:
            rows["predicted"].append(flash_row("predicted", p, files * int(p) // 100))
        if "min" in a.budgets.split(",") or any("below_minimum" in r for r in rows["predicted"]):
            rows["predicted"] += filter(None, [min_row("predicted")])
    if "oracle" in modes:
        rows["oracle"] += filter(None, [min_row("oracle")])
    ran = [r["cap_bytes"] for r in rows["predicted"] if "perplexity" in r]
    cmp_cap = min(ran) if ran else base_cap   # dense-mmap and accelerate: the cap of the smallest flash row that ran
    if "dense-mmap" in modes:
        rows["dense-mmap"].append(run_row(a, "dense-mmap", cmp_cap, work, common))
    if "accelerate" in modes:
        rows["accelerate"].append(accelerate_row(a, work, cmp_cap))
    results = [r for rs in rows.values() for r in rs]

    ref = next((r for r in results if r["mode"] == "dense-ram" and "perplexity" in r), None)
    for r in results:
        if ref and "perplexity" in r:
            r["ppl_vs_dense"] = round(r["perplexity"] / ref["perplexity"] - 1, 5)
            r["top1_agree_with_dense"] = agree(r["ppl_argmax"], ref["ppl_argmax"])
            r["gen_agree_with_dense"] = agree(r["gen_tokens"], ref["gen_tokens"])
    for r in results:
        r.pop("ppl_argmax", None)
    doc = {"model": str(a.model), "source": str(a.source) if a.source else None, "corpus": job["corpus"],
           "ppl_tokens_requested": a.tokens, "ctx": job["ctx"], "gen_tokens": a.gen, "prompt": a.prompt,
           "model_bytes": files, "ffn_bytes": ffn_bytes, "resident_bytes": resident_bytes, "cap_bytes": base_cap,
           "slack_bytes": slack, "runtime_minimum": minimums, "compare_cap_bytes": cmp_cap,
           "machine": {"cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                       "load_avg_start": load_start, "load_avg_end": os.getloadavg()},
           "results": results, "seconds": round(time.perf_counter() - t_start, 1),
           "command": " ".join(["python", "bench/smollm2_modes.py", *(argv if argv is not None else sys.argv[1:])])}
    md = markdown(doc)
    print(json.dumps(doc, indent=1))
    print(md, file=sys.stderr)
    if a.md:
        tmp = a.md.with_name(a.md.name + ".tmp")
        tmp.write_text(md + "\n")
        tmp.rename(a.md)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def accelerate_row(a, work: Path, cap: int) -> dict:
    """transformers + accelerate disk offload under the comparison cap (raised to what torch alone needs)."""
    from storage.sizes import parse_size
    row = {"mode": "accelerate-disk"}
    if not a.source:
        return dict(row, cap_bytes=None, error="skipped: pass --source (the HF dir or GGUF of the model)")
    if importlib.util.find_spec("accelerate") is None:       # transformers needs it for device_map
        return dict(row, cap_bytes=None, error="skipped: accelerate is not installed (pip install accelerate)")
    hf = Path(a.source) if Path(a.source).is_dir() else work / "hf"
    if not hf.exists():
        prep = run_row(a, "accelerate-prepare", None, work, ["--source", str(a.source), "--hf-dir", str(hf)])
        if "error" in prep:
            return dict(row, cap_bytes=None, error=f"preparing the HF directory failed: {prep['error']}")
    cap = max(cap, ACCEL_BASE + (64 << 20))
    hf_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    if a.accel_max_memory:
        max_mem = parse_size(a.accel_max_memory)
    elif a.quick:
        max_mem = hf_bytes // 2                       # the tiny model fits any cap: offload half of it anyway
    else:
        max_mem = cap - ACCEL_BASE
    r = run_row(a, "accelerate-disk", cap, work, ["--hf-dir", str(hf), "--budget", str(max_mem)])
    return dict(r, budget_bytes=max_mem, hf_files_bytes=hf_bytes)


def _f(v, nd=1) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def markdown(doc: dict) -> str:
    m, mib = doc["machine"], 2**20
    minimum = ", ".join(f"{k} {v['minimum_bytes'] / mib:.1f} MiB" for k, v in doc["runtime_minimum"].items()
                        if "minimum_bytes" in v)
    lines = [f"model {doc['model']}: files {doc['model_bytes'] / mib:.1f} MiB (ffn.bin {doc['ffn_bytes'] / mib:.1f}, "
             f"resident {doc['resident_bytes'] / mib:.1f}); cap {doc['cap_bytes'] / mib:.1f} MiB (rows needing more "
             f"run under budget + {doc['slack_bytes'] / mib:.0f} MiB); runtime minimum budget {minimum or '-'}; "
             f"perplexity on {', '.join(Path(c).name for c in doc['corpus'])}, ctx {doc['ctx']}; "
             f"{doc['gen_tokens']} greedy tokens; {m['cpus']} CPUs, load avg "
             f"{m['load_avg_start'][0]:.1f} -> {m['load_avg_end'][0]:.1f}",
             "",
             "| mode | budget MiB (% files) | cap MiB | perplexity (tokens) | vs dense | top-1 = dense | ms/tok P50 | "
             "P99 | tok/s | MB read/tok | hit rate | active share | peak RSS MiB | memcap peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        cap = "uncapped" if r.get("cap_bytes") is None else f"{r['cap_bytes'] / mib:.0f}"
        budget = (f"{r['budget_bytes'] / mib:.1f} ({r['budget_pct']:.0f}%)" if "budget_pct" in r
                  else f"{r['budget_bytes'] / mib:.1f} (max_memory)" if r.get("budget_bytes") is not None else "all")
        if "perplexity" not in r:
            why = r.get("below_minimum") or r.get("error", "?")
            lines.append(f"| {r['mode']} | {budget} | {cap} | {why.splitlines()[0][:300]} |" + " |" * 10)
            continue
        mc = r.get("memcap", {})
        vs = r.get("ppl_vs_dense")
        lines.append(
            f"| {r['mode']} | {budget} | {cap} | {r['perplexity']:.3f} ({r['ppl_tokens']}) | "
            f"{'-' if vs is None else f'{100 * vs:+.2f}%'} | {_f(r.get('top1_agree_with_dense'), 3)} | "
            f"{_f(r['p50_ms'])} | {_f(r['p99_ms'])} | {_f(r['tokens_per_s'], 2)} | "
            f"{_f(r.get('decode_MB_per_token'), 2)} | {_f(r.get('decode_hit_rate'), 3)} | "
            f"{_f(r.get('active_share'), 3)} | {r['peak_rss_bytes'] / mib:.0f} | "
            f"{mc.get('peak_bytes', 0) / mib:.0f}{' OOM' if mc.get('oom_kills') else ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
