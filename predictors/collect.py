"""`flashinfer-lite collect -m MODEL --corpus FILE [FILE...] --tokens N -o ACTS`: record what the FFNs see and do.

Runs the dense model over the corpus in windows of --ctx tokens (batched prefill: collection needs no decode path)
and records, per layer:
  - a uniform sample of token rows: FFN input x [d] and |a| [n] (written to safetensors shards as it goes, so memory
    stays bounded whatever N is),
  - over every token: the histogram of |a| (counts and mass, for CATS/TEAL-style thresholds) and how often each
    neuron is nonzero (the hot and cold neurons of ReLU models).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from flashinfer_lite.errors import UserError
from flashinfer_lite.loader import load_weights, open_any
from flashinfer_lite.model import FeedForward, Transformer, linear

from .acts import (ACTS_FORMAT, ACTS_VERSION, MANIFEST, N_BINS, corpus_chunks, histogram, model_identity,
                   read_corpus)

DEFAULT_ROWS = 8192        # sampled token rows kept per layer (training set of the predictors)
SHARD_ROWS = 1024          # rows per shard file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", required=True, help="HF model directory, .gguf file or FLASHDIR")
    parser.add_argument("--corpus", nargs="+", required=True, metavar="FILE", help="calibration text file(s)")
    parser.add_argument("--tokens", type=int, required=True, metavar="N", help="tokens to run through the model")
    parser.add_argument("-o", "--output", required=True, metavar="ACTS", help="activations directory to create")
    parser.add_argument("--ctx", type=int, default=256, help="window length in tokens (default 256)")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS,
                        help=f"token rows sampled and stored per layer (default {DEFAULT_ROWS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the row sampling")
    parser.add_argument("--force", action="store_true", help="replace an existing ACTS directory")


def run(args) -> int:
    out = collect(args.model, args.corpus, args.tokens, args.output, ctx=args.ctx, rows=args.rows, seed=args.seed,
                  force=args.force)
    m = json.loads((out / MANIFEST).read_text())
    print(f"wrote {out}: {m['tokens']} tokens in {m['windows']} windows, {m['rows']} sampled rows x "
          f"{m['identity']['config']['n_layers']} layers in {len(m['shards'])} shards")
    return 0


class Recorder:
    """The FFN callable during collection: dense math, plus statistics and the sampled rows."""

    def __init__(self, cfg, weights):
        self.cfg = cfg
        self.ffns = [FeedForward(cfg, weights, i) for i in range(cfg.n_layers)]
        L, n = cfg.n_layers, cfg.ffn_dim
        self.hist_count = np.zeros((L, N_BINS))
        self.hist_mass = np.zeros((L, N_BINS))
        self.nonzero = np.zeros((L, n), np.int64)
        self.sample_rows: np.ndarray = np.zeros(0, np.int64)   # rows of the current window to keep
        self.pending: list[dict[str, list]] = [{"x": [], "a": []} for _ in range(L)]

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        f = self.ffns[layer]
        a = f.activations(x)                                  # [T, n]
        absa = np.abs(a)
        c, m = histogram(absa)
        self.hist_count[layer] += c
        self.hist_mass[layer] += m
        self.nonzero[layer] += (absa > 0).sum(axis=0)
        if len(self.sample_rows):
            self.pending[layer]["x"].append(x[self.sample_rows].astype(np.float32))
            self.pending[layer]["a"].append(np.minimum(absa[self.sample_rows], 65504.0).astype(np.float16))
        return linear(a, f.w_down, f.b_down)

    def pending_rows(self) -> int:
        return sum(len(x) for x in self.pending[0]["x"])

    def take(self) -> dict[str, np.ndarray]:
        out = {}
        for i, p in enumerate(self.pending):
            out[f"layers.{i}.x"] = np.concatenate(p["x"])
            out[f"layers.{i}.a"] = np.concatenate(p["a"])
            p["x"].clear()
            p["a"].clear()
        return out


def token_windows(tokenizer, text: str, n_tokens: int, ctx: int, bos: int | None):
    """Windows of ctx tokens ([bos] + text tokens), n_tokens in all (the last window may be shorter)."""
    body = ctx - (bos is not None)
    buf: list[int] = []
    left = n_tokens
    for chunk in corpus_chunks(text):
        buf.extend(tokenizer.encode(chunk, add_special_tokens=False))
        while len(buf) >= body and left > 0:
            w = ([bos] if bos is not None else []) + buf[:body]
            w = w[:left]
            del buf[:body]
            left -= len(w)
            yield w
        if left <= 0:
            return
    if buf and left > (bos is not None):
        yield (([bos] if bos is not None else []) + buf)[:left]


def collect(model, corpus, n_tokens: int, output, ctx: int = 256, rows: int = DEFAULT_ROWS, seed: int = 0,
            force: bool = False, progress: bool = True) -> Path:
    from safetensors.numpy import save_file


    if n_tokens <= 0:
        raise UserError(f"--tokens must be positive (got {n_tokens})")
    if ctx < 2:
        raise UserError(f"--ctx must be at least 2 (got {ctx})")
    if rows <= 0:
        raise UserError(f"--rows must be positive (got {rows})")
    out = Path(output).expanduser()
    if out.exists():
        if not force:
            raise UserError(f"{out} already exists (use --force to replace it)")
        if not (out / MANIFEST).is_file():
            raise UserError(f"{out} exists and is not an activations directory; refusing to replace it")
    text = read_corpus(corpus)
    if text.replaced_bytes:
        print(f"warning: {text.replaced_bytes} bytes of the corpus are not valid UTF-8; decoded with replacement "
              f"(U+FFFD)", file=sys.stderr)
    ckpt = open_any(model)
    cfg = ckpt.config
    tokenizer = ckpt.tokenizer()
    ctx = min(ctx, cfg.max_pos)
    weights = load_weights(ckpt, progress)
    identity = model_identity(ckpt)
    rec = Recorder(cfg, weights)
    tf = Transformer(cfg, weights, ffn=rec)
    kv = tf.new_cache(ctx)
    rng = np.random.default_rng(seed)
    p_keep = min(1.0, rows / n_tokens)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        shards: list[str] = []
        seen = windows = kept = 0

        def flush():
            name = f"shard-{len(shards):05d}.safetensors"
            save_file(rec.take(), str(tmp / name))
            shards.append(name)

        bar = tqdm(total=n_tokens, desc="collect", unit="tok", disable=not progress, file=sys.stderr)
        for w in token_windows(tokenizer, text.text, n_tokens, ctx, cfg.bos_id):
            sel = np.flatnonzero(rng.random(len(w)) < p_keep)
            sel = sel[: max(0, rows - kept)]
            rec.sample_rows = sel
            kv.reset()
            tf.forward(w, kv)
            kept += len(sel)
            seen += len(w)
            windows += 1
            bar.update(len(w))
            if rec.pending_rows() >= SHARD_ROWS:
                flush()
        bar.close()
        if seen == 0:
            raise UserError(f"the corpus gives no tokens: {', '.join(text.files)}")
        if rec.pending_rows():
            flush()
        if not shards:
            raise UserError("no token rows were sampled (raise --tokens or --rows)")
        manifest = {
            "format": ACTS_FORMAT, "version": ACTS_VERSION, "identity": identity, "model": str(model),
            "corpus": text.files, "replaced_bytes": text.replaced_bytes, "tokens": seen, "windows": windows,
            "ctx": ctx, "rows": kept, "seed": seed, "shards": shards,
            "hist_count": rec.hist_count.tolist(), "hist_mass": rec.hist_mass.tolist(),
            "nonzero_count": rec.nonzero.tolist(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:    # includes Ctrl-C: nothing half-written survives
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if seen < n_tokens:
        print(f"note: the corpus gave only {seen} of the {n_tokens} tokens asked for", file=sys.stderr)
    return out
