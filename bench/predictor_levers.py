"""Issue 14's levers: perplexity against FFN neurons computed and FFN bytes read, per neuron-selection policy, on the
same held-out tokens. Prints one JSON object (and a line per policy on stderr).

A SwiGLU model's FFN is run densely in float32 (its float16 FLASHDIR matrices) and each policy masks the activations
a = silu(gate) * up before the down projection, so every policy sees the same weights and tokens and differs only in
which neurons it keeps. Windows of --ctx tokens are evaluated as one batch each (causal attention: the same logits as
token by token, up to rounding). Thresholds are calibrated on the built-in calibration text (what a fresh clone has).

  dense                  every neuron
  predicted[NAME]        the low-rank predictors stored in FLASHDIR NAME, thresholded as calibrated: what
                         `--ffn predicted` computes; every predicted neuron is read and its gate/up computed
  oracle[...]            |a| > t: the ideal selection (needs gate and up of every neuron)
  top[NAME f]            the predictor's f highest logits per token instead of its calibrated cut
  cats[s]                CATS: gate rows resident and exact, |silu(gate)| > t_s (t_s: the s quantile); up and down
                         (2/3 of a bundle) read for the kept neurons
  gate[s]+|a|[q]         exact gate (resident) picks candidates at sparsity s, then |a| > t_q (q: an |a| sparsity):
                         up and down read for the candidates, down computed for the neurons over t_q

read_share counts bytes read from flash per token as a share of the FFN's: a predicted/oracle/top neuron reads its
whole bundle; for cats and gate, whose gate rows stay in DRAM, only up and down (2/3 of a bundle; this needs reads of
part of a bundle, which storage/ does not do yet). computed_share: neurons whose up (and gate, where not resident) is
computed; fired_share: neurons whose down is accumulated.

  PYTHONPATH=. python bench/predictor_levers.py -m FLASHDIR --corpus wikitext2_test.txt --tokens 2048 \\
      --predictors builtin=FLASHDIR --oracle 0.3,0.4,0.5 --cats 0.1,0.2,0.3,0.5 --gate 0.2:0.4,0.2:0.5 --top 0.7
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import harness as h

from flashinfer_lite.predictor_set import load_predictors
from predictors.acts import read_corpus
from predictors.collect import token_segments
from predictors.first_use import builtin_text


def silu(z):
    return z / (1 + np.exp(-z))


def floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="FLASHDIR of a SwiGLU model")
    ap.add_argument("--corpus", required=True, help="held-out text (e.g. wikitext2_test.txt)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--predictors", nargs="*", default=[], metavar="NAME=FLASHDIR",
                    help="predictor sets to compare (FLASHDIRs of the same model)")
    ap.add_argument("--oracle", default="", help="|a| thresholds at these sparsities (comma-separated)")
    ap.add_argument("--cats", default="", help="CATS gate thresholds at these sparsities")
    ap.add_argument("--gate", default="", help="S:Q,...: exact-gate candidates at sparsity S, then |a| > t at Q")
    ap.add_argument("--top", default="", help="the predictors' top fractions of neurons per token")
    ap.add_argument("--calibration-tokens", type=int, default=2048)
    a = ap.parse_args(argv)

    model, tok, _ = h.load_model(a.model, "dense")
    cfg = model.cfg
    if not cfg.glu or cfg.act != "silu":
        raise SystemExit("predictor_levers.py measures SwiGLU models")
    L, n = cfg.n_layers, cfg.ffn_dim
    W = [(f.w_gate.astype(np.float32), f.w_up.astype(np.float32), f.w_down.astype(np.float32))
         for f in model.dense_ffn]

    # calibration on the built-in text: |silu(gate)| and |a| quantiles per layer (every 7th value kept)
    seen_g, seen_a = [[] for _ in range(L)], [[] for _ in range(L)]

    def calibrate(i, x):
        wg, wu, wd = W[i]
        g = x @ wg.T
        act = silu(g) * (x @ wu.T)
        seen_g[i].append(np.abs(silu(g)).ravel()[::7])
        seen_a[i].append(np.abs(act).ravel()[::7])
        return act @ wd.T
    model.ffn = calibrate
    for w in token_segments(tok, builtin_text(), a.calibration_tokens, a.ctx, cfg.bos_id):
        model.forward(w, model.new_cache(a.ctx), all_logits=True)
    seen_g = [np.concatenate(c) for c in seen_g]
    seen_a = [np.concatenate(c) for c in seen_a]

    def quantiles(seen, q):
        return [float(np.quantile(c, q)) for c in seen]

    policies = {"dense": ("dense", None)}
    sets = {}
    for spec in a.predictors:
        name, path = spec.split("=", 1)
        sets[name] = load_predictors(path)
        policies[f"predicted[{name}]"] = ("predicted", sets[name])
        policies[f"oracle[{name} threshold]"] = ("oracle", [sets[name].act_threshold(i) for i in range(L)])
        for f in floats(a.top):
            policies[f"top[{name} {f}]"] = ("top", (sets[name], f))
    for q in floats(a.oracle):
        policies[f"oracle[sparsity {q}]"] = ("oracle", quantiles(seen_a, q))
    for q in floats(a.cats):
        policies[f"cats[sparsity {q}]"] = ("cats", quantiles(seen_g, q))
    for spec in [v for v in a.gate.split(",") if v]:
        s_g, q_a = (float(v) for v in spec.split(":"))
        policies[f"gate[{s_g}]+|a|[{q_a}]"] = ("gate", (quantiles(seen_g, s_g), quantiles(seen_a, q_a)))

    windows = list(token_segments(tok, read_corpus([a.corpus]).text, a.tokens, a.ctx, cfg.bos_id))
    rows = sum(len(w) for w in windows)
    results = {}
    for name, (kind, p) in policies.items():
        t0 = time.perf_counter()
        computed = read = fired = 0.0

        def ffn(i, x):
            nonlocal computed, read, fired
            wg, wu, wd = W[i]
            g = x @ wg.T
            act = silu(g) * (x @ wu.T)
            if kind == "dense":
                m = sel = np.ones(act.shape, bool)
            elif kind == "predicted":
                sel = p.predict(i, x, count=False)
                m = sel & (np.abs(act) > p.act_threshold(i))
            elif kind == "top":
                ps, f = p
                if ps.rank(i) == 0:          # a dense layer (no predictor)
                    sel = np.ones(act.shape, bool)
                else:
                    w_in, w_out, b = ps._w[i]
                    z = (x @ w_in) @ w_out + b
                    k = int(round(f * n))
                    sel = z >= np.partition(z, -k, axis=1)[:, -k][:, None]
                m = sel & (np.abs(act) > ps.act_threshold(i))
            elif kind == "oracle":
                m = sel = np.abs(act) > p[i]
            elif kind == "cats":
                m = sel = np.abs(silu(g)) > p[i]
            else:  # gate
                sel = np.abs(silu(g)) > p[0][i]
                m = sel & (np.abs(act) > p[1][i])
            computed += sel.sum()
            read += sel.sum() * (2 / 3 if kind in ("cats", "gate") else 1.0)
            fired += m.sum()
            return np.where(m, act, 0.0) @ wd.T
        model.ffn = ffn
        nll, count = 0.0, 0
        for w in windows:
            lg = model.forward(w, model.new_cache(a.ctx), all_logits=True)[:-1].astype(np.float64)
            tgt = np.asarray(w[1:])
            mx = lg.max(1)
            nll += float((mx + np.log(np.exp(lg - mx[:, None]).sum(1)) - lg[np.arange(len(tgt)), tgt]).sum())
            count += len(tgt)
        per = rows * L * n
        results[name] = {"perplexity": round(float(np.exp(nll / count)), 3), "computed_share": round(computed / per, 4),
                         "fired_share": round(fired / per, 4), "read_share": round(read / per, 4),
                         "seconds": round(time.perf_counter() - t0, 1)}
        r, d = results[name], results["dense"]["perplexity"]
        print(f"{name:28s} ppl {r['perplexity']:8.3f} ({100 * (r['perplexity'] / d - 1):+6.1f}%)  computed "
              f"{r['computed_share']:.3f}  fired {r['fired_share']:.3f}  read {r['read_share']:.3f}", file=sys.stderr)
    print(json.dumps({"model": str(a.model), "corpus": a.corpus, "tokens": count, "ctx": a.ctx,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
