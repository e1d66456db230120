#!/usr/bin/env python3
"""Issue 28's levers: the exact gate (--ffn gate) at several sparsities against today's predicted mode and dense, at
one --dram-budget, each row its own process under a memory cap (harness.run_row).

    PYTHONPATH=. python bench/exact_gate.py -m FLASHDIR [--predicted FLASHDIR_WITH_PREDICTORS] [--budget 300M]
        [--sparsity 0.3,0.4,0.5,0.6] [--tokens 1024] [--gen 32] [--md FILE]

FLASHDIR: a GLU model converted with the split layout and calibrated (gate.json; the first --ffn gate run makes it).
Per row: perplexity on each held-out text (wikitext2_test, and TinyStories, which the gate thresholds were not
calibrated on), windows of --ctx tokens run as one prompt each (the function does not depend on the budget or the
prefill strategy: tests/test_exact_gate.py); then --gen greedy decode steps after a short prompt: ms/token (P50), flash
MB read per decoded token, the share of FFN neurons computed (whose down row is accumulated). `gate@none` is the
same function with every weight in DRAM.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import harness as h

from predictors.acts import read_corpus
from storage.tokenizer import token_segments
from predictors.evaluate import log_probs_at
from storage.sizes import parse_size

TEXTS = {"wikitext2_test": h.CORPUS / "wikitext2_test.txt", "tinystories": h.CORPUS / "tinystories_cased_197KB.txt"}
PROMPT = "Give me three tips for staying healthy."
CHUNK = 32              # prompt rows per forward: its logits (rows x vocab float32) are the bench's, not the budget's


def measure(a) -> dict:
    mode, sparsity, budget = a.worker.split(":")
    model, tok, rt = h.load_model(a.model if mode != "predicted" else a.predicted, mode, ctx=a.ctx,
                                  dram_budget=None if budget == "none" else parse_size(budget),
                                  sparsity=float(sparsity or 0.4))
    cfg = model.cfg
    out = {"ffn": mode, "sparsity": float(sparsity) if sparsity else None, "budget": budget}
    if rt is not None:
        out["plan"] = {"minimum_mib": rt.plan.minimum_bytes / 2**20, "gate_layers": rt.plan.gate_layers,
                       "window_rows": rt.plan.window_rows, "hot_rows": rt.plan.hot_rows}
    kv = model.new_cache(a.ctx)
    for name, path in TEXTS.items():
        segs = list(token_segments(tok, read_corpus([path]).text, a.tokens, a.ctx, cfg.bos_id))
        nll, n = 0.0, 0
        for w in segs:
            kv.reset()
            for c in range(0, len(w) - 1, CHUNK):     # a prompt in chunks: [CHUNK, vocab] logits at a time
                part = w[c:min(c + CHUNK, len(w) - 1)]
                nll -= float(log_probs_at(model.forward(part, kv, all_logits=True), w[c + 1:c + 1 + len(part)]).sum())
            n += len(w) - 1
        out[f"ppl_{name}"] = float(np.exp(nll / n))
    kv.reset()
    ids = tok.encode(PROMPT)
    logits = model.forward(ids, kv)
    before = (rt.stats.read_bytes, int(rt.stats.active.sum()), int(rt.stats.rows.sum()), rt.stats.requested_bytes) \
        if rt else (0, 0, 0, 0)
    steps = []
    for _ in range(a.gen):
        t0 = time.perf_counter()
        logits = model.forward([int(np.argmax(logits))], kv)
        steps.append((time.perf_counter() - t0) * 1e3)
    out.update(p50_ms=float(np.median(steps)), mean_ms=float(np.mean(steps)))
    if rt is not None:
        rows = int(rt.stats.rows.sum()) - before[2]
        out.update(flash_mb_per_token=(rt.stats.read_bytes - before[0]) / 1e6 / a.gen,
                   requested_mb_per_token=(rt.stats.requested_bytes - before[3]) / 1e6 / a.gen,
                   hit_rate=rt.stats.hit_rate,
                   neurons_computed_share=(int(rt.stats.active.sum()) - before[1]) / max(rows * cfg.ffn_dim, 1))
    return out


def markdown(doc: dict) -> str:
    rows = []
    for r in doc["rows"]:
        if "p50_ms" not in r:
            rows.append([r["mode"], "-", "-", "-", "-", "-", "-", h.failed(r)])
            continue
        rows.append([r["mode"], h.fmt(r["ppl_wikitext2_test"], 2), h.fmt(r["ppl_tinystories"], 2),
                     h.fmt(r.get("neurons_computed_share", 1.0), 2), h.fmt(r.get("flash_mb_per_token", 0.0), 1),
                     h.fmt(r.get("requested_mb_per_token", 0.0), 1),
                     h.fmt(r["p50_ms"], 0), f"peak {r['peak_rss_bytes'] / 2**20:.0f} MiB, load {r['loadavg'][0]:.1f}"])
    return "\n".join([f"`{doc['command']}`", "",
                      *h.table(["row (ffn:sparsity:budget)", "ppl wikitext2_test", "ppl tinystories",
                                "neurons computed", "flash MB/token read", "of which requested", "ms/token (P50)",
                                "note"], rows)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="FLASHDIR with the split layout")
    ap.add_argument("--predicted", help="a FLASHDIR of the same model with trained predictors: today's mode's row")
    ap.add_argument("--budget", default="300M")
    ap.add_argument("--sparsity", default="0.3,0.4,0.5,0.6")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of each text for perplexity")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--gen", type=int, default=32)
    h.add_arguments(ap)
    a = ap.parse_args(argv)
    if a.worker:
        return h.worker(a.out, a.worker, lambda: measure(a))
    work = h.work_dir(a, "exact-gate-")
    rows = ["dense::none", *(f"gate:{s}:{a.budget}" for s in a.sparsity.split(",")), "gate:0.4:none"]
    if a.predicted:
        rows.append(f"predicted::{a.budget}")
    args = ["-m", a.model, "--tokens", a.tokens, "--ctx", a.ctx, "--gen", a.gen,
            *(["--predicted", a.predicted] if a.predicted else [])]
    results = [h.run_row(__file__, r, r.replace(":", "_"), None, work, args) for r in rows]
    return h.emit({"command": h.command("exact_gate.py", argv), "machine": h.machine(), "rows": results},
                  markdown, a.md, None if a.keep else work)


if __name__ == "__main__":
    sys.exit(main())
