#!/usr/bin/env python3
"""End-to-end decode benchmark: flashinfer-lite against the baselines users would pick, same model, same cap.

    PYTHONPATH=. python bench/e2e.py -m FLASHDIR --trace TRACE.npz [--cap 3G] [--tokens 24] [--slow-tokens 6]
    PYTHONPATH=. python bench/e2e.py --quick          # tiny generated model, < 1 minute, for smoke tests

Modes (each one a subprocess under tools/memcap.py, page cache dropped before it):
  dense-ram     every FFN weight in DRAM (ffn.bin read into RAM), uncapped: the compute floor
  dense-mmap    FFN weights np.memmap'ed from ffn.bin under the cap (llama.cpp's default): the page cache thrashes
  layer-stream  each layer's whole FFN read with O_DIRECT (BundleReader) per token, then computed (AirLLM)
  flash-P%      NeuronCache (hot region + sliding window) + BundleReader + SparseFFN at a DRAM budget of P% of the
                model files, active sets replayed from a trace:
                  oracle: the exact active sets the dense-ram run recorded (a perfect predictor on random weights)
                  trace:  real SmolLM2 activation sets mapped onto the big width (tools/record_trace.py)
Dense modes compute all three FFN matrices for every neuron (as llama.cpp does) with one Numba kernel over the
bundle rows; flash modes compute only the active rows with flashinfer_lite.kernels.SparseFFN. Attention and the
rest of the model are the same numpy math (flashinfer_lite.model.Transformer) in every mode.
Tokens: dense-ram decodes greedily from a fixed prompt; every other mode is fed the same tokens one at a time
(T = 1 each) and records its own argmax, so modes are compared on identical inputs.
Prints one JSON document (stdout) and a markdown table (stderr, and --md FILE).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from numba import njit, prange  # noqa: E402

from storage.files import disk_bytes  # noqa: E402


MEMCAP = REPO / "tools" / "memcap.py"
PROMPT = "Once upon a time, there was a little"
WINDOW = 5                                      # sliding window of the neuron cache, tokens
CAP_SLACK = 640 << 20                           # interpreter + numba + numpy beyond the DRAM budget


def proc_read_bytes() -> int:
    """Bytes this process (all threads) caused to be fetched from storage: page-cache misses and O_DIRECT reads."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# Worker: one mode in this process

