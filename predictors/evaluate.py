"""`flashinfer-lite eval -m FLASHDIR --corpus FILE --ffn MODE [--tokens N] [--dram-budget SIZE] [--json]`.

Runs the model built by `flashinfer_lite.load` (the one generation uses), one token at a time through
`model.forward([t], kv)` (the decode path), in segments of --ctx tokens that each start from an empty cache, against
the dense model on the same tokens. The dense reference is computed first, layer by layer over all segments
(predictors/layerwise.py), so it never needs the whole model in memory; `--ffn dense` is that reference alone (its
ms_per_token: the layer-streamed batched pass, weight loads included, per token). The mode's model runs under
--dram-budget as generate's does (default auto), so a model bigger than RAM is evaluated from flash; its dense
reference then runs in a child process, whose memory leaves with it (dense_reference_apart).
Reports perplexity (and the dense one), top-1 agreement with dense, the mean share of neurons computed per layer
(of a mixture of experts: of experts, k/E), the share the predictors selected (what has to be read from flash), and
the predictors' time and memory. A mixture of experts' dense reference loads one routed expert at a time; its mode
(auto: the expert cache, as generate runs it) reads its experts from flash under the budget.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from storage.errors import UserError, child_exit_code, run_child
from flashinfer_lite.model import open_any
from flashinfer_lite.model import half_matrix
from flashinfer_lite.modes import FFN_MODES, check_mode, keeps_float16, plans, predicts
from flashinfer_lite.process import return_freed_heap
from flashinfer_lite.kernels.blocks import ACT8, set_act8
from flashinfer_lite.generate import add_kv_arguments, kv_options_from
from flashinfer_lite.kv_pages import KVOptions
from flashinfer_lite.runtime import load
from storage.gate_file import DEFAULT_SPARSITY
from storage.sizes import parse_size

from .acts import read_corpus
from storage.tokenizer import token_segments
from .layerwise import LayerStream


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", required=True, help="FLASHDIR (or an HF dir / GGUF for --ffn dense)")
    parser.add_argument("--corpus", nargs="+", required=True, metavar="FILE", help="evaluation text file(s)")
    parser.add_argument("--ffn", choices=FFN_MODES, default="predicted",
                        help="as generate's; auto measures what generate runs by default at that --dram-budget")
    parser.add_argument("--sparsity", type=float, default=DEFAULT_SPARSITY,
                        help=f"--ffn gate: the calibrated share of neurons dropped (default {DEFAULT_SPARSITY})")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens to evaluate (default 2048)")
    parser.add_argument("--ctx", type=int, default=256, help="segment length (default 256)")
    parser.add_argument("--dram-budget", default="auto", metavar="SIZE|auto",
                        help="DRAM budget of the oracle/predicted model, as generate's (default auto)")
    parser.add_argument("--json", action="store_true",
                        help="print only one JSON object on stdout (the table goes to stderr)")
    add_kv_arguments(parser)     # the mode's model keeps its KV cache as generate's would


def run(args) -> int:
    budget = args.dram_budget if args.dram_budget == "auto" else parse_size(args.dram_budget)
    kv = kv_options_from(args)      # a bad KV flag refused before the dense reference runs
    res = evaluate(args.model, args.corpus, args.ffn, n_tokens=args.tokens, ctx=args.ctx, dram_budget=budget,
                   sparsity=args.sparsity, kv=kv)
    print(format_result(res), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(res))
    return 0


def log_probs_at(logits: np.ndarray, targets) -> np.ndarray:
    """log softmax(logits[t])[targets[t]] per row t, in float64: logits [T, V], targets [T] -> [T]."""
    z = logits.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(axis=-1))
    return z[np.arange(len(z)), np.asarray(targets, np.int64)] - m[:, 0] - lse


def log_softmax_at(logits: np.ndarray, target: int) -> float:
    return float(log_probs_at(logits[None, :], [target])[0])


def dense_reference(ckpt, segments, progress: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per segment w, the dense model's log-probability of each next token and its top-1 token ([len(w) - 1] each).

    Layer by layer over all segments (predictors/layerwise.py): one layer's weights in memory, so the model may be
    bigger than RAM. Each segment as one batch from an empty cache: the decode path's logits to float rounding.
    As load's dense model (modes.keeps_float16), a float16 FLASHDIR runs with float16 matrices, a GGUF and a
    quantized FLASHDIR with their matrices in blocks (a FLASHDIR's FFN too where it holds its GGUF's blocks: the
    GGUF's numbers, bit for bit), anything else in float32."""
    out = []
    with LayerStream(ckpt, segments, convert=half_matrix if keeps_float16(ckpt) else None, progress=progress,
                     desc="eval dense", keep_blocks=True) as stream:
        stream.run()
        for k, logits in stream.logits():
            out.append((log_probs_at(logits[:-1], segments[k][1:]), np.argmax(logits[:-1], axis=-1)))
    return out


