"""ResidentFFN: the FFN of a quantized FLASHDIR kept whole in DRAM (an FFNFn, model.py)."""
from __future__ import annotations

import numpy as np
from tqdm import tqdm

from storage.format import FlashCheckpoint

from storage.config import ModelConfig
from .dense import FeedForward
from ..kernels.blocks import QuantMatrix
from .quant import sparse_ffns


class ResidentFFN:
    """The FFN of a quantized FLASHDIR in DRAM: every layer's bundles read once and computed whole, with no predictor
    and no neuron cache to consult.

    A layer whose down vectors are columns (a GGUF's down blocks, kept exactly) has its gate, up and down matrices
    put back as the GGUF stores them (FlashCheckpoint.ffn_blocks) and computed by ffn.dense.FeedForward, the GGUF's own
    dense path, so the FLASHDIR computes its GGUF's numbers to the bit (the down products round the coefficients to
    8-bit blocks as llama.cpp does; the column kernels' float32 sums of c * w do not). Any other layer stays in its
    blocks without the bundles' padding (ffn.quant.DenseLayer): QuantSparseFFN.dense, one Numba call per layer and
    token at decode, widened blocks + BLAS for a prompt."""

    def __init__(self, cfg: ModelConfig, ckpt: FlashCheckpoint, down_bias=None, progress: bool = False):
        L = ckpt.layout
        self.cfg = cfg
        down_bias = list(down_bias) if down_bias is not None else [None] * cfg.n_layers
        rows = not all(L.down_column(i) for i in range(L.n_layers))
        self.kernels = sparse_ffns(L, max_active=max(L.n_neurons),     # per layer: its block formats
                                   down_scales=ckpt.down_scales_all()) if rows else None
        self.layers = [gguf_ffn(cfg, ckpt, i, down_bias[i]) if L.down_column(i) else
                       self.kernels[i].dense_layer(ckpt.bundles(i))    # one layer's bundles at a time in transit
                       for i in tqdm(range(L.n_layers), desc="ffn", unit="layer", disable=not progress, leave=False)]
        self.down_bias = down_bias

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        ffn = self.layers[layer]
        if isinstance(ffn, FeedForward):
            return ffn(x)
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty_like(x)
        self.kernels[layer].dense(ffn, x, y)
        if self.down_bias[layer] is not None:
            y += self.down_bias[layer]
        return y

    @property
    def nbytes(self) -> int:
        """DRAM of every layer's weights."""
        return sum(ffn_bytes(f) for f in self.layers)


def gguf_ffn(cfg: ModelConfig, ckpt: FlashCheckpoint, layer: int, down_bias: np.ndarray | None) -> FeedForward:
    """Layer `layer`'s FFN (down vectors: columns) over its matrices as the GGUF stored them (ckpt.ffn_blocks), its
    gate and up biases from the bundles."""
    p = f"layers.{layer}.ffn."
    w = {f"{v}.weight": QuantMatrix.of(ckpt.ffn_blocks(f"{p}{v}.weight")) for v in ckpt.layout.vectors}
    w.update({f"{v}.bias": ckpt.tensor(f"{p}{v}.bias") for v in ("gate", "up") if f"{p}{v}.bias" in ckpt})
    if down_bias is not None:
        w["down.bias"] = down_bias
    ckpt.release()
    return FeedForward(cfg, w, layer, prefix="")


def ffn_bytes(layer) -> int:
    """DRAM of one layer of ResidentFFN: a DenseLayer's, or its FeedForward's matrices and biases."""
    if not isinstance(layer, FeedForward):
        return layer.nbytes
    parts = (layer.w_gate, layer.w_up, layer.w_down, layer.b_gate, layer.b_up)
    return sum(p.nbytes for p in parts if p is not None)
