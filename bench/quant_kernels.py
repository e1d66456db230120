"""The FFN and GEMV kernels on Llama-7B shapes (or --rows / --cols), every weight format, as JSON.

gemv: one decode GEMV (T = 1) over an [11008, 4096] matrix: kernels.matmul_t on float16 against quant_matmul_t on
every block format (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k). sparse_ffn: one token's sparse FFN of a 7B layer
(d 4096, 11008 neurons, --frac active, SwiGLU at threshold -inf: every chosen neuron fires in every format; ReLU's
share hung on the random weights, 47% of q4_0's neurons, 85% of the K-quants'), kernels.SparseFFN on f16 and int8
bundles against QuantSparseFFN on bundles of each block format (gate, up and down in it; `<kind>.col`: down as a
GGUF's down columns of that kind, storage.columns, with scale tables of all 11008 neurons). The block formats' dot
products round x to 8 bits (blocks.set_act8, the default; --act8-off adds GEMV rows with float32 x: "act8" false).
"vs_q4_0": GB/s over q4_0's at the same thread count (and act8), the speed per byte read, measured in pairs: each
call follows one of q4_0, and vs_q4_0 is the median over the pairs, so load that comes and goes weighs on both
(format after format, one format's ratio spread 0.7-1.5 from run to run on this machine).
K-quant blocks are random bytes with small float16 scales (gguf-py cannot make them; the work does not hang on them).
Weights come from DRAM: every call reads another copy of the matrix (or layer, with its own column tables) from a
pool of at least --pool-mb (default 1024 MB; L3 is 32 MiB), as a real model finds them after the other layers ran.
"gbps" counts the weight bytes a call reads (the whole matrix; the active neurons' bundles up to the last block; not
the column tables). Times: median and best of --calls calls. SmolLM2-135M's FFN is --rows 1536 --cols 576: rows of
360-612 bytes, where the kernels' software prefetch (kernels.prefetch_ahead) matters; 7B rows of 2-8 KiB stream.

  PYTHONPATH=. python bench/quant_kernels.py [--calls 40] [--frac 0.1] [--pool-mb 1024] [--rows 11008 --cols 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numba
import numpy as np

from flashinfer_lite.ffn.quant import sparse_ffn
from flashinfer_lite.kernels.gemv import matmul_t
from flashinfer_lite.kernels.blocks import KINDS, quant_matmul_t, quantize, set_act8
from storage import columns
from storage.blocks import QUANTIZABLE
from storage.format import FlashLayout, pack_bundles

N, D = 11008, 4096
HALVES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}     # byte offsets of a K-quant block's float16 scales


def blocks_of(w: np.ndarray, kind: str, rng) -> np.ndarray:
    """w [rows, cols] in `kind`: llama.cpp's rounding, or for a K-quant random blocks of w's shape."""
    if kind in QUANTIZABLE:
        return quantize(w, kind)
    k = KINDS[kind]
    q = rng.integers(0, 256, (w.size // k.weights, k.block_bytes), dtype=np.uint8)
    for o in HALVES[kind]:
        q[:, o:o + 2] = np.full(q.shape[0], 1e-4, np.float16).view(np.uint8).reshape(-1, 2)
    return q.reshape(w.shape[0], -1)


def pool_of(a: np.ndarray, pool_mb: int) -> np.ndarray:
    """Copies of `a` stacked until they fill pool_mb: calls that rotate through them miss every cache."""
    copies = max(2, -(-pool_mb * 2**20 // a.nbytes))
    return np.repeat(a[None], copies, axis=0)


def timed(fn, calls: int, pool_len: int, nbytes: int, q4_0: tuple) -> dict:
    """fn(i) on pool copy i, `calls` times, each after a call of q4_0 = (fn, pool_len, nbytes) (q4_0's row: after
    itself, half its pool away; the pairs' noise); vs_q4_0: the median over the pairs of fn's GB/s over q4_0's."""
    def once(f, i):
        t0 = time.perf_counter()
        f(i)
        return time.perf_counter() - t0
    fn(0), q4_0[0](0)  # warm-up: compilation is cached, first-call dispatch is not
    pairs = [(once(q4_0[0], c % q4_0[1]), once(fn, (c + pool_len // 2) % pool_len)) for c in range(calls)]
    ms = 1e3 * float(np.median([t for _, t in pairs]))
    vs = float(np.median([nbytes / t * q / q4_0[2] for q, t in pairs]))
    return {"ms_median": round(ms, 3), "ms_best": round(1e3 * min(t for _, t in pairs), 3),
            "gbps": round(nbytes / ms / 1e6, 2), "vs_q4_0": round(vs, 2)}


def bench_gemv(rng, calls: int, pool_mb: int, threads: list[int], N: int = N, D: int = D, act8_off=False) -> list:
    w = rng.standard_normal((N, D), dtype=np.float32) * 0.02
    x = rng.standard_normal((1, D), dtype=np.float32)
    q4_0 = pool_of(blocks_of(w, "q4_0", rng), pool_mb)
    out = []
    for fmt in ("q4_0", "f16", *(k for k in KINDS if k != "q4_0")):
        one = w.astype(np.float16) if fmt == "f16" else blocks_of(w, fmt, rng)
        pool = q4_0 if fmt == "q4_0" else pool_of(one, pool_mb)
        for t in threads:
            numba.set_num_threads(t)
            for eight in ((False, True) if act8_off else (True,)) if fmt in KINDS else (None,):
                set_act8(eight is not False)
                fn = (lambda i, p=pool: matmul_t(x, p[i])) if fmt == "f16" else \
                    (lambda i, p=pool, f=fmt: quant_matmul_t(x, p[i], f))
                base = (lambda i: quant_matmul_t(x, q4_0[i], "q4_0"), len(q4_0), q4_0[0].nbytes)
                r = timed(fn, calls, len(pool), one.nbytes, base)
                out.append({"format": fmt, "threads": t, **({} if eight is None else {"act8": eight}), **r,
                            "matrix_mb": round(one.nbytes / 1e6, 1)})
            set_act8(True)
        del pool
    return out


def bench_sparse_ffn(rng, calls: int, pool_mb: int, frac: float, threads: list[int], N: int = N,
                     D: int = D) -> list[dict]:
    k = int(round(frac * N))
    # 1024 distinct neurons repeated to fill the layer: the same speed as 11008 distinct ones, a tenth of the memory
    vecs = rng.standard_normal((1024, 3, D), dtype=np.float32) * 0.02  # [neuron, gate/up/down, d]
    x = rng.standard_normal(D, dtype=np.float32)
    y = np.zeros(D, np.float32)
    sets = [np.sort(rng.choice(N, k, replace=False)).astype(np.int32) for _ in range(16)]
    out, base = [], {}
    for fmt in ("q4_0", "f16", "int8", *(k for k in KINDS if k != "q4_0"), *columns.COLUMN_DTYPES):
        kind, tables = columns.kind_of(fmt), None
        layout = FlashLayout.create(D, [len(vecs)], kind or fmt, glu=True, layer_dtypes=kind and [(kind, kind, fmt)])
        if kind:     # down [D, N] in a GGUF's blocks along the neurons, cut into columns; tables of N neurons (a 7B's)
            cols, tables = columns.split(blocks_of(np.ascontiguousarray(np.resize(vecs[:, 2], (N, D)).T), kind, rng),
                                         kind, N)
            layer = pack_bundles(layout, [np.resize(g, (N, g.shape[1])) for g in
                                          (blocks_of(vecs[:, k], kind, rng) for k in range(2))] + [cols],
                                 neurons=np.arange(N))
        else:
            layer = pack_bundles(layout, [blocks_of(vecs[:, k], fmt, rng) for k in range(3)] if fmt in KINDS else vecs)
        touched = k * layout.scalars_offset
        pool = pool_of(np.resize(layer, (N, layer.shape[1])), pool_mb)
        del layer
        # each layer of the pool with its own scale tables (a copy each: they come from DRAM, as a real model's do)
        make = lambda copies: [sparse_ffn(layout, act="silu", relu_threshold=-np.inf, max_active=k,  # noqa: E731
                                          down_scales=tables and [{n: v.copy() for n, v in tables.items()}])
                               for _ in range(copies if tables else 1)]
        for t in threads:
            numba.set_num_threads(t)
            fn = (lambda ffns, pool: lambda i: ffns[i % len(ffns)](pool[i], sets[i % len(sets)], x, y))(make(len(pool)),
                                                                                                        pool)
            r = timed(fn, calls, len(pool), touched, base.setdefault(t, (fn, len(pool), touched)))   # q4_0's first
            out.append({"format": fmt, "threads": t, "active": k, **r, "neurons_per_s": round(k / r["ms_median"] * 1e3),
                        "weight_mb_touched": round(touched / 1e6, 2)})
        del pool
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--frac", type=float, default=0.1, help="active fraction of the FFN neurons")
    ap.add_argument("--pool-mb", type=int, default=1024, help="bytes each format's calls rotate through")
    ap.add_argument("--rows", type=int, default=N, help="GEMV rows and FFN neurons (default 11008)")
    ap.add_argument("--cols", type=int, default=D, help="GEMV columns and FFN width d, a multiple of 32 (default 4096)")
    ap.add_argument("--act8-off", action="store_true", help="GEMV rows with float32 x too (blocks.set_act8 off)")
    a, rng, threads = ap.parse_args(), np.random.default_rng(0), sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)})
    res = {"shape": {"gemv": [a.rows, a.cols], "ffn": {"d": a.cols, "n": a.rows, "frac": a.frac}}, "loadavg_1m_start":
           os.getloadavg()[0], "gemv": bench_gemv(rng, a.calls, a.pool_mb, threads, a.rows, a.cols, a.act8_off),
           "sparse_ffn": bench_sparse_ffn(rng, a.calls, a.pool_mb, a.frac, threads, a.rows, a.cols),
           "loadavg_1m_end": os.getloadavg()[0]}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
