"""Calibrate the exact gate's thresholds (ffn.gate) of a FLASHDIR with the split layout: `python -m
predictors.calibrate_gate FLASHDIR [--tokens N]`; the runtime runs it in a child process on a FLASHDIR's first
exact-gate run.

The model runs with no threshold (every coefficient counts) over N tokens of the built-in calibration text
(calibration.txt, written for the project; never an evaluation text), each layer's coefficients |act(gate.x) * up.x|
seen as the runtime's own kernel computes them. Per layer and sparsity s in SPARSITIES, the threshold is the
s-quantile of those magnitudes, so a share s of them falls under it (the kernel drops |c| <= t), and a neuron's
frequency is the share of tokens it cleared it. Written to FLASHDIR/gate.json (storage.gate_file).
"""
from __future__ import annotations

import argparse
import sys
from importlib import resources

import numpy as np
from tqdm import tqdm

from flashinfer_lite.runtime import build, decide, open_model_files
from storage.errors import child_exit_code
from storage.gate_file import SPARSITIES, GateCalibration, write_gate_file

from .collect import token_segments

CALIBRATION_TOKENS = 1024
CTX = 256


def calibrate(flashdir: str, n_tokens: int = CALIBRATION_TOKENS, progress: bool = True) -> None:
    files = open_model_files(flashdir, "gate", verify=False, runtime_bytes=0)
    cfg = files.ckpt.config
    n = cfg.ffn_dim
    files.gate = GateCalibration(0.0, (-1.0,) * cfg.n_layers, (np.zeros(n, np.float32),) * cfg.n_layers, {})
    model, tokenizer, runtime = build(files, decide(files, "gate"))
    text = (resources.files("predictors") / "calibration.txt").read_text()
    ctx = min(CTX, cfg.max_pos)
    segments = list(token_segments(tokenizer, text, n_tokens, ctx, cfg.bos_id))
    seen = [[] for _ in range(cfg.n_layers)]
    runtime.observe = lambda layer, coef: seen[layer].append(np.abs(coef))
    kv = model.new_cache(ctx)
    for w in tqdm(segments, desc="calibrate gate", unit="window", disable=not progress, file=sys.stderr):
        kv.reset()
        model.forward(w, kv)
    by_sparsity = {}
    mags = [np.concatenate(s) for s in seen]                  # per layer [tokens, n]
    for s in SPARSITIES:
        th = [float(np.quantile(m, s)) for m in mags]
        by_sparsity[s] = (th, [(m > t).mean(axis=0) for m, t in zip(mags, th)])
    write_gate_file(flashdir, n, {"text": "the built-in calibration text (calibration.txt)",
                                  "tokens": int(sum(len(w) for w in segments))}, by_sparsity)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m predictors.calibrate_gate", description=__doc__.split("\n\n")[0])
    p.add_argument("flashdir")
    p.add_argument("--tokens", type=int, default=CALIBRATION_TOKENS)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.tokens < CTX:
        print(f"error: --tokens must be at least {CTX}", file=sys.stderr)
        return 2
    return child_exit_code(lambda: calibrate(a.flashdir, a.tokens, progress=not a.quiet and sys.stderr.isatty()))


if __name__ == "__main__":
    sys.exit(main())