class Worker:
    def __init__(self, a):
        from flashinfer_lite.loader import load_weights
        from flashinfer_lite.model import Transformer
        from storage.format import FlashCheckpoint, ffn_tensor_names
        t0 = time.perf_counter()
        self.a = a
        ck = FlashCheckpoint(a.flashdir)
        self.layout, self.cfg = ck.layout, ck.config
        L = self.layout
        if L.dtype == "int8" or L.n_vec != 3 or L.biases:
            raise SystemExit("bench/e2e.py: the dense modes support f16/f32 GLU bundles without biases")
        ffn_names = {n for i in range(L.n_layers) for n in ffn_tensor_names(L, i)}
        from flashinfer_lite.model import half_matrix   # as the runtime keeps them (runtime.load_runtime)
        weights = load_weights(ck, skip=lambda n: n in ffn_names, convert=half_matrix if L.dtype != "f32" else None)
        self.resident_bytes = sum(w.nbytes for w in weights.values())
        self.prompt_ids = ck.tokenizer().encode(PROMPT)
        self.model = Transformer(self.cfg, weights, ffn=self.ffn)
        from flashinfer_lite.kernels import SparseFFN
        # Dense = the runtime's own kernel over every row: the modes differ only in where the rows come from.
        self.dense_kernel = SparseFFN.from_layout(L, max_active=max(L.n_neurons))   # act + threshold of the config
        self.all_rows = np.arange(max(L.n_neurons), dtype=np.int32)
        self.coef = self.dense_kernel.coef
        self.t = 0                          # index of the token being decoded
        self.ffn_s = self.read_s = self.lookup_s = self.compute_s = self.predictor_s = self.io_s = 0.0
        self.flash_bytes = 0                # bytes read by our own readers (mmap: from /proc/self/io)
        self.hits = self.misses = 0
        self.active_rec = None
        self.info = {}
        self.setup()
        self.warm_up()
        self.load_s = time.perf_counter() - t0

    def warm_up(self):
        """Compile (or load from numba's cache) the kernels before the clock starts."""
        L = self.layout
        B = np.zeros((2, L.stride), np.uint8)
        x = np.zeros(L.d, np.float32)
        self.dense_kernel(B, self.all_rows[:2], x, np.empty(L.d, np.float32))
        if hasattr(self, "flash"):
            self.flash.kernel(B, np.zeros(1, np.int32), x, np.empty(L.d, np.float32))
        self.compute_s = 0.0

    def region(self, B_file, layer):
        L = self.layout
        off, n = L.offset[layer], L.n_neurons[layer]
        return B_file[off:off + n * L.stride].reshape(n, L.stride)

    def dense(self, B, x):
        """y [1, d] of the dense FFN over bundle matrix B [n, stride]; self.coef[:n] <- activations."""
        L = self.layout
        y = np.empty(L.d, np.float32)
        t0 = time.perf_counter()
        self.dense_kernel(B, self.all_rows[:B.shape[0]], np.ascontiguousarray(x[0], np.float32), y)
        self.compute_s += time.perf_counter() - t0
        return y[None, :]

    # -- per mode ----------------------------------------------------------------------------------------------------
    def setup(self):
        a, L = self.a, self.layout
        if a.mode == "dense-ram":
            from storage.reader import aligned_empty
            self.B = aligned_empty((L.ffn_size,), np.uint8)
            with open(L.ffn_path, "rb", buffering=0) as f:
                mv, pos = memoryview(self.B), 0
                while pos < L.ffn_size:
                    got = f.readinto(mv[pos:pos + (64 << 20)])
                    if not got:
                        raise SystemExit("bench/e2e.py: short read of ffn.bin")
                    pos += got
            self.active_rec = np.zeros((a.n_tokens, L.n_layers, max(L.n_neurons)), bool)
        elif a.mode == "dense-mmap":
            self.B = np.memmap(L.ffn_path, np.uint8, mode="r")
        elif a.mode == "layer-stream":
            from storage.reader import aligned_empty
            from storage.reader import BundleReader
            self.reader = BundleReader(L)
            self.buf = aligned_empty((max(L.n_neurons), L.stride), np.uint8)
        elif a.mode.startswith("flash"):
            self.setup_flash()
        else:
            raise SystemExit(f"unknown mode {a.mode}")

    def setup_flash(self):
        """The runtime's own FlashFFN (neuron cache, reader, overlapped reads, sparse kernel), fed replayed sets."""
        from flashinfer_lite.budget import plan_budget
        from flashinfer_lite.errors import UserError
        from flashinfer_lite.runtime import FlashFFN
        a, L = self.a, self.layout
        with np.load(a.active, allow_pickle=False) as z:
            n = int(z["n"])
            self.active = np.unpackbits(z["active"], axis=-1, count=n).astype(bool)   # [T, L, n] original ids
            freq = z["freq"]                                                            # [L, n]
        if self.active.shape[0] < a.n_tokens or self.active.shape[1] < L.n_layers or n != max(L.n_neurons):
            raise SystemExit(f"bench/e2e.py: active sets {self.active.shape} do not cover {a.n_tokens} tokens x "
                             f"{L.n_layers} layers x {max(L.n_neurons)} neurons")
        self.active = self.active[:a.n_tokens, :L.n_layers]
        # the window's per-token reservation as the runtime makes it (runtime.expected_max_active: twice the mean);
        # a rarer, larger set is computed in window-sized pieces
        counts = self.active.sum(axis=2)
        max_active = int(min(counts.max(), 2 * counts.mean()))
        budget = int(a.budget)
        try:
            plan = plan_budget(self.cfg, L, budget, ctx=a.n_tokens, window=WINDOW, max_active=max_active,
                               resident_bytes=self.resident_bytes, lookahead=a.mode.endswith("-lookahead"))
        except UserError as e:
            self.info["below_minimum"] = str(e)
            raise BelowMinimum(str(e))

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
        self.flash = FlashFFN(self.cfg, L, plan, replay, TraceProfile(freq), overlap=not a.mode.endswith("-serial"),
                              lookahead=guess if a.mode.endswith("-lookahead") else None)
        self.info.update(budget_bytes=budget, window_rows=plan.window_rows, overlap=self.flash.overlap,
                         hot_neurons=int(sum(len(self.flash.cache.hot(i)) for i in range(L.n_layers))),
                         max_active=max_active, hot_load_s=round(time.perf_counter() - t0, 3),
                         minimum_bytes=plan.minimum_bytes, reader_threads=self.flash.reader.threads,
                         coalesce_gap=self.flash.reader.coalesce_gap, plan=plan.table(),
                         lookahead={"recall": a.lookahead_recall, "precision": a.lookahead_precision}
                         if self.flash.lookahead else None)

    def ffn(self, layer, x):
        t0 = time.perf_counter()
        mode, L = self.a.mode, self.layout
        if mode == "dense-ram":
            y = self.dense(self.region(self.B, layer), x)
            self.active_rec[self.t, layer, :L.n_neurons[layer]] = self.coef[:L.n_neurons[layer]] != 0
        elif mode == "dense-mmap":
            y = self.dense(self.region(self.B, layer), x)
        elif mode == "layer-stream":
            n = L.n_neurons[layer]
            ids = np.arange(n)
            st = self.reader.read(layer, ids, self.buf[:n], ids)
            self.read_s += st.io_s
            self.flash_bytes += st.read_bytes
            y = self.dense(self.buf[:n], x)
        else:
            y = self.flash(layer, np.asarray(x, np.float32))
        self.ffn_s += time.perf_counter() - t0
        return y

    # -- decode loop -------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.a
        ids = [int(i) for i in np.load(a.ids)] if a.ids else list(self.prompt_ids)
        greedy = not a.ids
        kv = self.model.new_cache(a.n_tokens)
        step_ms, argmax = [], []
        io0 = proc_read_bytes()
        for t in range(a.n_tokens):
            self.t = t
            t0 = time.perf_counter()
            logits = self.model.forward([ids[t]], kv)
            step_ms.append(1e3 * (time.perf_counter() - t0))
            nxt = int(np.argmax(logits))
            argmax.append(nxt)
            if greedy and t + 1 >= len(ids):
                ids.append(nxt)
        if flash := getattr(self, "flash", None):
            s = flash.stats
            self.read_s, self.lookup_s, self.compute_s = s.read_s, s.lookup_s, s.compute_s
            self.predictor_s, self.io_s = s.predictor_s, s.io_s
            self.flash_bytes, self.hits, self.misses = s.read_bytes, s.hits, s.misses
        io_bytes = proc_read_bytes() - io0
        ids = ids[:a.n_tokens]
        steady = step_ms[1:] if len(step_ms) > 1 else step_ms      # the first token pays cold caches
        total_s = sum(step_ms) / 1e3
        n = len(step_ms)
        ffn_s, comp_s = self.ffn_s, self.compute_s
        res = {"mode": a.mode, "tokens": n, "load_s": round(self.load_s, 3),
               "first_token_ms": round(step_ms[0], 2),
               "p50_ms": round(float(np.percentile(steady, 50)), 2),
               "p99_ms": round(float(np.percentile(steady, 99)), 2),
               "tokens_per_s": round(1e3 / float(np.mean(steady)), 4),
               "flash_MB_per_token": round(io_bytes / n / 1e6, 2),
               "reader_MB_per_token": round(self.flash_bytes / n / 1e6, 2),
               "read_GBps": round(io_bytes / max(self.read_s if self.read_s else total_s, 1e-9) / 1e9, 3),
               "hit_rate": round(self.hits / max(self.hits + self.misses, 1), 4) if self.hits + self.misses else None,
               "active_per_token": round((self.hits + self.misses) / n / self.layout.n_layers, 1)
               if self.hits + self.misses else None,
               "time_split_s_per_token": {"ffn_total": round(ffn_s / n, 4), "ffn_compute": round(comp_s / n, 4),
                                          "flash_read_wait": round(self.read_s / n, 4),
                                          "flash_io_in_flight": round(self.io_s / n, 4),
                                          "cache_bookkeeping": round(self.lookup_s / n, 4),
                                          "predictor": round(self.predictor_s / n, 4),
                                          "attention_and_rest": round((total_s - ffn_s) / n, 4)},
               "resident_bytes": self.resident_bytes,
               "peak_rss_bytes": peak_rss_bytes(),
               "rss_end_bytes": _psutil_rss(), "argmax": argmax, "ids": [int(i) for i in ids], **self.info}
        if self.active_rec is not None:
            np.savez_compressed(a.record, active=np.packbits(self.active_rec, axis=-1),
                                n=np.int64(self.active_rec.shape[2]),
                                freq=self.active_rec.mean(axis=0).astype(np.float32))
            res["active_share"] = round(float(self.active_rec.mean()), 4)
        return res


