#!/usr/bin/env python3
"""End-to-end decode benchmark: flashinfer-lite against the baselines users would pick, same model, same cap.

    PYTHONPATH=. python bench/e2e.py -m FLASHDIR [FLASHDIR ...] [--gguf GGUF ...] [--trace TRACE.npz] [--cap 3G]
                                     [--tokens 24] [--slow-tokens 6] [--reference dense-ram|layer-stream]
    PYTHONPATH=. python bench/e2e.py --quick          # tiny generated model, < 1 minute, for smoke tests

Modes, each its own worker under a cap (bench/README.md, "What each mode is"): dense-ram, dense-mmap, layer-stream
(harness.BundleFFN over the bundles in RAM, memmapped, or read per layer), flash-{oracle,trace}-P[-serial|-lookahead]
(the runtime's FlashFFN at P% of the model files, replaying recorded active sets) and llama.cpp-P (llama.cpp itself on
the paired GGUF, under the cap of the flash rows). The reference mode runs first, uncapped: its greedy tokens are
every other row's input and its active sets the oracle's. Attention is the runtime's in every mode but llama.cpp.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import harness as h

from flashinfer_lite.process import read_bytes, rss_bytes  # noqa: E402  (standard library and numpy only)
from storage.files import disk_bytes  # noqa: E402

PROMPT = "Once upon a time, there was a little"
WINDOW = 5                                      # sliding window of the neuron cache, tokens
CAP_SLACK = 640 << 20                           # interpreter + numba + numpy beyond the DRAM budget


# ----------------------------------------------------------------------------------------------------------------------
# Worker: one mode in this process

class Worker:
    def __init__(self, a):
        t0 = time.perf_counter()
        self.a, self.t, self.info, self.flash, self.active_rec = a, 0, {}, None, None   # t: the token being decoded
        self.ffn_s = self.read_s = self.io_s = 0.0
        self.flash_bytes = 0                # bytes read by our own readers (mmap: from /proc/self/io)
        self.model, tokenizer, _ = h.load_model(a.flashdir, self.build_ffn)
        self.prompt_ids = tokenizer.encode(PROMPT)
        self.warm_up_flash() if self.flash else self.dense.warm_up()
        self.load_s = time.perf_counter() - t0

    def build_ffn(self, ck, weights):
        """The FFN function of this mode over the FLASHDIR's bundles."""
        a, L = self.a, ck.layout
        self.layout, self.cfg = L, ck.config
        self.resident_bytes = sum(w.nbytes for w in weights.values())
        if L.n_vec != 3 or L.biases:
            raise SystemExit("bench/e2e.py: the dense modes support GLU bundles without biases")
        if a.record:
            self.active_rec = np.zeros((a.n_tokens, L.n_layers, max(L.n_neurons)), bool)
        if a.mode.startswith("flash"):
            inner = self.setup_flash()
        elif a.mode == "layer-stream":
            from storage.reader import aligned_empty, bundle_reader
            self.reader = bundle_reader(L)
            self.buf = aligned_empty((max(L.n_neurons), L.stride), np.uint8)
            inner = self.dense = h.BundleFFN(L, self.stream, record=self.record if a.record else None)
        elif a.mode in ("dense-ram", "dense-mmap"):
            B = np.fromfile(L.ffn_path, np.uint8) if a.mode == "dense-ram" else np.memmap(L.ffn_path, np.uint8, "r")
            inner = self.dense = h.BundleFFN(L, lambda i: h.region(B, L, i), record=self.record if a.record else None)
        else:
            raise SystemExit(f"unknown mode {a.mode}")

        def ffn(layer, x):
            t0 = time.perf_counter()
            y = inner(layer, x)
            self.ffn_s += time.perf_counter() - t0
            return y
        return ffn

    def stream(self, layer):
        """Layer `layer`'s whole FFN read with O_DIRECT into one buffer (AirLLM)."""
        n = self.layout.n_neurons[layer]
        ids = np.arange(n)
        st = self.reader.read(layer, ids, self.buf[:n], ids)
        self.read_s += st.io_s
        self.flash_bytes += st.read_bytes
        return self.buf[:n]

    def record(self, layer, active):                 # the reference run records the oracle's sets
        self.active_rec[self.t, layer, :active.size] = active

    def setup_flash(self):
        """The runtime's own FlashFFN (neuron cache, reader, overlapped reads, sparse kernel), fed replayed sets."""
        from flashinfer_lite.budget import plan_budget
        from flashinfer_lite.ffn.flash import FlashFFN
        from flashinfer_lite.modes import expected_max_active
        a, L = self.a, self.layout
        with np.load(a.active, allow_pickle=False) as z:
            n = int(z["n"])
            self.active = np.unpackbits(z["active"], axis=-1, count=n).astype(bool)   # [T, L, n] original ids
            profile = TraceProfile(z["freq"])                                          # [L, n]
        if self.active.shape[0] < a.n_tokens or self.active.shape[1] < L.n_layers or n != max(L.n_neurons):
            raise SystemExit(f"bench/e2e.py: active sets {self.active.shape} do not cover {a.n_tokens} tokens x "
                             f"{L.n_layers} layers x {max(L.n_neurons)} neurons")
        self.active = self.active[:a.n_tokens, :L.n_layers]
        max_active = expected_max_active(self.cfg, profile)      # the window's reservation, as the runtime makes it
        budget = int(a.budget)
        plan = plan_budget(self.cfg, L, budget, ctx=a.n_tokens, window=WINDOW, max_active=max_active,
                           resident_bytes=self.resident_bytes, lookahead=a.mode.endswith("-lookahead"))

        def replay(layer, x):   # the recorded set of this token, whatever x is
            return self.active[self.t, layer][None, :L.n_neurons[layer]]

        rng = np.random.default_rng(0)

        def guess(layer, x):
            """A lookahead guess with the recall and precision given on the command line (1, 1: perfect)."""
            true = self.active[self.t, layer, :L.n_neurons[layer]]
            g = true & (rng.random(true.size) < a.lookahead_recall)
            n_false = int(round(g.sum() * (1 / a.lookahead_precision - 1)))
            off = np.flatnonzero(~true)
            g[rng.choice(off, min(n_false, off.size), replace=False)] = True
            return g[None, :]

        t0 = time.perf_counter()
        self.flash = FlashFFN.predicted(self.cfg, L, plan, replay, profile, overlap=not a.mode.endswith("-serial"),
                                        lookahead=guess if a.mode.endswith("-lookahead") else None)
        self.info.update(budget_bytes=budget, window_rows=plan.window_rows, overlap=self.flash.overlap,
                         hot_neurons=int(sum(len(self.flash.cache.hot(i)) for i in range(L.n_layers))),
                         max_active=max_active, hot_load_s=round(time.perf_counter() - t0, 3),
                         minimum_bytes=plan.minimum_bytes, reader_threads=self.flash.reader.threads,
                         coalesce_gap=self.flash.reader.coalesce_gap, plan=plan.table(),
                         lookahead={"recall": a.lookahead_recall, "precision": a.lookahead_precision}
                         if self.flash.lookahead else None)
        return lambda layer, x: self.flash(layer, np.asarray(x, np.float32))

    def warm_up_flash(self):
        """Compile (or load from Numba's cache) the sparse kernel before the clock starts."""
        L = self.layout
        x = np.zeros(L.d, np.float32)
        self.flash.kernels[0](np.zeros((2, L.stride), np.uint8), np.zeros(1, np.int32), x, np.empty(L.d, np.float32))

    # -- decode loop -------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.a
        ids = [int(i) for i in np.load(a.ids)] if a.ids else list(self.prompt_ids)
        greedy = not a.ids
        kv = self.model.new_cache(a.n_tokens)
        step_ms, argmax = [], []
        io0 = read_bytes()
        for t in range(a.n_tokens):
            self.t = t
            t0 = time.perf_counter()
            logits = self.model.forward([ids[t]], kv)
            step_ms.append(1e3 * (time.perf_counter() - t0))
            nxt = int(np.argmax(logits))
            argmax.append(nxt)
            if greedy and t + 1 >= len(ids):
                ids.append(nxt)
        hits = misses = 0
        lookup_s = predictor_s = 0.0
        comp_s = self.dense.compute_s if self.flash is None else self.flash.stats.compute_s
        if self.flash:
            s = self.flash.stats
            self.read_s, lookup_s, predictor_s, self.io_s = s.read_s, s.lookup_s, s.predictor_s, s.io_s
            self.flash_bytes, hits, misses = s.read_bytes, s.hits, s.misses
        io_bytes = read_bytes() - io0
        ids = ids[:a.n_tokens]
        steady = step_ms[1:] if len(step_ms) > 1 else step_ms      # the first token pays cold caches
        total_s = sum(step_ms) / 1e3
        n = len(step_ms)
        looked = hits + misses
        res = {"mode": a.mode, "tokens": n, "load_s": round(self.load_s, 3), "first_token_ms": round(step_ms[0], 2),
               "p50_ms": round(float(np.percentile(steady, 50)), 2),
               "p99_ms": round(float(np.percentile(steady, 99)), 2),
               "tokens_per_s": round(1e3 / float(np.mean(steady)), 4),
               "flash_MB_per_token": round(io_bytes / n / 1e6, 2),
               "reader_MB_per_token": round(self.flash_bytes / n / 1e6, 2),
               "read_GBps": round(io_bytes / max(self.read_s if self.read_s else total_s, 1e-9) / 1e9, 3),
               "hit_rate": round(hits / looked, 4) if looked else None,
               "active_per_token": round(looked / n / self.layout.n_layers, 1) if looked else None,
               "time_split_s_per_token": {"ffn_total": round(self.ffn_s / n, 4), "ffn_compute": round(comp_s / n, 4),
                                          "flash_read_wait": round(self.read_s / n, 4),
                                          "flash_io_in_flight": round(self.io_s / n, 4),
                                          "cache_bookkeeping": round(lookup_s / n, 4),
                                          "predictor": round(predictor_s / n, 4),
                                          "attention_and_rest": round((total_s - self.ffn_s) / n, 4)},
               "resident_bytes": self.resident_bytes, "rss_end_bytes": rss_bytes(), "argmax": argmax,
               "ids": [int(i) for i in ids], "prompt_len": len(self.prompt_ids), **self.info}
        if self.active_rec is not None:
            np.savez_compressed(a.record, active=np.packbits(self.active_rec, axis=-1),
                                n=np.int64(self.active_rec.shape[2]),
                                freq=self.active_rec.mean(axis=0).astype(np.float32))
            res["active_share"] = round(float(self.active_rec.mean()), 4)
        return res


