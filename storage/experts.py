"""Experts on flash: where a mixture of experts' FFN sits in ffn.bin, one aligned, checksummed chunk per expert.

A FLASHDIR of a mixture of experts has no neuron bundles (its manifest's `layers` is empty); its `experts` section
describes ffn.bin instead. Expert e of layer l is one chunk of `chunk` bytes at offset + (l * n_experts + e) * chunk:

  gate [n, d], up [n, d], down [d, n] back to back, each from a 512-aligned offset in the chunk, in its dtype:
  f32 / f16 (little-endian, row-major) or a GGUF block format (uint8 [rows, row_bytes], storage/blocks.py: blocks
  along each row, as llama.cpp stores them, so a GGUF's expert rows are copied verbatim), zero padding to `chunk`
  (a multiple of 4096).

One expert is one read of `chunk` bytes straight into a cache slot, whose matrices are then views of the slot
(ExpertLayout.matrices). The router, the attention, the norms and a shared expert stay in resident.safetensors.

Split chunks (`split`; convert --expert-chunks split) hold the same expert as the dense split
layout holds a layer (storage.format.SPLIT_PARTS), so a routed expert reads only the down columns of its firing
neurons (ffn.experts, the exact gate inside an expert):

  heads    n rows of head_stride bytes: neuron j's gate row then its up row (blocks along d), padded to 4
  columns  from a 512-aligned offset, n rows of column_stride bytes: neuron j's down column (the down matrix's
           column j, quantized along d in the down dtype: a GGUF's down blocks run along n, so they are requantized),
           padded to 4
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from storage.errors import UserError

from . import blocks

MATRICES = ("gate", "up", "down")
FLOAT_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}
EXPERT_DTYPES = (*FLOAT_DTYPES, *blocks.BLOCK_BYTES)
MATRIX_ALIGN = 512
SPLIT_ROW_ALIGN = 4        # split chunks' rows: packed (the reader aligns its reads, as for packed bundles)
CHUNK_ALIGN = 4096


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def expert_tensor_name(layer: int, expert: int, matrix: str) -> str:
    return f"layers.{layer}.ffn.experts.{expert}.{matrix}.weight"


@dataclass
class ExpertLayout:
    """The geometry of the experts' chunks in ffn.bin (see the module's docstring) and their checksums."""
    d: int
    n: int                           # neurons per expert: the model's ffn_dim
    n_experts: int
    n_layers: int
    dtypes: tuple[str, str, str]     # of gate, up, down
    offset: int = 0                  # of the first chunk
    checksum: list[list[str]] = field(default_factory=list)   # [layer][expert]
    split: bool = False              # heads, then down columns (see the module's docstring)

    def __post_init__(self):
        for name in ("d", "n", "n_experts", "n_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"expert layout: {name} must be a positive integer (got {v!r})")
        self.dtypes = tuple(self.dtypes)
        if len(self.dtypes) != 3 or any(t not in EXPERT_DTYPES for t in self.dtypes):
            raise UserError(f"expert layout: dtypes {list(self.dtypes)} (each one of {', '.join(EXPERT_DTYPES)})")
        if not isinstance(self.split, bool):
            raise UserError(f"expert layout: split must be true or false (got {self.split!r})")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset % CHUNK_ALIGN:
            raise UserError(f"expert layout: offset {self.offset!r} is not a multiple of {CHUNK_ALIGN}")
        for m in MATRICES:
            self.row_bytes(m)          # a block format needs rows of whole blocks: one clear line here

    def shape(self, matrix: str) -> tuple[int, int]:
        return (self.d, self.n) if matrix == "down" else (self.n, self.d)

    def row_bytes(self, matrix: str) -> int:
        """Bytes of one stored row of a matrix (split: every matrix's rows run along d, down's are its columns)."""
        kind, cols = self.dtypes[MATRICES.index(matrix)], self.d if self.split else self.shape(matrix)[1]
        return cols * FLOAT_DTYPES[kind].itemsize if kind in FLOAT_DTYPES else blocks.row_bytes(cols, kind)

    @property
    def head_stride(self) -> int:
        """split: bytes of a neuron's gate|up row."""
        return _align(self.row_bytes("gate") + self.row_bytes("up"), SPLIT_ROW_ALIGN)

    @property
    def column_stride(self) -> int:
        """split: bytes of a neuron's down column row."""
        return _align(self.row_bytes("down"), SPLIT_ROW_ALIGN)

    @property
    def columns_at(self) -> int:
        """split: where the down columns start in a chunk."""
        return _align(self.n * self.head_stride, MATRIX_ALIGN)

    @property
    def matrix_offsets(self) -> list[int]:
        """Byte offset of gate, up and down in a chunk, then the end of down (split: of gate and up in a head row,
        of the columns in the chunk)."""
        if self.split:
            return [0, self.row_bytes("gate"), self.columns_at, self.columns_at + self.n * self.column_stride]
        at, out = 0, []
        for m in MATRICES:
            at = _align(at, MATRIX_ALIGN)
            out.append(at)
            at += self.shape(m)[0] * self.row_bytes(m)
        return out + [at]

    def span(self, matrix: str) -> slice:
        """Where a matrix's bytes sit in a chunk."""
        k = MATRICES.index(matrix)
        start = self.matrix_offsets[k]
        return slice(start, start + self.shape(matrix)[0] * self.row_bytes(matrix))

    @property
    def chunk(self) -> int:
        return _align(self.matrix_offsets[-1], CHUNK_ALIGN)

    @property
    def end(self) -> int:
        return self.offset + self.n_layers * self.n_experts * self.chunk

    def chunk_offset(self, layer: int, expert: int) -> int:
        return self.offset + (layer * self.n_experts + expert) * self.chunk

    def geometry(self) -> dict:
        return {"d": self.d, "n": self.n, "n_experts": self.n_experts, "n_layers": self.n_layers,
                "dtypes": list(self.dtypes), "offset": self.offset, "chunk": self.chunk,
                **({"split": True} if self.split else {})}     # whole chunks' digests as before split existed

    # -- packing and views ------------------------------------------------------------------------------------------
    def _raw(self, m: str, a: np.ndarray) -> np.ndarray:
        """Matrix m as stored: uint8 [rows, row_bytes] (split: down's columns as rows) from a float32 matrix of
        shape(m) or its blocks already in the matrix's block format (a GGUF's, copied as they are unless split
        turns them)."""
        kind, shape = self.dtypes[MATRICES.index(m)], self.shape(m)
        if a.dtype == np.uint8:
            if a.shape != (shape[0], blocks.row_bytes(shape[1], kind) if kind in blocks.BLOCK_BYTES else -1):
                raise UserError(f"expert {m} matrix holds {list(a.shape)} bytes, not the {kind} blocks of "
                                f"{list(shape)}")
            if not (self.split and m == "down"):
                return a
            a = blocks.dequantize(a, kind)         # blocks along n: requantized along d below
        if a.shape != shape:
            raise UserError(f"expert {m} matrix has shape {list(a.shape)}, expected {list(shape)}")
        a = np.ascontiguousarray(a.T if self.split and m == "down" else a, np.float32)
        if kind in blocks.BLOCK_BYTES:
            return blocks.quantize(a, kind)
        with np.errstate(over="ignore"):
            raw = a.astype(FLOAT_DTYPES[kind])
        if not np.isfinite(raw).all():
            raise UserError(f"expert weights do not fit in {kind} (non-finite values after conversion)")
        return raw.view(np.uint8).reshape(raw.shape[0], -1)

    def pack(self, mats: dict) -> np.ndarray:
        """One expert's chunk, uint8 [chunk], from {gate, up, down}: float32 matrices of shape(m), or uint8 [rows,
        row_bytes] already in the matrix's block format (a GGUF's, copied as they are)."""
        out = np.zeros(self.chunk, np.uint8)
        raw = {m: self._raw(m, mats[m]) for m in MATRICES}
        if self.split:
            g = self.row_bytes("gate")
            heads, cols = self.heads(out), self.columns(out)
            heads[:, :g], heads[:, g:g + self.row_bytes("up")] = raw["gate"], raw["up"]
            cols[:, :self.row_bytes("down")] = raw["down"]
            return out
        for m in MATRICES:
            out[self.span(m)] = raw[m].reshape(-1)
        return out

    def heads(self, buf: np.ndarray) -> np.ndarray:
        """split: a chunk's gate|up rows, uint8 [n, head_stride] (a view)."""
        return buf[:self.n * self.head_stride].reshape(self.n, self.head_stride)

    def columns(self, buf: np.ndarray) -> np.ndarray:
        """split: a chunk's down column rows, uint8 [n, column_stride] (a view)."""
        return buf[self.columns_at:self.columns_at + self.n * self.column_stride].reshape(self.n, self.column_stride)

    def matrices(self, buf: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """Views of one chunk's matrices (no copy): per matrix (dtype, array) with array float32 / float16 [rows,
        cols], or for a block format uint8 [rows, row_bytes]. Split chunks: gate and up as views of the head rows,
        down as float32 [d, n] (a copy: its columns dequantized and turned)."""
        out = []
        for k, m in enumerate(MATRICES):
            kind, rows, rb = self.dtypes[k], self.shape(m)[0], self.row_bytes(m)
            if not self.split:
                raw = buf[self.span(m)].reshape(rows, rb)
            elif m != "down":
                at = self.matrix_offsets[k]
                raw = self.heads(buf)[:, at:at + rb]
            else:
                c = self.columns(buf)[:, :rb]
                c = c.view(FLOAT_DTYPES[kind]) if kind in FLOAT_DTYPES else blocks.dequantize(c, kind)
                out.append(("f32", np.ascontiguousarray(c.T, np.float32)))
                continue
            out.append((kind, raw.view(FLOAT_DTYPES[kind]) if kind in FLOAT_DTYPES else raw))
        return out

    def unpack(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """{gate, up, down}: float32 matrices of one chunk (blocks dequantized)."""
        return {m: (a.astype(np.float32) if kind in FLOAT_DTYPES else blocks.dequantize(np.ascontiguousarray(a),
                                                                                         kind))
                for m, (kind, a) in zip(MATRICES, self.matrices(buf))}

    # -- manifest ---------------------------------------------------------------------------------------------------
    def to_manifest(self) -> dict:
        return {**self.geometry(), "checksums": self.checksum}

    @classmethod
    def from_manifest(cls, m, src) -> "ExpertLayout":
        """Parsed and checked: the manifest comes from disk."""
        if not isinstance(m, dict):
            raise UserError(f"{src}: manifest field experts is not an object")
        try:
            layout = cls(d=m["d"], n=m["n"], n_experts=m["n_experts"], n_layers=m["n_layers"],
                         dtypes=tuple(m["dtypes"]) if isinstance(m["dtypes"], list) else (), offset=m["offset"],
                         split=m.get("split", False))
        except KeyError as e:
            raise UserError(f"{src}: manifest field experts lacks {e}") from None
        except UserError as e:
            raise UserError(f"{src}: {e}") from None
        if m.get("chunk") != layout.chunk:
            raise UserError(f"{src}: experts chunk {m.get('chunk')!r} does not match its geometry ({layout.chunk})")
        sums = m.get("checksums")
        if not (isinstance(sums, list) and len(sums) == layout.n_layers
                and all(isinstance(r, list) and len(r) == layout.n_experts
                        and all(isinstance(c, str) and len(c) == 32 for c in r) for r in sums)):
            raise UserError(f"{src}: experts checksums are not {layout.n_layers} lists of {layout.n_experts} digests")
        layout.checksum = sums
        return layout
