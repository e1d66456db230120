"""Sparse FFN kernel speed on a Llama-7B layer shape (d 4096, n 11008, GLU ReLU), printed as JSON.

Active sets are drawn at random from a bundle matrix far larger than the L3 cache. working_set "cold" rotates 16
sets, so weights come from DRAM as a real layer finds them (the other layers evicted it); "l3_hot" repeats one set.
Every chosen neuron is computed in full (threshold -inf). "gbps" counts the weight bytes the call actually reads
(gate + up + down of every active neuron, plus int8 scales).

  PYTHONPATH=. python bench/sparse_ffn.py [--frac 0.1] [--calls 50]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numba
import numpy as np

from flashinfer_lite.ffn.sparse import SparseFFN
from storage.format import BundleGeometry


def build_matrix(n: int, d: int, dtype: str, rng: np.random.Generator) -> tuple[np.ndarray, BundleGeometry]:
    """Random bundle matrix uint8[n, stride] in the contract layout; returns (B, its geometry)."""
    g = BundleGeometry.of(d, dtype, glu=True)
    B = np.zeros((n, g.stride), np.uint8)
    for lo in range(0, n, 1024):  # in blocks: keeps the float32 temporaries small
        hi = min(n, lo + 1024)
        w = rng.standard_normal((hi - lo, 3 * d), dtype=np.float32) * 0.02
        if dtype == "f16":
            B[lo:hi, : 3 * d * 2] = w.astype(np.float16).view(np.uint8)
        else:
            q = rng.integers(-127, 128, size=(hi - lo, 3 * d), dtype=np.int8)
            B[lo:hi, : 3 * d] = q.view(np.uint8)
            B[lo:hi].view(np.float32)[:, [g.scalar_slot(f"scale.{v}") for v in g.vectors]] = 0.02 / 127
    return B, g


def time_calls(fn, sets: list[np.ndarray], calls: int) -> float:
    fn(sets[0])  # warm-up (compilation is cached, but first-call dispatch is not)
    t0 = time.perf_counter()
    for c in range(calls):
        fn(sets[c % len(sets)])
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--n", type=int, default=11008)
    ap.add_argument("--frac", type=float, default=0.1)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    d, n = args.d, args.n
    k = int(round(args.frac * n))
    max_threads = numba.config.NUMBA_NUM_THREADS
    x = rng.standard_normal(d, dtype=np.float32)
    y = np.zeros(d, np.float32)
    results = []
    for dtype in ("f16", "int8"):
        B, geometry = build_matrix(n, d, dtype, rng)
        sets = [np.sort(rng.choice(n, k, replace=False)).astype(np.int32) for _ in range(16)]
        itemsize = 2 if dtype == "f16" else 1
        touched = k * 3 * d * itemsize + (k * 12 if dtype == "int8" else 0)
        for threads in sorted({1, min(2, max_threads)}):
            numba.set_num_threads(threads)
            # threshold -inf: every chosen neuron contributes (the worst case: all of gate, up and down are read)
            ffn = SparseFFN(geometry, act="relu", relu_threshold=-np.inf, max_active=k)
            kernels = {"runtime": lambda s: ffn(B, s, x, y)}
            # cold: 16 different active sets, weights come from DRAM; l3_hot: one set again and again (27 MB of
            # f16 weights fit this machine's 35.8 MB L3), the upper bound a layer never sees in a real model
            for working_set, pool in (("cold", sets), ("l3_hot", sets[:1])):
                for name, fn in kernels.items():
                    ms = 1e3 * time_calls(fn, pool, args.calls)
                    results.append({"dtype": dtype, "threads": threads, "strategy": name, "working_set": working_set,
                                    "active": k, "ms_per_call": round(ms, 3),
                                    "weight_mb_touched": round(touched / 1e6, 2), "gbps": round(touched / ms / 1e6, 2)})
    # the machine is shared: the load average says how much the numbers can be trusted
    print(json.dumps({"shape": {"d": d, "n": n, "frac": args.frac}, "loadavg_1m": os.getloadavg()[0],
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
