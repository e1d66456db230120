"""GGUF's block formats as FLASHDIRs store them: names, sizes, quantize, dequantize.

A quantized matrix [rows, cols] is uint8 [rows, row_bytes]: each row is cols / weights-per-block blocks in llama.cpp's
byte layout, so a GGUF tensor's bytes (rows along ne1, blocks along ne0) are such a matrix as they are:

  q8_0   34 bytes / 32 weights: float16 d, 32 x int8 q                        value = d * q
  q4_0   18 bytes / 32: float16 d, 16 bytes of nibbles                          value = d * (q - 8)
  q4_1   20 bytes / 32: float16 d, float16 m, 16 bytes of nibbles               value = d * q + m
  q5_0   22 bytes / 32: float16 d, u32 of 5th bits, 16 bytes of nibbles          value = d * (q - 16)
  q5_1   24 bytes / 32: float16 d, float16 m, u32 of 5th bits, nibbles           value = d * q + m
  q4_k  144 bytes / 256, q5_k 176 / 256, q6_k 210 / 256: llama.cpp's K-quants (super-blocks of 8 sub-blocks of 32
        with 6-bit (q4_k, q5_k) or 8-bit (q6_k) sub-block scales; the layouts: flashinfer_lite/kernels/blocks.py)

Here in numpy through gguf.quants (llama.cpp's reference, ported bit-exactly): what convert writes and what
FlashCheckpoint reads back. The runtime computes on the blocks directly (flashinfer_lite/kernels/blocks.py, bit-exact with
these). gguf.quants has no quantizer for the K-quants: they are only ever copied from a GGUF, never made here.
gguf is imported on first use: only quantized models pay for it.
"""
from __future__ import annotations

import numpy as np

from storage.errors import UserError
from storage.untrusted import check_finite

BLOCK = 32                   # weights of the smallest block (and of a K-quant sub-block): every row length divides by it
KIND_SIZES = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
              "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}    # kind -> (weights, bytes) of a block
BLOCK_BYTES = {k: b for k, (_, b) in KIND_SIZES.items()}
QUANTIZABLE = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")                    # the kinds gguf.quants can write
# Byte offsets of a block's float16 fields (d, and m or dmin): the only ones that can hold NaN or inf. A K-quant's
# sub-block scales are 6- or 8-bit integers.
HALF_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
                "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def check_finite_blocks(q: np.ndarray, kind: str, what: str) -> np.ndarray:
    """q (uint8 [rows, row_bytes] of `kind` blocks), unless a block's float16 d (or m, dmin) is NaN or inf: one line
    naming `what`. A strided view of those fields, summed: 2 bytes of every 18 to 210 read, nothing copied."""
    nbytes = BLOCK_BYTES[check_kind(kind)]
    b = q.reshape(q.shape[0], -1, nbytes)
    for o in HALF_OFFSETS[kind]:
        check_finite(b[..., o:o + 2].view(np.float16)[..., 0], f"{what} ({kind} block scales)")
    return q


def check_kind(kind: str) -> str:
    if kind not in KIND_SIZES:
        raise UserError(f"unknown quantized format {kind!r} (expected one of {', '.join(KIND_SIZES)})")
    return kind


def block_weights(kind: str) -> int:
    return KIND_SIZES[check_kind(kind)][0]


def row_bytes(cols: int, kind: str) -> int:
    """Bytes of one quantized row of `cols` weights."""
    per_block, nbytes = KIND_SIZES[check_kind(kind)]
    if cols <= 0 or cols % per_block:
        raise UserError(f"{kind} rows need a length that is a positive multiple of {per_block}, got {cols}")
    return cols // per_block * nbytes


def row_cols(nbytes: int, kind: str) -> int:
    """Weights of a quantized row of `nbytes` bytes (whole blocks: the caller checked nbytes % BLOCK_BYTES[kind])."""
    per_block, size = KIND_SIZES[check_kind(kind)]
    return nbytes // size * per_block


def fits(cols: int, kind: str) -> bool:
    """Whether a row of `cols` weights is whole blocks of `kind`."""
    return cols > 0 and cols % block_weights(kind) == 0


def _ggml(kind: str):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType[check_kind(kind).upper()]


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, row_bytes], llama.cpp's rounding."""
    from gguf import quants
    if w.ndim != 2:
        raise UserError(f"quantize expects a matrix [rows, cols], got shape {list(w.shape)}")
    if kind not in QUANTIZABLE:
        raise UserError(f"cannot quantize into {kind} (kept only as a GGUF stores it); quantizable: "
                        f"{', '.join(QUANTIZABLE)}")
    rb = row_bytes(w.shape[1], kind)
    if not np.isfinite(w).all():
        raise UserError(f"cannot quantize to {kind}: the weights hold non-finite values")
    with np.errstate(over="ignore"):  # reported below as one clear error
        q = np.ascontiguousarray(quants.quantize(np.ascontiguousarray(w, dtype=np.float32), _ggml(kind)))
    # the float16 scale (and the minimum of q4_1 and q5_1) overflow for weights beyond ~1e6: refuse rather than store inf
    blocks = q.reshape(-1, BLOCK_BYTES[kind])
    scales = blocks[:, :4 if kind in ("q4_1", "q5_1") else 2].copy().view(np.float16)
    if not np.isfinite(scales).all():
        raise UserError(f"weights do not fit in {kind} (a block's float16 scale overflows)")
    return q.reshape(w.shape[0], rb)


def dequantize(q: np.ndarray, kind: str) -> np.ndarray:
    """uint8 [rows, row_bytes] -> float32 [rows, cols]."""
    from gguf import quants
    if q.dtype != np.uint8 or q.ndim != 2 or q.shape[1] % BLOCK_BYTES[check_kind(kind)]:
        raise UserError(f"a {kind} matrix must be uint8 [rows, whole blocks], got {q.dtype}{list(q.shape)}")
    with np.errstate(invalid="ignore", over="ignore"):  # blocks from a file may hold inf or NaN scales: kept as is
        out = np.asarray(quants.dequantize(np.ascontiguousarray(q), _ggml(kind)), dtype=np.float32)
    return out.reshape(q.shape[0], row_cols(q.shape[1], kind))
