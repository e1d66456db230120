#!/usr/bin/env python3
"""Where a token's time goes: per-token milliseconds by part of the forward pass, for decode and for the prompt.

    PYTHONPATH=. python bench/part_times.py [-m MODEL] [--ffn dense|predicted|...] [-n 64] [-p PROMPT] [-t THREADS]

MODEL defaults to the default model (SmolLM2-135M-Instruct GGUF). The model's parts are wrapped with timers
(attention per layer on the instance, model.norm in the module, the FFN call, the lm_head matmul measured on its own), the sampler is
timed around its call, and "python" is the rest of forward(): embedding, residual adds, RoPE tables, the per-layer
loop. A flash FFN's kernels (--ffn gate: ffn.flash.SplitRows) are timed too, inside "ffn": "ffn_kernels" has their
coefficients (every neuron's gate|up rows) and down sums; the rest of "ffn" is reads and the neuron cache's lookups. Greedy decoding, the same Session.generate loop as the CLI. Prints one JSON document on stdout and a table on
stderr. Timer overhead (~1 us a call, ~100 calls a token) is inside the parts it wraps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import harness as h  # first: flashinfer_lite sets the thread pools' variables before numpy loads

from flashinfer_lite.default_model import ensure_default_model
from flashinfer_lite.generate import Sampler, Session, prompt_ids
from flashinfer_lite import model as model_math
from flashinfer_lite.kernels.blocks import linear

import numpy as np  # noqa: E402

PARTS = ("attention", "norms", "ffn", "lm_head", "python", "sampling")
NORM_FUNCTIONS = ("norm", "add_norm")  # flashinfer_lite.model functions timed as "norms"


def timed(fn, acc: dict, key: str):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0
    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--ffn", default="dense")
    ap.add_argument("-n", type=int, default=64, help="decode steps")
    ap.add_argument("-p", "--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, tokenizer, runtime = h.load_model(args.model or ensure_default_model(), args.ffn, threads=args.threads)
    load_ms = 1e3 * (time.perf_counter() - t0)
    ids = prompt_ids(tokenizer, args.prompt, None, True)

    acc: dict = defaultdict(float)
    for block in model.blocks:
        block.attn = timed(block.attn, acc, "attention")
    # the norms are module functions that Block and output_logits look up by name at each call
    for name in NORM_FUNCTIONS:
        setattr(model_math, name, timed(getattr(model_math, name), acc, "norms"))
    # a flash FFN's per-layer kernels (shared between layers of one geometry: each wrapped once)
    for k in {id(k): k for k in getattr(model.ffn, "kernels", None) or []}.values():
        if hasattr(k, "coefficients") and hasattr(k, "accumulate"):
            k.coefficients = timed(k.coefficients, acc, "coefficients")
            k.accumulate = timed(k.accumulate, acc, "down")
    model.ffn = timed(model.ffn, acc, "ffn")
    forward = model.forward
    model.forward = timed(forward, acc, "forward")
    greedy = Sampler(temp=0)
    sampler = timed(greedy, acc, "sampling")

    # one warm-up generation (the prompt and 3 decode steps) compiles the Numba kernels and fills caches; then the
    # measured one
    for _ in Session(model, tokenizer, len(ids) + args.n + 1, choose_threads=False).generate(ids, 4, greedy,
                                                                                         ignore_eos=True):
        pass
    acc.clear()
    session = Session(model, tokenizer, len(ids) + args.n + 1, choose_threads=False)   # every step on -t threads
    gen = session.generate(ids, args.n, sampler, ignore_eos=True)
    next(gen)                                           # the prompt's forward pass and the first sample
    prompt = {k: v for k, v in acc.items()}
    acc.clear()
    steps = sum(1 for _ in gen)
    decode = dict(acc)

    # the lm_head matmul on its own (it sits inside forward() with the embedding and the residual adds)
    x = np.random.default_rng(0).standard_normal((1, model.cfg.dim)).astype(np.float32)
    t0 = time.perf_counter()
    for _ in range(20):
        linear(x, model.lm_head)
    lm_head_s = (time.perf_counter() - t0) / 20

    def table(acc: dict, tokens: int, forwards: int, lm_head_rows: int) -> dict:
        lm = lm_head_s * forwards * lm_head_rows
        rest = acc.get("forward", 0) - acc.get("attention", 0) - acc.get("norms", 0) - acc.get("ffn", 0) - lm
        parts = {"attention": acc.get("attention", 0), "norms": acc.get("norms", 0), "ffn": acc.get("ffn", 0),
                 "lm_head": lm, "python": rest, "sampling": acc.get("sampling", 0)}
        out = {k: round(v / tokens * 1e3, 3) for k, v in parts.items()}
        out["total"] = round(sum(parts.values()) / tokens * 1e3, 3)
        return out

    def kernels(acc: dict, tokens: int) -> dict:
        return {k: round(acc[k] / tokens * 1e3, 3) for k in ("coefficients", "down") if k in acc}

    doc = {"model": args.model or "default (SmolLM2-135M-Instruct GGUF)", "ffn": args.ffn,
           "loadavg": [round(v, 2) for v in os.getloadavg()],   # the machine is shared: how busy it was
           "threads": args.threads, "prompt_tokens": len(ids), "decode_tokens": steps, "load_ms": round(load_ms, 1),
           "decode_ms_per_token": table(decode, steps, steps, 1),
           "prompt_ms_per_token": table(prompt, len(ids), 1, 1),
           "ffn_kernels_ms_per_token": {"decode": kernels(decode, steps), "prompt": kernels(prompt, len(ids))}}
    print(f"{'part':<12}{'decode ms/tok':>15}{'prompt ms/tok':>15}", file=sys.stderr)
    for k in (*PARTS, "total"):
        print(f"{k:<12}{doc['decode_ms_per_token'][k]:>15.3f}{doc['prompt_ms_per_token'][k]:>15.3f}", file=sys.stderr)
    for k, v in doc["ffn_kernels_ms_per_token"]["decode"].items():   # inside "ffn" above
        print(f"  ffn {k:<8}{v:>13.3f}{doc['ffn_kernels_ms_per_token']['prompt'][k]:>15.3f}", file=sys.stderr)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
