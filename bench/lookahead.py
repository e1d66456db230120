#!/usr/bin/env python3
"""Does a lookahead predictor pay for its recall loss? (issue #6: overlap flash reads with compute)

    PYTHONPATH=. python bench/lookahead.py -m FLASHDIR [--cal-acts ACTS] [--eval-tokens 3000] [--md FILE]
    PYTHONPATH=. python bench/lookahead.py --quick      # stories260K built on the fly, < 1 minute (smoke test)

Per layer j >= 1 on held-out text, three predictors of layer j's active set (same: layer j's predictor on x_j, today's
path; naive: the same predictor on the residual after attention j-1, normed with layer j's ffn_norm; trained: a
low-rank predictor on x_{j-1}, predictors.train.train_layer on the calibration ACTS), their recall, mass recall and
precision (predictors.train.metrics), and the bytes per token a NeuronCache with the sliding window reads on and off
the critical path (today, and the hybrid that prefetches the lookahead's misses a layer early). bench/README.md,
"Lookahead predictor", defines each measure. --sparsity S measures another operating point (predictors retrained);
--load-lookahead reuses a --save-lookahead file (vary --window without retraining). Layer 0 (dense) is left out.
Prints one JSON document (stdout) and markdown tables (stderr, and --md FILE). No timings: bytes only.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import harness as h

from storage.errors import UserError  # noqa: E402

REPO, CORPUS = h.REPO, h.CORPUS
CAL_CORPUS = [CORPUS / "wikitext2_valid.txt", CORPUS / "tinystories_cased_197KB.txt"]
EVAL_CORPUS = [CORPUS / "wikitext2_test.txt"]
KINDS = ("same", "naive", "trained")
AHEAD = ("naive", "trained")
HYBRIDS = ("naive", "trained", "naive_drop", "trained_drop")


def mask_metrics(mask: np.ndarray, absa: np.ndarray, y: np.ndarray) -> dict:
    """predictors.train.metrics of a bool mask [T, n]: a predicted neuron is a logit of 1 against a cut of 0.5."""
    from predictors.train import metrics
    return {k: round(float(v), 5) for k, v in metrics(mask.astype(np.float32), absa, y, np.float32(0.5)).items()}


def window_traffic(exact: np.ndarray, ahead: dict[str, np.ndarray], stride: int, window: int, capacity: int,
                   hot: np.ndarray, warmup: int) -> dict:
    """Neurons read per policy, summed over tokens warmup.. (the caches see every token; the first ones fill the
    window from empty). exact, ahead[k]: bool [T, n] in bundle (file) order.

    Policies: "today"; per lookahead k, "k" (prefetched rows join the window: its own NeuronCache holds
    lookahead | exact) and "k_drop" (prefetched rows the exact set does not select are dropped, as the runtime's
    staging rows do: the window is today's). -> {policy: {"critical", ["prefetched", "wasted", "total"], "resident"}}
    in neuron counts (resident: rows held after each token, hot ones included). The split of each token's misses is
    computed from the resident set before the fetch and checked against the cache's own miss count.
    """
    from flashinfer_lite.neuron_cache import NeuronCache
    from storage.reader import CountingReader
    T, n = exact.shape

    def cache():
        return NeuronCache([n], stride, CountingReader(stride), capacity=capacity, window=window, hot=[hot])

    def hybrid_counts():
        return dict(prefetched=0, wasted=0, critical=0, total=0, resident=0)

    today, keep = cache(), {k: cache() for k in ahead}
    out = {"today": {"critical": 0, "resident": 0}}
    for k in ahead:
        out[k], out[k + "_drop"] = hybrid_counts(), hybrid_counts()

    def count(o, pre, late, e, rows):
        o["prefetched"] += int(pre.sum())
        o["wasted"] += int((pre & ~e).sum())
        o["critical"] += int(late.sum())
        o["total"] += int(pre.sum() + late.sum())
        o["resident"] += rows

    for t in range(T):
        on = t >= warmup
        e = exact[t]
        resident = today.slot_of(0) >= 0
        crit = e & ~resident
        st = today.new_token()
        today.fetch(0, np.flatnonzero(e))
        if st.misses != int(crit.sum()):
            raise RuntimeError("window accounting disagrees with NeuronCache (today)")
        rows = len(hot) + today.window_rows(0)
        if on:
            out["today"]["critical"] += int(crit.sum())
            out["today"]["resident"] += rows
            for k in ahead:
                a = ahead[k][t]
                count(out[k + "_drop"], a & ~resident, crit & ~a, e, rows)
        for k, c in keep.items():
            a = ahead[k][t]
            resident = c.slot_of(0) >= 0
            pre = a & ~resident                       # issued a layer ahead
            late = e & ~resident & ~a                 # the exact predictor's misses the lookahead did not cover
            st = c.new_token()
            c.fetch(0, np.flatnonzero(a | e))
            if st.misses != int(pre.sum() + late.sum()):
                raise RuntimeError(f"window accounting disagrees with NeuronCache ({k})")
            if on:
                count(out[k], pre, late, e, len(hot) + c.window_rows(0))
    return out


class LayerRows:
    """Acts.layer(i) with the last two layers kept: layer j needs rows of j-1 and j."""

    def __init__(self, acts):
        self.acts, self.kept = acts, {}

    def __call__(self, i: int):
        if i not in self.kept:
            self.kept = {k: v for k, v in self.kept.items() if k == i - 1}
            self.kept[i] = self.acts.layer(i)
        return self.kept[i]


def prepare_quick(work: Path) -> tuple[Path, Path]:
    """stories260K as an f32 FLASHDIR with predictors trained on calibration text, and its ACTS."""
    if not h.STORIES.exists():
        raise UserError(f"--quick needs {h.STORIES}")
    return h.trained_flashdir(h.STORIES, work, "f32", CAL_CORPUS, 3000, dict(rows=1500), target_recall=0.9,
                              sparsity=0.5, steps=100)


def measure(a, flash: Path, work: Path) -> dict:
    from predictors.acts import Acts, check_same_model, threshold_for
    from predictors.collect import collect
    from flashinfer_lite.predictor_set import load_predictors
    from predictors.train import flashdir_checkpoint, predictor_logits, train_layer
    from storage.format import read_layout

    preds = load_predictors(flash)
    if preds is None or not preds.has_predictors:
        raise UserError(f"{flash} has no predictors: run `flashinfer-lite train-predictor` first")
    ckpt = flashdir_checkpoint(flash)
    cfg, layout = ckpt.config, read_layout(flash, check_size=False)
    if cfg.norm != "rms" or not cfg.pre_norm or not cfg.glu:
        raise UserError("the naive lookahead input is derived for pre-norm RMS GLU models (Llama family) only")
    L, d, stride = cfg.n_layers, cfg.dim, layout.stride
    if a.hot == "runtime":
        # the neuron cache as the runtime builds it by default (hot region + window rows from its budget plan)
        rt = h.load_model(flash, "predicted", window=a.window, verify=False)[2]
        hot, capacity = [np.asarray(rt.cache.hot(i)) for i in range(L)], rt.plan.window_rows
        del rt
    else:
        hot, capacity = [np.zeros(0, np.int64)] * L, cfg.ffn_dim
    loaded = cal = None
    if a.sparsity is not None and (a.load_lookahead or not 0 < a.sparsity < 1):
        raise UserError("--sparsity must be in (0, 1) and retrains: it does not combine with --load-lookahead")
    if a.load_lookahead:
        from safetensors.numpy import load_file
        loaded = load_file(str(a.load_lookahead))
    elif a.cal_acts:
        cal = Acts(a.cal_acts)
        check_same_model(cal.identity, ckpt, a.cal_acts, flash)
    else:
        cal = Acts(collect(flash, a.cal_corpus, a.cal_tokens, work / "cal-acts", ctx=a.ctx, rows=a.cal_rows,
                           force=True))
    # every eval token is kept (rows = tokens), in corpus order: the cache replays them as a decode would
    if a.eval_acts:
        ev = Acts(a.eval_acts)
        check_same_model(ev.identity, ckpt, a.eval_acts, flash)
        if ev.manifest["rows"] != ev.tokens:
            raise UserError(f"{a.eval_acts} sampled {ev.manifest['rows']} of {ev.tokens} tokens: --eval-acts needs "
                            f"every token (collect --rows >= --tokens)")
        a.eval_corpus = ev.manifest["corpus"]
    else:
        ev = Acts(collect(flash, a.eval_corpus, a.eval_tokens, work / "eval-acts", ctx=a.ctx, rows=a.eval_tokens,
                          force=True))
    target = a.target_recall or float(preds.manifest.get("target_recall", 0.99))
    layers = [int(s) for s in a.layers.split(",")] if a.layers else list(range(1, L))
    layers = [j for j in layers if preds.rank(j) > 0]
    warmup = a.window if a.warmup is None else a.warmup
    if not 0 <= warmup < ev.tokens:
        raise UserError(f"--warmup must be in 0..{ev.tokens - 1}")
    if not layers or min(layers) < 1 or max(layers) >= L:
        raise UserError(f"--layers must name predicted layers in 1..{L - 1}")
    import torch
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    cal_rows, ev_rows = LayerRows(cal), LayerRows(ev)
    saved, rows = {}, []
    for j in tqdm(layers, desc="lookahead", unit="layer", file=sys.stderr):
        rank = preds.rank(j)
        max_rank = rank if a.no_rank_growth else min(d, 4 * rank)
        importance = np.linalg.norm(ckpt.tensor(f"layers.{j}.ffn.down.weight"), axis=0)     # [n] |down_i|
        if a.sparsity is None:
            t = preds.act_threshold(j)
            same = lambda x, j=j: preds.predict(j, x)  # noqa: E731
        else:
            # a sparser operating point than the FLASHDIR's: layer j's own predictor retrained for it, as
            # train-predictor --sparsity would
            t = threshold_for(cal.hist_count[j], cal.hist_mass[j], sparsity=a.sparsity)
            x_cal, absa_cal = cal_rows(j)
            _, Ws = train_layer(x_cal, absa_cal, t, importance, rank, max_rank, target, a.max_ratio, a.steps,
                                a.seed + j)
            same = lambda x, Ws=Ws: predictor_logits(x, *Ws) > 0  # noqa: E731
        # trained lookahead: x_{j-1} -> |a_j| > t_j on the calibration rows (same rows in every layer)
        if loaded is not None:
            try:
                W1, W2, b = (loaded[f"layers.{j}.{k}"] for k in ("w_in", "w_out", "bias"))
            except KeyError:
                raise UserError(f"{a.load_lookahead} has no lookahead for layer {j}") from None
            card = {"rank": W1.shape[0], "loaded_from": str(a.load_lookahead)}
        else:
            x_prev, _ = cal_rows(j - 1)
            _, absa_j = cal_rows(j)
            card, (W1, W2, b) = train_layer(x_prev, absa_j, t, importance, rank, max_rank, target, a.max_ratio,
                                            a.steps, a.seed + j)
        saved.update({f"layers.{j}.w_in": W1, f"layers.{j}.w_out": W2, f"layers.{j}.bias": b})
        # held-out text
        xe_prev, _ = ev_rows(j - 1)
        xe, absa = ev_rows(j)
        y = absa > t
        w_prev, w_j = (ckpt.tensor(f"layers.{i}.ffn_norm.weight") for i in (j - 1, j))
        if not np.all(w_prev != 0):
            raise UserError(f"layer {j - 1}'s ffn_norm has zero weights: the residual cannot be recovered")
        masks = {"same": same(xe),
                 "naive": same(xe_prev * (w_j / w_prev)),
                 "trained": predictor_logits(xe_prev, W1, W2, b) > 0}
        row = {"layer": j, "act_threshold": t, "true_share": round(float(y.mean()), 5)}
        for k, m in masks.items():
            row[k] = mask_metrics(m, absa, y)
        row["same"]["rank"], row["trained"]["rank"] = rank, int(card["rank"])
        row["trained"]["calibration_card"] = {k: card[k] for k in ("recall", "mass_recall", "precision",
                                                                    "pred_true_ratio", "rows", "loaded_from")
                                              if k in card}
        # what the hybrid computes on if it also used the prefetched rows: exact | lookahead (no extra bytes)
        for k in AHEAD:
            row[k]["union_recall"] = mask_metrics(masks[k] | masks["same"], absa, y)["recall"]
        bundle = layout.order[j]                        # bundle id -> original neuron id
        traffic = window_traffic(masks["same"][:, bundle], {k: masks[k][:, bundle] for k in AHEAD}, stride,
                                 a.window, capacity, hot[j], warmup)
        T = len(xe) - warmup
        row["bytes_per_token"] = {p: {k: round(v * stride / T, 1) for k, v in c.items() if k != "resident"}
                                  for p, c in traffic.items()}
        row["hot_rows"] = len(hot[j])
        row["resident_bytes"] = {p: round(c["resident"] * stride / T) for p, c in traffic.items()}
        rows.append(row)
    if a.save_lookahead:
        from safetensors.numpy import save_file
        tmp = Path(str(a.save_lookahead) + ".tmp")
        save_file(saved, str(tmp))
        os.replace(tmp, a.save_lookahead)
    return {"model": str(flash), "config": {k: cfg.to_dict()[k] for k in ("n_layers", "dim", "ffn_dim", "act")},
            "stride": stride, "window": a.window, "window_rows": capacity, "hot": a.hot, "warmup_tokens": warmup,
            "target_recall": target, "sparsity": a.sparsity,
            "same_layer_predictors": "FLASHDIR" if a.sparsity is None else f"retrained at sparsity {a.sparsity}",
            "steps": a.steps, "max_ratio": a.max_ratio, "rank_growth": not a.no_rank_growth,
            "naive_input": "residual after layer j-1's attention, normed with layer j's ffn_norm "
                           "(= x_{j-1} * w_j / w_{j-1})",
            "trained_input": "layer j-1's FFN input x_{j-1}",
            "calibration": {"acts": str(cal.path), "corpus": cal.manifest["corpus"], "tokens": cal.tokens,
                            "rows": cal.manifest["rows"], "ctx": cal.manifest["ctx"]} if cal is not None else
                           {"lookahead_from": str(a.load_lookahead)},
            "eval": {"corpus": [str(c) for c in a.eval_corpus], "tokens": ev.tokens, "ctx": ev.manifest["ctx"]},
            "layers": rows}


def summarise(doc: dict) -> None:
    """Means over layers, totals per token over layers, and the conclusion, added to doc."""
    rows = doc["layers"]
    doc["means"] = {k: {m: round(float(np.mean([r[k][m] for r in rows])), 5)
                        for m in ("recall", "mass_recall", "precision", "pred_share")} for k in KINDS}
    for k in AHEAD:
        doc["means"][k]["union_recall"] = round(float(np.mean([r[k]["union_recall"] for r in rows])), 5)
    tot = {p: {m: round(sum(r["bytes_per_token"][p][m] for r in rows), 1) for m in rows[0]["bytes_per_token"][p]}
           for p in rows[0]["bytes_per_token"]}
    doc["bytes_per_token"] = tot
    doc["resident_bytes"] = {p: sum(r["resident_bytes"][p] for r in rows) for p in rows[0]["resident_bytes"]}
    today = tot["today"]["critical"]
    con = {"layers": f"{rows[0]['layer']}..{rows[-1]['layer']}" if len(rows) > 1 else str(rows[0]["layer"]),
           "today_critical_MB_per_token": round(today / 1e6, 4)}
    res_today = doc["resident_bytes"]["today"]
    pct = lambda v, ref: f"{100 * v / ref:+.1f}%" if ref else "n/a"  # noqa: E731
    text = [f"today {today / 1e3:.1f} KB/token on the critical path (layers {con['layers']}, neuron cache "
            f"{res_today / 1e6:.1f} MB)"]
    for h in HYBRIDS:
        k, t = h.removesuffix("_drop"), tot[h]
        moved = 1 - t["critical"] / today if today else 0.0
        extra = t["total"] - today
        con[h] = {"recall": doc["means"][k]["recall"],
                  "recall_loss_vs_same": round(doc["means"]["same"]["recall"] - doc["means"][k]["recall"], 5),
                  "moved_off_critical_share": round(moved, 4),
                  "critical_MB_per_token": round(t["critical"] / 1e6, 4),
                  "prefetched_MB_per_token": round(t["prefetched"] / 1e6, 4),
                  "wasted_MB_per_token": round(t["wasted"] / 1e6, 4),
                  "extra_MB_per_token": round(extra / 1e6, 4),
                  "extra_share": round(extra / today, 4) if today else None,
                  "extra_resident_share": round(doc["resident_bytes"][h] / res_today - 1, 4) if res_today else None}
        how = "unselected prefetches dropped" if h.endswith("_drop") else "prefetches join the window"
        text.append(f"{k} lookahead ({how}; recall {con[h]['recall']:.3f} vs {doc['means']['same']['recall']:.3f}): "
                    f"{100 * moved:.1f}% of those bytes move off the critical path "
                    f"({t['critical'] / 1e3:.1f} KB/token left), {extra / 1e3:+.1f} KB/token read in all "
                    f"({pct(extra, today)}; {t['wasted'] / 1e3:.1f} KB/token prefetched but not selected; "
                    f"cache {pct(doc['resident_bytes'][h] - res_today, res_today)} rows)")
    con["text"] = "; ".join(text)
    doc["conclusion"] = con


def markdown(doc: dict) -> str:
    kb = lambda v: f"{v / 1e3:.1f}"  # noqa: E731
    cb = doc["calibration"]
    cal = (f"calibration {cb['rows']} rows of {cb['tokens']} tokens" if "rows" in cb
           else f"lookahead from {cb['lookahead_from']}")
    out = [f"model {doc['model']}: eval {doc['eval']['tokens']} tokens of "
           f"{', '.join(Path(c).name for c in doc['eval']['corpus'])}; same-layer predictors: "
           f"{doc['same_layer_predictors']}; {cal}; target recall {doc['target_recall']}; "
           f"window "
           f"{doc['window']} tokens (bytes from token {doc['warmup_tokens']} on); stride {doc['stride']} B",
           "",
           "| layer | true share | rank same / trained | recall same | naive | trained | mass recall same | naive | "
           "trained | precision same | naive | trained | predicted share same | naive | trained |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def qrow(label, share, ranks, get):
        return (f"| {label} | {share} | {ranks} | "
                + " | ".join(f"{get(k, m):.3f}" for m in ("recall", "mass_recall", "precision", "pred_share")
                             for k in KINDS) + " |")
    for r in doc["layers"]:
        out.append(qrow(r["layer"], f"{r['true_share']:.3f}", f"{r['same']['rank']} / {r['trained']['rank']}",
                        lambda k, m, r=r: r[k][m]))
    out.append(qrow("mean", f"{np.mean([r['true_share'] for r in doc['layers']]):.3f}", "",
                    lambda k, m: doc["means"][k][m]))
    def brow(label, b, pair):
        return (f"| {label} | {kb(b['today']['critical'])} | "
                + " | ".join(kb(b[k][m]) for k in pair for m in ("prefetched", "wasted", "critical", "total"))
                + " |")
    for title, pair in (("prefetched rows join the window", AHEAD),
                        ("prefetched rows the exact set does not select are dropped (the runtime's staging rows)",
                         tuple(k + "_drop" for k in AHEAD))):
        out += ["", f"KB per token (1 KB = 1000 B). Hybrid: prefetch by the lookahead, then read the exact "
                    f"predictor's misses; {title}. wasted = prefetched, not selected", "",
                "| layer | today critical | naive prefetched | wasted | critical | total | trained prefetched | "
                "wasted | critical | total |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in doc["layers"]:
            out.append(brow(r["layer"], r["bytes_per_token"], pair))
        out.append(brow("sum", doc["bytes_per_token"], pair))
    out += ["", doc["conclusion"]["text"]]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="FLASHDIR with predictors (omit with --quick: stories260K)")
    ap.add_argument("--cal-acts", type=Path, help="calibration ACTS from `flashinfer-lite collect` (e.g. the one "
                    "the predictors were trained on); default: collect --cal-tokens of --cal-corpus")
    ap.add_argument("--cal-corpus", type=Path, nargs="+", default=CAL_CORPUS)
    ap.add_argument("--cal-tokens", type=int, default=12000)
    ap.add_argument("--cal-rows", type=int, default=6000, help="sampled calibration rows (train-predictor's 70/15/15)")
    ap.add_argument("--eval-corpus", type=Path, nargs="+", default=EVAL_CORPUS)
    ap.add_argument("--eval-tokens", type=int, default=3000)
    ap.add_argument("--eval-acts", type=Path, help="held-out ACTS with every token kept (e.g. a previous run's "
                    "--keep DIR/eval-acts); default: collect --eval-tokens of --eval-corpus")
    ap.add_argument("--ctx", type=int, default=256, help="window of tokens per sequence (as `eval`)")
    ap.add_argument("--layers", help="comma-separated layers j >= 1 to measure (default: all predicted ones)")
    ap.add_argument("--window", type=int, default=5, help="sliding window of the neuron cache, tokens")
    ap.add_argument("--hot", choices=("none", "runtime"), default="none",
                    help="hot region of the simulated cache: none (window only, default), or the one the runtime's "
                         "default plan pins (load_runtime with the full DRAM budget)")
    ap.add_argument("--target-recall", type=float, help="of the trained lookahead (default: the predictors')")
    ap.add_argument("--max-ratio", type=float, default=4.0, help="as train-predictor --max-ratio")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps per layer and rank")
    ap.add_argument("--no-rank-growth", action="store_true", help="keep the same-layer predictor's rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sparsity", type=float, help="measure at another SwiGLU sparsity than the FLASHDIR's "
                    "predictors: thresholds from the calibration histograms, same-layer predictors retrained too")
    ap.add_argument("--warmup", type=int, help="first eval tokens left out of the byte counts while the window fills "
                    "from empty (default: --window)")
    ap.add_argument("--load-lookahead", type=Path, help="use the lookahead weights a previous --save-lookahead wrote "
                    "instead of training (e.g. to vary --window)")
    ap.add_argument("--save-lookahead", type=Path, help="write the trained lookahead weights (safetensors: "
                    "layers.{j}.w_in/w_out/bias, j = the layer predicted, input x_{j-1}, cut folded into bias)")
    ap.add_argument("--quick", action="store_true", help="small sizes (stories260K unless -m), < 1 minute")
    h.add_arguments(ap)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    work = h.work_dir(a, "lookahead-")
    try:
        if a.quick:
            a.cal_tokens, a.cal_rows, a.eval_tokens, a.steps, a.no_rank_growth = 3000, 1500, 400, 100, True
            if a.model is None:
                a.model, a.cal_acts = prepare_quick(work)
        if a.model is None:
            ap.error("-m FLASHDIR is required (or --quick)")
        doc = measure(a, a.model, work)
        summarise(doc)
        doc["seconds"] = round(time.perf_counter() - t0, 1)
        doc["command"] = h.command("lookahead.py", argv)
        return h.emit(doc, markdown, a.md, None)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
