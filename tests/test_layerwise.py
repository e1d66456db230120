"""Layer-streaming (predictors/layerwise.py): collect and eval's dense reference run one layer's weights at a time.

Oracles: the whole-model path they replaced, kept here only: Transformer.forward over each window with every weight
loaded (a recording FFN for collect; the decode loop of the dense runtime for eval's perplexity)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import CORPUS, STORIES

REPO = Path(__file__).resolve().parents[1]
TEXT = CORPUS / "tinystories_cased_197KB.txt"


def corpus(tmp_path, n_bytes=20_000) -> Path:
    f = tmp_path / "cal.txt"
    f.write_bytes(TEXT.read_bytes()[:n_bytes])
    return f


def whole_model_collect(model, corpus_file, n_tokens, ctx, rows, seed, shard_rows):
    """The collection as it was before layer-streaming: every weight loaded, each window through Transformer.forward
    with a recording FFN, rows drawn window by window, a shard flushed once shard_rows rows are pending."""
    from flashinfer_lite.model import load_weights, open_any
    from flashinfer_lite.model import Transformer
    from flashinfer_lite.ffn.dense import FeedForward
    from flashinfer_lite.kernels.blocks import linear
    from predictors.acts import N_BINS, histogram, read_corpus
    from storage.tokenizer import token_segments
    ckpt = open_any(model)
    cfg = ckpt.config
    weights = load_weights(ckpt)
    ffns = [FeedForward(cfg, weights, i) for i in range(cfg.n_layers)]
    L = cfg.n_layers
    stats = dict(hist_count=np.zeros((L, N_BINS)), hist_mass=np.zeros((L, N_BINS)),
                 nonzero_count=np.zeros((L, cfg.ffn_dim), np.int64))
    pending = [{"x": [], "a": []} for _ in range(L)]
    shards, sel = [], np.zeros(0, np.int64)

    def ffn(layer, x):
        a = ffns[layer].activations(x)
        absa = np.abs(a)
        c, m = histogram(absa)
        stats["hist_count"][layer] += c
        stats["hist_mass"][layer] += m
        stats["nonzero_count"][layer] += (absa > 0).sum(axis=0)
        if len(sel):
            pending[layer]["x"].append(x[sel].astype(np.float32))
            pending[layer]["a"].append(np.minimum(absa[sel], 65504.0).astype(np.float16))
        return linear(a, ffns[layer].w_down, ffns[layer].b_down)

    def flush():
        shards.append({f"layers.{i}.{k}": np.concatenate(p[k]) for i, p in enumerate(pending) for k in "xa"})
        for p in pending:
            p["x"].clear()
            p["a"].clear()

    tf = Transformer(cfg, weights, ffn=ffn)
    ctx = min(ctx, cfg.max_pos)
    kv = tf.new_cache(ctx)
    rng = np.random.default_rng(seed)
    p_keep, kept = min(1.0, rows / n_tokens), 0
    for w in token_segments(ckpt.tokenizer(), read_corpus([corpus_file]).text, n_tokens, ctx, cfg.bos_id):
        sel = np.flatnonzero(rng.random(len(w)) < p_keep)[: max(0, rows - kept)]
        kv.reset()
        tf.forward(w, kv)
        kept += len(sel)
        if sum(len(x) for x in pending[0]["x"]) >= shard_rows:
            flush()
    if sum(len(x) for x in pending[0]["x"]):
        flush()
    return stats, shards, kept


@pytest.fixture(scope="module")
def stories_flash_f16(tmp_path_factory):
    from storage.convert import convert
    return convert(STORIES, tmp_path_factory.mktemp("flash16") / "flash", dtype="f16", progress=False)


@pytest.mark.parametrize("kind", ["stories260K", "stories260K-flashdir-f16", "opt-postnorm", "mistral",
                                  "llama-bias-untied"])
def test_collect_equals_the_whole_model_path(kind, tiny_model, stories_flash_f16, tmp_path, monkeypatch):
    """Same statistics and the same sampled rows in the same shards, bit for bit: the same math on the same windows,
    only the loop order differs (layers outside, windows inside). Small shards, so rows span several."""
    from safetensors import safe_open
    from predictors import collect as collect_mod
    from predictors.acts import Acts
    model = {"stories260K": STORIES, "stories260K-flashdir-f16": stories_flash_f16}.get(kind) or tiny_model(kind)
    monkeypatch.setattr(collect_mod, "SHARD_ROWS", 64)
    text = corpus(tmp_path)
    n_tokens, ctx, rows, seed = 700, 64, 300, 3
    out = collect_mod.collect(model, [text], n_tokens, tmp_path / "acts", ctx=ctx, rows=rows, seed=seed,
                              progress=False)
    want_stats, want_shards, want_kept = whole_model_collect(model, text, n_tokens, ctx, rows, seed, 64)
    m = json.loads((out / "manifest.json").read_text())
    assert m["tokens"] == n_tokens and m["rows"] == want_kept
    for key, want in want_stats.items():
        assert np.array_equal(np.asarray(m[key]), want), key
    assert len(m["shards"]) == len(want_shards) > 2
    for name, want in zip(m["shards"], want_shards):
        with safe_open(str(out / name), framework="numpy") as f:
            assert set(f.keys()) == set(want)
            for t, arr in want.items():
                got = f.get_tensor(t)
                assert got.dtype == arr.dtype and np.array_equal(got, arr), (name, t)
    acts = Acts(out)                                     # and the reader sees the rows in corpus order
    x, absa = acts.layer(1)
    assert np.array_equal(x, np.concatenate([s["layers.1.x"] for s in want_shards]))


def test_hidden_states_spill_to_a_memory_mapped_file(tmp_path, monkeypatch):
    """Beyond HIDDEN_IN_RAM_BYTES the hidden states live in a temporary file: same logits as in RAM, and as
    Transformer.forward on each window."""
    from flashinfer_lite.model import load_reference, open_any
    from predictors import layerwise
    ckpt = open_any(STORIES)
    model, _ = load_reference(STORIES)
    rng = np.random.default_rng(0)
    windows = [rng.integers(3, 512, n) for n in (40, 17, 64)]
    monkeypatch.setattr(layerwise, "HIDDEN_IN_RAM_BYTES", 1024)
    with layerwise.LayerStream(ckpt, windows) as s:
        assert isinstance(s.hidden, np.memmap)
        s.run()
        for k, logits in s.logits():
            assert np.array_equal(logits, model.forward(windows[k], model.new_cache(64), all_logits=True))


# Perplexity of batched windows vs one token at a time: float32 order, and the float16 K/V rounding it flips (~1% of
# the elements by an ulp; 4e-5 measured on stories260K)
BATCHED_VS_STEPPED_REL = 2e-4


def decode_loop_perplexity(path, corpus_file, n_tokens, ctx):
    """eval's dense perplexity as it was: the dense runtime (every weight loaded), one token at a time."""
    from flashinfer_lite.runtime import load_runtime
    from predictors.acts import read_corpus
    from storage.tokenizer import token_segments
    from predictors.evaluate import log_softmax_at
    model, tok, _ = load_runtime(path, ffn="dense")
    nll, n = 0.0, 0
    for w in token_segments(tok, read_corpus([corpus_file]).text, n_tokens, min(ctx, model.cfg.max_pos),
                           model.cfg.bos_id):
        kv = model.new_cache(ctx)
        for j in range(len(w) - 1):
            nll -= log_softmax_at(model.forward([w[j]], kv), w[j + 1])
            n += 1
    return float(np.exp(nll / n)), n


