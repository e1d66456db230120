"""From a model path to its tensors: `open_any(path)`, `load_weights(ckpt)`, and `load_reference(path)`: the float32
model every other run is checked against."""
from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from storage.format import FlashCheckpoint, is_flashdir

from storage.checkpoint import Checkpoint, GGUFCheckpoint, open_checkpoint
from storage.half import half_matrix
from .model import Transformer
from .kernels.blocks import QuantMatrix
from storage.tokenizer import Tokenizer


def open_any(path) -> Checkpoint:
    """A checkpoint over an HF directory, a .gguf file, or a FLASHDIR made by `flashinfer-lite convert`."""
    if is_flashdir(path):
        return FlashCheckpoint(path)
    return open_checkpoint(Path(path))


def load_tensor(ckpt: Checkpoint, name: str, convert=None, keep_blocks: bool = False):
    """A tensor as the runtime keeps it: a FLASHDIR's matrix stored in a block format stays in it (a QuantMatrix),
    anything else float32 through `convert` (e.g. half.half_matrix). A GGUF's blocks are dequantized (the float32
    reference of load_reference()) unless keep_blocks (--ffn dense: a quarter of the DRAM, and the quantized kernels);
    with keep_blocks, a FLASHDIR's FFN matrices that hold its GGUF's blocks exactly are those blocks too
    (FlashCheckpoint.ffn_blocks), so a dense pass computes the GGUF's numbers, and a GGUF's matrices are views of the
    mapped file (its float16 ones kept float16): the file's pages are the model's DRAM, as in llama.cpp."""
    flashdir = isinstance(ckpt, FlashCheckpoint)
    stored = ckpt.quantized(name) if keep_blocks or flashdir else None
    if stored is None and keep_blocks and flashdir:
        stored = ckpt.ffn_blocks(name)
    if stored is not None:
        return QuantMatrix.of(stored)
    mapped = ckpt.stored_matrix(name) if keep_blocks and isinstance(ckpt, GGUFCheckpoint) else None
    if mapped is not None:
        return mapped
    half = ckpt.stored_half(name) if flashdir and convert is half_matrix else None
    if half is not None:      # what half_matrix would keep, read as is: not widened to float32 and rounded back
        return half
    return convert(ckpt.tensor(name)) if convert else ckpt.tensor(name)


def load_weights(ckpt: Checkpoint, progress: bool = False, skip=lambda name: False, convert=None,
                 keep_blocks: bool = False) -> dict:
    """Tensors read one by one as load_tensor keeps them; `skip(name)` leaves some on flash (the sparse runtime's
    FFN); `convert` is applied to each as it is read, so no second copy of the model exists."""
    names = [n for n in ckpt.names() if not skip(n)]
    it = tqdm(names, desc="loading", unit="tensor", disable=not progress, leave=False)
    return {n: load_tensor(ckpt, n, convert, keep_blocks) for n in it}


def load_reference(path, progress: bool = False) -> tuple[Transformer, Tokenizer]:
    """The reference model: every weight in DRAM as float32 (a GGUF's dequantized), the dense FFN."""
    ckpt = open_any(path)
    tokenizer = ckpt.tokenizer()
    return Transformer(ckpt.config, load_weights(ckpt, progress)), tokenizer
