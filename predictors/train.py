"""`flashinfer-lite train-predictor ACTS -o FLASHDIR [--rank R] [--target-recall 0.99] [--sparsity S]`.

Per layer:
  1. the activation threshold t_l: 0 for ReLU-family models (active = a != 0); for SwiGLU the |a| magnitude under
     which a share S of activations falls (CATS / TEAL), or under which a share 1-M of the |a| mass falls (--kept-mass);
  2. a low-rank predictor x [d] -> r -> n, sigmoid (Deja Vu, LLM in a Flash), trained in torch with balanced BCE to
     tell |a| > t_l; the decision threshold (a logit cut per neuron, see tune_cut) is tuned on held-out rows to reach
     the target recall, and the rank is doubled for layers whose recall (on a second held-out split) or
     over-prediction misses the mark. The first --dense-layers layers get no predictor (all neurons predicted), and
     neither does a layer whose predictor, at the target recall, would still select more than --max-read-share of
     its neurons on held-out rows: there the predictor saves few reads and its misses cost perplexity, so every
     neuron is read and the exact threshold alone decides (SwiGLU models such as SmolLM2: see docs/PREDICTORS.md).
Rows are split in corpus order: 70% train, 15% to tune the decision threshold, 15% to report (text neither saw).
Everything lands in FLASHDIR/predictors/ (read by flashinfer_lite/predictor_set.py), written to a temp dir and renamed into place.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from storage.errors import UserError
from flashinfer_lite.model import is_flashdir, open_any
from flashinfer_lite.process import keep_freed_arrays_out_of_rss
from flashinfer_lite.predictor_set import save_expert_freq
from storage.predictor_files import write_predictor_files

from .acts import Acts, check_same_model, relu_family, threshold_for

DEFAULT_SWIGLU_SPARSITY = 0.5
DEFAULT_MAX_READ_SHARE = 0.9
DEFAULT_TARGET_RECALL = 0.99


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("acts", metavar="ACTS", help="activations directory written by `flashinfer-lite collect`")
    parser.add_argument("-o", "--output", required=True, metavar="FLASHDIR",
                        help="flash directory of the same model (made by `flashinfer-lite convert`)")
    parser.add_argument("--rank", type=int, default=None,
                        help="starting rank of the low-rank predictors (default: dim/8 clamped to 16..128)")
    parser.add_argument("--max-rank", type=int, default=None, help="rank cap when raising it (default 4x --rank)")
    sel = parser.add_mutually_exclusive_group()
    sel.add_argument("--target-recall", type=float, default=None,
                     help="share of truly active neurons the predictor must select (default 0.99)")
    sel.add_argument("--keep", type=float, default=None, metavar="F",
                     help="instead of a recall target, a read budget: each layer's predictor selects a share F of "
                          "its neurons on held-out rows (those it scores highest), trained on the top F of |a|; the "
                          "activation threshold defaults to none (--sparsity 0: every selected neuron counts)")
    parser.add_argument("--max-ratio", type=float, default=4.0,
                        help="raise the rank of layers predicting more than this many neurons per truly active "
                             "one (default 4.0)")
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--sparsity", type=float, default=None,
                   help=f"SwiGLU: share of activations to skip, per layer (default {DEFAULT_SWIGLU_SPARSITY})")
    g.add_argument("--kept-mass", type=float, default=None,
                   help="SwiGLU: instead of --sparsity, keep the neurons carrying this share of |a| mass")
    parser.add_argument("--dense-layers", type=int, default=1, metavar="K",
                        help="the first K layers get no predictor (all neurons predicted; the activation threshold "
                             "still applies). Layer 0 sees little more than the token, and rare tokens then fire "
                             "large neurons no predictor saw in training (default 1)")
    parser.add_argument("--max-read-share", type=float, default=DEFAULT_MAX_READ_SHARE, metavar="F",
                        help="a layer whose predictor would select more than this share of its neurons gets none "
                             f"(all neurons read, the threshold decides; default {DEFAULT_MAX_READ_SHARE})")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per layer and rank (default 400)")
    parser.add_argument("--thresholds-only", action="store_true",
                        help="store activation thresholds and neuron frequencies, train no predictors")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    cards = train(args.acts, args.output, rank=args.rank, max_rank=args.max_rank, target_recall=args.target_recall,
                  keep=args.keep, max_ratio=args.max_ratio, sparsity=args.sparsity, kept_mass=args.kept_mass,
                  steps=args.steps, dense_layers=args.dense_layers, max_read_share=args.max_read_share,
                  thresholds_only=args.thresholds_only, seed=args.seed)
    if cards:                                  # none for a mixture of experts: train said what it wrote
        print(format_cards(cards))
    return 0


def format_cards(cards: list[dict]) -> str:
    head = (f"{'layer':>5} {'t_act':>9} {'true':>6} {'rank':>5} {'recall':>7} {'mass_rec':>8} {'prec':>6} "
            f"{'pred/true':>9} {'bytes':>9}")
    lines = [head]
    for c in cards:
        if c.get("dense") and c.get("rank"):
            lines.append(f"{c['layer']:>5} {c['act_threshold']:>9.4g} {c['true_share']:>6.3f}  dense: a predictor "
                         f"(rank {c['rank']}, recall {c['recall']:.4f}) would select {c['pred_share']:.3f} of it")
        elif c.get("dense"):
            lines.append(f"{c['layer']:>5} {c['act_threshold']:>9.4g} {c['true_share']:>6.3f}  dense (no predictor)")
        elif c.get("rank"):
            lines.append(f"{c['layer']:>5} {c['act_threshold']:>9.4g} {c['true_share']:>6.3f} {c['rank']:>5} "
                         f"{c['recall']:>7.4f} {c['mass_recall']:>8.4f} {c['precision']:>6.3f} "
                         f"{c['pred_true_ratio']:>9.3f} {c['bytes']:>9}"
                         + (f"  reads {c['pred_share']:.3f}, output mass kept {c['mass_kept']:.3f}"
                            if "mass_kept" in c else ""))
        else:
            lines.append(f"{c['layer']:>5} {c['act_threshold']:>9.4g} {c['true_share']:>6.3f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# One layer

def split_rows(R: int) -> tuple[slice, slice, slice]:
    a, b = int(R * 0.70), int(R * 0.85)
    return slice(0, a), slice(a, b), slice(b, R)


def fit_low_rank(x: np.ndarray, y: np.ndarray, rank: int, steps: int, seed: int) -> tuple[np.ndarray, ...]:
    """Train logits = ((x - mu) / s) W1^T W2^T + b on labels y with balanced BCE.

    x float32 [R, d], y bool [R, n] -> (W1 [r, d], W2 [n, r], b [n]) with the standardisation folded in, so that
    inference is x @ W1^T @ W2^T + b.
    """
    import torch
    torch.manual_seed(seed)
    R, d = x.shape
    n = y.shape[1]
    mu = x.mean(0)
    s = x.std(0) + 1e-6
    X = torch.from_numpy((x - mu) / s)
    Y = torch.from_numpy(y.astype(np.float32))
    p = Y.mean(0).clamp(1.0 / R, 1 - 1.0 / R)                    # [n] positive rate per neuron
    w_pos, w_neg = 0.5 / p, 0.5 / (1 - p)                         # balanced: both classes weigh the same per neuron
    lin1 = torch.nn.Linear(d, rank, bias=False)
    lin2 = torch.nn.Linear(rank, n, bias=True)
    with torch.no_grad():
        lin2.bias.copy_(torch.log(p / (1 - p)))
    params = list(lin1.parameters()) + list(lin2.parameters())
    opt = torch.optim.Adam(params, lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    batch = min(512, R)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, R, (batch,), generator=gen)
        xb, yb = X[idx], Y[idx]
        logits = lin2(lin1(xb))
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, yb, reduction="none")
        loss = (bce * (yb * w_pos + (1 - yb) * w_neg)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    W1 = lin1.weight.detach().numpy() / s[None, :]                # [r, d]
    W2 = lin2.weight.detach().numpy()                             # [n, r]
    b = lin2.bias.detach().numpy() - W2 @ (W1 @ mu)               # [n]
    # Stored as float16 weights: compute the metrics with exactly what will be stored.
    return W1.astype(np.float16), W2.astype(np.float16), b.astype(np.float32)


def predictor_logits(x: np.ndarray, W1: np.ndarray, W2: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (x @ W1.astype(np.float32).T) @ W2.astype(np.float32).T + b


def tune_cut(logits: np.ndarray, absa: np.ndarray, y: np.ndarray, target: float,
             importance: np.ndarray) -> np.ndarray:
    """Per-neuron logit cuts [n] (predict logit > cut) tuned on these rows.

    A layer-wide cut is lowered until both the recall (share of active neurons selected) and the output-weighted
    mass recall (share of sum |a_i| * |down_i| selected) reach the target plus two binomial standard errors, so that
    it still holds on text it was not tuned on. Then each neuron's cut is lowered further, if needed, until that
    neuron alone reaches the target recall: a few rarely-predicted neurons with large outputs otherwise cost more
    perplexity than many small misses."""
    n = y.shape[1]
    P = int(y.sum())
    if P == 0:
        return np.full(n, np.inf, np.float32)
    w = (absa * importance[None, :])[y].astype(np.float64)
    pos_logits = logits[y]
    order = np.argsort(pos_logits)[::-1]                          # positives, most confident first
    pos, mass = pos_logits[order], np.cumsum(w[order])
    goal = min(1.0, target + 2.0 * math.sqrt(target * (1 - target) / P))
    k_count = int(math.ceil(goal * P))                            # positives that must be kept
    k_mass = int(np.searchsorted(mass, goal * mass[-1] * (1 - 1e-12))) + 1
    k = min(P, max(k_count, k_mass, 1))
    cuts = np.full(n, np.nextafter(pos[k - 1], -np.inf), np.float32)
    for j in np.flatnonzero(y.any(0)):
        pj = np.sort(logits[y[:, j], j])[::-1]
        kj = int(math.ceil(target * len(pj)))
        cuts[j] = min(cuts[j], np.nextafter(pj[kj - 1], -np.inf))
    return cuts


def metrics(logits: np.ndarray, absa: np.ndarray, y: np.ndarray, cut: np.ndarray) -> dict:
    pred = logits > cut
    tp = int((pred & y).sum())
    n_true, n_pred = int(y.sum()), int(pred.sum())
    mass = float(absa[y].sum())
    return {"recall": tp / max(n_true, 1), "mass_recall": float(absa[pred & y].sum()) / mass if mass else 1.0,
            "precision": tp / max(n_pred, 1), "pred_true_ratio": n_pred / max(n_true, 1),
            "pred_share": n_pred / y.size, "true_share": n_true / y.size}


def train_layer(x, absa, t: float, importance: np.ndarray, rank: int, max_rank: int, target: float,
                max_ratio: float, steps: int, seed: int) -> tuple[dict, tuple]:
    """(card metrics, (W_in f16 [r, d], W_out f16 [n, r], bias f32 [n] with the cuts folded in)) for one layer."""
    R = len(x)
    tr, ca, te = split_rows(R)
    y = absa > t
    best = None
    r = rank
    while True:
        W1, W2, b = fit_low_rank(x[tr], y[tr], r, steps, seed)
        cut = tune_cut(predictor_logits(x[ca], W1, W2, b), absa[ca], y[ca], target, importance)
        m = metrics(predictor_logits(x[te], W1, W2, b), absa[te], y[te], cut)
        m.update(rank=r, bytes=int(W1.nbytes + W2.nbytes + b.nbytes))
        met = m["recall"] >= target and m["mass_recall"] >= target
        ok = met and m["pred_true_ratio"] <= max_ratio
        key = (met, -m["pred_true_ratio"])
        if best is None or key > best[0]:
            best = (key, m, (W1, W2, (b - cut).astype(np.float32)))    # the cut folds into the bias
        if ok or r * 2 > max_rank:
            break
        r *= 2
    _, m, w = best
    m["rows"] = {"train": tr.stop - tr.start, "tune": ca.stop - ca.start, "test": te.stop - te.start}
    return m, w


def share_cut(logits: np.ndarray, keep: float) -> float:
    """The logit cut under which all but the top share `keep` of these scores fall: one cut for the whole layer, so
    what a token reads is the neurons the predictor scores highest, about keep x n of them on average."""
    flat = np.sort(logits, axis=None)
    k = int(round(keep * flat.size))                # scores kept: the k highest
    return float(flat[flat.size - k - 1]) if k < flat.size else -np.inf


def train_layer_keep(x, absa, t_label: float, importance: np.ndarray, rank: int, keep: float, steps: int,
                     seed: int) -> tuple[dict, tuple]:
    """train_layer for a read budget: learn |a| > t_label (the top share `keep` of |a| over the calibration tokens),
    then one layer-wide cut so that a share `keep` of the tuning rows' scores clear it. The card adds `mass_kept`,
    the share of the output-weighted mass sum |a_i| * |down_i| the selection holds on the reporting rows."""
    tr, ca, te = split_rows(len(x))
    y = absa > t_label
    W1, W2, b = fit_low_rank(x[tr], y[tr], rank, steps, seed)
    # Balanced BCE leaves out each neuron's prior odds: a layer-wide cut on those logits would favour rare neurons.
    # Adding them back ranks by the estimated probability itself (on the real Qwen2.5-0.5B's layer 12 at F 0.75: 0.868
    # of the output mass kept in place of 0.839).
    p = np.clip(y[tr].mean(0), 1.0 / len(x), 1 - 1.0 / len(x))
    b = (b + np.log(p / (1 - p))).astype(np.float32)
    cut = np.float32(share_cut(predictor_logits(x[ca], W1, W2, b), keep))
    logits = predictor_logits(x[te], W1, W2, b)
    m = metrics(logits, absa[te], y[te], np.full(y.shape[1], cut, np.float32))
    w = absa[te].astype(np.float64) * importance[None, :]
    m.update(rank=rank, bytes=int(W1.nbytes + W2.nbytes + b.nbytes),
             mass_kept=float(w[logits > cut].sum() / max(w.sum(), 1e-30)),
             rows={"train": tr.stop - tr.start, "tune": ca.stop - ca.start, "test": te.stop - te.start})
    return m, (W1, W2, (b - cut).astype(np.float32))


# ----------------------------------------------------------------------------------------------------------------------
# The command

def flashdir_checkpoint(flashdir):
    if not is_flashdir(flashdir):
        raise UserError(f"{flashdir} is not a flash directory: make one with `flashinfer-lite convert MODEL -o "
                        f"{flashdir}` first")
    return open_any(flashdir)


def train(acts_dir, flashdir, rank=None, max_rank=None, target_recall=None, keep=None, max_ratio=4.0, sparsity=None,
          kept_mass=None, steps=400, dense_layers=1, max_read_share=DEFAULT_MAX_READ_SHARE, thresholds_only=False, seed=0, progress=True,
          calibration: dict | None = None, threads: int | None = None, on_layer=None) -> list[dict]:
    """Thresholds and predictors for every layer, saved into FLASHDIR/predictors; `calibration` (where the text came
    from) is recorded in its manifest as is. threads: torch threads (default: up to 2). on_layer(card, bar): called
    after each layer with its card (a trained layer's has "seconds") and the progress bar. keep: a read budget in
    place of target_recall (train_layer_keep); every layer past dense_layers keeps its predictor."""
    if keep is not None and target_recall is not None:
        raise UserError("give --keep or --target-recall, not both")
    if keep is not None and not 0 < keep < 1:
        raise UserError(f"--keep must be in (0, 1) (got {keep})")
    if keep is None and target_recall is None:
        target_recall = DEFAULT_TARGET_RECALL
    if target_recall is not None and not 0 < target_recall <= 1:
        raise UserError(f"--target-recall must be in (0, 1] (got {target_recall})")
    if sparsity is not None and not 0 <= sparsity < 1:
        raise UserError(f"--sparsity must be in [0, 1) (got {sparsity})")
    if not 0 < max_read_share <= 1:
        raise UserError(f"--max-read-share must be in (0, 1] (got {max_read_share})")
    if kept_mass is not None and not 0 < kept_mass <= 1:
        raise UserError(f"--kept-mass must be in (0, 1] (got {kept_mass})")
    acts = Acts(acts_dir)
    ckpt = flashdir_checkpoint(flashdir)
    check_same_model(acts.identity, ckpt, acts_dir, flashdir)
    cfg = acts.config
    if cfg.moe:
        path = save_expert_freq(flashdir, expert_counts(acts))
        print(f"a mixture of experts: its router picks the experts exactly, so no neuron predictor is trained; "
              f"wrote the router's choices collected in {acts_dir} to {path} (the expert cache pins the most routed "
              f"experts)", file=sys.stderr)
        return []
    relu = relu_family(cfg)
    if relu and (sparsity or kept_mass):
        print("note: ReLU-family model: the activation threshold is 0 (a != 0); --sparsity/--kept-mass ignored",
              file=sys.stderr)
    if not relu and sparsity is None and kept_mass is None:
        sparsity = 0.0 if keep is not None else DEFAULT_SWIGLU_SPARSITY
    d = cfg.dim
    rank = rank or int(min(128, max(16, d // 8)))
    max_rank = max_rank or min(d, 4 * rank)
    if rank < 1 or max_rank < rank:
        raise UserError(f"--rank must be >= 1 and <= --max-rank (got {rank}, {max_rank})")

    import torch
    torch.set_num_threads(threads or min(2, os.cpu_count() or 1))
    # Each layer's training arrays ([rows, n] labels, logits, gradients) go back to the system when freed; glibc
    # would otherwise keep them in the heap and the next layer's would add up (1.1 GB vs 0.6 for 12 layers x 16384).
    keep_freed_arrays_out_of_rss()
    cards, weights, freqs = [], {}, {}
    bar = tqdm(range(cfg.n_layers), desc="train-predictor", unit="layer", disable=not progress, file=sys.stderr)
    for i in bar:
        t0 = time.perf_counter()
        if relu:
            t = 0.0
        else:
            t = threshold_for(acts.hist_count[i], acts.hist_mass[i], sparsity=sparsity, kept_mass=kept_mass)
        x, absa = acts.layer(i)
        if relu:
            freq = acts.nonzero[i] / max(acts.tokens, 1)          # over every collected token
        else:
            freq = (absa > t).mean(0)                             # over the sampled rows
        freqs[f"layers.{i}.freq"] = freq.astype(np.float32)
        card = {"layer": i, "act_threshold": t, "true_share": float((absa > t).mean())}
        if not thresholds_only and i < dense_layers:
            card["dense"] = True
        elif not thresholds_only:
            if len(x) < 20:
                raise UserError(f"{acts_dir} holds only {len(x)} sampled rows: collect more (--tokens / --rows)")
            importance = ckpt.vector_norms(i, "down")             # [n] |down_i|, read in chunks
            if keep is not None:
                t_label = threshold_for(acts.hist_count[i], acts.hist_mass[i], sparsity=1.0 - keep)
                m, (W1, W2, b) = train_layer_keep(x, absa, t_label, importance, rank, keep, steps, seed + i)
            else:
                m, (W1, W2, b) = train_layer(x, absa, t, importance, rank, max_rank, target_recall, max_ratio, steps,
                                             seed + i)
            card.update(m)
            if keep is None and m["pred_share"] > max_read_share:
                card["dense"] = True                              # reads all but a sliver anyway: read them all
            else:
                weights[f"layers.{i}.w_in"], weights[f"layers.{i}.w_out"], weights[f"layers.{i}.bias"] = W1, W2, b
            card["seconds"] = round(time.perf_counter() - t0, 2)
            bar.set_postfix(rank=m["rank"], recall=f"{m['recall']:.3f}", ratio=f"{m['pred_true_ratio']:.2f}")
        cards.append(card)
        if on_layer is not None:
            on_layer(card, bar)
    save_predictors(flashdir, acts, cards, weights, freqs, dict(
        target_recall=target_recall, dense_layers=[c["layer"] for c in cards if c.get("dense")], sparsity=sparsity,
        max_read_share=max_read_share, keep=keep,
        kept_mass=kept_mass, relu=relu,
        has_predictors=not thresholds_only, ffn_bytes=ffn_bytes(ckpt),
        **({"calibration": calibration} if calibration is not None else {})))
    return cards


def expert_counts(acts: Acts) -> np.ndarray:
    """[L, E] the router's choices a mixture of experts' `collect` counted (checked: the manifest comes from disk)."""
    cfg, counts = acts.config, acts.manifest.get("expert_counts")
    try:
        a = np.asarray(counts, np.int64)
    except (TypeError, ValueError, OverflowError):
        a = None
    if a is None or a.shape != (cfg.n_layers, cfg.n_experts) or (a < 0).any() or \
            not all(isinstance(c, int) and not isinstance(c, bool) for row in counts for c in row):
        raise UserError(f"{acts.path}: no expert counts of {cfg.n_layers} layers x {cfg.n_experts} experts in its "
                        f"manifest: re-run `flashinfer-lite collect`")
    return a


def ffn_bytes(ckpt) -> int:
    """Bytes of FFN weights on flash (the bundles), for the predictor size share."""
    L = getattr(ckpt, "layout", None)
    return int(sum(L.region_bytes(i) for i in range(L.n_layers))) if L is not None else 0


def save_predictors(flashdir, acts: Acts, cards, weights, freqs, info: dict) -> Path:
    manifest = {"fingerprint": acts.identity["fingerprint"],
                "n_layers": acts.config.n_layers, "dim": acts.config.dim, "ffn_dim": acts.config.ffn_dim,
                "acts": {"path": str(acts.path), "tokens": acts.tokens, "corpus": acts.manifest["corpus"]},
                "predictor_bytes": int(sum(v.nbytes for v in weights.values())),
                "act_threshold": [c["act_threshold"] for c in cards],
                **info}
    return write_predictor_files(flashdir, manifest, weights if info.get("has_predictors") else None, freqs, cards)
