"""`load_predictors(flashdir) -> PredictorSet | None`: what the runtime asks about each layer's neurons. Numpy only.

The files (FLASHDIR/predictors/: manifest, weights, frequencies, per-layer cards) are storage/predictor_files.py's.
A neuron is predicted active when x W_in^T W_out^T + bias > 0: the sigmoid is monotone, so it is never computed, and
the tuned decision threshold (a logit cut per neuron) is already subtracted from the bias.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from storage.errors import UserError
from storage.format import read_layout
from storage.predictor_files import PREDICTOR_DIR, read_predictor_arrays, read_predictor_manifest


class PredictorSet:
    """Per layer: the activation threshold, the neuron frequencies and (optionally) a low-rank predictor."""

    def __init__(self, path: Path, manifest: dict, weights: dict | None, freqs: dict):
        self.path, self.manifest = path, manifest
        self.n_layers, self.dim, self.ffn_dim = manifest["n_layers"], manifest["dim"], manifest["ffn_dim"]
        self.has_predictors = weights is not None
        self._thresholds = [float(t) for t in manifest["act_threshold"]]
        self._freq = []
        for i in range(self.n_layers):
            f = freqs.get(f"layers.{i}.freq")
            if f is None or f.shape != (self.ffn_dim,):
                raise UserError(f"{path}: neuron frequencies of layer {i} are missing or misshapen")
            self._freq.append(f.astype(np.float32))
        self.predicted = np.zeros(self.n_layers, np.int64)   # [L] neurons predicted (= read from flash), summed
        self.rows = np.zeros(self.n_layers, np.int64)        # [L] token rows predicted for
        self._w = []
        if weights is not None:
            dense = set(manifest.get("dense_layers", []))
            for i in range(self.n_layers):
                if i in dense:
                    self._w.append(None)
                    continue
                try:
                    w_in, w_out, b = (weights[f"layers.{i}.{k}"] for k in ("w_in", "w_out", "bias"))
                except KeyError:
                    raise UserError(f"{path}: predictor of layer {i} is missing") from None
                r = w_in.shape[0]
                if w_in.shape != (r, self.dim) or w_out.shape != (self.ffn_dim, r) or b.shape != (self.ffn_dim,):
                    raise UserError(f"{path}: predictor of layer {i} has the wrong shape for this model")
                # float32 and pre-transposed once here: per token the work is two small GEMVs
                self._w.append((np.ascontiguousarray(w_in.astype(np.float32).T),     # [d, r]
                                np.ascontiguousarray(w_out.astype(np.float32).T),    # [r, n]
                                b.astype(np.float32)))

    def predict(self, layer: int, x: np.ndarray, count: bool = True) -> np.ndarray:
        """x float32 [T, d] -> bool [T, n]: neurons (original ids) predicted to clear the activation threshold.
        count=False: a guess (lookahead) that the predicted-share statistics leave out."""
        if not self.has_predictors:
            raise UserError(f"{self.path} holds thresholds only: run `flashinfer-lite train-predictor` without "
                            f"--thresholds-only")
        if self._w[layer] is None:                      # a dense layer: every neuron
            mask = np.ones((x.shape[0], self.ffn_dim), bool)
        else:
            a, b, c = self._w[layer]
            mask = (x @ a) @ b + c > 0
        if count:
            self.predicted[layer] += int(mask.sum())
            self.rows[layer] += x.shape[0]
        return mask

    def predicted_share(self) -> np.ndarray:
        """[L] share of neurons predicted active so far: what a flash runtime has to read (before thresholding)."""
        return self.predicted / np.maximum(self.rows * self.ffn_dim, 1)

    def act_threshold(self, layer: int) -> float:
        return self._thresholds[layer]

    def neuron_freq(self, layer: int) -> np.ndarray:
        return self._freq[layer]

    def rank(self, layer: int) -> int:
        return self._w[layer][0].shape[1] if self.has_predictors and self._w[layer] is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes the predictors take in memory (float32 at inference)."""
        return int(sum(sum(v.nbytes for v in w) for w in self._w if w is not None))


def read_manifest(flashdir) -> dict | None:
    """FLASHDIR's validated predictor manifest (no weights read); None when it has no predictors directory."""
    m = read_predictor_manifest(flashdir)
    if m is None:
        return None
    cfg = read_layout(flashdir, check_size=False).config
    if (cfg.get("n_layers"), cfg.get("dim"), cfg.get("ffn_dim")) != (m["n_layers"], m.get("dim"), m.get("ffn_dim")):
        raise UserError(f"{Path(flashdir) / PREDICTOR_DIR} was trained for another model (layers/dim/ffn_dim differ): "
                        f"re-run train-predictor")
    return m


def describe_calibration(record: dict) -> str:
    """Where first-use predictors were trained from, as the manifest's `calibration` record says."""
    if record.get("source") == "corpus":
        return f"{record['path']} ({', '.join(record['files'])}; {record['tokens']} tokens)"
    return f"the built-in calibration text ({record.get('tokens')} tokens)"


def has_trained_predictors(flashdir) -> bool:
    """Whether FLASHDIR holds trained predictors (not thresholds only), from the manifest alone."""
    m = read_manifest(flashdir)
    return bool(m is not None and m.get("has_predictors"))


def load_predictors(flashdir) -> PredictorSet | None:
    """The predictors (or thresholds and frequencies only) stored in FLASHDIR; None when it has none."""
    m = read_manifest(flashdir)
    if m is None:
        return None
    weights, freqs = read_predictor_arrays(flashdir, m)
    return PredictorSet(Path(flashdir) / PREDICTOR_DIR, m, weights, freqs)
