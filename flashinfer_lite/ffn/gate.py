"""The exact gate's thresholds, calibrated on text (measure_thresholds: what `calibrate_gate` writes to gate.json),
in memory that does not grow with the text. The exact gate itself: ffn.flash.ExactGate.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np
from tqdm import tqdm

from storage.checksums import drop_from_page_cache

from .flash import FlashFFN

CALIBRATION_TOKENS = 1024
CALIBRATION_CTX = 256
# A magnitude's bin: the top 14 bits of its float32 pattern (sign 0, the exponent, 5 mantissa bits). The patterns of
# non-negative floats sort as the floats do, so bins are ordered intervals, each at most 1/32 of its values wide (the
# second pass keeps a bin's magnitudes: narrower bins keep fewer, but their counts take 4 bytes each per layer).
BIN_SHIFT = 17
BINS = 1 << 14


# The calibration's rate, layer weights x tokens per second, for the line announcing a first use: the 0.5B and 1.5B
# Qwen Q4_K_M took 12e9 and 15e9 per CPU second (2 vCPUs; process start and model load included). A quiet machine
# runs two threads, a busy one gives less than one: the bar's ETA is the measured figure.
CALIBRATION_WEIGHT_TOKENS_PER_S = 15e9


def calibration_seconds(cfg, tokens: int = CALIBRATION_TOKENS) -> float:
    """Roughly how long measure_thresholds runs the model over `tokens` once (the head computes one row a window)."""
    attention = cfg.dim * cfg.head_dim * 2 * (cfg.n_heads + cfg.n_kv_heads)
    ffn = (3 if cfg.glu else 2) * cfg.dim * cfg.ffn_dim
    return cfg.n_layers * (attention + ffn) * tokens / CALIBRATION_WEIGHT_TOKENS_PER_S


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


def measure_thresholds(model, ffn, windows, sparsities, progress: bool = False, spill_dir=None) -> dict:
    """{s: (thresholds [L], freq [L][n])}: per layer the s-quantile of every |coefficient| the windows (token id
    lists) give with no threshold, and per neuron the share of tokens above it. The magnitudes of 1,024 tokens would
    be 4 bytes x tokens x neurons x layers (189 MiB on the default model, 1.4 GiB on a 7B) beside the model, so they
    are seen twice (LayerMagnitudes): a histogram, then only the bins that hold the order statistics. The second time
    they are read back from a scratch file in spill_dir, written the first time (Spill: the model runs once, and the
    file's bytes are a fraction of a pass's compute), or, without room there, computed again by a second pass.
    ffn: the exact gate's FlashFFN (its ExactGate holds the thresholds) or an ExpertFFN of split experts."""
    cfg = ffn.cfg
    gate = ffn.selector if isinstance(ffn, FlashFFN) else ffn     # per layer thresholds, and observe
    gate.thresholds = [-1.0] * cfg.n_layers         # every coefficient counts
    layers = [LayerMagnitudes(cfg.ffn_dim, sparsities) for _ in range(cfg.n_layers)]
    kv = model.new_cache(max(map(len, windows)))
    tokens = sum(map(len, windows))
    spill = Spill.open(spill_dir, 4 * tokens * cfg.ffn_dim * cfg.n_layers)
    bar = tqdm(total=len(windows) * (2 if spill is None else 1), desc="calibrate gate", unit="window",
               disable=not progress, file=sys.stderr)

    def run() -> None:
        for w in windows:
            kv.reset()
            model.forward(w, kv)
            bar.update()

    def count(layer, coef):
        mags = np.abs(coef)
        layers[layer].count(mags)
        if spill is not None:
            spill.write(layer, mags)
    try:
        gate.observe = count
        run()
        if spill is not None:
            for layer, mags in spill.read():
                layers[layer].keep(mags)
        else:                           # the same tokens again: the coefficients are the same bits both times
            gate.observe = lambda layer, coef: layers[layer].keep(np.abs(coef))
            run()
    finally:
        gate.observe = None
        bar.close()
        if spill is not None:
            spill.close()
    out = {}
    for s in sparsities:
        th, freq = zip(*(m.result(s) for m in layers))
        out[s] = (list(th), list(freq))
    return out


class Spill:
    """The first pass's magnitudes in an unnamed scratch file (nothing is left behind, even by a SIGKILL), read back
    in the order written for the second. Their pages are written out and dropped from the page cache every
    FLUSH_BYTES and after each read: the file's bytes never count in the process's memory, nor (beyond FLUSH_BYTES) in
    a memory cgroup around it."""

    ROOM = 256 << 20            # free space left to others beyond the file
    FLUSH_BYTES = 16 << 20

    def __init__(self, f):
        self.f, self.records, self.flushed = f, [], 0

    @classmethod
    def open(cls, where, nbytes: int) -> "Spill | None":
        """A scratch file in directory `where` for `nbytes`, or None (no directory, no room, not writable)."""
        if where is None:
            return None
        try:
            if shutil.disk_usage(where).free < nbytes + cls.ROOM:
                return None
            return cls(tempfile.TemporaryFile(dir=where))
        except OSError:
            return None

    def write(self, layer: int, mags: np.ndarray) -> None:
        self.records.append((layer, mags.shape))
        self.f.write(np.ascontiguousarray(mags, np.float32).data)
        if self.f.tell() - self.flushed >= self.FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        self.f.flush()
        getattr(os, "fdatasync", os.fsync)(self.f.fileno())     # macOS has fsync only
        end = self.f.tell()
        drop_from_page_cache(self.f.fileno(), self.flushed, end - self.flushed)
        self.flushed = end

    def read(self):
        """(layer, magnitudes [T, n]) as written."""
        self.flush()
        fd, pos = self.f.fileno(), 0
        for layer, shape in self.records:
            mags = np.empty(shape, np.float32)
            if os.preadv(fd, [mags], pos) != mags.nbytes:
                raise OSError(f"calibration's scratch file came back short at byte {pos}")
            drop_from_page_cache(fd, pos, mags.nbytes)
            pos += mags.nbytes
            yield layer, mags

    def close(self) -> None:
        self.f.close()