class BelowMinimum(Exception):
    pass


class TraceProfile:
    """What FlashFFN asks of a PredictorSet, from a replayed trace: the neuron frequencies [L, n] that choose the hot
    neurons; no magnitude threshold (the replayed sets are exact)."""

    def __init__(self, freq: np.ndarray):
        self.freq = freq

    def neuron_freq(self, layer: int) -> np.ndarray:
        return self.freq[layer]

    def act_threshold(self, layer: int) -> float:
        return 0.0


def peak_rss_bytes() -> int:
    from flashinfer_lite.budget import peak_rss_bytes as vm_hwm   # VmHWM: ru_maxrss inherits the parent's peak
    return vm_hwm()


def _psutil_rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def worker_main(a) -> int:
    try:
        w = Worker(a)
        res = w.run()
    except BelowMinimum as e:
        res = {"mode": a.mode, "below_minimum": str(e), "budget_bytes": int(a.budget)}
    Path(a.out).write_text(json.dumps(res))
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# Machine measurements: flash bandwidth at the request sizes the modes issue, DRAM bandwidth

@njit(cache=True, parallel=True)
def _sum_u64(a):
    s = 0
    for i in prange(a.shape[0]):
        s += a[i]
    return s


def dram_gbps(nbytes: int = 1 << 30) -> float:
    a = np.ones(nbytes // 8, np.uint64)
    _sum_u64(a[:1024])
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        _sum_u64(a)
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

def run_mode(a, mode: str, cap: int | None, work: Path, extra: list[str]) -> dict:
    out = work / f"{mode}.json"
    capjson = work / f"{mode}.memcap.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "-m", str(a.model), "--out", str(out),
           "--lookahead-recall", str(a.lookahead_recall), "--lookahead-precision", str(a.lookahead_precision), *extra]
    limit = str(cap) if cap else str(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    full = [sys.executable, str(MEMCAP), "--limit", limit, "--drop-caches", "--json", str(capjson), "--", *cmd]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    p = subprocess.run(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = json.loads(out.read_text()) if out.exists() else {"mode": mode, "error": p.stderr.strip()[-2000:]}
    if capjson.exists():
        res["memcap"] = json.loads(capjson.read_text())
    elif p.returncode == 3:
        res["memcap"] = {"unavailable": p.stderr.strip()}
    res["cap_bytes"] = cap
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    if p.returncode and "error" not in res:
        res["error"] = f"exit {p.returncode}: {p.stderr.strip()[-1000:]}"
    print(f"  {mode}: {res.get('p50_ms', res.get('below_minimum', res.get('error', '?')))} ({res['wall_s']} s)",
          file=sys.stderr)
    return res


def prepare_quick(work: Path) -> tuple[Path, Path]:
    """Tiny generated model (converted to a FLASHDIR) and a stories260K trace mapped onto it."""
    from storage.convert import convert
    env = dict(os.environ, PYTHONPATH=str(REPO))
    hf, flash, trace = work / "quick-hf", work / "quick-flash", work / "quick-trace.npz"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_large_model.py"), str(hf), "--layers", "2", "--dim",
                    "128", "--ffn", "2048", "--heads", "2", "--check-tokens", "0", "--force"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    convert(hf, flash, dtype="f16", force=True, progress=False)
    stories = REPO / "tests" / "data" / "stories260K"
    subprocess.run([sys.executable, str(REPO / "tools" / "record_trace.py"), "-o", str(trace), "--model",
                    str(stories), "--layers", "2", "--ffn", "2048", "--cal-tokens", "256", "--tokens", "32"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return flash, trace


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="FLASHDIR (f16/f32 GLU) made by `flashinfer-lite convert`")
    ap.add_argument("--trace", type=Path, help="trace from tools/record_trace.py (omit: oracle scenario only)")
    ap.add_argument("--cap", default="3G", help="memory cap for the capped modes (RAM + page cache)")
    ap.add_argument("--tokens", type=int, default=24, help="decode steps for dense-ram and flash modes")
    ap.add_argument("--slow-tokens", type=int, default=6, help="decode steps for dense-mmap and layer-stream")
    ap.add_argument("--budgets", default="25,50,75", help="flash DRAM budgets, %% of the model files")
    ap.add_argument("--lookahead-budgets", default="25",
                    help="also run these flash budgets with lookahead prefetch (rows '-lookahead'); '' for none")
    ap.add_argument("--lookahead-recall", type=float, default=1.0,
                    help="recall of the simulated lookahead guess (take it from bench/lookahead.py; 1 = perfect)")
    ap.add_argument("--lookahead-precision", type=float, default=1.0,
                    help="precision of the simulated lookahead guess (from bench/lookahead.py; 1 = perfect)")
    ap.add_argument("--serial-budgets", default="25",
                    help="also run these flash budgets with reads NOT overlapped with compute (rows '-serial'): "
                         "the measurement of what the overlap gains; '' for none")
    ap.add_argument("--modes", default="dense-ram,dense-mmap,layer-stream,flash",
                    help="subset of dense-ram,dense-mmap,layer-stream,flash")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of all modes (the machine is shared: compare "
                    "rows of one round)")
    ap.add_argument("--bw-seconds", type=float, default=1.0, help="seconds per flash bandwidth cell")
    ap.add_argument("--quick", action="store_true", help="tiny generated model, < 1 minute (smoke test)")
    ap.add_argument("--keep", type=Path, help="keep worker outputs in this directory")
    ap.add_argument("--md", type=Path, help="also write the markdown table here")
    # worker side
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--n-tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--active", help=argparse.SUPPRESS)
    ap.add_argument("--budget", help=argparse.SUPPRESS)
    ap.add_argument("--record", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.mode, a.flashdir = a.worker, a.model
        return worker_main(a)

    from storage.flash_bench import parse_size
    t_start = time.perf_counter()
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="e2e-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    if a.quick:
        a.model, a.trace = prepare_quick(work)
        a.tokens, a.slow_tokens, a.bw_seconds, a.budgets = 6, 6, 0.1, "75"
        a.serial_budgets = a.lookahead_budgets = "75"
        a.cap = a.cap if a.cap != "3G" else "1G"
    if not a.model:
        ap.error("-m FLASHDIR is required (or --quick)")
    from storage.format import read_layout
    L = read_layout(a.model)
    cap = parse_size(a.cap)
    model_bytes = disk_bytes(Path(a.model))
    modes = a.modes.split(",")
    print(f"e2e: {a.model}: {model_bytes / 2**30:.2f} GiB files (ffn.bin {L.ffn_size / 2**30:.2f} GiB), cap "
          f"{cap / 2**30:.2f} GiB, work dir {work}", file=sys.stderr)

    machine = {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg(),
               "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
               "dram_GBps": round(dram_gbps(256 << 20 if a.quick else 1 << 30), 2)}
    bw = flash_gbps(L.ffn_path, sorted({L.stride, 1 << 20}), a.bw_seconds)
    machine["flash_GBps"] = {str(c): round(v, 3) for c, v in bw.items()}

    ids_file = work / "ids.npy"
    oracle = work / "oracle.npz"
    results = []
    for rnd in range(1, a.repeat + 1):
        got = run_round(a, modes, cap, model_bytes, work, ids_file, oracle)
        if got is None:
            return 1
        for r in got:
            r["round"] = rnd
        results += got
    ref = next((r for r in results if r["mode"] == "dense-ram"), None)
    for r in results:
        if ref and "argmax" in r:
            k = len(r["argmax"])
            r["argmax_agree_with_dense"] = round(float(np.mean(np.array(r["argmax"]) == np.array(ref["argmax"][:k]))), 4)
        floors(r, L, model_bytes, machine, bw)
    machine["load_avg_end"] = os.getloadavg()
    doc = {"model": str(a.model), "model_bytes": model_bytes, "ffn_bytes": L.ffn_size, "cap_bytes": cap,
           "config": L.config, "stride": L.stride, "machine": machine, "results": results,
           "speedups": speedups(results),
           "seconds": round(time.perf_counter() - t_start, 1),
           "command": " ".join(["python", "bench/e2e.py", *(argv if argv is not None else sys.argv[1:])])}
    md = markdown(doc)
    print(json.dumps(doc, indent=1))
    print(md, file=sys.stderr)
    if a.md:
        a.md.write_text(md + "\n")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_round(a, modes, cap, model_bytes, work, ids_file, oracle) -> list[dict] | None:
    """Every mode once, in a fixed order. dense-ram runs first: its tokens and active sets feed the others."""
    results = []
    if "dense-ram" in modes or "flash" in modes:
        r = run_mode(a, "dense-ram", None, work, ["--n-tokens", str(a.tokens), "--record", str(oracle)])
        results.append(r)
        if "ids" not in r:
            print(json.dumps({"error": "dense-ram failed", "result": r}))
            return None
        np.save(ids_file, np.asarray(r["ids"], np.int64))
    for mode in ("dense-mmap", "layer-stream"):
        if mode in modes:
            results.append(run_mode(a, mode, cap, work, ["--n-tokens", str(min(a.slow_tokens, a.tokens)),
                                                         "--ids", str(ids_file)]))
    if "flash" in modes:
        scen = [("oracle", oracle)] + ([("trace", a.trace)] if a.trace else [])
        for name, active in scen:
            serial = {int(p) for p in a.serial_budgets.split(",") if p}
            ahead = {int(p) for p in a.lookahead_budgets.split(",") if p}
            runs = [(int(p), "") for p in a.budgets.split(",")] + [(p, "-serial") for p in sorted(serial)] \
                + [(p, "-lookahead") for p in sorted(ahead)]
            for pct, suffix in runs:
                budget = model_bytes * pct // 100
                # budgets above the cap run under budget + interpreter slack (reported per row)
                mcap = max(cap, budget + CAP_SLACK)
                r = run_mode(a, f"flash-{name}-{pct}{suffix}", mcap, work,
                             ["--n-tokens", str(a.tokens), "--ids", str(ids_file), "--active", str(active),
                              "--budget", str(budget)])
                r["scenario"], r["budget_pct"] = name, pct
                results.append(r)
    return results


def speedups(results: list[dict]) -> list[dict]:
    """Per round: P50 of dense-mmap and layer-stream over P50 of each flash row (same round, same machine load)."""
    out = []
    for rnd in sorted({r["round"] for r in results}):
        rows = {r["mode"]: r for r in results if r["round"] == rnd and "p50_ms" in r}
        for m, r in rows.items():
            if m.startswith("flash"):
                out.append({"round": rnd, "mode": m, "cap_bytes": r["cap_bytes"],
                            **{f"vs_{b}": round(rows[b]["p50_ms"] / r["p50_ms"], 2) for b in
                               ("dense-mmap", "layer-stream", "dense-ram") if b in rows}})
    return out


def floors(r: dict, L, model_bytes: int, machine: dict, bw: dict) -> None:
    """Physical floor per token: flash bytes that must be read / flash bandwidth at that request size, and DRAM bytes
    touched / DRAM bandwidth."""
    if "tokens" not in r:
        return
    dram = machine["dram_GBps"] * 1e9
    ffn, res = L.ffn_size, r.get("resident_bytes", 0)
    mode = r["mode"]
    if mode == "dense-ram":
        must_flash, req, touched = 0, L.stride, ffn + res
    elif mode in ("dense-mmap", "layer-stream"):
        # cyclic access to more than the cap: LRU keeps nothing useful, every FFN byte is read each token
        must_flash, req, touched = ffn, 1 << 20, ffn + res
    else:
        must_flash, req = r["reader_MB_per_token"] * 1e6, L.stride
        touched = r["active_per_token"] * L.n_layers * L.stride + res
    r["floor_flash_ms"] = round(1e3 * must_flash / (bw[req] * 1e9), 1)
    r["floor_dram_ms"] = round(1e3 * touched / dram, 1)


def _fmt(v, nd=1):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"model {doc['model']}: {doc['model_bytes'] / 2**30:.2f} GiB files, ffn.bin {doc['ffn_bytes'] / 2**30:.2f}"
             f" GiB; cap {doc['cap_bytes'] / 2**30:.2f} GiB; {m['cpus']} CPUs, DRAM {m['dram_GBps']} GB/s, flash "
             + ", ".join(f"{int(k) // 1024} KiB: {v} GB/s" for k, v in m["flash_GBps"].items())
             + f"; load avg {m['load_avg_start'][0]:.1f} -> {m['load_avg_end'][0]:.1f}",
             "",
             "| round | mode | cap GiB | tokens | ms/tok P50 | P99 | tok/s | flash MB/tok | read GB/s | hit rate | "
             "peak RSS MiB | memcap peak MiB | floor flash ms | floor DRAM ms | argmax = dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        cap = "uncapped" if r.get("cap_bytes") is None else f"{r['cap_bytes'] / 2**30:.2f}"
        if "tokens" not in r:
            why = r.get("below_minimum") or r.get("error", "?")
            lines.append(f"| {r['round']} | {r['mode']} | {cap} | {why.splitlines()[0][:300]} |" + " |" * 11)
            continue
        mc = r.get("memcap", {})
        lines.append(
            f"| {r['round']} | {r['mode']} | {cap} | {r['tokens']} | {_fmt(r['p50_ms'])} | {_fmt(r['p99_ms'])} | "
            f"{_fmt(r['tokens_per_s'], 3)} | {_fmt(r['flash_MB_per_token'])} | {_fmt(r['read_GBps'], 3)} | "
            f"{_fmt(r['hit_rate'], 3)} | {r['peak_rss_bytes'] / 2**20:.0f} | "
            f"{_fmt(mc.get('peak_bytes', 0) / 2**20, 0)}{' OOM' if mc.get('oom_kills') else ''} | "
            f"{_fmt(r.get('floor_flash_ms'))} | {_fmt(r.get('floor_dram_ms'))} | "
            f"{_fmt(r.get('argmax_agree_with_dense'), 2)} |")
    lines += ["", "| round | mode | s/token: FFN compute | flash read wait | reads in flight | cache bookkeeping | "
              "predictor | attention + rest |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if "time_split_s_per_token" in r:
            t = r["time_split_s_per_token"]
            lines.append(f"| {r['round']} | {r['mode']} | {t['ffn_compute']:.3f} | {t['flash_read_wait']:.3f} | "
                         f"{t.get('flash_io_in_flight', 0):.3f} | {t['cache_bookkeeping']:.3f} | {t['predictor']:.3f} | {t['attention_and_rest']:.3f} |")
    if doc["speedups"]:
        lines += ["", "| round | flash row | cap GiB | P50 speed-up vs dense-mmap | vs layer-stream | vs dense-ram |",
                  "|---|---|---|---|---|---|"]
        for x in doc["speedups"]:
            lines.append(f"| {x['round']} | {x['mode']} | {x['cap_bytes'] / 2**30:.2f} | {_fmt(x.get('vs_dense-mmap'), 2)}"
                         f" | {_fmt(x.get('vs_layer-stream'), 2)} | {_fmt(x.get('vs_dense-ram'), 2)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
