"""`load(path) -> (Transformer, Tokenizer)`: the one entry point from a model path to something that generates."""
from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from .checkpoint import Checkpoint, open_checkpoint
from .model import Transformer
from .tokenizer import Tokenizer


def load_weights(ckpt: Checkpoint, progress: bool = False) -> dict:
    """Every tensor as float32, read one by one (the dense path; the flash runtime keeps FFN weights on flash)."""
    names = ckpt.names()
    it = tqdm(names, desc="loading", unit="tensor", disable=not progress, leave=False)
    return {n: ckpt.tensor(n) for n in it}


def load(path, progress: bool = False) -> tuple[Transformer, Tokenizer]:
    ckpt = open_checkpoint(Path(path))
    tokenizer = ckpt.tokenizer()
    return Transformer(ckpt.config, load_weights(ckpt, progress)), tokenizer
