"""Shared by the storage tests: an in-memory checkpoint with random weights, and flash directories written from it."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from storage.config import ModelConfig
from storage.checkpoint import Checkpoint
from storage.convert import layout_for, write_flashdir

STORIES = Path(__file__).resolve().parent / "data" / "stories260K"


class FakeTokenizer:
    def save(self, path: Path) -> None:
        (Path(path) / "tokenizer.json").write_text("{}")


class RandomCheckpoint(Checkpoint):
    """The Checkpoint API over random float32 weights: config, names(), tensor(), shape(), tokenizer(), path."""

    def __init__(self, d=40, n=300, n_layers=2, glu=True, bias=True, seed=0):
        rng = np.random.default_rng(seed)
        self.path = Path("<random>")
        self.config = ModelConfig(arch="llama" if glu else "opt", vocab_size=16, dim=d, n_layers=n_layers, n_heads=1,
                                  n_kv_heads=1, head_dim=d, ffn_dim=n, glu=glu, mlp_bias=bias)
        t = {"embed.weight": rng.standard_normal((16, d), np.float32)}
        for i in range(n_layers):
            # Spread of magnitudes per neuron, including an all-zero neuron, so int8 scales vary and 0 is handled.
            mag = np.exp(rng.uniform(-4, 2, size=(n, 1))).astype(np.float32)
            for v in (("gate", "up") if glu else ("up",)):
                t[f"layers.{i}.ffn.{v}.weight"] = rng.standard_normal((n, d), np.float32) * mag
                if bias:
                    t[f"layers.{i}.ffn.{v}.bias"] = rng.standard_normal(n, np.float32)
            t[f"layers.{i}.ffn.down.weight"] = rng.standard_normal((d, n), np.float32) * mag.T
            for v in (("gate", "up") if glu else ("up",)):
                t[f"layers.{i}.ffn.{v}.weight"][7] = 0
            t[f"layers.{i}.ffn.down.weight"][:, 7] = 0
            t[f"layers.{i}.ffn_norm.weight"] = rng.standard_normal(d, np.float32)
            if bias:
                t[f"layers.{i}.ffn.down.bias"] = rng.standard_normal(d, np.float32)
        self.tensors = t

    def names(self):
        return list(self.tensors)

    def tensor(self, name):
        return self.tensors[name].copy()

    def shape(self, name):
        return self.tensors[name].shape

    def tokenizer(self):
        return FakeTokenizer()


def write_random_flashdir(path: Path, dtype: str, orders=None, ffn_layout: str = "bundles", **kw) -> RandomCheckpoint:
    """A random checkpoint written as a FLASHDIR; its FFN in ffn.bin's bundles unless ffn_layout says otherwise (the
    split parts: convert's default for SiLU- and GELU-gated models)."""
    ckpt = RandomCheckpoint(**kw)
    path.mkdir(parents=True)
    write_flashdir(ckpt, layout_for(ckpt, dtype, orders, ffn_layout=ffn_layout), path, progress=False)
    return ckpt


def bundle_vectors(ckpt: RandomCheckpoint, layer: int, neuron: int) -> np.ndarray:
    """The source vectors of one neuron, [n_vec, d], in bundle order (the oracle for what a bundle must hold)."""
    t = ckpt.tensors
    vecs = [t[f"layers.{layer}.ffn.{v}.weight"][neuron] for v in (("gate", "up") if ckpt.config.glu else ("up",))]
    return np.stack(vecs + [t[f"layers.{layer}.ffn.down.weight"][:, neuron]])


def assert_stored_equal(got: np.ndarray, src: np.ndarray, dtype: str) -> None:
    """Vectors read back equal the source as the dtype stores them: exact for f32, f16-rounded, int8 within its bound."""
    if dtype == "f32":
        assert np.array_equal(got, src)
    elif dtype == "f16":
        assert np.array_equal(got, src.astype(np.float16).astype(np.float32))
    else:
        assert (np.abs(got - src) <= int8_bound(src)).all()


def int8_bound(v: np.ndarray) -> np.ndarray:
    """Max abs error of symmetric int8 with scale max|v|/127, per vector (last axis): half a step, plus f32 slack."""
    return np.abs(v).max(axis=-1, keepdims=True) / 254 * (1 + 1e-5) + 1e-30