@pytest.mark.parametrize("kind", ["stories260K", "stories260K-flashdir-f16", "opt-postnorm"])
def test_eval_dense_perplexity_equals_the_whole_model_path(kind, tiny_model, stories_flash_f16, tmp_path):
    from predictors.evaluate import evaluate
    model = {"stories260K": STORIES, "stories260K-flashdir-f16": stories_flash_f16}.get(kind) or tiny_model(kind)
    text = corpus(tmp_path)
    res = evaluate(model, [text], "dense", n_tokens=300, ctx=64, progress=False)
    want, n = decode_loop_perplexity(model, text, 300, 64)
    assert res["tokens"] == n
    assert res["perplexity"] == pytest.approx(want, rel=BATCHED_VS_STEPPED_REL)
    assert res["dense_perplexity"] == res["perplexity"] and res["top1_agreement"] == 1.0


def test_eval_oracle_compares_with_the_streamed_dense_reference(stories_flash_f16, tmp_path):
    """A sparse mode's dense twin is the streamed reference now: its perplexity is the dense decode loop's."""
    import shutil
    from predictors.collect import collect
    from predictors.evaluate import evaluate
    from predictors.train import train
    flash = tmp_path / "flash"
    shutil.copytree(stories_flash_f16, flash)
    text = corpus(tmp_path)
    collect(STORIES, [text], 1500, tmp_path / "acts", ctx=128, rows=1000, progress=False)
    train(tmp_path / "acts", flash, sparsity=0.5, thresholds_only=True, progress=False)
    res = evaluate(flash, [text], "oracle", n_tokens=300, ctx=64, progress=False)
    want, n = decode_loop_perplexity(flash, text, 300, 64)
    assert res["tokens"] == n
    assert res["dense_perplexity"] == pytest.approx(want, rel=BATCHED_VS_STEPPED_REL)
    assert 0.5 < res["top1_agreement"] < 1.0 and res["perplexity"] != res["dense_perplexity"]
    assert res["active_share"] < 0.7


# ----------------------------------------------------------------------------------------------------------------------
# Memory: the streamed collection holds one layer, so 8 layers cost what 2 do

CHILD = """
import json, sys
mode, model, text, out = sys.argv[1:]
if mode == "collect":
    from predictors.collect import collect
    collect(model, [text], 256, out, ctx=128, rows=64, progress=False)
else:   # the whole model in memory: the control that shows the measurement sees weights
    from flashinfer_lite.model import load_weights, open_any
    w = load_weights(open_any(model))
# VmHWM: this process's peak RSS since exec (ru_maxrss would carry over the forking parent's, pytest's)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"peak": int(hwm.split()[1]) * 1024}))
"""


def test_collect_peak_memory_does_not_grow_with_layers(tmp_path):
    dim, ffn = 1024, 2816
    layer_bytes = 4 * (4 * dim * dim + 3 * dim * ffn)          # one layer's float32 weights (50 MiB)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    text = corpus(tmp_path, 10_000)
    models = {}
    for layers in (2, 8):
        models[layers] = tmp_path / f"m{layers}"
        subprocess.run([sys.executable, str(REPO / "tools" / "make_large_model.py"), str(models[layers]),
                        "--layers", str(layers), "--dim", str(dim), "--ffn", str(ffn), "--heads", "8",
                        "--check-tokens", "0"], env=env, check=True, capture_output=True)

    def peak(mode, layers):
        p = subprocess.run([sys.executable, "-c", CHILD, mode, str(models[layers]), str(text),
                            str(tmp_path / f"acts-{mode}-{layers}")], env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])["peak"]

    streamed = peak("collect", 8) - peak("collect", 2)
    whole = peak("whole", 8) - peak("whole", 2)
    assert whole > 5 * layer_bytes          # the measurement sees weights (6 more layers: ~6 x layer_bytes)
    assert streamed < layer_bytes, f"8 layers cost {streamed / 2**20:.1f} MiB more than 2"
