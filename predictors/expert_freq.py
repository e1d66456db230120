"""`flashinfer-lite count-experts -m FLASHDIR --corpus FILE [FILE...] --tokens N`: how often each expert is routed.

A mixture of experts needs no predictor (its router says exactly which experts run), but its expert cache pins the
experts routed most often (ffn.experts.ExpertFFN), as a dense model's neuron cache pins its most active neurons.
This runs the model over calibration text, its experts read through the expert cache under --dram-budget (so a
model bigger than RAM is counted in bounded memory), counts the router's choices per layer and writes them to
FLASHDIR/predictors/expert_frequencies.json, with a checksum of its own that every load checks.
"""
from __future__ import annotations

import argparse

import numpy as np
from tqdm import tqdm

from flashinfer_lite.predictor_set import save_expert_freq
from flashinfer_lite.runtime import load_runtime
from storage.errors import UserError
from storage.sizes import parse_size
from storage.tokenizer import corpus_chunks

from .acts import read_corpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", required=True, help="FLASHDIR of a mixture of experts")
    parser.add_argument("--corpus", nargs="+", required=True, metavar="FILE", help="calibration text file(s)")
    parser.add_argument("--tokens", type=int, required=True, metavar="N", help="tokens to run through the model")
    parser.add_argument("--ctx", type=int, default=256, help="segment length in tokens (default 256)")
    parser.add_argument("--dram-budget", default="auto", help="DRAM for the run (default auto)")


def run(args) -> int:
    budget = args.dram_budget if args.dram_budget == "auto" else parse_size(args.dram_budget)
    counts = count_routes(args.model, args.corpus, args.tokens, args.ctx, budget)
    path = save_expert_freq(args.model, counts)
    print(f"wrote {path}: {int(counts[0].sum())} routings per layer over {counts.shape[0]} layers x "
          f"{counts.shape[1]} experts")
    return 0


def count_routes(flashdir, corpus, tokens: int, ctx: int = 256, dram_budget="auto", progress: bool = True):
    """[L, E] int64: per layer, the tokens the router sent to each expert, over the first `tokens` tokens of the
    corpus run in segments of ctx."""
    if tokens < 1 or ctx < 2:
        raise UserError("--tokens must be positive and --ctx at least 2")
    model, tokenizer, runtime = load_runtime(flashdir, "auto", dram_budget=dram_budget, ctx=ctx)
    if runtime is None or not hasattr(runtime, "layers"):
        raise UserError(f"{flashdir} is not a mixture of experts")
    kv = model.new_cache(ctx)
    done = 0
    with tqdm(total=tokens, desc="count-experts", unit="tok", disable=not progress, leave=False) as bar:
        for text in corpus_chunks(str(read_corpus(corpus))):
            ids = tokenizer.encode(text)
            for a in range(0, len(ids), ctx):
                seg = ids[a:a + min(ctx, tokens - done)]
                if not seg:
                    break
                kv.reset()
                model.forward(seg, kv)
                done += len(seg)
                bar.update(len(seg))
            if done >= tokens:
                break
    return np.stack([layer.routed for layer in runtime.layers])
