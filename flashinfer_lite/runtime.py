"""The runtime: a Transformer whose FFN computes only the active neurons, chosen by `--ffn`.

  dense      every neuron (the reference)
  oracle     neurons whose true activation clears the layer's threshold (0 for ReLU models): exact for ReLU
  predicted  neurons the low-rank predictor selects, then the same threshold on what was computed

`load_runtime()` is the one way generation, chat and eval build a model, so that they all run the same code path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .errors import UserError
from .loader import is_flashdir, load_weights, open_any
from .model import FeedForward, Transformer, linear
from .tokenizer import Tokenizer

FFN_MODES = ("dense", "oracle", "predicted")


@dataclass
class RuntimeStats:
    """Counters accumulated over every FFN call; per layer where it matters."""
    n_layers: int
    n_neurons: int
    rows: np.ndarray = field(init=False)       # [L] token rows seen by each layer's FFN
    active: np.ndarray = field(init=False)     # [L] active neurons summed over those rows
    predictor_s: float = 0.0

    def __post_init__(self):
        self.rows = np.zeros(self.n_layers, np.int64)
        self.active = np.zeros(self.n_layers, np.int64)

    def active_share(self) -> np.ndarray:
        return self.active / np.maximum(self.rows * self.n_neurons, 1)


class FlashRuntime:
    """Chooses each layer's active set and computes the FFN on it."""

    def __init__(self, cfg, weights: dict, mode: str, predictors=None):
        self.cfg, self.mode, self.predictors = cfg, mode, predictors
        self.stats = RuntimeStats(cfg.n_layers, cfg.ffn_dim)
        self.ffns = [FeedForward(cfg, weights, i) for i in range(cfg.n_layers)]
        self.act_threshold = [predictors.act_threshold(i) if predictors is not None else 0.0
                              for i in range(cfg.n_layers)]

    def active_mask(self, layer: int, x: np.ndarray, a: np.ndarray) -> np.ndarray:
        # x [T, d], a [T, n] true activations -> bool [T, n]
        mask = np.abs(a) > self.act_threshold[layer]
        if self.mode == "predicted":
            t0 = time.perf_counter()
            mask &= self.predictors.predict(layer, x)
            self.stats.predictor_s += time.perf_counter() - t0
        return mask

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        f = self.ffns[layer]
        a = f.activations(x)
        mask = self.active_mask(layer, x, a)
        self.stats.rows[layer] += x.shape[0]
        self.stats.active[layer] += int(mask.sum())
        return linear(np.where(mask, a, 0.0), f.w_down, f.b_down)


def load_predictor_set(path):
    from predictors.predictor import load_predictors
    return load_predictors(path)


def load_runtime(path, ffn: str = "dense", progress: bool = False):
    """(model, tokenizer, runtime) for a model path and an FFN mode; runtime is None for dense."""
    if ffn not in FFN_MODES:
        raise UserError(f"unknown --ffn mode '{ffn}' (choose from {', '.join(FFN_MODES)})")
    ckpt = open_any(path)
    tokenizer: Tokenizer = ckpt.tokenizer()
    weights = load_weights(ckpt, progress)
    if ffn == "dense":
        return Transformer(ckpt.config, weights), tokenizer, None
    if not is_flashdir(path):
        raise UserError(f"--ffn {ffn} needs a flash directory made by `flashinfer-lite convert` (got {path})")
    predictors = load_predictor_set(path)
    if ffn == "predicted" and predictors is None:
        raise UserError(f"{path} has no predictors: run `flashinfer-lite collect` and `flashinfer-lite train-predictor`")
    runtime = FlashRuntime(ckpt.config, weights, ffn, predictors)
    return Transformer(ckpt.config, weights, ffn=runtime), tokenizer, runtime
