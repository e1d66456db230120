"""Resident matrices (attention, embeddings, lm_head) in float32 + OpenBLAS against float16 + the Numba kernel.

Per model: the Transformer with its FFN stubbed out (returns zeros), so what is timed is attention, norms, embedding
and lm_head, i.e. everything the flash runtime keeps in DRAM. One prefill of --prefill tokens, then --tokens decode
steps, for each mode, interleaved over --rounds rounds (the machine may be shared: compare within one run).

  f32_blas        float32 weights, x @ W.T through OpenBLAS with its default threads (today's path)
  f16_numba       float16 matrices (model.half_matrices), kernels.matmul_t: Numba's threads for T <= 12, widened
                  blocks through OpenBLAS (default threads) above
  *_1t            the same with OpenBLAS and Numba both limited to 1 thread (threadpoolctl, numba.set_num_threads)

Numba's threading layer matters on a loaded machine (NUMBA_THREADING_LAYER=omp|workqueue): run it under each.

"decode_gbps" is the matrix bytes one token streams (every attention matrix + lm_head) over the decode time.
"gemv" times one matrix larger than the L3 cache alone; "crossover" times kernels.matmul_t's two paths for T tokens,
which is what sets kernels.MATMUL_ROW_KERNEL_MAX_T.

  PYTHONPATH=. python bench/resident_gemv.py [-m FLASHDIR ...] [--tokens 8] [--prefill 128] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from flashinfer_lite.kernels.gemv import matmul_t
from flashinfer_lite.loader import load_weights
from flashinfer_lite.model import Transformer, half_matrix
from storage.format import FlashCheckpoint

MODES = ("f32_blas", "f32_blas_1t", "f16_numba", "f16_numba_1t")


@contextmanager
def numba_threads(n: int | None):
    old = numba.get_num_threads()
    numba.set_num_threads(n or old)
    try:
        yield
    finally:
        numba.set_num_threads(old)


@contextmanager
def mode_threads(mode: str):
    one = 1 if mode.endswith("_1t") else None
    with threadpool_limits(one, user_api="blas"), numba_threads(one):
        yield


def zero_ffn(layer: int, x: np.ndarray) -> np.ndarray:
    return np.zeros_like(x)


def matrix_bytes(w: dict, tied: bool) -> int:
    """Bytes of the matrices one decoded token reads: all 2-D weights but the embedding (one row is looked up),
    which as the tied lm_head is read whole."""
    return sum(a.nbytes for n, a in w.items() if a.ndim == 2 and (n != "embed.weight" or tied)
               and n != "pos_embed.weight")


def bench_model(path: str, tokens: int, prefill: int, rounds: int) -> dict:
    ckpt = FlashCheckpoint(path)
    cfg = ckpt.config
    w32 = load_weights(ckpt, skip=lambda n: ".ffn." in n)        # resident: everything but the bundled FFN
    w16 = {n: half_matrix(a) for n, a in w32.items()}
    models = {m: Transformer(cfg, w16 if m.startswith("f16") else w32, ffn=zero_ffn) for m in MODES}
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, size=prefill).tolist()
    steps = rng.integers(3, cfg.vocab_size, size=tokens).tolist()
    decode = {m: [] for m in MODES}
    pre = {m: [] for m in MODES}
    last = {}
    for r in range(rounds + 1):                                   # round 0 compiles / warms caches, not counted
        for m in MODES:
            model = models[m]
            with mode_threads(m):
                kv = model.new_cache(prefill + tokens)
                t0 = time.perf_counter()
                model.forward(prompt, kv)
                t1 = time.perf_counter()
                times = []
                for t in steps:
                    s = time.perf_counter()
                    last[m] = model.forward([t], kv)
                    times.append(time.perf_counter() - s)
            if r:
                pre[m].append((t1 - t0) * 1e3)
                decode[m] += [x * 1e3 for x in times]
    ref = last["f32_blas"]
    mb = {"f32": matrix_bytes(w32, cfg.tie_embeddings), "f16": matrix_bytes(w16, cfg.tie_embeddings)}
    dec = {m: round(float(np.median(decode[m])), 2) for m in MODES}
    return {
        "path": path, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "vocab": cfg.vocab_size,
        "resident_mb": {"f32": round(sum(a.nbytes for a in w32.values()) / 2**20, 1),
                        "f16": round(sum(a.nbytes for a in w16.values()) / 2**20, 1)},
        "matrix_mb_per_token": {k: round(v / 2**20, 1) for k, v in mb.items()},
        "decode_ms_per_token_median": dec,
        "decode_ms_per_token_min": {m: round(min(decode[m]), 2) for m in MODES},
        "decode_gbps": {m: round(mb[m[:3]] / dec[m] / 1e6, 2) for m in MODES},
        f"prefill_{prefill}_ms_median": {m: round(float(np.median(pre[m])), 1) for m in MODES},
        # f16 rounding of the weights, not the kernel, is what moves the logits
        "f16_logits_max_rel_diff": round(float(np.abs(last["f16_numba"] - ref).max() / np.abs(ref).max()), 6),
    }


def best_ms(f, reps: int) -> float:
    f()
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def bench_gemv(n: int, d: int, reps: int) -> dict:
    """One decode GEMV (T = 1) over a matrix larger than the L3 cache; f32_numba is the row kernel on float32 rows."""
    rng = np.random.default_rng(1)
    w32 = rng.standard_normal((n, d), dtype=np.float32)
    w16 = w32.astype(np.float16)
    x = rng.standard_normal((1, d), dtype=np.float32)
    ms = {}
    for m in MODES + ("f32_numba", "f32_numba_1t"):
        w = w16 if m.startswith("f16") else w32
        with mode_threads(m):
            ms[m] = best_ms(lambda: x @ w.T if "blas" in m else matmul_t(x, w), reps)
    return {"shape": [n, d], "ms_best": {m: round(v, 3) for m, v in ms.items()},
            "gbps": {m: round(n * d * (2 if m.startswith("f16") else 4) / v / 1e6, 2) for m, v in ms.items()}}


def bench_crossover(n: int, d: int, ts: list[int], reps: int) -> dict:
    """One thread for both libraries: compares the algorithms, not how each copes with a loaded machine."""
    rng = np.random.default_rng(2)
    w32 = rng.standard_normal((n, d), dtype=np.float32)
    w16 = w32.astype(np.float16)
    out = {"shape": [n, d], "threads": 1, "T": ts, "f16_row_kernel_ms": [], "f16_widen_blas_ms": [],
           "f32_row_kernel_ms": [], "f32_blas_ms": []}
    with mode_threads("_1t"):
        for T in ts:
            x = rng.standard_normal((T, d), dtype=np.float32)
            r = max(2, reps // T)
            out["f16_row_kernel_ms"].append(round(best_ms(lambda: matmul_t(x, w16, row_kernel_max_t=T), r), 3))
            out["f16_widen_blas_ms"].append(round(best_ms(lambda: matmul_t(x, w16, row_kernel_max_t=0), r), 3))
            out["f32_row_kernel_ms"].append(round(best_ms(lambda: matmul_t(x, w32, row_kernel_max_t=T), r), 3))
            out["f32_blas_ms"].append(round(best_ms(lambda: x @ w32.T, r), 3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", default=[],
                    help="FLASHDIR to time end to end (repeatable; bench/README.md: $BIG/llama7b-ffn-h4.flash, "
                         "smol.flash); none: the GEMV micro-benchmarks only")
    ap.add_argument("--tokens", type=int, default=8, help="decode steps per mode per round")
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-micro", action="store_true", help="only the models, not gemv / crossover")
    a = ap.parse_args()
    res = {"numba_threads": numba.get_num_threads(), "loadavg_start": os.getloadavg()[0], "models": {}}
    if not a.skip_micro:
        res["gemv"] = bench_gemv(8192, 4096, reps=20)
        res["crossover"] = bench_crossover(2048, 4096, [1, 2, 4, 8, 12, 16, 24, 32, 64, 128], reps=64)
    for path in a.model:
        if Path(path).exists():
            res["models"][Path(path).stem] = bench_model(path, a.tokens, a.prefill, a.rounds)
    res["numba_threading_layer"] = numba.threading_layer()  # known only once a parallel kernel has run
    res["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
