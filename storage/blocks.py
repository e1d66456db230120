"""GGUF's block formats as FLASHDIRs store them: q8_0, q4_0, q4_1 (names, sizes, quantize, dequantize).

A quantized matrix [rows, cols] is uint8 [rows, row_bytes]: each row is cols / 32 blocks in llama.cpp's byte layout,
so a GGUF tensor's bytes (rows along ne1, blocks along ne0) are such a matrix as they are:

  q8_0  34 bytes: float16 d, 32 x int8 q                          value = d * q
  q4_0  18 bytes: float16 d, 16 bytes of nibbles                    value = d * (q - 8)
  q4_1  20 bytes: float16 d, float16 m, 16 bytes of nibbles         value = d * q + m
  (nibbles: byte k holds element k in its low 4 bits and element k + 16 in its high 4 bits)

Here in numpy through gguf.quants (llama.cpp's reference, ported bit-exactly): what convert writes and what
FlashCheckpoint reads back. The runtime computes on the blocks directly (flashinfer_lite/quant.py, bit-exact with
these). gguf is imported on first use: only quantized models pay for it.
"""
from __future__ import annotations

import numpy as np

from storage.errors import UserError

BLOCK = 32                                              # weights per block, along a row
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}      # the kinds, and the bytes of one block of each


def check_kind(kind: str) -> str:
    if kind not in BLOCK_BYTES:
        raise UserError(f"unknown quantized format {kind!r} (expected one of {', '.join(BLOCK_BYTES)})")
    return kind


def row_bytes(cols: int, kind: str) -> int:
    """Bytes of one quantized row of `cols` weights."""
    check_kind(kind)
    if cols <= 0 or cols % BLOCK:
        raise UserError(f"{kind} rows need a length that is a positive multiple of {BLOCK}, got {cols}")
    return cols // BLOCK * BLOCK_BYTES[kind]


def _ggml(kind: str):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType[check_kind(kind).upper()]


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, row_bytes], llama.cpp's rounding."""
    from gguf import quants
    if w.ndim != 2:
        raise UserError(f"quantize expects a matrix [rows, cols], got shape {list(w.shape)}")
    rb = row_bytes(w.shape[1], kind)
    if not np.isfinite(w).all():
        raise UserError(f"cannot quantize to {kind}: the weights hold non-finite values")
    with np.errstate(over="ignore"):  # reported below as one clear error
        q = np.ascontiguousarray(quants.quantize(np.ascontiguousarray(w, dtype=np.float32), _ggml(kind)))
    # the float16 scale (and q4_1's minimum) overflow for weights beyond ~1e6: refuse rather than store inf
    blocks = q.reshape(-1, BLOCK_BYTES[kind])
    scales = blocks[:, :4 if kind == "q4_1" else 2].copy().view(np.float16)
    if not np.isfinite(scales).all():
        raise UserError(f"weights do not fit in {kind} (a block's float16 scale overflows)")
    return q.reshape(w.shape[0], rb)


def dequantize(q: np.ndarray, kind: str) -> np.ndarray:
    """uint8 [rows, row_bytes] -> float32 [rows, cols]."""
    from gguf import quants
    if q.dtype != np.uint8 or q.ndim != 2 or q.shape[1] % BLOCK_BYTES[check_kind(kind)]:
        raise UserError(f"a {kind} matrix must be uint8 [rows, whole blocks], got {q.dtype}{list(q.shape)}")
    with np.errstate(invalid="ignore", over="ignore"):  # blocks from a file may hold inf or NaN scales: kept as is
        return np.asarray(quants.dequantize(np.ascontiguousarray(q), _ggml(kind)), dtype=np.float32)
