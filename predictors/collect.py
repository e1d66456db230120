"""`flashinfer-lite collect -m MODEL --corpus FILE [FILE...] --tokens N -o ACTS`: record what the FFNs see and do.

Runs the dense model over the corpus in segments of --ctx tokens (batched prefill: collection needs no decode path),
layer by layer (predictors/layerwise.py: one layer's weights in memory, so the model may be bigger than RAM), and
records, per layer:
  - a uniform sample of token rows: FFN input x [d] and |a| [n] (written to safetensors shards as it goes, so memory
    stays bounded whatever N is),
  - over every token: the histogram of |a| (counts and mass, for CATS/TEAL-style thresholds) and how often each
    neuron is nonzero (the hot and cold neurons of ReLU models).
A mixture of experts needs no neuron predictor (its router picks the experts exactly), so for it collect samples no
rows and records, per layer over every token: how often the router picked each expert (`expert_counts` [L, E], what
the expert cache pins: train-predictor writes them into the FLASHDIR) and the histogram of |a| inside the routed
experts (each expert loaded alone, as predictors/layerwise.py runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from storage.errors import UserError
from flashinfer_lite.model import open_any
from storage.files import remove_stale_temp_dirs, temp_path
from storage.tokenizer import token_segments

from .acts import (ACTS_FORMAT, ACTS_VERSION, MANIFEST, N_BINS, ShardWriter, histogram,
                   model_identity, read_corpus)
from .layerwise import LayerStream

DEFAULT_ROWS = 8192        # sampled token rows kept per layer (training set of the predictors)
SHARD_ROWS = 1024          # rows per shard file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", required=True, help="HF model directory, .gguf file or FLASHDIR")
    parser.add_argument("--corpus", nargs="+", required=True, metavar="FILE", help="calibration text file(s)")
    parser.add_argument("--tokens", type=int, required=True, metavar="N", help="tokens to run through the model")
    parser.add_argument("-o", "--output", required=True, metavar="ACTS", help="activations directory to create")
    parser.add_argument("--ctx", type=int, default=256, help="segment length in tokens (default 256)")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS,
                        help=f"token rows sampled and stored per layer (default {DEFAULT_ROWS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the row sampling")
    parser.add_argument("--force", action="store_true", help="replace an existing ACTS directory")


def run(args) -> int:
    out = collect(args.model, args.corpus, args.tokens, args.output, ctx=args.ctx, rows=args.rows, seed=args.seed,
                  force=args.force)
    m = json.loads((out / MANIFEST).read_text())
    if m.get("expert_counts") is not None:
        E = len(m["expert_counts"][0])
        print(f"wrote {out}: {m['tokens']} tokens in {m['segments']} segments, the router's choices over "
              f"{m['identity']['config']['n_layers']} layers x {E} experts (no rows sampled: a mixture of experts "
              f"needs no neuron predictor)")
        return 0
    print(f"wrote {out}: {m['tokens']} tokens in {m['segments']} segments, {m['rows']} sampled rows x "
          f"{m['identity']['config']['n_layers']} layers in {len(m['shards'])} shards")
    return 0


class RowDraws:
    """Which token rows of each segment are sampled, and where they are stored.

    The draws are made segment by segment in corpus order (rng.random(len(segment)) < p_keep, at most `rows` kept in
    all), and a shard is closed after the segment at which SHARD_ROWS or more rows are pending (and at the end), as
    when segments ran through the whole model one after another. Known before any layer runs, so every layer's rows
    of a segment go straight to their place in their shard."""

    def __init__(self, lengths: list[int], n_tokens: int, rows: int, seed: int):
        rng = np.random.default_rng(seed)
        p_keep = min(1.0, rows / n_tokens)
        self.sel: list[np.ndarray] = []       # per segment: its sampled rows
        self.shard: list[int] = []            # per segment: its shard (-1: nothing sampled after the last shard)
        self.row0: list[int] = []             # per segment: where its rows start in the shard
        self.shard_rows: list[int] = []       # per shard: rows
        kept = pending = 0
        for T in lengths:
            sel = np.flatnonzero(rng.random(T) < p_keep)
            sel = sel[: max(0, rows - kept)]
            self.sel.append(sel)
            self.shard.append(len(self.shard_rows))
            self.row0.append(pending)
            kept += len(sel)
            pending += len(sel)
            if pending >= SHARD_ROWS:
                self.shard_rows.append(pending)
                pending = 0
        if pending:
            self.shard_rows.append(pending)
        self.shard = [s if s < len(self.shard_rows) else -1 for s in self.shard]
        self.kept = kept


class Recorder:
    """The per-layer hook during collection: statistics over every token, and the sampled rows written into the
    shards in place."""

    def __init__(self, cfg, draws: RowDraws, shards: list[ShardWriter]):
        L, n = cfg.n_layers, 0 if cfg.moe else cfg.ffn_dim      # no neuron of an expert is counted across experts
        self.draws, self.shards = draws, shards
        self.hist_count = np.zeros((L, N_BINS))
        self.hist_mass = np.zeros((L, N_BINS))
        self.nonzero = np.zeros((L, n), np.int64)

    def __call__(self, layer: int, segment: int, x: np.ndarray, a: np.ndarray) -> None:
        absa = self.add_histogram(layer, a)                   # [T, n]
        self.nonzero[layer] += (absa > 0).sum(axis=0)
        sel = self.draws.sel[segment]
        if len(sel):
            shard, row0 = self.shards[self.draws.shard[segment]], self.draws.row0[segment]
            shard.write_rows(f"layers.{layer}.x", row0, x[sel].astype(np.float32))
            shard.write_rows(f"layers.{layer}.a", row0, np.minimum(absa[sel], 65504.0).astype(np.float16))

    def add_histogram(self, layer: int, a: np.ndarray) -> np.ndarray:
        absa = np.abs(a)
        c, m = histogram(absa)
        self.hist_count[layer] += c
        self.hist_mass[layer] += m
        return absa

    def expert(self, layer: int, expert: int, a: np.ndarray) -> None:
        """A mixture of experts' hook (LayerStream's expert_hook): the histogram of |a| over the routed experts."""
        self.add_histogram(layer, a)


def shard_tensors(cfg, rows: int) -> dict:
    """The tensors of a shard of `rows` rows: float32 x first, then float16 |a| (each aligned to its item size)."""
    L, d, n = cfg.n_layers, cfg.dim, cfg.ffn_dim
    return {**{f"layers.{i}.x": (np.float32, (rows, d)) for i in range(L)},
            **{f"layers.{i}.a": (np.float16, (rows, n)) for i in range(L)}}


def collect(model, corpus, n_tokens: int, output, ctx: int = 256, rows: int = DEFAULT_ROWS, seed: int = 0,
            force: bool = False, progress: bool = True) -> Path:
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
    ckpt = open_any(model)
    cfg = ckpt.config
    tokenizer = ckpt.tokenizer()
    text = read_corpus(corpus, tokenizer.text_cap(2 * n_tokens))   # twice: a cut changes the tokens next to it
    ctx = min(ctx, cfg.max_pos)
    identity = model_identity(ckpt)
    segments = list(token_segments(tokenizer, text.text, n_tokens, ctx, cfg.bos_id))
    seen = sum(len(w) for w in segments)
    if seen == 0:
        raise UserError(f"the corpus gives no tokens: {', '.join(text.files)}")
    draws = RowDraws([len(w) for w in segments], n_tokens, 0 if cfg.moe else rows, seed)
    if not draws.shard_rows and not cfg.moe:
        raise UserError("no token rows were sampled (raise --tokens or --rows)")

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(out.parent)          # what a killed collect (or convert, train) left beside it
    tmp = temp_path(out, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        shards = [f"shard-{k:05d}.safetensors" for k in range(len(draws.shard_rows))]
        writers = [ShardWriter(tmp / name, shard_tensors(cfg, r)) for name, r in zip(shards, draws.shard_rows)]
        rec = Recorder(cfg, draws, writers)
        # layer by layer over all segments: one layer's weights in memory, whatever the model's size
        with LayerStream(ckpt, segments, progress=progress, desc="collect") as stream:
            stream.run(rec, rec.expert)
            counts = stream.expert_counts
        manifest = {
            "format": ACTS_FORMAT, "version": ACTS_VERSION, "identity": identity, "model": str(model),
            "corpus": text.files, "replaced_bytes": text.replaced_bytes, "tokens": seen,
            "segments": len(segments), "ctx": ctx, "rows": draws.kept, "seed": seed, "shards": shards,
            "hist_count": rec.hist_count.tolist(), "hist_mass": rec.hist_mass.tolist(),
            "nonzero_count": rec.nonzero.tolist(),
            **({"expert_counts": counts.tolist()} if counts is not None else {}),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        if out.exists():
            old = temp_path(out, "old")
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
