"""FlashMatrix: a matrix of resident.safetensors left on flash (the token embeddings; the head when the DRAM plan
streams it), used as the same matrix in DRAM is, by model.Transformer:

  m[ids]        those rows, read in one batched request and decoded as the resident matrix's [ids] decodes them
                (blocks.dequantize_rows, row by row): the embedding lookup, the same bits
  linear(x, m)  the whole matrix read in chunks of rows, `depth` in flight (storage.reader.RowStream), each chunk's
                columns of the product computed by the resident matrix's kernel as soon as it lands: only the chunks
                are in DRAM. A column of the product depends on its row and x alone (blocks.quant_matmul_t,
                gemv.matmul_t; a prompt's BLAS products sum each over the same panels of x whatever their width),
                and a chunk is whole blocks of gemv.matmul_widened (budget.stream_rows), so the logits have the
                resident head's bits.

A tied head is one FlashMatrix with both uses. Rows are read with O_DIRECT where the filesystem allows it, as the
FFN's bundles are: the page cache would hold what the budget leaves on flash.
"""
from __future__ import annotations

import time

import numpy as np

from storage.blocks import BLOCK_BYTES, check_finite_blocks
from storage.errors import UserError
from storage.reader import BundleReader, FlashStats, RowStream, aligned_empty
from storage.untrusted import check_finite
from .budget import stream_rows
from .kernels.blocks import QuantMatrix, linear
from .kernels.gemv import WIDEN_BLOCK_BYTES

FLOATS = {"f16": np.float16, "f32": np.float32}


def widened_rows(cols: int) -> int:
    """Rows of the blocks gemv.matmul_widened widens a matrix of `cols` columns in (a prompt's products)."""
    return max(1, WIDEN_BLOCK_BYTES // (4 * cols))


class FlashMatrix:
    """Rows [rows, cols] of a resident matrix on flash: layout and kind from FlashCheckpoint.rows_layout; a stream of
    chunk_bytes chunks, depth in flight (the device's stream settings: budget.head_sizes counts the same buffers).
    lookups: FlashStats of the row reads; stats: of the streamed passes (tokens: the passes)."""

    def __init__(self, layout, kind: str, chunk_bytes: int, depth: int):
        self.layout, self.kind, self.cols = layout, kind, layout.d
        self.reader = BundleReader(layout, coalesce_gap=0)     # a gap's rows are not wanted: read runs only
        self.stream = RowStream(self.reader, stream_rows(layout.stride, chunk_bytes, widened_rows(self.cols)), depth)
        self.lookups, self.stats = FlashStats(), FlashStats()
        self.checked = False            # every block scale of the matrix seen finite (on the first pass)

    @property
    def shape(self) -> tuple[int, int]:
        return self.layout.n_neurons[0], self.cols

    def describe(self, streamed: bool) -> str:
        """One line for -v: the matrix, how it is used (streamed: as the head), the reader's settings."""
        use = f"streamed each token, {self.stream.describe()}" if streamed else "a step's token rows read"
        return f"{self.kind} {self.shape[0]} x {self.cols} on flash: {use}; {self.reader.describe()}"

    def matrix(self, q: np.ndarray, where: str | None = None):
        """Rows as read (uint8 [n, stride]) as the resident matrix holds them: QuantMatrix, or float16/32 rows. With
        `where`, refused in one line naming it when a block scale or a value is not finite (the file comes from
        disk; load_tensor checks a resident matrix so)."""
        if self.kind in BLOCK_BYTES:
            return QuantMatrix(q if where is None else check_finite_blocks(q, self.kind, where), self.kind, self.cols)
        a = np.require(q.view(FLOATS[self.kind]), requirements="A")     # float32 rows on a 2-byte boundary: copied
        return a if where is None else check_finite(a, where)

    def __getitem__(self, ids) -> np.ndarray:
        """Rows ids (token ids: any order, repeats) as the resident matrix's [ids] gives them."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise UserError(f"row ids must lie in [0, {self.shape[0]}), got {ids.min()}..{ids.max()}")
        unique, at = np.unique(ids, return_inverse=True)
        q = aligned_empty((len(unique), self.layout.stride), np.uint8)
        t0 = time.perf_counter()
        self.lookups += self.reader.read(0, unique, q, np.arange(len(unique)))
        self.lookups.read_s += time.perf_counter() - t0
        return self.matrix(q, self.where("rows"))[at.reshape(-1)]

    def prime(self) -> None:
        """Start reading the first chunks (the layers run meanwhile); matmul_t takes them."""
        self.stream.prime(0)

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """x [T, cols] @ M^T -> float32 [T, rows], chunk by chunk from flash."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty((x.shape[0], self.shape[0]), np.float32)
        for first, q, read, waited in self.stream.chunks(0):
            t0 = time.perf_counter()
            w = self.matrix(q, None if self.checked else self.where("a chunk"))
            y[:, first:first + q.shape[0]] = linear(x, w)
            read.read_s, read.compute_s = waited, time.perf_counter() - t0
            self.stats += read
        self.checked = True
        self.stats.tokens += 1
        return y

    def where(self, what: str) -> str:
        return f"{self.reader.path}: {what} of the {self.kind} matrix at byte {self.layout.offset[0]}"

    def close(self) -> None:
        self.stream.cancel()
        self.reader.close()