def dense_reference_apart(model_path, segments, progress: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    """dense_reference in a child process (`python -m predictors.evaluate`), with this process's 8-bit activation
    setting. What it leaves in a process (the dense pass's compiled kernels, freed arrays the heap keeps: 208 MiB of
    RSS after it on SmolLM2's Q4_K_M, 110 MiB over generate's process base) would be counted in the mode's model's
    budget: `eval --ffn gate --dram-budget 300M` was refused (minimum 385 MiB) where generate runs from 276 MiB."""
    with tempfile.TemporaryDirectory(prefix="flashinfer-lite-eval-") as tmp:
        seg, out = Path(tmp) / "segments.npz", Path(tmp) / "reference.npz"
        np.savez(seg, *[np.asarray(w, np.int64) for w in segments])
        run_child([sys.executable, "-m", "predictors.evaluate", str(model_path), str(seg), str(out),
                   "--act8", str(int(ACT8[0])), *([] if progress else ["--quiet"])])
        with np.load(out, allow_pickle=False) as z:
            return [(z[f"lp{k}"], z[f"top{k}"]) for k in range(len(segments))]


def evaluate(model_path, corpus, ffn: str, n_tokens: int = 2048, ctx: int = 256, progress: bool = True,
             dram_budget: int | str | None = None, sparsity: float = DEFAULT_SPARSITY,
             kv: KVOptions | None = None) -> dict:
    if n_tokens < 2:
        raise UserError(f"--tokens must be at least 2 (got {n_tokens})")
    check_mode(ffn)
    ckpt = open_any(model_path)
    cfg = ckpt.config
    ctx = min(ctx, cfg.max_pos)
    tokenizer = ckpt.tokenizer()
    text = read_corpus(corpus, tokenizer.text_cap(2 * n_tokens))   # twice: a cut changes the tokens next to it
    segments = list(token_segments(tokenizer, text.text, n_tokens, ctx, cfg.bos_id))
    n_pred = sum(max(0, len(w) - 1) for w in segments)
    if n_pred == 0:
        raise UserError(f"the corpus gives too few tokens to evaluate: {', '.join(text.files)}")
    # the dense reference first, then the mode's model: the two are never in memory together
    t0 = time.perf_counter()
    ref = dense_reference(ckpt, segments, progress) if not plans(ffn) else \
        dense_reference_apart(model_path, segments, progress)
    t_dense = time.perf_counter() - t0
    nll_dense = -sum(float(lp.sum()) for lp, _ in ref)
    flash = None                   # the FFN object of a run from flash
    if not plans(ffn):             # dense: the reference is the mode's run
        nll, agree, t_model = nll_dense, n_pred, t_dense
    else:
        return_freed_heap()        # what tokenizing the corpus freed (27 MiB of SmolLM2's on wikitext2_test)
        loaded, _ = load(model_path, dram_budget, ffn, ctx, sparsity=sparsity, kv=kv)
        model, flash = loaded.transformer, loaded.ffn
        kv = model.new_cache(ctx)
        nll, agree, t_model = 0.0, 0, 0.0
        bar = tqdm(total=n_pred, desc=f"eval {ffn}", unit="tok", disable=not progress, file=sys.stderr)
        for w, (_, top1) in zip(segments, ref):
            kv.reset()
            for j in range(len(w) - 1):
                t0 = time.perf_counter()
                logits = model.forward([w[j]], kv)          # the decode path: one token at a time
                t_model += time.perf_counter() - t0
                nll -= log_softmax_at(logits, w[j + 1])
                agree += int(np.argmax(logits) == top1[j])
            bar.update(len(w) - 1)
        bar.close()
    res = {"model": str(model_path), "ffn": ffn, "corpus": text.files, "replaced_bytes": text.replaced_bytes,
           "tokens": n_pred, "perplexity": float(np.exp(nll / n_pred)),
           "dense_perplexity": float(np.exp(nll_dense / n_pred)), "top1_agreement": agree / n_pred,
           "ms_per_token": 1000 * t_model / n_pred}
    if flash is None:
        share = np.ones(cfg.n_layers)
    else:
        share = flash.stats.active_share()
    res["active_share"] = float(share.mean())
    res["ffn_source"] = "dram" if flash is None else type(flash).__name__     # what auto ran
    if flash is not None:
        res["flash_mb_per_token"] = (flash.stats.read_bytes + flash.stats.prefill_bytes_read) / 1e6 / n_pred
        res["hit_rate"] = flash.stats.hit_rate        # of neurons, or of a mixture of experts' experts
    res["active_share_per_layer"] = [round(float(s), 4) for s in share]
    preds = getattr(flash, "predictors", None) if flash is not None else None
    if preds is not None and predicts(ffn):
        ps = preds.predicted_share()
        res["predicted_share"] = float(ps.mean())
        res["predicted_share_per_layer"] = [round(float(s), 4) for s in ps]
        res["predictor_ms_per_token"] = 1000 * flash.stats.predictor_s / n_pred
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
    if "hit_rate" in res:
        lines.append(f"flash {res['flash_mb_per_token']:.3f} MB/token  hit_rate={res['hit_rate']:.3f}  "
                     f"{res['ms_per_token']:.1f} ms/token")
    if "predicted_share" in res:
        share = res["predictor_share_of_ffn_bytes"]
        lines.append(f"predicted_share={res['predicted_share']:.3f}  predictor {res['predictor_ms_per_token']:.3f} "
                     f"ms/token, {res['predictor_bytes'] / 2**20:.2f} MiB in memory"
                     + (f", {100 * share:.2f}% of FFN bytes stored" if share else ""))
    return "\n".join(lines)


def _reference_child(argv=None) -> int:
    """dense_reference_apart's child: python -m predictors.evaluate MODEL SEGMENTS.npz OUT.npz --act8 0|1."""
    p = argparse.ArgumentParser(prog="python -m predictors.evaluate")
    p.add_argument("model")
    p.add_argument("segments")
    p.add_argument("out")
    p.add_argument("--act8", type=int, choices=(0, 1), default=1)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)

    def work():
        set_act8(bool(a.act8))
        with np.load(a.segments, allow_pickle=False) as z:
            segments = [z[f"arr_{k}"].tolist() for k in range(len(z.files))]
        ref = dense_reference(open_any(a.model), segments, progress=not a.quiet and sys.stderr.isatty())
        # into the parent's temp directory, read only after this process exits 0 (run_child)
        np.savez(a.out, **{f"{n}{k}": v for k, r in enumerate(ref) for n, v in zip(("lp", "top"), r)})
    return child_exit_code(work)


if __name__ == "__main__":
    sys.exit(_reference_child())
