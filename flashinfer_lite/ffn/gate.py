"""The exact gate's thresholds, calibrated on text (measure_thresholds: what `calibrate_gate` writes to gate.json),
in memory that does not grow with the text. The exact gate itself: ffn.flash.ExactGate.
"""
from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm

from .flash import FlashFFN

CALIBRATION_TOKENS = 1024
CALIBRATION_CTX = 256
# A magnitude's bin: the top 14 bits of its float32 pattern (sign 0, the exponent, 5 mantissa bits). The patterns of
# non-negative floats sort as the floats do, so bins are ordered intervals, each at most 1/32 of its values wide (the
# second pass keeps a bin's magnitudes: narrower bins keep fewer, but their counts take 4 bytes each per layer).
BIN_SHIFT = 17
BINS = 1 << 14


class LayerMagnitudes:
    """One layer's |coefficients| [tokens, n] over two passes of the same tokens: count() every row in the first,
    keep() in the second; then result(s): np.quantile(all, s), and per neuron the share of tokens above it.
    Held: a histogram of BINS counts, per sparsity n counts and the magnitudes of (usually) two bins."""

    def __init__(self, n: int, sparsities):
        self.n, self.sparsities, self.tokens = n, tuple(sparsities), 0
        self.hist = np.zeros(BINS, np.int32)     # at most tokens x n per bin: 11 M for 1,024 tokens of a 7B
        self.order = {}     # s -> (k, gamma, bin of order statistic k, bin of k + 1, how many magnitudes lie below)

    @staticmethod
    def nbytes(n: int, sparsities) -> int:
        """What one layer's LayerMagnitudes holds (the bins' kept magnitudes aside: a few thousand)."""
        return BINS * 4 + len(sparsities) * n * 8

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

    def result(self, s: float) -> tuple[float, np.ndarray]:
        """(the threshold: np.quantile(all, s), per neuron the share of tokens whose magnitude is above it)."""
        k, gamma, _, _, below = self.order[s]
        vals = np.concatenate([v for v, _ in self.kept[s]])
        cols = np.concatenate([c for _, c in self.kept[s]])
        pair = np.sort(vals)[k - below: k - below + 2]   # order statistics k and k + 1 (one at the very top)
        t = float(np.quantile(pair, gamma)) if len(pair) == 2 else float(pair[0])
        return t, (self.above[s] + np.bincount(cols[vals > t], minlength=self.n)) / self.tokens


def measure_thresholds(model, ffn, windows, sparsities, progress: bool = False) -> dict:
    """{s: (thresholds [L], freq [L][n])}: per layer the s-quantile of every |coefficient| the windows (token id
    lists) give with no threshold, and per neuron the share of tokens above it. The magnitudes of 1,024 tokens would
    be 4 bytes x tokens x neurons x layers (189 MiB on the default model, 1.4 GiB on a 7B) beside the model, so the
    windows go through twice (LayerMagnitudes): a histogram, then only the bins that hold the order statistics.
    ffn: the exact gate's FlashFFN (its ExactGate holds the thresholds) or an ExpertFFN of split experts."""
    cfg = ffn.cfg
    gate = ffn.selector if isinstance(ffn, FlashFFN) else ffn     # per layer thresholds, and observe
    gate.thresholds = [-1.0] * cfg.n_layers         # every coefficient counts
    layers = [LayerMagnitudes(cfg.ffn_dim, sparsities) for _ in range(cfg.n_layers)]
    kv = model.new_cache(max(map(len, windows)))
    bar = tqdm(total=2 * len(windows), desc="calibrate gate", unit="window", disable=not progress, file=sys.stderr)
    for first in (True, False):     # the same tokens twice: the coefficients are the same bits both times
        gate.observe = ((lambda layer, coef: layers[layer].count(np.abs(coef))) if first else
                       (lambda layer, coef: layers[layer].keep(np.abs(coef))))
        for w in windows:
            kv.reset()
            model.forward(w, kv)
            bar.update()
    bar.close()
    gate.observe = None
    out = {}
    for s in sparsities:
        th, freq = zip(*(m.result(s) for m in layers))
        out[s] = (list(th), list(freq))
    return out
