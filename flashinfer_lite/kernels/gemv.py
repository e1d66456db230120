"""Resident matrices (attention q/k/v/o, embeddings, lm_head): y = x @ W^T with W float16 (viewed as uint16 bits)
or float32. Decode (T = 1) is a GEMV bound by how fast W streams from DRAM: float16 halves those bytes, and a
Numba kernel runs on the sparse FFN's thread pool instead of OpenBLAS threads that compete with it. Prefill (large
T) is compute bound, where OpenBLAS's register-blocked sgemm is ~7x this row kernel at T = 128, so there W is
widened to float32 one cache-sized row block at a time and given to numpy matmul. bench/resident_gemv.py measured
both sides (a closed study, in git history)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..threads import numba_threads

from .rows import dot, f32_at, prefetch_ahead


MATMUL_ROW_KERNEL_MAX_T = 12      # T up to this: row kernel; above: widened blocks + BLAS (crossover measured 12-16)
# A parallel call pays for waking the other threads (the OpenMP pool: microseconds on an idle machine, far more on an
# overloaded one): from this much work (T * n * d) it pays. At 1 << 18 SmolLM2's 576 x 576 and 960 x 576 attention
# GEMVs run parallel: attention 3.2 -> 2.2 ms/token in RAM (bench/part_times.py, 2 threads, quiet); at 1 << 21 (the
# workqueue pool's threshold) they ran serial.
MATMUL_PARALLEL_MIN_WORK = 1 << 18
WIDEN_BLOCK_BYTES = 1 << 20       # float32 bytes per widened block: stays in L2 while BLAS reads it


@njit(cache=True, fastmath=True, nogil=True)
def matmul_t_rows(W, x, y, lo, hi):
    """y[:, lo:hi] = x[T, d] @ W[lo:hi]^T; W float32 or float16 bits (uint16) [n, d], x and y float32.

    Row by row: each row of W is read from DRAM once and stays in L1 for the T dot products."""
    d = W.shape[1]
    for j in range(lo, hi):
        prefetch_ahead(W, j, 0, d * W.itemsize)
        w = W[j]
        for t in range(x.shape[0]):
            y[t, j] = dot(w, x[t], d)


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def matmul_t_kernel(W, x, y, chunks):
    """matmul_t_rows over all rows, split into `chunks` contiguous row ranges run in parallel."""
    n = W.shape[0]
    for c in prange(chunks):
        matmul_t_rows(W, x, y, c * n // chunks, (c + 1) * n // chunks)


# Serial on purpose: it alternates with multi-threaded BLAS calls, and a Numba parallel region between them makes
# each pool wait for the other's spinning threads (measured ~10x slower on 2 loaded cores).
@njit(cache=True, fastmath=True, nogil=True)
def widen_rows(W, lo, out):
    """out[m, d] = rows lo .. lo + m of W as float32."""
    for r in range(out.shape[0]):
        w = W[lo + r]
        o = out[r]
        for k in range(out.shape[1]):
            o[k] = f32_at(w, k)


def matmul_t(x: np.ndarray, w: np.ndarray, row_kernel_max_t: int = MATMUL_ROW_KERNEL_MAX_T,
             parallel_min_work: int = MATMUL_PARALLEL_MIN_WORK) -> np.ndarray:
    """x [T, d] @ w [n, d]^T -> float32 [T, n] for a float16 or float32 matrix w."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul_t: x {x.shape} does not match w {w.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, (n, d) = x.shape[0], w.shape
    W = w.view(np.uint16) if w.dtype == np.float16 else w
    y = np.empty((T, n), np.float32)
    if T <= row_kernel_max_t:
        threads = numba_threads()
        if threads > 1 and T * n * d >= parallel_min_work:
            matmul_t_kernel(W, x, y, threads)
        else:
            matmul_t_rows(W, x, y, 0, n)
    elif w.dtype == np.float32:
        np.matmul(x, w.T, out=y)
    else:
        matmul_widened(x, n, d, lambda lo, block: widen_rows(W, lo, block), y)
    return y


def matmul_widened(x: np.ndarray, n: int, d: int, widen, y: np.ndarray) -> None:
    """y[T, n] = x @ W^T for a compact W [n, d] that `widen(lo, block)` writes to float32 rows lo.. of `block`, one
    L2-sized block at a time, each then multiplied by BLAS (the prefill path of matmul_t and blocks.quant_matmul_t)."""
    buf = np.empty((max(1, min(n, WIDEN_BLOCK_BYTES // (4 * d))), d), np.float32)
    for lo in range(0, n, buf.shape[0]):
        block = buf[: min(buf.shape[0], n - lo)]
        widen(lo, block)
        np.matmul(x, block.T, out=y[:, lo: lo + block.shape[0]])

