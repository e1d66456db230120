"""Can a predictor that picks SwiGLU neurons before their rows are read keep perplexity at a fixed read share?

The selection is a budget, not a recall threshold: per token and layer, the k = share x n neurons with the highest
score are computed (gate, up and down rows read), the others not at all. Scores:
  oracle  the true product rule |act(gate.x) * up.x| (the ceiling: no predictor can select better by |a|)
  linear  a low-rank linear score x -> r -> n (Deja Vu, LLM in a Flash), trained on the top-share labels of |a|
  mlp     x -> r -> hidden (ReLU) -> n (Deja Vu's MLP predictor), the same labels
  svd     not learned: |act(x G_r^T) * (x U_r^T)|, G_r and U_r the rank-r truncated SVDs of the gate and up matrices
The selected neurons are exact (their true a); the perplexity is that of the whole model with every layer so
selected, on segments that each start at BOS, each segment one batch (as eval's dense reference: the decode path's
numbers to float rounding). Every configuration runs in the same layer-by-layer pass over the same tokens (one
layer's float32 weights loaded once for all of them), so the rows compare with each other exactly.

    python bench/predict_product.py train ACTS -o STUDY.safetensors [--rank 128] [--hidden 256] [--steps 300]
    python bench/predict_product.py eval MODEL --corpus TEST.txt --tokens 512 [--study STUDY.safetensors]
        --rows dense oracle:0.5 linear:0.5 mlp:0.5 svd64:0.5 ...

ACTS comes from `flashinfer-lite collect` (its rows: x and |a| per layer). Training uses torch with one thread.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashinfer_lite.ffn.dense import FeedForward                       # noqa: E402
from flashinfer_lite.kernels.blocks import linear                       # noqa: E402
from flashinfer_lite.kernels.neurons import activations, threshold_of   # noqa: E402
from flashinfer_lite.loader import load_tensor, open_any                # noqa: E402
from flashinfer_lite.model import Block, KVCache, embed_tokens, layer_ropes, output_logits, rope_tables  # noqa: E402
from predictors.acts import Acts, read_corpus                           # noqa: E402
from predictors.evaluate import log_probs_at                            # noqa: E402
from predictors.layerwise import layer_tensor_names                     # noqa: E402
from predictors.train import split_rows                                 # noqa: E402
from storage.tokenizer import token_segments                            # noqa: E402

LABEL_SHARE = 0.5      # the predictors learn which neurons are in each token's top half by |a|


# ----------------------------------------------------------------------------------------------------------------------
# Training

def top_share_mask(score: np.ndarray, share: float) -> np.ndarray:
    """bool [T, n]: each row's k = round(share x n) highest scores."""
    n = score.shape[1]
    k = max(1, min(n, int(round(share * n))))
    idx = np.argpartition(-score, k - 1, axis=1)[:, :k]
    m = np.zeros(score.shape, bool)
    np.put_along_axis(m, idx, True, axis=1)
    return m


