"""ResidentFFN: the FFN of a quantized FLASHDIR kept whole in DRAM (an FFNFn, model.py)."""
from __future__ import annotations

import numpy as np
from tqdm import tqdm

from storage.format import FlashCheckpoint

from storage.config import ModelConfig
from .quant import sparse_ffns


class ResidentFFN:
    """The FFN of a quantized FLASHDIR in DRAM: every layer's bundles read once, kept in their blocks (without the
    bundles' padding: ffn.quant.DenseLayer) and computed whole, with no predictor and no neuron cache to consult
    (QuantSparseFFN.dense: one Numba call per layer and token at decode, widened blocks + BLAS for a prompt)."""

    def __init__(self, cfg: ModelConfig, ckpt: FlashCheckpoint, down_bias=None, progress: bool = False):
        L = ckpt.layout
        self.cfg = cfg
        self.kernels = sparse_ffns(L, max_active=max(L.n_neurons),     # per layer: its block formats
                                   down_scales=[ckpt.down_scales(i) for i in range(L.n_layers)])
        self.layers = [self.kernels[i].dense_layer(ckpt.bundles(i))    # one layer's bundles at a time in transit
                       for i in tqdm(range(L.n_layers), desc="ffn", unit="layer", disable=not progress, leave=False)]
        self.down_bias = list(down_bias) if down_bias is not None else [None] * cfg.n_layers

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty_like(x)
        self.kernels[layer].dense(self.layers[layer], x, y)
        if self.down_bias[layer] is not None:
            y += self.down_bias[layer]
        return y
