#!/usr/bin/env python3
"""CPU time of a decoded token's FFN, --ffn modes alternating on the same inputs: a ratio a busy machine keeps.

    PYTHONPATH=. python bench/ffn_cpu.py -m MODEL [--ffn dense,gate] [--rounds 5] [-t 1]

Every mode loads in one process. The first mode decodes a token after the prompt and its FFN inputs (every layer's)
are kept; then each round runs every layer's FFN on them, mode after mode, timed in CPU seconds (the thread's with
-t 1, else the process's): wall time on a shared machine measures the other processes, CPU time much less, and a ratio
of alternating rounds less still. A flash FFN's kernels (--ffn gate: ffn.flash.SplitRows) are timed apart:
"coefficients" (every neuron's gate|up rows) and "down" (the sum over the fired neurons' down rows); the rest of
its time is the Python around them (selection, the neuron cache's lookups). Prints one JSON document on stdout (per
mode the median ms per token, each round's, and the ratio to the first mode) and a table on stderr.
"""
import argparse
import json
import os
import sys
import time
from collections import defaultdict

import harness as h  # first: flashinfer_lite sets the thread pools' variables before numpy loads

from flashinfer_lite.default_model import ensure_default_model
from flashinfer_lite.generate import prompt_ids

import numpy as np  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--ffn", default="dense,gate", help="modes, comma-separated; ratios are to the first")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-p", "--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("-t", "--threads", type=int, default=1)
    args = ap.parse_args()
    modes = args.ffn.split(",")
    path = args.model or ensure_default_model()
    models = {m: h.load_model(path, m, threads=args.threads)[:2] for m in modes}
    first, tokenizer = models[modes[0]]
    ids = prompt_ids(tokenizer, args.prompt, None, True)
    xs: dict = {}
    ffn = first.ffn

    def keep(layer, x):
        xs[layer] = x.copy()
        return ffn(layer, x)
    first.ffn = keep
    kv = first.new_cache(len(ids) + 2)
    first.forward(ids, kv)
    first.forward([ids[-1]], kv)             # a decoded token: its inputs are the last ones kept
    first.ffn = ffn
    clock = time.thread_time if args.threads == 1 else time.process_time
    acc: dict = defaultdict(float)

    def timed(fn, key):
        def wrapper(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += clock() - t0
        return wrapper
    for m in modes:
        for k in {id(k): k for k in getattr(models[m][0].ffn, "kernels", None) or []}.values():
            if hasattr(k, "coefficients") and hasattr(k, "accumulate"):
                k.coefficients = timed(k.coefficients, (m, "coefficients"))
                k.accumulate = timed(k.accumulate, (m, "down"))
                for part in ("begin", "finish"):       # the exact gate's down sum in integers: its ends
                    if hasattr(k, part):
                        setattr(k, part, timed(getattr(k, part), (m, "down")))
    rounds: dict = defaultdict(list)
    for r in range(args.rounds + 1):        # round 0 compiles and warms the caches: not counted
        for m in modes:
            f, before = models[m][0].ffn, dict(acc)
            t0 = clock()
            for layer in sorted(xs):
                f(layer, xs[layer])
            if r:
                rounds[m, "ffn"].append(1e3 * (clock() - t0))
                for part in ("coefficients", "down"):
                    if (m, part) in acc:
                        rounds[m, part].append(1e3 * (acc[m, part] - before.get((m, part), 0.0)))
    med = {key: float(np.median(v)) for key, v in rounds.items()}
    doc = {"model": args.model or "default", "threads": args.threads, "rounds": args.rounds,
           "loadavg": [round(v, 2) for v in os.getloadavg()],      # the machine is shared: how busy it was
           "cpu_ms_per_token": {m: {part: round(med[m2, part], 3) for m2, part in med if m2 == m} for m in modes},
           "rounds_ms": {m: [round(v, 2) for v in rounds[m, "ffn"]] for m in modes},
           "ratio_to_first": {m: round(med[m, "ffn"] / med[modes[0], "ffn"], 3) for m in modes}}
    print(f"{'mode':<10}{'ffn ms':>10}{'coef ms':>10}{'down ms':>10}{'ratio':>8}", file=sys.stderr)
    for m in modes:
        c = doc["cpu_ms_per_token"][m]
        print(f"{m:<10}{c['ffn']:>10.2f}{c.get('coefficients', float('nan')):>10.2f}"
              f"{c.get('down', float('nan')):>10.2f}{doc['ratio_to_first'][m]:>8.3f}", file=sys.stderr)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
