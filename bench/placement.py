"""Small reads at q4 bundle size: random-read GB/s per stride, and what coalescing and neuron placement recover. JSON.

    PYTHONPATH=. python bench/placement.py --dir $BIG/placement [--model GGUF] [--corpus DIR]
                                           [--size 4GiB] [--threads 2,4,8,16] [--seconds 2] [--tokens 64]

Activations: |a| float16 [T, L, n] of a real model (default: SmolLM2-135M) over --cal-tokens of calibration text
(DIR/wikitext2_valid.txt) and --eval-tokens of held-out text (DIR/wikitext2_test.txt), recorded with
tools/record_trace.py's record_abs_activations into --dir (placement_cal.npy, placement_eval.npy; reused when there).
A neuron is active where |a| is above its layer's (1 - --active) quantile on the calibration text. Placements are
fitted on the calibration text only and evaluated on the held-out text only.

1. raw: BundleReader random reads, no coalescing, at the 7B bundle strides (f16, q4_0, q4_0 with q8_0 down), one
   layer's active set (10% of 11008) per call, 2..16 threads, on a --size scratch file (O_DIRECT: cold).
2. replay: per held-out token and layer the bundles to read, for three placements of each layer's neurons:
   identity (convert's order), freq (hottest first) and coact (co-activation chains, hot first; below),
   with and without a sliding window (misses of a 5-token window + a pinned hot region, as NeuronCache keeps);
   counted for every coalescing gap (requests per token, over-read), and timed with the real BundleReader on the
   scratch file seen as L layers of n bundles at the 7B stride (each placement in its own part of the file, the
   placements alternating token by token).
The layers keep their real width n (SmolLM2: 1536); the file has the 7B stride, so requests and over-read are what a
7B layer of that active density and co-activation structure would see, bytes per token are not (x 11008/n x 32/L).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import harness as h

from storage.sizes import parse_size  # noqa: E402
from storage.flash_bench import drop_caches, measure, synthetic_layout, write_scratch  # noqa: E402
from storage.format import REGION_ALIGN, FlashLayout, align_up  # noqa: E402
from storage.reader import BundleReader, aligned_empty  # noqa: E402

ROOT = h.REPO
DIM, FFN = 4096, 11008      # Llama-2-7B
STRIDES = {name: FlashLayout.create(DIM, [FFN], dtype, True, down_dtype=down).stride
           for name, dtype, down in (("f16", "f16", None), ("q4_0", "q4_0", None), ("q4_0+q8_0down", "q4_0", "q8_0"))}
GAPS = (-1, 0, 1, 2, 4, 8)
WINDOW = 5


# ----------------------------------------------------------------------------------------------------------------------
# Placements. coactivation_order, as Ripple does it, greedily: score every pair of neurons by how often they fire
# together on calibration text (Jaccard: tokens on which both fire / tokens on which either fires; it chained better
# than raw counts on a validation split of SmolLM2's calibration text, bench/README.md); walk the pairs from the most
# co-active down and join two neurons whenever both are still the end of their chain (and in different chains), so the
# most co-active pairs end up adjacent; lay the chains out one after another, the chains with the most activity first.
# The hottest neurons (pinned in DRAM by the cache anyway) go first, by frequency, and are left out of the chaining.
# Kept here, not in predictors/: it did not pay enough to become a pipeline step (bench/README.md, issue #12).

NEIGHBOURS = 32          # strongest co-activation partners kept per neuron (the pair list stays n x k, not n x n)
BLOCK = 1024             # neurons per block of the co-activation product (memory: BLOCK x n counts)


def frequency_order(active: np.ndarray) -> np.ndarray:
    """Bundle index -> neuron id, hottest first. active: bool [T, n]."""
    return np.argsort(-active.mean(axis=0), kind="stable").astype(np.int64)


def top_partners(active: np.ndarray, k: int = NEIGHBOURS, score: str = "jaccard") -> tuple[np.ndarray, np.ndarray]:
    """(partner ids int64 [n, k], scores float32 [n, k]) of each neuron's k most co-active others. score "count":
    tokens on which both fire; "jaccard": that over the tokens on which either fires (rare pairs count as much)."""
    a = np.ascontiguousarray(active, dtype=np.float32)            # [T, n]
    n = a.shape[1]
    fires = a.sum(axis=0)
    k = min(k, n - 1)
    ids = np.empty((n, k), np.int64)
    counts = np.empty((n, k), np.float32)
    for lo in range(0, n, BLOCK):
        c = a[:, lo:lo + BLOCK].T @ a                              # [b, n] co-activation counts
        if score == "jaccard":
            c /= np.maximum(fires[lo:lo + BLOCK, None] + fires[None, :] - c, 1)
        c[np.arange(c.shape[0]), np.arange(lo, lo + c.shape[0])] = -1   # not its own partner
        part = np.argpartition(-c, k - 1, axis=1)[:, :k]
        ids[lo:lo + BLOCK] = part
        counts[lo:lo + BLOCK] = np.take_along_axis(c, part, axis=1)
    return ids, counts


def chain(n: int, i: np.ndarray, j: np.ndarray, w: np.ndarray) -> list[list[int]]:
    """Greedy path cover: edges (i, j) by weight w, heaviest first, joined when both ends are chain ends of different
    chains. Returns the chains (every node in exactly one)."""
    root = np.arange(n)

    def find(x):
        while root[x] != x:
            root[x] = root[root[x]]
            x = root[x]
        return x

    nbr = [[] for _ in range(n)]
    for e in np.argsort(-w, kind="stable").tolist():
        a, b = int(i[e]), int(j[e])
        if w[e] <= 0 or len(nbr[a]) == 2 or len(nbr[b]) == 2:
            continue
        ra, rb = find(a), find(b)
        if ra == rb:
            continue
        root[ra] = rb
        nbr[a].append(b)
        nbr[b].append(a)
    chains, seen = [], np.zeros(n, bool)
    for s in range(n):
        if seen[s] or len(nbr[s]) == 2:
            continue                                  # start walks at chain ends (or lone nodes)
        path, prev, cur = [], -1, s
        while cur != -1:
            path.append(cur)
            seen[cur] = True
            nxt = [x for x in nbr[cur] if x != prev]
            prev, cur = cur, (nxt[0] if nxt else -1)
        chains.append(path)
    return chains


def coactivation_order(active: np.ndarray, hot: int = 0, k: int = NEIGHBOURS, score: str = "jaccard") -> np.ndarray:
    """Bundle index -> neuron id: the `hot` most frequent neurons first, then the rest in co-activation chains.
    active: bool [T, n] on calibration text."""
    freq = active.mean(axis=0)
    by_freq = np.argsort(-freq, kind="stable")
    hot_ids, rest = by_freq[:hot], np.sort(by_freq[hot:])
    ids, counts = top_partners(active[:, rest], k, score)
    src = np.repeat(np.arange(rest.size), ids.shape[1])
    chains = chain(rest.size, src, ids.ravel(), counts.ravel())
    chains.sort(key=lambda c: -freq[rest[c]].sum())
    order = np.concatenate([hot_ids] + [rest[c] for c in chains]).astype(np.int64)
    assert np.array_equal(np.sort(order), np.arange(active.shape[1]))
    return order


# ----------------------------------------------------------------------------------------------------------------------
# Measurements


def raw_grid(path: Path, size: int, threads: list[int], seconds: float) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for name, stride in STRIDES.items():
        for t in threads:
            drop_caches(path)
            with BundleReader(synthetic_layout(path, stride, size), threads=t, coalesce_gap=-1, engine="threads") as r:
                assert r.direct, "O_DIRECT refused: put --dir on a real device"
                m = measure(r, size // stride, FFN // 10, seconds, rng)
            rows.append({"bundle": name, "stride": stride, "threads": t,
                         "GBps": round(m["read_bytes"] / m["seconds"] / 1e9, 3),
                         "IOPS": round(m["n_reads"] / m["seconds"]),
                         "ms_per_1100_bundles": round(1e3 * m["seconds"] / m["calls"], 2)})
            print(f"raw {name:14s} {stride:6d} B x {t:2d} thr: {rows[-1]['GBps']:.3f} GB/s "
                  f"{rows[-1]['IOPS']} IOPS", file=sys.stderr)
    return rows


def to_read(active: np.ndarray, hot: np.ndarray | None, window: int) -> list[np.ndarray]:
    """Per token the neuron ids to fetch: all active ones (window 0), or those neither hot nor active in the last
    `window` tokens (what a NeuronCache with room enough would miss)."""
    T, n = active.shape
    keep = np.zeros(n, bool)
    if hot is not None:
        keep[hot] = True
    out = []
    for t in range(T):
        seen = keep | (active[max(0, t - window):t].any(axis=0) if window and t else False)
        out.append(np.flatnonzero(active[t] & ~seen))
    return out


def count_runs(ids: np.ndarray, gap: int) -> tuple[int, int]:
    """(requests, bundles read) when the sorted bundle ids are read with coalescing gap `gap` (< 0: none)."""
    if ids.size == 0:
        return 0, 0
    holes = np.diff(ids) - 1
    joined = holes <= gap if gap >= 0 else np.zeros(holes.size, bool)
    return int(ids.size - joined.sum()), int(ids.size + holes[joined].sum())


def replay(path: Path, size: int, stride: int, sets: dict[str, list[list[np.ndarray]]], n: int, threads: int,
           tokens: int, timed_gaps: list[int]) -> list[dict]:
    """sets[placement][layer][token] = bundle ids (sorted). Counted over all tokens, timed over the first `tokens`."""
    names = list(sets)
    n_layers = len(next(iter(sets.values())))
    T = len(sets[names[0]][0])
    region = align_up(n * stride, REGION_ALIGN)
    # each placement is its own model file: its own layer regions, spread over the scratch file
    span = size // len(names) // REGION_ALIGN * REGION_ALIGN
    assert n_layers * region <= span, f"scratch file too small for {len(names)} x {n_layers} layers at {stride} B"
    step = span // n_layers // REGION_ALIGN * REGION_ALIGN
    rows = []
    for gap in GAPS:
        timed = {p: 0.0 for p in names}
        stats = {p: [0, 0, 0, 0] for p in names}    # requests, bundles read, bundles wanted, reader calls (timed)
        for p in names:
            for layer in range(n_layers):
                for ids in sets[p][layer]:
                    req, got = count_runs(ids, gap)
                    stats[p][0] += req
                    stats[p][1] += got
                    stats[p][2] += ids.size
        readers = {}
        for k, p in enumerate(names):
            lay = synthetic_layout(path, stride, size)
            lay.offset = [k * span + i * step for i in range(n_layers)]
            lay.n_neurons, lay.order, lay.checksum = [n] * n_layers, [np.arange(n)] * n_layers, [""] * n_layers
            readers[p] = BundleReader(lay, threads=threads, coalesce_gap=gap)
        dest = aligned_empty((n, stride), np.uint8)
        drop_caches(path)
        try:
            for t in range(min(tokens, T) if gap in timed_gaps else 0):
                for p in names[t % len(names):] + names[:t % len(names)]:      # A B C, B C A, ...: drift spreads evenly
                    t0 = time.perf_counter()
                    for layer in range(n_layers):
                        ids = sets[p][layer][t]
                        if ids.size:
                            stats[p][3] += readers[p].read(layer, ids, dest, np.arange(ids.size)).n_reads
                    timed[p] += time.perf_counter() - t0
        finally:
            for r in readers.values():
                r.close()
        Tt = min(tokens, T)
        for p in names:
            req, got, want, calls = stats[p]
            rows.append({"placement": p, "gap": gap, "requests_per_token": round(req / T, 1),
                         "bundles_per_token": round(want / T, 1), "over_read": round(got / max(want, 1) - 1, 3),
                         "read_MB_per_token": round(got * stride / T / 1e6, 3),
                         **({"measured_ms_per_token": round(1e3 * timed[p] / Tt, 2),
                             "measured_preadv_per_token": round(calls / Tt, 1)} if gap in timed_gaps else {})})
        line = "  ".join(f"{r['placement']}: {r['requests_per_token']:.0f} req "
                         f"{r.get('measured_ms_per_token', 0):.1f} ms" for r in rows[-len(names):])
        print(f"replay stride {stride} gap {gap:2d}: {line}", file=sys.stderr)
    return rows


def counted(orders: list[np.ndarray], active: list[np.ndarray], gap: int) -> float:
    """Requests per token and layer for all active neurons of `active` (per layer bool [T, n]) under `orders`."""
    req = [count_runs(np.sort(np.argsort(o)[np.flatnonzero(row)]), gap)[0] for o, a in zip(orders, active) for row in a]
    return round(float(np.mean(req)), 1)


def record_trace_mapping(active: list[np.ndarray], width: int = FFN, seed: int = 0) -> dict:
    """tools/record_trace.py widens a small layer to `width` by copying each small neuron ~width/n times (shuffled).
    The copies are active on exactly the same tokens, so a placement that stores them side by side merges ~width/n
    bundles per read for free: a mapping artefact, not co-activation of distinct neurons. Counted on one layer."""
    n = active[0].shape[1]
    parent = np.random.default_rng(seed).permutation(np.arange(width) % n)      # as record_trace does
    big = [active[0][:, parent]]
    return {"copies_per_neuron": round(width / n, 2),
            "requests_per_token_gap0_identity": counted([np.arange(width)], big, 0),
            "requests_per_token_gap0_copies_adjacent": counted([np.argsort(parent, kind="stable")], big, 0)}


def validate(cal: np.ndarray, active_share: float, n_hot: int) -> dict:
    """How coactivation_order's settings were chosen, on calibration text only: fit on its first 3/4, count requests
    per token and layer (gap 0) on the last 1/4, every other layer; all active neurons and the cache's misses."""
    T, L, n = cal.shape
    cut = T * 3 // 4
    variants = {f"{score}_hot{h}_k{k}": {"score": score, "hot": h, "k": k}
                for score in ("count", "jaccard") for h in (0, n_hot) for k in (8, 32)}
    out: dict[str, dict[str, list]] = {}
    for layer in range(0, L, 2):
        a = np.asarray(cal[:, layer], np.float32)
        active = a > np.quantile(a[:cut], 1 - active_share)
        fit, val = active[:cut], active[cut:]
        sets = {"all_active": [np.flatnonzero(row) for row in val],
                "cache_misses": to_read(val, frequency_order(fit)[:n_hot], WINDOW)}
        orders = {"identity": np.arange(n), **{v: coactivation_order(fit, **kw) for v, kw in variants.items()}}
        for name, order in orders.items():
            bundle_of = np.argsort(order)
            for what, rows in sets.items():
                req = np.mean([count_runs(np.sort(bundle_of[ids]), 0)[0] for ids in rows])
                out.setdefault(name, {}).setdefault(what, []).append(req)
    return {name: {what: round(float(np.mean(v)), 1) for what, v in d.items()} for name, d in out.items()}


