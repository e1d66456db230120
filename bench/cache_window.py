"""Bytes read from flash per token and cache hit rate vs sliding-window size and DRAM budget, as JSON.

The activation trace is recorded from the dense model (flashinfer_lite.model) over a slice of a corpus: per token
and layer, the neurons whose |a_i| (a = act(gate)*up) is at least a per-layer cut chosen so that `--active-frac`
of all activations pass (for ReLU models use --active-frac 0 to take exactly the nonzero ones). The first half of
the trace is the calibration profile for the hot region, the second half is replayed through NeuronCache with the
real BundleReader over a converted flash directory (so bytes include the reader's coalescing over-read).

With --trace TRACE.npz (written by tools/record_trace.py: a big-model trace with its own calibration frequencies)
there is no flash file: misses go to a reader that only counts, and bytes are misses x --stride (no over-read).

  PYTHONPATH=. python bench/cache_window.py [--model tests/data/stories260K] [--tokens 1024]
  PYTHONPATH=. python bench/cache_window.py --trace TRACE.npz [--stride 24576]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

import harness as h

from flashinfer_lite.budget import plan_budget
from flashinfer_lite.neuron_cache import NeuronCache, select_hot
from storage.convert import convert
from storage.format import read_layout
from storage.reader import BundleReader, CountingReader

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"       # stories260K and corpus excerpts shipped with the repo


def record_trace(model_path: Path, corpus: Path, n_tokens: int, chunk: int) -> list[np.ndarray]:
    """Per layer |a| of every token, float32 [T, n], from the dense model over the first n_tokens of corpus."""
    model, tok, _ = h.load_model(model_path, "float32")
    ids = tok.encode(corpus.read_text(encoding="utf-8"))[:n_tokens]
    acts: list[list[np.ndarray]] = [[] for _ in range(model.cfg.n_layers)]
    dense = model.ffn

    def recording_ffn(layer, x):
        acts[layer].append(np.abs(model.dense_ffn[layer].activations(x)))
        return dense(layer, x)

    model.ffn = recording_ffn
    for s in range(0, len(ids), chunk):  # independent windows of `chunk` tokens, fresh KV each
        model.forward(ids[s:s + chunk], model.new_cache(chunk), all_logits=True)
    return [np.concatenate(a) for a in acts]


def active_sets(acts: list[np.ndarray], frac: float) -> list[np.ndarray]:
    """Per layer a bool [T, n] mask: |a| above the per-layer cut (frac = 0: nonzero)."""
    out = []
    for a in acts:
        cut = np.quantile(a, 1 - frac) if frac > 0 else 0.0
        out.append(a > cut if frac == 0 else a >= cut)
    return out


def replay(n_neurons, row_bytes, reader, masks, window: int, capacity: int, hot) -> dict:
    """Run the masks (per layer [T, n]) through a NeuronCache; bytes/token, hit rate, peak window rows."""
    cache = NeuronCache(n_neurons, row_bytes, reader, capacity=capacity, window=window, hot=hot)
    T = masks[0].shape[0]
    hits = misses = read = requested = 0
    peak = 0
    for t in range(T):
        st = cache.new_token()
        for layer, m in enumerate(masks):
            cache.fetch(layer, np.flatnonzero(m[t]))
            peak = max(peak, cache.window_rows(layer))
        hits, misses, read = hits + st.hits, misses + st.misses, read + st.read_bytes
        requested += st.requested_bytes
    # requested = misses x stride; read adds the reader's coalescing over-read (gap bundles fetched and dropped)
    return {"bytes_requested_per_token": round(requested / T), "bytes_read_per_token": round(read / T),
            "hit_rate": round(hits / max(hits + misses, 1), 4),
            "peak_window_rows": peak, "hot_neurons": int(sum(len(h) for h in hot))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DATA / "stories260K")
    ap.add_argument("--corpus", type=Path, default=DATA / "corpus" / "tinystories_cased_197KB.txt")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--active-frac", type=float, default=0.2)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--trace", type=Path, default=None, help="replay a tools/record_trace.py trace instead")
    ap.add_argument("--stride", type=int, default=24576, help="bundle bytes for --trace (Llama-7B f16: 24576)")
    ap.add_argument("--coalesce-gap", type=int, default=None, help="reader gap in bundles (default: device profile)")
    args = ap.parse_args()

    if args.trace:
        print(json.dumps(replay_trace(args.trace, args.stride), indent=1))
        return
    acts = record_trace(args.model, args.corpus, args.tokens, args.chunk)
    masks = active_sets(acts, args.active_frac)
    T = masks[0].shape[0]
    calib, evalm = [m[: T // 2] for m in masks], [m[T // 2:] for m in masks]
    freqs = [m.mean(axis=0) for m in calib]
    max_active = int(max(m.sum(axis=1).max() for m in evalm))

    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:  # on the repo's disk: O_DIRECT needs a real filesystem
        flashdir = convert(args.model, Path(tmp) / "flash", dtype=args.dtype, progress=False)
        layout = read_layout(flashdir)
        n, L, stride = layout.n_neurons[0], layout.n_layers, layout.stride
        reader = BundleReader(layout, coalesce_gap=args.coalesce_gap)
        try:
            window_sweep = sweep_windows(layout.n_neurons, stride, stride, reader, evalm, freqs)
            budget_sweep = []
            cfg = layout.config
            lo = plan_budget(cfg, layout, 1 << 50, ctx=args.chunk, window=5, max_active=max_active).minimum_bytes
            for extra_frac in (0.0, 0.1, 0.25, 0.5, 1.0):
                for hot_share in (0.0, 0.5, 1.0):
                    budget = lo + int(extra_frac * L * n * stride)
                    p = plan_budget(cfg, layout, budget, ctx=args.chunk, window=5, max_active=max_active,
                                    hot_share=hot_share)
                    r = replay(layout.n_neurons, stride, reader, evalm, 5, p.window_rows, p.hot_neurons(freqs))
                    budget_sweep.append({"budget_bytes": budget, "extra_over_min_frac_of_ffn": extra_frac,
                                         "hot_share": hot_share, "window_rows": p.window_rows, **r})
            gap = reader.coalesce_gap
        finally:
            reader.close()
    per_token = [int(m.sum()) // m.shape[0] for m in evalm]
    print(json.dumps({
        "model": str(args.model), "eval_tokens": T - T // 2, "calib_tokens": T // 2, "layers": L, "n_neurons": n,
        "stride": stride, "reader_coalesce_gap": gap, "active_frac": args.active_frac,
        "mean_active_per_layer": per_token, "dense_ffn_bytes_per_token": L * n * stride,
        "no_cache_bytes_per_token": int(sum(per_token)) * stride,
        "window_sweep": window_sweep, "budget_sweep": budget_sweep}, indent=1))


def sweep_windows(n_neurons, row_bytes, stride, reader, masks, freqs) -> list[dict]:
    """Window size x hot-region size (as a share of the FFN bytes), window capacity unconstrained."""
    out = []
    ffn_bytes = sum(n_neurons) * stride
    for hot_frac in (0.0, 0.1, 0.25, 0.5):
        hot = select_hot(freqs, stride, int(hot_frac * ffn_bytes))
        for k in (1, 2, 3, 5, 8):
            cap = max(n_neurons)
            r = replay(n_neurons, row_bytes, reader, masks, k, cap, hot)
            out.append({"window": k, "hot_frac_of_ffn": hot_frac, **r})
    return out


def replay_trace(path: Path, stride: int) -> dict:
    """The window sweep over a tools/record_trace.py trace (cache rows of 512 B stand in for `stride`)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from record_trace import load_trace
    active, freq, info = load_trace(path)                     # [T, L, n], [L, n]
    masks = [active[:, i] for i in range(active.shape[1])]
    n_neurons = [active.shape[2]] * active.shape[1]
    sweep = sweep_windows(n_neurons, 512, stride, CountingReader(stride), masks, list(freq))
    per_token = [int(m.sum()) // m.shape[0] for m in masks]
    return {"trace": str(path), "trace_info": info, "stride": stride, "eval_tokens": int(active.shape[0]),
            "mean_active_per_layer": per_token, "no_cache_bytes_per_token": int(sum(per_token)) * stride,
            "window_sweep": sweep}


if __name__ == "__main__":
    sys.exit(main())
