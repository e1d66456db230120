#!/usr/bin/env python3
"""Real-model bench: perplexity and decode speed of every FFN mode of one FLASHDIR (SmolLM2-135M), and a
transformers + accelerate disk-offload baseline, on the same tokens, each in its own process under a memory cap.

    PYTHONPATH=. python bench/smollm2_modes.py -m FLASHDIR [--source GGUF_OR_HF_DIR] [--tokens 4096] [--md FILE]
    PYTHONPATH=. python bench/smollm2_modes.py --quick     # stories260K + predictors built in a temp dir (smoke test)

Rows (bench/README.md, "SmolLM2: perplexity and speed per mode"): dense-ram, dense-mmap (harness.BundleFFN over the
memmapped bundles), flash-oracle-min, flash-predicted-P (P% of the model files; `min`: the runtime's minimum, probed
in a fresh process) and accelerate-disk. Each row generates --gen greedy tokens from a chat prompt (decode steps
timed), then measures perplexity over --tokens tokens of the corpus in windows of --ctx, one token at a time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

import harness as h

from flashinfer_lite.process import read_bytes  # noqa: E402

PROMPT = "What is the capital of France?"
WINDOW = 5                                   # neuron cache sliding window, tokens (the runtime's default)
SLACK = "256M"                               # page cache of buffered reads + peak RSS over the DRAM budget
ACCEL_BASE = 512 << 20                       # torch + transformers + activations before any weight (~390-500 MiB seen)


# ----------------------------------------------------------------------------------------------------------------------
# Worker side: one row in this process

def load_mode(a):
    """(model, tokenizer, runtime or None, DRAM budget or None) for this worker's row."""
    if a.worker == "dense-ram":
        return (*h.load_model(a.model, "dense"), None)
    if a.worker == "dense-mmap":   # the runtime has no mmap dense mode: the bundles memmapped, every row computed
        def mmap_ffn(ck, weights):
            assert ck.layout.bundled, "smollm2_modes: dense-mmap maps ffn.bin; convert with --ffn-layout bundles"
            L, B = ck.layout, np.memmap(ck.layout.ffn_path, np.uint8, mode="r")
            return h.BundleFFN(L, lambda i: h.region(B, L, i),
                               [weights.get(f"layers.{i}.ffn.down.bias") for i in range(L.n_layers)])
        return (*h.load_model(a.model, mmap_ffn), None)
    ffn = a.worker.split("-")[1]                                   # flash-oracle-B / flash-predicted-B
    budget = int(a.budget)
    return (*h.load_model(a.model, ffn, dram_budget=budget, ctx=a.ctx_run, window=WINDOW), budget)


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
            c = h.Counters(runtime)                                 # after the prompt: decode steps only
        out.append(tok)
    tim = session.timings.as_dict()
    res.update(gen_tokens=out, prompt_ms=tim["prompt_ms"], decode_steps=tim["eval_tokens"], p50_ms=tim["p50_ms"],
               p99_ms=tim["p99_ms"], tokens_per_s=tim["tokens_per_second"], ms_per_token=tim["ms_per_token"])
    res.update({f"decode_{k}": v for k, v in c.since(tim["eval_tokens"]).items()})

    # 2. perplexity, one token at a time through the decode path (evaluate.py's loop, without its dense twin)
    kv = session.kv
    c = h.Counters(runtime)
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
        io0 = read_bytes()
        while len(out) < job["n_gen"]:
            t1 = time.perf_counter()
            o = model(torch.tensor([[out[-1]]]), past_key_values=o.past_key_values, use_cache=True)
            step_ms.append(1e3 * (time.perf_counter() - t1))
            out.append(int(o.logits[0, -1].argmax()))
        io = read_bytes() - io0
        tim = Timings(token_ms=step_ms).as_dict()
        res.update(gen_tokens=out, prompt_ms=round(prompt_ms, 3), decode_steps=len(step_ms), p50_ms=tim["p50_ms"],
                   p99_ms=tim["p99_ms"], tokens_per_s=tim["tokens_per_second"], ms_per_token=tim["ms_per_token"],
                   decode_MB_per_token=round(io / max(len(step_ms), 1) / 1e6, 3))
        # perplexity: one forward per window (the causal mask makes it the same sum as token by token)
        nll, argmax, t_model = 0.0, [], 0.0
        io0 = read_bytes()
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
                   ppl_argmax=argmax, ppl_MB_per_token=round((read_bytes() - io0) / n / 1e6, 3))
    return res


def measure(a) -> dict:
    job = json.loads(Path(a.job).read_text())
    if a.worker.startswith("probe-"):
        return h.probe_minimum(a.model, a.worker.split("-")[1], a.ctx_run, WINDOW)
    if a.worker == "accelerate-prepare":
        return prepare_hf(Path(a.source), Path(a.hf_dir))
    if a.worker == "accelerate-disk":
        return measure_accelerate(a, job)
    return measure_runtime(a, job)


def run_row(a, mode: str, cap: int | None, work: Path, extra: list[str]) -> dict:
    """One row as a subprocess under tools/memcap.py (page cache dropped first)."""
    return h.run_row(__file__, mode, mode, cap, work, ["--job", work / "job.json", *extra,
                                                       *(["-m", a.model] if a.model else [])])


