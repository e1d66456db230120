#!/usr/bin/env python3
"""Record real FFN activation traces from a small real model and map them onto a large layer width.

    python tools/record_trace.py -o TRACE.npz [--model SmolLM2.gguf] [--layers 32] [--ffn 11008]
                                 [--active 0.10] [--cal-tokens 512] [--tokens 256]

Random weights have no hot neurons and no token-to-token locality, so a cache looks worse (or, with a predictor
trained on them, arbitrary) compared with a real model. This tool runs a real model (SmolLM2-135M by default) over
real text and keeps, per token and layer, the set of neurons with |a_i| above the layer's 90th percentile of |a|
(SwiGLU has no exact zeros; the percentile is taken on the calibration text, so ~10% are active per token).

Mapping to the big model (kept: per-neuron frequency, co-activation, and window locality in time):
  big neuron k of any layer copies small neuron parent[k], where parent tiles 0..n_small-1 over the big width and
  is then shuffled by a fixed permutation (so co-active copies are not adjacent in the file); big layer l replays
  small layer l mod n_small_layers.
  The ~n_big / n_small copies of a small neuron fire on exactly the same tokens: the trace holds n_small independent
  neurons per layer, not n_big. Frequencies, window locality and random-order reads hold; neuron placement does not
  (an order storing copies side by side looks ~7x better than it is), so the placement study (bench/README.md) measured at the small
  model's own width.
Stored (npz, no pickles): active [T, L, n] packed bits (replay text), freq [L, n] (calibration text), parent,
layer_map, thresholds, token ids and the provenance.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CORPUS = REPO / "tests" / "data" / "corpus"          # excerpts shipped with the repo; --corpus for the full files

CHUNK = 128          # tokens per forward pass (prefill: each token's activations are what decode would give)


def record_abs_activations(model, ids: np.ndarray) -> np.ndarray:
    """|a| float16 [T, L, n] of every FFN neuron for the token ids, run in chunks with one growing KV cache."""
    cfg = model.cfg
    out = np.zeros((len(ids), cfg.n_layers, cfg.ffn_dim), np.float16)
    pos = [0]

    def ffn(layer, x):
        f = model.dense_ffn[layer]
        a = f.activations(x)                                                  # [T, n]
        out[pos[0]:pos[0] + len(x), layer] = np.abs(a)
        return a @ f.w_down.T if f.b_down is None else a @ f.w_down.T + f.b_down

    model.ffn = ffn
    kv = model.new_cache(len(ids))
    for lo in tqdm(range(0, len(ids), CHUNK), desc="trace", unit="chunk", file=sys.stderr):
        pos[0] = lo
        model.forward(ids[lo:lo + CHUNK], kv)
    return out


def text_tokens(tok, path: Path, n: int) -> np.ndarray:
    ids = tok.encode(path.read_text(encoding="utf-8", errors="replace")[: 40 * n])
    if len(ids) < n:
        sys.exit(f"record_trace: {path} gives only {len(ids)} tokens, {n} wanted")
    return np.asarray(ids[:n], np.int64)


def map_to_big(small: np.ndarray, parent: np.ndarray, layer_map: np.ndarray) -> np.ndarray:
    """small bool [..., Ls, ns] -> big bool [..., L, n]."""
    return small[..., layer_map, :][..., parent]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None, help="model (default: the default model, fetched on first use)")
    ap.add_argument("--corpus", type=Path, default=CORPUS,
                    help="directory with wikitext2_valid.txt (calibration) and wikitext2_test.txt (replay)")
    ap.add_argument("--layers", type=int, default=32, help="layers of the big model")
    ap.add_argument("--ffn", type=int, default=11008, help="FFN width of the big model")
    ap.add_argument("--active", type=float, default=0.10, help="share of neurons counted active")
    ap.add_argument("--cal-tokens", type=int, default=512, help="tokens of calibration text (thresholds, freq)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens of replay text")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from flashinfer_lite.model import load_reference
    if a.model is None:
        from flashinfer_lite.default_model import ensure_default_model
        a.model = ensure_default_model()
    model, tok = load_reference(a.model)
    cfg = model.cfg
    cal_text, replay_text = a.corpus / "wikitext2_valid.txt", a.corpus / "wikitext2_test.txt"
    cal = text_tokens(tok, cal_text, a.cal_tokens)
    rep = text_tokens(tok, replay_text, a.tokens)
    acts_cal = record_abs_activations(model, cal)                               # [Tc, Ls, ns]
    # per layer: the |a| above which `active` of the calibration (token, neuron) pairs lie
    thr = np.array([np.quantile(acts_cal[:, i].astype(np.float32), 1 - a.active) for i in range(cfg.n_layers)],
                   np.float32)
    small_cal = acts_cal > thr[None, :, None]
    del acts_cal
    small_rep = record_abs_activations(model, rep) > thr[None, :, None]          # [Tr, Ls, ns]

    rng = np.random.default_rng(a.seed)
    parent = rng.permutation(np.arange(a.ffn) % cfg.ffn_dim)                     # big neuron -> small neuron
    layer_map = np.arange(a.layers) % cfg.n_layers
    big_rep = map_to_big(small_rep, parent, layer_map)                           # [Tr, L, n]
    freq = small_cal.mean(axis=0)[layer_map][:, parent].astype(np.float32)       # [L, n]
    info = {"model": str(a.model), "small_layers": cfg.n_layers, "small_ffn": cfg.ffn_dim, "layers": a.layers,
            "ffn": a.ffn, "active_target": a.active, "cal_text": cal_text.name, "replay_text": replay_text.name,
            "active_share_replay": round(float(small_rep.mean()), 4),
            "active_share_cal": round(float(small_cal.mean()), 4),
            # how much of token t's active set token t-1 already had (window locality)
            "overlap_prev_token": round(float((small_rep[1:] & small_rep[:-1]).sum() / small_rep[1:].sum()), 4)}
    out = a.output.expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}.npz")
    np.savez_compressed(tmp, active=np.packbits(big_rep, axis=-1), n=np.int64(a.ffn), freq=freq, parent=parent,
                        layer_map=layer_map, thresholds=thr, replay_ids=rep, info=json.dumps(info))
    os.replace(tmp, out)
    print(json.dumps(info))
    return 0


def load_trace(path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(active bool [T, L, n], freq float32 [L, n], info) of a trace written by this tool."""
    with np.load(path, allow_pickle=False) as z:
        n = int(z["n"])
        active = np.unpackbits(z["active"], axis=-1, count=n).astype(bool)
        return active, z["freq"], json.loads(str(z["info"]))


if __name__ == "__main__":
    sys.exit(main())
