"""Calibrate the exact gate's thresholds (ffn.gate) of a FLASHDIR with the split layout: `python -m
predictors.calibrate_gate FLASHDIR [--tokens N]`; the runtime runs it in a child process on a FLASHDIR's first
exact-gate run.

The model runs with no threshold (every coefficient counts) over N tokens of the built-in calibration text
(calibration.txt, written for the project; never an evaluation text), each layer's coefficients |act(gate.x) * up.x|
seen as the runtime's own kernel computes them. Per layer and sparsity s in SPARSITIES, the threshold is the
s-quantile of those magnitudes, so a share s of them falls under it (the kernel drops |c| <= t), and a neuron's
frequency is the share of tokens it cleared it. Written to FLASHDIR/gate.json (storage.gate_file).

Memory does not grow with the tokens (LayerMagnitudes): the magnitudes of 1,024 tokens would be 4 bytes x tokens x
neurons x layers (189 MiB on the default model, 1.4 GiB on a 7B), held beside the model in a child that runs inside
the user's --dram-budget. So the tokens go through the model twice: the first pass counts each magnitude's bin, the
second keeps only the magnitudes in the bins that hold the wanted order statistics. The thresholds and frequencies
are np.quantile's ('linear') and the comparison's on all magnitudes, exactly.
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
# A magnitude's bin: the top 16 bits of its float32 pattern (sign 0, the exponent, 7 mantissa bits). The patterns of
# non-negative floats sort as the floats do, so bins are ordered intervals, each at most 1/128 of its values wide.
BIN_SHIFT = 15
BINS = 1 << 16


class LayerMagnitudes:
    """One layer's |coefficients| [tokens, n] over two passes of the same tokens: count() every row in the first,
    keep() in the second; then threshold(s) is np.quantile(all, s) and freq(s) per neuron the share of tokens above it.
    Held: a histogram of BINS counts, per sparsity n counts and the magnitudes of (usually) two bins."""

    def __init__(self, n: int, sparsities):
        self.n, self.sparsities, self.tokens = n, tuple(sparsities), 0
        self.hist = np.zeros(BINS, np.int64)
        self.order = {}     # s -> (k, gamma, bin of order statistic k, bin of k + 1, how many magnitudes lie below)

    def count(self, mags: np.ndarray) -> None:
        assert mags.dtype == np.float32     # the bins are float32 bit patterns
        self.hist += np.bincount((mags.view(np.uint32) >> BIN_SHIFT).ravel(), minlength=BINS)
        self.tokens += mags.shape[0]

    def _locate(self) -> None:
        """After the first pass: where np.quantile's two order statistics of each sparsity lie."""
        cum = np.cumsum(self.hist)
        last = int(cum[-1]) - 1
        for s in self.sparsities:
            h = last * s                       # np.quantile's 'linear' virtual index
            k = int(np.floor(h))
            lo, hi = (int(np.searchsorted(cum, i, side="right")) for i in (k, min(k + 1, last)))
            self.order[s] = (k, h - k, lo, hi, int(cum[lo - 1]) if lo else 0)
        self.above = {s: np.zeros(self.n, np.int64) for s in self.sparsities}
        self.kept = {s: [] for s in self.sparsities}

    def keep(self, mags: np.ndarray) -> None:
        if not self.order:
            self._locate()
        b = mags.view(np.uint32) >> BIN_SHIFT
        for s, (_, _, lo, hi, _) in self.order.items():
            self.above[s] += np.count_nonzero(b > hi, axis=0)
            r, c = np.nonzero((b >= lo) & (b <= hi))
            self.kept[s].append((mags[r, c], c))

    def threshold(self, s: float) -> float:
        k, gamma, _, _, below = self.order[s]
        vals = np.sort(np.concatenate([v for v, _ in self.kept[s]]))
        pair = vals[k - below: k - below + 2]   # order statistics k and k + 1 (one at the very top)
        return float(np.quantile(pair, gamma)) if len(pair) == 2 else float(pair[0])

    def freq(self, s: float, t: float) -> np.ndarray:
        vals = np.concatenate([v for v, _ in self.kept[s]])
        cols = np.concatenate([c for _, c in self.kept[s]])
        over = self.above[s] + np.bincount(cols[vals > t], minlength=self.n)
        return over / self.tokens


def calibrate(flashdir: str, n_tokens: int = CALIBRATION_TOKENS, progress: bool = True) -> None:
    files = open_model_files(flashdir, "gate", verify=False, runtime_bytes=0)
    cfg = files.ckpt.config
    n = cfg.ffn_dim
    files.gate = GateCalibration(0.0, (-1.0,) * cfg.n_layers, (np.zeros(n, np.float32),) * cfg.n_layers, {})
    model, tokenizer, runtime = build(files, decide(files, "gate"))
    text = (resources.files("predictors") / "calibration.txt").read_text()
    ctx = min(CTX, cfg.max_pos)
    segments = list(token_segments(tokenizer, text, n_tokens, ctx, cfg.bos_id))
    layers = [LayerMagnitudes(n, SPARSITIES) for _ in range(cfg.n_layers)]
    kv = model.new_cache(ctx)
    bar = tqdm(total=2 * len(segments), desc="calibrate gate", unit="window", disable=not progress, file=sys.stderr)
    for first in (True, False):     # the same tokens twice: the coefficients are the same bits both times
        runtime.observe = ((lambda layer, coef: layers[layer].count(np.abs(coef))) if first else
                           (lambda layer, coef: layers[layer].keep(np.abs(coef))))
        for w in segments:
            kv.reset()
            model.forward(w, kv)
            bar.update()
    bar.close()
    by_sparsity = {}
    for s in SPARSITIES:
        th = [m.threshold(s) for m in layers]
        by_sparsity[s] = (th, [m.freq(s, t) for m, t in zip(layers, th)])
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