def record(model: Path | None, corpus: Path, n_cal: int, n_eval: int, out: Path) -> tuple[Path, Path]:
    """placement_{cal,eval}.npy in `out`: |a| [T, L, n] over calibration and held-out text (kept across runs)."""
    paths = out / "placement_cal.npy", out / "placement_eval.npy"
    if all(p.exists() for p in paths):
        return paths
    sys.path.insert(0, str(ROOT / "tools"))
    from record_trace import record_abs_activations, text_tokens

    from flashinfer_lite.default_model import ensure_default_model
    m, tok, _ = h.load_model(model or ensure_default_model(), "float32")
    for path, text, n in zip(paths, ("wikitext2_valid.txt", "wikitext2_test.txt"), (n_cal, n_eval)):
        np.save(path, record_abs_activations(m, text_tokens(tok, corpus / text, n)))
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the scratch file goes (a real device)")
    ap.add_argument("--model", type=Path, default=None, help="model to record (default: the default model)")
    ap.add_argument("--corpus", type=Path, default=ROOT / "tests" / "data" / "corpus",
                    help="directory with wikitext2_valid.txt (calibration) and wikitext2_test.txt (held out)")
    ap.add_argument("--cal-tokens", type=int, default=4096)
    ap.add_argument("--eval-tokens", type=int, default=768)
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--threads", default="2,4,8,16")
    ap.add_argument("--replay-threads", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=64, help="held-out tokens timed per (placement, gap)")
    ap.add_argument("--active", type=float, default=0.10, help="share of calibration |a| counted active")
    ap.add_argument("--hot", type=float, default=0.10, help="share of neurons pinned (windowed replay)")
    ap.add_argument("--strides", default="q4_0,f16")
    ap.add_argument("--gaps", default=",".join(map(str, GAPS)), help="coalescing gaps timed (all are counted)")
    ap.add_argument("--skip-raw", action="store_true")
    ap.add_argument("--validate", action="store_true", help="only compare coactivation_order's settings (no reads)")
    args = ap.parse_args()
    size = parse_size(args.size)
    cal_path, eval_path = record(args.model, args.corpus, args.cal_tokens, args.eval_tokens, args.dir)
    cal = np.load(cal_path, mmap_mode="r")
    ev = np.load(eval_path, mmap_mode="r")
    _, L, n = cal.shape
    if args.validate:
        print(json.dumps(validate(cal, args.active, int(args.hot * n)), indent=1))
        return 0
    t0 = time.perf_counter()
    placements = {"identity": [], "freq": [], "coact": []}
    act_cal, act_ev = [], []
    for layer in range(L):
        a = np.asarray(cal[:, layer], np.float32)
        thr = np.quantile(a, 1 - args.active)
        act_cal.append(a > thr)
        act_ev.append(np.asarray(ev[:, layer], np.float32) > thr)
        placements["identity"].append(np.arange(n))
        placements["freq"].append(frequency_order(act_cal[-1]))
        placements["coact"].append(coactivation_order(act_cal[-1], hot=int(args.hot * n)))
    fit_s = time.perf_counter() - t0
    n_hot = int(args.hot * n)
    modes = {"all_active": (None, 0), f"window{WINDOW}+hot{args.hot:g}": ("hot", WINDOW)}
    sets = {}
    for mode, (hot, window) in modes.items():
        sets[mode] = {}
        for p, orders in placements.items():
            per_layer = []
            for layer in range(L):
                bundle_of = np.argsort(orders[layer])                   # neuron id -> bundle index
                hot_ids = np.argsort(-act_cal[layer].mean(axis=0), kind="stable")[:n_hot] if hot else None
                per_layer.append([np.sort(bundle_of[ids]) for ids in to_read(act_ev[layer], hot_ids, window)])
            sets[mode][p] = per_layer

    # Upper bound, not a result: the co-activation order fitted on the held-out text itself.
    oracle = [coactivation_order(a, hot=n_hot) for a in act_ev]
    counts = {f"gap{g}": {**{p: counted(o, act_ev, g) for p, o in placements.items()},
                          "coact_fit_on_eval_upper_bound": counted(oracle, act_ev, g)} for g in GAPS}
    # The same bound for the windowed reads: the hot region, then chains fitted on the held-out misses themselves.
    window_mode = list(modes)[1]
    oracle_w, misses_ev = [], []
    for layer in range(L):
        hot_ids = placements["freq"][layer][:n_hot]
        m = np.zeros_like(act_ev[layer])
        for t, ids in enumerate(to_read(act_ev[layer], hot_ids, WINDOW)):
            m[t, ids] = True
        misses_ev.append(m)
        chained = coactivation_order(m, hot=0)
        oracle_w.append(np.concatenate([hot_ids, chained[~np.isin(chained, hot_ids)]]))
    counts_w = {f"gap{g}": {"identity": counted(placements["identity"], misses_ev, g),
                            "coact": counted(placements["coact"], misses_ev, g),
                            "coact_fit_on_eval_misses_upper_bound": counted(oracle_w, misses_ev, g)} for g in GAPS}
    path = args.dir.resolve() / f".placement-{os.getpid()}.tmp"
    out = {"cal_tokens": int(cal.shape[0]), "eval_tokens": int(ev.shape[0]), "layers": L, "n_neurons": n,
           "active": args.active, "strides": STRIDES, "fit_seconds": round(fit_s, 1),
           "active_per_layer_eval": round(float(np.mean([a.sum(axis=1).mean() for a in act_ev])), 1),
           "requests_per_token_per_layer_all_active": counts,
           f"requests_per_token_per_layer_{window_mode}": counts_w,
           "record_trace_mapping": record_trace_mapping(act_ev)}
    try:
        write_scratch(path, size)
        out["load_before"] = os.getloadavg()
        if not args.skip_raw:
            out["raw"] = raw_grid(path, size, [int(t) for t in args.threads.split(",")], args.seconds)
        out["replay"] = {}
        for s in args.strides.split(","):
            for mode in modes:
                out["replay"][f"{s}/{mode}"] = replay(path, size, STRIDES[s], sets[mode], n, args.replay_threads,
                                                      args.tokens, [int(g) for g in args.gaps.split(",")])
        out["load_after"] = os.getloadavg()
    finally:
        path.unlink(missing_ok=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