def fit(x: np.ndarray, absa: np.ndarray, kind: str, rank: int, hidden: int, steps: int, seed: int) -> dict:
    """Train a scorer on rows (x [R, d], |a| [R, n]): BCE on top-LABEL_SHARE membership, each entry weighted by
    1 + |a| / its row's mean |a| (missing a large activation costs more than a small one). Returns float16 weights
    with the input standardisation folded into the first matrix."""
    import torch
    torch.set_num_threads(1)      # a shared machine
    torch.manual_seed(seed)
    R, d = x.shape
    mu, s = x.mean(0), x.std(0) + 1e-6
    X = torch.from_numpy((x - mu) / s)
    Y = torch.from_numpy(top_share_mask(absa, LABEL_SHARE).astype(np.float32))
    W = torch.from_numpy(1.0 + absa / (absa.mean(1, keepdims=True) + 1e-12))
    n = absa.shape[1]
    layers = [torch.nn.Linear(d, rank, bias=False)]
    if kind == "mlp":
        layers += [torch.nn.Linear(rank, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, n)]
    else:
        layers += [torch.nn.Linear(rank, n)]
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    gen = torch.Generator().manual_seed(seed)
    batch = min(256, R)
    for _ in range(steps):
        idx = torch.randint(0, R, (batch,), generator=gen)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(net(X[idx]), Y[idx], reduction="none")
        loss = (bce * W[idx]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    w1 = layers[0].weight.detach().numpy() / s[None, :]                  # [r, d]: standardisation folded in
    out = {"w1": w1.astype(np.float16), "b1": (-(w1 @ mu)).astype(np.float32)}
    rest = [m for m in layers[1:] if isinstance(m, torch.nn.Linear)]
    for j, m in enumerate(rest, start=2):
        out[f"w{j}"] = m.weight.detach().numpy().astype(np.float16)
        out[f"b{j}"] = m.bias.detach().numpy().astype(np.float32)
    return out


def score_learned(p: dict, x: np.ndarray) -> np.ndarray:
    """The scorer's logits [T, n] from its stored (float16) weights."""
    h = x @ p["w1"].astype(np.float32).T + p["b1"]
    if "w3" in p:                                             # mlp: r -> hidden (ReLU) -> n
        h = np.maximum(h @ p["w2"].astype(np.float32).T + p["b2"], 0)
        return h @ p["w3"].astype(np.float32).T + p["b3"]
    return h @ p["w2"].astype(np.float32).T + p["b2"]


def captured(score: np.ndarray, absa: np.ndarray, share: float) -> float:
    """Share of the |a| mass in the top-share by score, over that in the top-share by |a| (the oracle): 1 is best."""
    return float((absa * top_share_mask(score, share)).sum() / (absa * top_share_mask(absa, share)).sum())


def train(acts_dir, out, kinds, rank: int, hidden: int, steps: int, seed: int, layers: range | None = None) -> None:
    from safetensors.numpy import save_file
    acts = Acts(acts_dir)
    tensors, cards = {}, []
    for i in tqdm(layers or range(acts.config.n_layers), desc="train", unit="layer", file=sys.stderr):
        x, absa = acts.layer(i)
        tr, _, rep = split_rows(len(x))          # the tuning split is not needed: k is fixed, not tuned
        card = {"layer": i, "rows_train": tr.stop, "rows_report": len(x) - rep.start}
        for kind in kinds:
            p = fit(x[tr], absa[tr], kind, rank, hidden, steps, seed + i)
            sc = score_learned(p, x[rep])
            card[kind] = {f"captured@{s}": round(captured(sc, absa[rep], s), 4) for s in (0.3, 0.5, 0.7)}
            card[kind]["bytes"] = int(sum(v.nbytes for v in p.values()))
            tensors.update({f"layers.{i}.{kind}.{k}": v for k, v in p.items()})
        cards.append(card)
        print(json.dumps(card), file=sys.stderr)
    meta = {"cards": json.dumps(cards), "rank": str(rank), "hidden": str(hidden), "steps": str(steps),
            "label_share": str(LABEL_SHARE), "acts": str(acts_dir)}
    save_file(tensors, str(out), metadata=meta)


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation

class Row:
    """One configuration: a scorer and a read share (the same k in every layer)."""

    def __init__(self, spec: str, study: dict | None):
        self.spec = spec
        kind, _, share = spec.partition(":")
        self.kind, self.share = kind, float(share) if share else 1.0
        if kind.startswith("svd"):
            self.svd_rank = int(kind[3:])
        elif kind in ("linear", "mlp") and study is None:
            raise SystemExit(f"{spec}: needs --study (from `train`)")
        elif kind not in ("dense", "oracle", "linear", "mlp"):
            raise SystemExit(f"unknown row {spec!r} (dense, oracle:S, linear:S, mlp:S, svdR:S)")
        self.study = study
        self.nll, self.read, self.top1 = 0.0, [], []
        self.predictor_bytes = 0

    def params(self, layer: int) -> dict:
        pre = f"layers.{layer}.{self.kind}."
        return {k[len(pre):]: v for k, v in self.study.items() if k.startswith(pre)}


def svd_factors(w: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """W [n, d] ~ A [n, r] @ B [r, d] (truncated SVD), float16 as it would be stored."""
    u, s, vt = np.linalg.svd(w.astype(np.float64), full_matrices=False)
    return (u[:, :r] * s[:r]).astype(np.float16), vt[:r].astype(np.float16)


def evaluate(model, corpus, n_tokens: int, ctx: int, rows: list[Row]) -> dict:
    ckpt = open_any(model)
    cfg = ckpt.config
    tok = ckpt.tokenizer()
    text = read_corpus(corpus, tok.text_cap(2 * n_tokens))
    segments = [np.asarray(w, np.int64) for w in token_segments(tok, text.text, n_tokens, ctx, cfg.bos_id)]
    bounds = np.concatenate([[0], np.cumsum([len(w) for w in segments])])
    names = layer_tensor_names(ckpt)
    emb = load_tensor(ckpt, "embed.weight")
    hidden = {}
    for r in rows:
        hidden[r.spec] = np.concatenate([embed_tokens(cfg, emb, None, w, 0) for w in segments]).astype(np.float32)
    del emb
    ckpt.release()
    inv_freq = layer_ropes(cfg)
    kv = KVCache(cfg, max(len(w) for w in segments), n_layers=1)
    thr = threshold_of(cfg.act, cfg.relu_threshold)
    for i in tqdm(range(cfg.n_layers), desc="eval", unit="layer", file=sys.stderr):
        w = {nm: load_tensor(ckpt, nm) for nm in names[i]}          # float32 (a GGUF's blocks dequantized)
        block, dense = Block(cfg, w, i, kv_slot=0), FeedForward(cfg, w, i)
        svd = {}
        for r in rows:
            if r.kind.startswith("svd") and r.svd_rank not in svd:
                svd[r.svd_rank] = (svd_factors(dense.w_gate, r.svd_rank), svd_factors(dense.w_up, r.svd_rank))
        for r in rows:
            def ffn(layer, x, r=r):
                a = dense.activations(x)
                if r.kind == "dense":
                    r.read.append(1.0)
                    return linear(a, dense.w_down, dense.b_down)
                if r.kind == "oracle":
                    score = np.abs(a)
                elif r.kind.startswith("svd"):
                    (ga, gb), (ua, ub) = svd[r.svd_rank]
                    g = (x @ gb.astype(np.float32).T) @ ga.astype(np.float32).T
                    u = (x @ ub.astype(np.float32).T) @ ua.astype(np.float32).T
                    score = np.abs(activations(cfg.act, g, u, thr))
                else:
                    score = score_learned(r.params(layer), x)
                m = top_share_mask(score, r.share)
                r.read.append(m.mean())
                return linear(a * m, dense.w_down, dense.b_down)
            h = hidden[r.spec]
            for k in range(len(segments)):
                seg = h[bounds[k]:bounds[k + 1]]
                kv.reset()
                seg[:] = block(seg, kv, 0, rope_tables(inv_freq[i], 0, len(seg)), ffn)
            if r.kind.startswith("svd"):
                r.predictor_bytes += sum(f.nbytes for pair in svd[r.svd_rank] for f in pair)
            elif r.kind in ("linear", "mlp"):
                r.predictor_bytes += sum(v.nbytes for v in r.params(i).values())
        del block, dense, w, svd
        ckpt.release()
    head = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
    hw = {nm: load_tensor(ckpt, nm) for nm in ("norm.weight", head)}
    for r in rows:
        for k, wseg in enumerate(segments):
            logits = output_logits(cfg, hidden[r.spec][bounds[k]:bounds[k + 1]], (hw["norm.weight"], None), hw[head])
            r.nll -= float(log_probs_at(logits[:-1], wseg[1:]).sum())
            r.top1.append(np.argmax(logits[:-1], axis=-1))
    n_pred = sum(len(w) - 1 for w in segments)
    dense_row = next((r for r in rows if r.kind == "dense"), None)
    out = {"model": str(model), "corpus": text.files, "tokens": n_pred, "segments": len(segments), "rows": []}
    for r in rows:
        ppl = float(np.exp(r.nll / n_pred))
        row = {"row": r.spec, "read_share": round(float(np.mean(r.read)), 4), "predictor_bytes": r.predictor_bytes,
               "perplexity": round(ppl, 4)}
        if dense_row is not None:
            row["vs_dense"] = round(100 * (ppl / float(np.exp(dense_row.nll / n_pred)) - 1), 2)
            row["top1_agreement"] = round(float(np.mean(np.concatenate(r.top1) == np.concatenate(dense_row.top1))), 4)
        out["rows"].append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train linear and/or mlp scorers on ACTS rows")
    t.add_argument("acts")
    t.add_argument("-o", "--output", required=True)
    t.add_argument("--kinds", nargs="+", default=["linear", "mlp"], choices=["linear", "mlp"])
    t.add_argument("--rank", type=int, default=128)
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layers", metavar="A:B", help="only layers A..B-1 (several trainers, one file each)")
    e = sub.add_parser("eval", help="perplexity of each row in one layer-by-layer pass")
    e.add_argument("model")
    e.add_argument("--corpus", nargs="+", required=True)
    e.add_argument("--tokens", type=int, default=512)
    e.add_argument("--ctx", type=int, default=256)
    e.add_argument("--study", nargs="+", help="the scorers `train` wrote (several files: their layers together)")
    e.add_argument("--rows", nargs="+", required=True, help="dense oracle:S linear:S mlp:S svdR:S")
    e.add_argument("-o", "--output", help="also write the JSON result here")
    a = p.parse_args(argv)
    if a.cmd == "train":
        layers = range(*map(int, a.layers.split(":"))) if a.layers else None
        train(a.acts, a.output, a.kinds, a.rank, a.hidden, a.steps, a.seed, layers)
        return 0
    study = None
    if a.study:
        from safetensors.numpy import load_file
        study = {k: v for f in a.study for k, v in load_file(f).items()}
    res = evaluate(a.model, a.corpus, a.tokens, a.ctx, [Row(s, study) for s in a.rows])
    print(f"{'row':<14} {'read':>6} {'pred MB':>8} {'ppl':>9} {'+%':>7} {'top1':>6}")
    for r in res["rows"]:
        print(f"{r['row']:<14} {r['read_share']:>6.3f} {r['predictor_bytes'] / 1e6:>8.2f} {r['perplexity']:>9.3f} "
              f"{r.get('vs_dense', float('nan')):>7.2f} {r.get('top1_agreement', float('nan')):>6.3f}")
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