class TraceProfile:
    """What FlashFFN (and modes.expected_max_active) ask of a PredictorSet, from a replayed trace: the neuron
    frequencies [L, n] that choose the hot neurons; no magnitude threshold (the replayed sets are exact)."""

    def __init__(self, freq: np.ndarray):
        self.freq = freq

    def neuron_freq(self, layer: int) -> np.ndarray:
        return self.freq[layer]

    def act_threshold(self, layer: int) -> float:
        return 0.0


def llama_worker(a) -> dict:
    """llama.cpp itself, mmap'ing the GGUF: the reference's prompt in one batch, then --n-tokens greedy steps of its own
    (GGUF's llama computes SwiGLU, not FATReLU, so its tokens are its own; the bytes it reads per token are not).
    Imports neither numba nor the runtime: the cgroup charges only what llama.cpp itself holds."""
    ids = [int(i) for i in np.load(a.ids)][:a.prompt_len]
    r = h.measure_llama({"gguf": a.gguf, "prompt_ids": ids, "n_gen": a.n_tokens + 1,
                         "ctx": len(ids) + a.n_tokens + 2, "threads": a.threads, "llama_extra_bufts": False})
    return {"mode": a.mode, "engine": "llama.cpp", "tokens": r["decode_steps"], "load_s": r["load_s"],
            "prompt_ms_per_token": r["prompt_ms_per_token"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
            "tokens_per_s": r["tokens_per_s"], "flash_MB_per_token": r["decode_MB_per_token"],
            "hit_rate": None, "resident_bytes": None, "argmax": r["gen_tokens"][1:],
            "gguf": a.gguf, "gguf_bytes": os.path.getsize(a.gguf), "llama_cpp": r["llama_cpp"],
            "system_info": r["system_info"]}


# ----------------------------------------------------------------------------------------------------------------------
# Machine measurements: flash bandwidth at the request sizes the modes issue, DRAM bandwidth

def dram_gbps(nbytes: int = 1 << 30) -> float:
    from numba import njit, prange        # here: the llama.cpp worker imports this module and must not load numba

    @njit(cache=True, parallel=True)
    def sum_u64(a):
        s = 0
        for i in prange(a.shape[0]):
            s += a[i]
        return s
    a = np.ones(nbytes // 8, np.uint64)
    sum_u64(a[:1024])
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        sum_u64(a)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def flash_gbps(ffn_path: Path, chunks: list[int], seconds: float) -> dict[int, float]:
    """Best random O_DIRECT read GB/s per request size over the model's own ffn.bin (flash-bench's measurement)."""
    from storage.flash_bench import bench_grid
    size = os.path.getsize(ffn_path) // max(chunks) * max(chunks)
    rows = bench_grid(ffn_path, size, chunks, [4, 8, 16], seconds)
    return {c: max(r["MBps"] for r in rows if r["chunk"] == c) / 1e3 for c in chunks}


# ----------------------------------------------------------------------------------------------------------------------
# Driver

def run_mode(a, m: dict, mode: str, cap: int | None, work: Path, extra: list[str]) -> dict:
    """One row: `mode` on model m (a FLASHDIR, or its GGUF for llama.cpp) as a worker under tools/memcap.py."""
    env = {"OMP_WAIT_POLICY": "passive"} if mode.startswith("llama.cpp") and a.llama_omp == "passive" else None
    r = h.run_row(__file__, mode, f"{m['tag']}-{mode}", cap, work,
                  ["-m", m["path"], "--lookahead-recall", a.lookahead_recall, "--lookahead-precision",
                   a.lookahead_precision, "--threads", a.threads, *extra], env)
    return dict(r, model=m["tag"])


def prepare_quick(work: Path, dtypes: list[str], gguf: bool) -> tuple[list[Path], list[Path], Path]:
    """Tiny generated model converted to a FLASHDIR per dtype (and, for llama.cpp, written as GGUF of the same
    dtypes), and a stories260K trace mapped onto it."""
    from storage.convert import convert
    env = dict(os.environ, PYTHONPATH=str(h.REPO))
    hf, trace = work / "quick-hf", work / "quick-trace.npz"
    subprocess.run([sys.executable, str(h.REPO / "tools" / "make_large_model.py"), str(hf), "--layers", "2", "--dim",
                    "128", "--ffn", "2048", "--heads", "2", "--check-tokens", "0", "--force",
                    *(["--gguf", ",".join(dtypes)] if gguf else [])],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    flash = [convert(hf, work / f"quick-{d}.flash", dtype=d, force=True, progress=False) for d in dtypes]
    subprocess.run([sys.executable, str(h.REPO / "tools" / "record_trace.py"), "-o", str(trace), "--model",
                    str(h.STORIES), "--layers", "2", "--ffn", "2048", "--cal-tokens", "256", "--tokens", "32"],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return flash, [hf / f"model.{d}.gguf" for d in dtypes] if gguf else [], trace


def describe(path: Path, gguf: Path | None, tags: list[str], bw_seconds: float) -> dict:
    """A FLASHDIR's sizes and geometry, its GGUF twin, and flash bandwidth at its bundle size and at 1 MiB (probed
    again after the rows: reprobe)."""
    from storage.format import read_layout
    L = read_layout(path)
    tag = L.dtype if L.dtype not in tags else f"{L.dtype}#{len(tags)}"
    bw = flash_gbps(L.device_path, sorted({L.stride, 1 << 20}), bw_seconds)
    return {"tag": tag, "path": str(path), "layout": L, "model_bytes": disk_bytes(Path(path)), "ffn_bytes": L.ffn_size,
            "resident_file_bytes": os.path.getsize(Path(path) / L.files["resident"]), "stride": L.stride,
            "config": L.config, "gguf": str(gguf) if gguf else None,
            "gguf_bytes": os.path.getsize(gguf) if gguf else None, "bw": bw,
            "flash_GBps_start": {str(c): round(v, 3) for c, v in bw.items()}}


def reprobe(m: dict, bw_seconds: float) -> None:
    """Probe m's flash bandwidth again after its rows and keep, per request size, the better of the two: the floor
    is what the device can do, and a probe that ran while another process read the disk (a shared machine) once
    measured 0.017 GB/s at 7 KiB against 0.35 in the runs before."""
    L = m["layout"]
    end = flash_gbps(L.device_path, sorted(m["bw"]), bw_seconds)
    m["flash_GBps_end"] = {str(c): round(v, 3) for c, v in end.items()}
    m["bw"] = {c: max(v, end[c]) for c, v in m["bw"].items()}
    m["flash_GBps"] = {str(c): round(v, 3) for c, v in m["bw"].items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, nargs="+", help="FLASHDIR(s) (GLU) made by `flashinfer-lite convert`")
    ap.add_argument("--gguf", type=Path, nargs="+", default=[],
                    help="for the llama.cpp rows: the same model as GGUF, one per FLASHDIR, in the same order")
    ap.add_argument("--trace", type=Path, help="trace from tools/record_trace.py (omit: oracle scenario only)")
    ap.add_argument("--cap", default="3G", help="memory cap for the capped modes (RAM + page cache); a flash row "
                    "and the llama.cpp row compared with it run under max(cap, budget + 640 MiB)")
    ap.add_argument("--tokens", type=int, default=24, help="decode steps for the reference and flash modes")
    ap.add_argument("--slow-tokens", type=int, default=6, help="decode steps for dense-mmap, layer-stream, llama.cpp")
    ap.add_argument("--budgets", default="25,50,75", help="flash DRAM budgets, %% of the model files")
    ap.add_argument("--lookahead-budgets", default="25",
                    help="also run these flash budgets with lookahead prefetch (rows '-lookahead'); '' for none")
    ap.add_argument("--lookahead-recall", type=float, default=1.0,
                    help="recall of the simulated lookahead guess (bench/README.md, Lookahead predictor; 1 = perfect)")
    ap.add_argument("--lookahead-precision", type=float, default=1.0,
                    help="precision of the simulated lookahead guess (bench/README.md, Lookahead predictor; 1 = perfect)")
    ap.add_argument("--serial-budgets", default="25",
                    help="also run these flash budgets with reads NOT overlapped with compute (rows '-serial'): "
                         "the measurement of what the overlap gains; '' for none")
    ap.add_argument("--modes", default="dense-ram,dense-mmap,layer-stream,flash",
                    help="subset of dense-ram,dense-mmap,layer-stream,flash,llama.cpp")
    ap.add_argument("--reference", default="dense-ram", choices=("dense-ram", "layer-stream"),
                    help="the uncapped dense run whose greedy tokens every row is fed and whose active sets the "
                         "oracle replays (layer-stream: one FFN layer in memory at a time)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's compute threads")
    ap.add_argument("--llama-omp", default="active", choices=("active", "passive"),
                    help="llama.cpp's OpenMP threads spin between ops (active, its default) or sleep (passive: "
                         "OMP_WAIT_POLICY=passive; faster on cores other processes share, see vs_llama_cpp.py)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of all modes (the machine is shared: compare "
                    "rows of one round)")
    ap.add_argument("--bw-seconds", type=float, default=1.0, help="seconds per flash bandwidth cell")
    ap.add_argument("--quick", action="store_true", help="tiny generated model, < 1 minute (smoke test)")
    ap.add_argument("--quick-dtypes", default="f16", help="--quick: convert the tiny model to these dtypes")
    h.add_arguments(ap)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--n-tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--active", help=argparse.SUPPRESS)
    ap.add_argument("--budget", help=argparse.SUPPRESS)
    ap.add_argument("--record", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.mode, a.flashdir = a.worker, a.model[0]
        a.gguf = str(a.model[0])
        return h.worker(a.out, a.mode, lambda: llama_worker(a) if a.mode.startswith("llama.cpp") else
                        Worker(a).run())

    from storage.flash_bench import parse_size
    t_start = time.perf_counter()
    work = h.work_dir(a, "e2e-")
    modes = a.modes.split(",")
    unknown = set(modes) - {"dense-ram", "dense-mmap", "layer-stream", "flash", "llama.cpp"}
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(sorted(unknown))}")
    if a.quick:
        dtypes = a.quick_dtypes.split(",")
        a.model, a.gguf, a.trace = prepare_quick(work, dtypes, "llama.cpp" in modes)
        a.tokens, a.slow_tokens, a.bw_seconds, a.budgets = 6, 6, 0.1, "75"
        a.serial_budgets = a.lookahead_budgets = "75"
        a.cap = a.cap if a.cap != "3G" else "1G"
    if not a.model:
        ap.error("-m FLASHDIR is required (or --quick)")
    if "llama.cpp" in modes and len(a.gguf) != len(a.model):
        ap.error("the llama.cpp mode needs one --gguf per FLASHDIR, in the same order")
    cap = parse_size(a.cap)
    machine = dict(h.machine(), dram_GBps=round(dram_gbps(256 << 20 if a.quick else 1 << 30), 2))
    models = []
    for i, path in enumerate(a.model):
        models.append(describe(path, a.gguf[i] if a.gguf else None, [m["tag"] for m in models], a.bw_seconds))
        m = models[-1]
        print(f"e2e: {m['tag']} {path}: {m['model_bytes'] / 2**30:.2f} GiB files (ffn.bin "
              f"{m['ffn_bytes'] / 2**30:.2f} GiB), cap {cap / 2**30:.2f} GiB, work dir {work}", file=sys.stderr)

    results = []
    for rnd in range(1, a.repeat + 1):
        for i, m in enumerate(models):
            # --quick runs the overlap and lookahead variants on the first FLASHDIR only: it stays under a minute
            got = run_round(a, m, modes, cap, work, variants=not (a.quick and i))
            if got is None:
                return 1
            for r in got:
                r["round"] = rnd
            results += got
    for m in models:
        reprobe(m, a.bw_seconds)
    for r in results:
        m = next(m for m in models if m["tag"] == r["model"])
        ref = next(x for x in results if x["model"] == r["model"] and x["mode"] == a.reference)
        if "argmax" in r and not r["mode"].startswith("llama.cpp"):
            k = len(r["argmax"])
            same = np.array(r["argmax"]) == np.array(ref["argmax"][:k])
            r["argmax_agree_with_dense"] = round(float(np.mean(same)), 4)
        floors(r, m, machine)
    doc = {"models": [{k: v for k, v in m.items() if k not in ("layout", "bw")} for m in models], "cap_bytes": cap,
           "reference": a.reference, "machine": machine, "results": results, "speedups": speedups(results),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "seconds": round(time.perf_counter() - t_start, 1), "command": h.command("e2e.py", argv)}
    return h.emit(doc, markdown, a.md, None if a.keep else work)


def run_round(a, m: dict, modes: list[str], cap: int, work: Path, variants: bool = True) -> list[dict] | None:
    """Every mode once on model m, in a fixed order. The reference runs first: its tokens and active sets feed the
    others."""
    ids_file, oracle = work / f"{m['tag']}-ids.npy", work / f"{m['tag']}-oracle.npz"
    r = run_mode(a, m, a.reference, None, work, ["--n-tokens", str(a.tokens), "--record", str(oracle)])
    results = [r]
    if "ids" not in r:
        print(f"e2e: the reference {a.reference} failed: {h.failed(r)}", file=sys.stderr)
        return None
    np.save(ids_file, np.asarray(r["ids"], np.int64))
    fed, prompt_len = ["--ids", str(ids_file)], r["prompt_len"]
    for mode in ("dense-mmap", "layer-stream"):
        if mode in modes and mode != a.reference:
            results.append(run_mode(a, m, mode, cap, work, ["--n-tokens", str(min(a.slow_tokens, a.tokens)), *fed]))
    caps = {}                                  # budget % -> the cap its flash rows ran under
    for pct in (int(p) for p in a.budgets.split(",")):
        caps[pct] = max(cap, m["model_bytes"] * pct // 100 + CAP_SLACK)
    if "flash" in modes:
        scen = [("oracle", oracle)] + ([("trace", a.trace)] if a.trace else [])
        serial = sorted({int(p) for p in a.serial_budgets.split(",") if p and variants})
        ahead = sorted({int(p) for p in a.lookahead_budgets.split(",") if p and variants})
        runs = [(p, "") for p in caps] + [(p, "-serial") for p in serial] + [(p, "-lookahead") for p in ahead]
        for name, active in scen:
            for pct, suffix in runs:
                budget = m["model_bytes"] * pct // 100
                # budgets above the cap run under budget + interpreter slack (reported per row)
                r = run_mode(a, m, f"flash-{name}-{pct}{suffix}", max(cap, budget + CAP_SLACK), work,
                             ["--n-tokens", str(a.tokens), *fed, "--active", str(active), "--budget", str(budget)])
                r["scenario"], r["budget_pct"] = name, pct
                results.append(r)
    if "llama.cpp" in modes:                   # under the cap of each budget's flash rows
        for pct, c in caps.items():
            r = run_mode(a, dict(m, path=m["gguf"]), f"llama.cpp-{pct}", c, work,
                         ["--n-tokens", str(min(a.slow_tokens, a.tokens)), *fed, "--prompt-len", str(prompt_len)])
            r["budget_pct"] = pct
            results.append(r)
    return results


def speedups(results: list[dict]) -> list[dict]:
    """Per round and model: P50 of the baselines over P50 of each flash row (same round, same machine load);
    llama.cpp: its row under the same cap (the same budget %)."""
    out = []
    for rnd, model in sorted({(r["round"], r["model"]) for r in results}):
        rows = {r["mode"]: r for r in results if r["round"] == rnd and r["model"] == model and "p50_ms" in r}
        for name, r in rows.items():
            if name.startswith("flash"):
                base = {b: rows[b] for b in ("dense-mmap", "layer-stream", "dense-ram") if b in rows}
                if f"llama.cpp-{r['budget_pct']}" in rows:
                    base["llama.cpp"] = rows[f"llama.cpp-{r['budget_pct']}"]
                out.append({"round": rnd, "model": model, "mode": name, "cap_bytes": r["cap_bytes"],
                            **{f"vs_{b}": round(x["p50_ms"] / r["p50_ms"], 2) for b, x in base.items()}})
    return out


def floors(r: dict, m: dict, machine: dict) -> None:
    """Physical floor per token: flash bytes that must be read / flash bandwidth at that request size, plus DRAM bytes
    touched / DRAM bandwidth (the compute of a memory-bound decode step); floor_ms is their sum."""
    if "tokens" not in r:
        return
    dram = machine["dram_GBps"] * 1e9
    L, bw = m["layout"], m["bw"]
    ffn, res = L.ffn_size, r.get("resident_bytes") or 0
    mode = r["mode"]
    if mode == "dense-ram":
        must_flash, req, touched = 0, L.stride, ffn + res
    elif mode in ("dense-mmap", "layer-stream"):
        # cyclic access to more than the cap: LRU keeps nothing useful, every FFN byte is read each token
        must_flash, req, touched = ffn, 1 << 20, ffn + res
    elif mode.startswith("llama.cpp"):
        # every weight of the GGUF each token; from flash too when the file does not fit under the cap (LRU again)
        g = r["gguf_bytes"]
        must_flash, req, touched = (g if r["cap_bytes"] and g > r["cap_bytes"] else 0), 1 << 20, g
    else:
        must_flash, req = r["reader_MB_per_token"] * 1e6, L.stride
        touched = r["active_per_token"] * L.n_layers * L.stride + res
    r["floor_flash_ms"] = round(1e3 * must_flash / (bw[req] * 1e9), 1)
    r["floor_dram_ms"] = round(1e3 * touched / dram, 1)
    r["floor_ms"] = round(r["floor_flash_ms"] + r["floor_dram_ms"], 1)
    r["p50_over_floor"] = round(r["p50_ms"] / r["floor_ms"], 2) if r["floor_ms"] else None


def markdown(doc: dict) -> str:
    m, mib = doc["machine"], 2**20
    lines = []
    for x in doc["models"]:
        c = x["config"]
        lines.append(f"model {x['tag']} {x['path']}: {x['model_bytes'] / 2**30:.2f} GiB files, ffn.bin "
                     f"{x['ffn_bytes'] / 2**30:.2f} GiB, resident file {x['resident_file_bytes'] / mib:.0f} MiB, "
                     f"bundle {x['stride']} B; {c['n_layers']} layers, dim {c['dim']}, ffn {c['ffn_dim']}, "
                     f"{c['n_heads']} heads; flash "
                     + ", ".join(f"{int(k) / 1024:g} KiB: {v} GB/s (start {x['flash_GBps_start'][k]}, end "
                                 f"{x['flash_GBps_end'][k]})" for k, v in x["flash_GBps"].items())
                     + (f"; GGUF {Path(x['gguf']).name} {x['gguf_bytes'] / 2**30:.2f} GiB" if x["gguf"] else ""))
    lines += [f"{doc['date']}; {m['cpus']} CPUs, DRAM {m['dram_GBps']} GB/s; load avg {m['load_avg_start'][0]:.1f} -> "
              f"{m['load_avg_end'][0]:.1f}; reference {doc['reference']}", ""]
    f, rows, split = h.fmt, [], []
    for r in doc["results"]:
        head = [r["round"], r["model"], r["mode"],
                "uncapped" if r.get("cap_bytes") is None else f"{r['cap_bytes'] / 2**30:.2f}"]
        if "tokens" not in r:
            rows.append(head + [h.failed(r)] + [""] * 15)
            continue
        mc, res = r.get("memcap", {}), r.get("resident_bytes")
        rows.append(head + [r["tokens"], f(r["load_s"]), f(r["p50_ms"]), f(r["p99_ms"]), f(r["flash_MB_per_token"]),
                            f(r.get("read_GBps"), 3), f(r["hit_rate"], 3), f(res and res / mib, 0),
                            f"{r['peak_rss_bytes'] / mib:.0f}",
                            f"{f(mc.get('peak_bytes', 0) / mib, 0)}{' OOM' if mc.get('oom_kills') else ''}",
                            f(r.get("floor_flash_ms")), f(r.get("floor_dram_ms")), f(r.get("floor_ms")),
                            f(r.get("p50_over_floor"), 2), f(r.get("argmax_agree_with_dense"), 2),
                            f"{r['loadavg'][0]:.1f}"])
        if "time_split_s_per_token" in r:
            t = r["time_split_s_per_token"]
            split.append(head[:3] + [f"{t[k]:.3f}" for k in ("ffn_compute", "flash_read_wait", "flash_io_in_flight",
                                                               "cache_bookkeeping", "predictor", "attention_and_rest")])
    lines += h.table(["round", "model", "mode", "cap GiB", "tokens", "load s", "ms/tok P50", "P99", "flash MB/tok",
                      "read GB/s", "hit rate", "resident MiB", "peak RSS MiB", "memcap peak MiB", "floor flash ms",
                      "floor DRAM ms", "floor ms", "P50 / floor", "argmax = ref", "load avg"], rows)
    lines += [""] + h.table(["round", "model", "mode", "s/token: FFN compute", "flash read wait", "reads in flight",
                             "cache bookkeeping", "predictor", "attention + rest"], split)
    if doc["speedups"]:
        lines += [""] + h.table(
            ["round", "model", "flash row", "cap GiB", "P50 speed-up vs llama.cpp (same cap)", "vs dense-mmap",
             "vs layer-stream", "vs dense-ram"],
            [[x["round"], x["model"], x["mode"], f"{x['cap_bytes'] / 2**30:.2f}",
              *(f(x.get(f"vs_{b}"), 2) for b in ("llama.cpp", "dense-mmap", "layer-stream", "dense-ram"))]
             for x in doc["speedups"]])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
