"""`flashinfer-lite eval -m FLASHDIR --corpus FILE --ffn dense|oracle|predicted [--tokens N] [--json]`.

Runs the model built by `flashinfer_lite.runtime.load_runtime` (the one generation uses), one token at a time through
`model.forward([t], kv)` (the decode path), in windows of --ctx tokens that each start from an empty cache, next to
the dense model on the same tokens. Reports perplexity (and the dense one), top-1 agreement with dense, the mean
share of neurons computed per layer, the share the predictors selected (what has to be read from flash), and the
predictors' time and memory.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from tqdm import tqdm

from flashinfer_lite.errors import UserError
from flashinfer_lite.runtime import load_runtime

from .acts import read_corpus
from .collect import token_windows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", required=True, help="FLASHDIR (or an HF dir / GGUF for --ffn dense)")
    parser.add_argument("--corpus", nargs="+", required=True, metavar="FILE", help="evaluation text file(s)")
    parser.add_argument("--ffn", choices=("dense", "oracle", "predicted"), default="predicted")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens to evaluate (default 2048)")
    parser.add_argument("--ctx", type=int, default=256, help="window length (default 256)")
    parser.add_argument("--json", action="store_true",
                        help="print only one JSON object on stdout (the table goes to stderr)")


def run(args) -> int:
    res = evaluate(args.model, args.corpus, args.ffn, n_tokens=args.tokens, ctx=args.ctx)
    print(format_result(res), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(res))
    return 0


def log_softmax_at(logits: np.ndarray, target: int) -> float:
    z = logits.astype(np.float64)
    m = z.max()
    return float(z[target] - m - np.log(np.exp(z - m).sum()))


def evaluate(model_path, corpus, ffn: str, n_tokens: int = 2048, ctx: int = 256, progress: bool = True) -> dict:


    if n_tokens < 2:
        raise UserError(f"--tokens must be at least 2 (got {n_tokens})")
    text = read_corpus(corpus)
    if text.replaced_bytes:
        print(f"warning: {text.replaced_bytes} bytes of the corpus are not valid UTF-8; decoded with replacement "
              f"(U+FFFD)", file=sys.stderr)
    model, tokenizer, runtime = load_runtime(model_path, ffn=ffn)
    dense = model if ffn == "dense" else load_runtime(model_path, ffn="dense")[0]
    cfg = model.cfg
    ctx = min(ctx, cfg.max_pos)
    kv, kv_dense = model.new_cache(ctx), dense.new_cache(ctx)
    nll = nll_dense = 0.0
    n_pred = agree = 0
    t_model = 0.0
    bar = tqdm(total=n_tokens, desc=f"eval {ffn}", unit="tok", disable=not progress, file=sys.stderr)
    for w in token_windows(tokenizer, text.text, n_tokens, ctx, cfg.bos_id):
        kv.reset()
        kv_dense.reset()
        for j in range(len(w) - 1):
            t0 = time.perf_counter()
            logits = model.forward([w[j]], kv)          # the decode path: one token at a time
            t_model += time.perf_counter() - t0
            ref = logits if dense is model else dense.forward([w[j]], kv_dense)
            nll -= log_softmax_at(logits, w[j + 1])
            nll_dense -= log_softmax_at(ref, w[j + 1])
            agree += int(np.argmax(logits) == np.argmax(ref))
            n_pred += 1
        bar.update(len(w))
    bar.close()
    if n_pred == 0:
        raise UserError(f"the corpus gives too few tokens to evaluate: {', '.join(text.files)}")
    res = {"model": str(model_path), "ffn": ffn, "corpus": text.files, "replaced_bytes": text.replaced_bytes,
           "tokens": n_pred, "perplexity": float(np.exp(nll / n_pred)),
           "dense_perplexity": float(np.exp(nll_dense / n_pred)), "top1_agreement": agree / n_pred,
           "ms_per_token": 1000 * t_model / n_pred}
    if runtime is None:
        share = np.ones(cfg.n_layers)
    else:
        share = runtime.stats.active_share()
    res["active_share"] = float(share.mean())
    res["active_share_per_layer"] = [round(float(s), 4) for s in share]
    preds = getattr(runtime, "predictors", None) if runtime is not None else None
    if preds is not None and ffn == "predicted":
        ps = preds.predicted_share()
        res["predicted_share"] = float(ps.mean())
        res["predicted_share_per_layer"] = [round(float(s), 4) for s in ps]
        res["predictor_ms_per_token"] = 1000 * runtime.stats.predictor_s / n_pred
        res["predictor_bytes"] = preds.nbytes
        res["predictor_stored_bytes"] = int(preds.manifest.get("predictor_bytes", 0))
        ffn_bytes = int(preds.manifest.get("ffn_bytes", 0))
        res["predictor_share_of_ffn_bytes"] = res["predictor_stored_bytes"] / ffn_bytes if ffn_bytes else None
    if preds is not None:
        res["act_threshold"] = [preds.act_threshold(i) for i in range(cfg.n_layers)]
    return res


def format_result(res: dict) -> str:
    lines = [f"{'layer':>5} {'active':>8}" + (f" {'predicted':>9}" if "predicted_share_per_layer" in res else "")]
    for i, a in enumerate(res["active_share_per_layer"]):
        row = f"{i:>5} {a:>8.3f}"
        if "predicted_share_per_layer" in res:
            row += f" {res['predicted_share_per_layer'][i]:>9.3f}"
        lines.append(row)
    lines.append(f"ffn={res['ffn']}  tokens={res['tokens']}  perplexity={res['perplexity']:.4f}  "
                 f"dense={res['dense_perplexity']:.4f}  top1_agreement={res['top1_agreement']:.4f}  "
                 f"active_share={res['active_share']:.3f}")
    if "predicted_share" in res:
        share = res["predictor_share_of_ffn_bytes"]
        lines.append(f"predicted_share={res['predicted_share']:.3f}  predictor {res['predictor_ms_per_token']:.3f} "
                     f"ms/token, {res['predictor_bytes'] / 2**20:.2f} MiB in memory"
                     + (f", {100 * share:.2f}% of FFN bytes stored" if share else ""))
    return "\n".join(lines)