def model_files(flashdir: Path) -> tuple[int, int, int]:
    """(FFN files + resident, FFN files, resident) bytes of a FLASHDIR."""
    from storage.format import read_layout
    L = read_layout(flashdir)
    ffn = sum(os.path.getsize(F.ffn_path) for F in L.ffn_files)
    res = os.path.getsize(Path(flashdir) / L.files["resident"])
    return ffn + res, ffn, res


def make_job(flashdir: Path, corpus: list[Path], n_tokens: int, ctx: int, n_gen: int, prompt: str) -> dict:
    """The tokens every row sees: evaluate.py's windows of the corpus, and the chat prompt as generate builds it."""
    from storage.errors import UserError
    from flashinfer_lite.generate import prompt_ids
    from predictors.acts import read_corpus
    from storage.tokenizer import token_segments
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
    cal = work / "cal.txt"
    cal.write_bytes((h.CORPUS / "tinystories_cased_197KB.txt").read_bytes()[:30_000])
    flash, _ = h.trained_flashdir(h.STORIES, work, "f32", [cal], 800, dict(ctx=64, rows=400), sparsity=0.5, rank=8,
                                  max_rank=8, steps=30)
    return flash, h.STORIES


def agree(xs: list[int], ref: list[int]) -> float | None:
    n = min(len(xs), len(ref))
    return round(float(np.mean(np.asarray(xs[:n]) == np.asarray(ref[:n]))), 4) if n else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="FLASHDIR with predictors (convert, collect, train-predictor)")
    ap.add_argument("--source", type=Path, help="the HF dir or GGUF the FLASHDIR came from (accelerate row; "
                                                "omitted: that row says it was skipped)")
    ap.add_argument("--corpus", type=Path, nargs="+", default=[h.CORPUS / "wikitext2_test.txt"])
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
    h.add_arguments(ap, "--job", "--budget", "--hf-dir")
    ap.add_argument("--ctx-run", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return h.worker(a.out, a.worker, lambda: measure(a))

    from storage.sizes import parse_size
    t_start, mach = time.perf_counter(), h.machine()
    work = h.work_dir(a, "smollm2-modes-")
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
        own process measures a larger process base (numba compiling, say), once more at the minimum it names."""
        r = run_row(a, f"probe-{ffn}", None, work, common)
        minimums[ffn] = {k: r[k] for k in ("minimum_bytes", "message", "error") if k in r}
        if "minimum_bytes" not in r:
            return None
        row = flash_row(ffn, "min", r["minimum_bytes"])
        if "below_minimum" in row:
            row = dict(flash_row(ffn, "min", h.retry_bytes(row)), first_attempt=row["below_minimum"])
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
           "machine": mach, "results": results, "seconds": round(time.perf_counter() - t_start, 1),
           "command": h.command("smollm2_modes.py", argv)}
    return h.emit(doc, markdown, a.md, None if a.keep else work)


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


def markdown(doc: dict) -> str:
    m, mib, f = doc["machine"], 2**20, h.fmt
    minimum = ", ".join(f"{k} {v['minimum_bytes'] / mib:.1f} MiB" for k, v in doc["runtime_minimum"].items()
                        if "minimum_bytes" in v)
    lines = [f"model {doc['model']}: files {doc['model_bytes'] / mib:.1f} MiB (ffn.bin {doc['ffn_bytes'] / mib:.1f}, "
             f"resident {doc['resident_bytes'] / mib:.1f}); cap {doc['cap_bytes'] / mib:.1f} MiB (rows needing more "
             f"run under budget + {doc['slack_bytes'] / mib:.0f} MiB); runtime minimum budget {minimum or '-'}; "
             f"perplexity on {', '.join(Path(c).name for c in doc['corpus'])}, ctx {doc['ctx']}; "
             f"{doc['gen_tokens']} greedy tokens; {m['cpus']} CPUs, load avg "
             f"{m['load_avg_start'][0]:.1f} -> {m['load_avg_end'][0]:.1f}", ""]
    rows = []
    for r in doc["results"]:
        cap = "uncapped" if r.get("cap_bytes") is None else f"{r['cap_bytes'] / mib:.0f}"
        budget = (f"{r['budget_bytes'] / mib:.1f} ({r['budget_pct']:.0f}%)" if "budget_pct" in r
                  else f"{r['budget_bytes'] / mib:.1f} (max_memory)" if r.get("budget_bytes") is not None else "all")
        if "perplexity" not in r:
            rows.append([r["mode"], budget, cap, h.failed(r)] + [""] * 10)
            continue
        mc, vs = r.get("memcap", {}), r.get("ppl_vs_dense")
        rows.append([r["mode"], budget, cap, f"{r['perplexity']:.3f} ({r['ppl_tokens']})",
                     "-" if vs is None else f"{100 * vs:+.2f}%", f(r.get("top1_agree_with_dense"), 3),
                     f(r["p50_ms"]), f(r["p99_ms"]), f(r["tokens_per_s"], 2), f(r.get("decode_MB_per_token"), 2),
                     f(r.get("decode_hit_rate"), 3), f(r.get("active_share"), 3), f"{r['peak_rss_bytes'] / mib:.0f}",
                     f"{mc.get('peak_bytes', 0) / mib:.0f}{' OOM' if mc.get('oom_kills') else ''}"])
    lines += h.table(["mode", "budget MiB (% files)", "cap MiB", "perplexity (tokens)", "vs dense", "top-1 = dense",
                      "ms/tok P50", "P99", "tok/s", "MB read/tok", "hit rate", "active share", "peak RSS MiB",
                      "memcap peak MiB"], rows)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
