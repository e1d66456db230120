"""Qwen2, Qwen3 and Gemma 3 next to Llama (issue 27): tiny random transformers models as the oracle, in every FFN mode
and at every DRAM budget, and the refusal of what is not supported."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from conftest import assert_same_bits_at_every_budget, greedy_tokens, predicted_ffn_calls, transformers_model
from flashinfer_lite.model import load_weights
from flashinfer_lite.model import Transformer
from flashinfer_lite.runtime import load_runtime
from storage.checkpoint import open_checkpoint
from storage.convert import convert
from storage.errors import UserError

KINDS = ["qwen2", "qwen3", "gemma3"]
PROMPT = np.random.default_rng(11).integers(3, 512, size=12).tolist()   # longer than gemma3's window (6)


def transformers_greedy(path, ids: list[int], n: int) -> list[int]:
    import torch
    hf = transformers_model(path)
    return hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_32_tokens_equal_transformers_dense_and_oracle(tiny_model, tmp_path, kind):
    path = tiny_model(kind)
    want = transformers_greedy(path, PROMPT, 32)
    model, _, rt = load_runtime(path, "dense")
    assert rt is None and greedy_tokens(model, PROMPT, 32) == want
    flash = convert(path, tmp_path / "flash", dtype="f32", progress=False)
    model, _, rt = load_runtime(flash, "oracle")
    assert rt is not None and greedy_tokens(model, PROMPT, 32) == want


@pytest.mark.parametrize("kind", KINDS)
def test_same_bits_at_every_budget(tiny_model, tmp_path, monkeypatch, kind):
    flash = convert(tiny_model(kind), tmp_path / "flash", dtype="f32", progress=False)
    assert_same_bits_at_every_budget(flash, "oracle", PROMPT, 8, monkeypatch)


def test_every_gemma3_feature_changes_the_logits(tiny_model):
    """Each Gemma 3 flag moves the logits by far more than the 1e-4 within which they equal transformers'
    (test_model_oracle), so the agreement checks every one of them."""
    ckpt = open_checkpoint(tiny_model("gemma3"))
    cfg, w = ckpt.config, load_weights(ckpt)

    def logits(c):
        m = Transformer(c, w)
        return m.forward(PROMPT + PROMPT, m.new_cache(32), all_logits=True)
    want = logits(cfg)
    for change in (dict(sliding_layers=None), dict(sliding_window=None), dict(rope_theta_sliding=None),
                   dict(query_scale=None), dict(embed_scale=1.0), dict(logit_softcap=None), dict(act="silu")):
        got = logits(dataclasses.replace(cfg, **change))
        assert np.abs(got - want).max() > 1e-3, change
    qk, post = dict(w), dict(w)
    for i in range(cfg.n_layers):
        qk[f"layers.{i}.attn.q_norm.weight"] = np.ones(cfg.head_dim, np.float32)
        post[f"layers.{i}.ffn_post_norm.weight"] = np.ones(cfg.dim, np.float32)
    for changed in (qk, post):
        m = Transformer(cfg, changed)
        assert np.abs(m.forward(PROMPT + PROMPT, m.new_cache(32), all_logits=True) - want).max() > 1e-3


def test_unsupported_architecture_is_one_line_naming_the_supported(tiny_model, tmp_path):
    d = shutil.copytree(tiny_model("qwen3"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["Phi3ForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as e:
        open_checkpoint(d)
    msg = str(e.value)
    assert "\n" not in msg and "'Phi3ForCausalLM'" in msg
    assert all(a in msg for a in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"))


@pytest.mark.parametrize("field, value, says", [
    ("attn_logit_softcapping", 50.0, "unsupported Gemma 3 field attn_logit_softcapping"),
    ("hidden_activation", "gelu", "unsupported activation 'gelu'"),
    ("layer_types", ["sliding_attention"], "layer_types must name"),
    ("query_pre_attn_scalar", 0, "'query_pre_attn_scalar' must be a positive integer"),
    ("final_logit_softcapping", "x", "logit_softcap must be a positive number")])
def test_a_gemma3_config_we_cannot_compute_is_one_line(tiny_model, tmp_path, field, value, says):
    d = shutil.copytree(tiny_model("gemma3"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=says) as e:
        open_checkpoint(d)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------------------------------
# The sparse paths with a GELU-gated FFN (Gemma 3), as with SwiGLU (tests/test_predictors.py)

@pytest.fixture(scope="module")
def gemma_predicted(tiny_model, tmp_path_factory):
    """The tiny Gemma 3 as a FLASHDIR with thresholds at 50% sparsity and a predictor in every layer."""
    from conftest import CORPUS
    from predictors.collect import collect
    from predictors.train import train
    tmp = tmp_path_factory.mktemp("gemma_predicted")
    flash = convert(tiny_model("gemma3"), tmp / "flash", dtype="f32", progress=False)
    acts = collect(str(flash), [str(CORPUS / "tinystories_cased_197KB.txt")], 2000, tmp / "acts", ctx=64, rows=1500,
                   progress=False)
    train(acts, flash, sparsity=0.5, steps=100, max_read_share=1.0, progress=False)
    return flash


def test_gelu_thresholds_hit_the_target_sparsity(tiny_model, gemma_predicted):
    """GELU goes negative like SiLU: the threshold is on |a|, calibrated to zero half the neurons, on text."""
    from conftest import CORPUS
    from flashinfer_lite.model import load_reference
    model, tok = load_reference(tiny_model("gemma3"))
    preds = load_runtime(gemma_predicted, "predicted")[2].predictors
    ids = tok.encode((CORPUS / "tinystories_cased_197KB.txt").read_text()[-2000:])[:120]
    shares, dense = [], model.ffn

    def record(layer, x):
        a = model.dense_ffn[layer].activations(x)
        shares.append((np.abs(a) > preds.act_threshold(layer)).mean())
        return dense(layer, x)
    model.ffn = record
    model.forward(ids, model.new_cache(128))
    assert len(shares) == model.cfg.n_layers and all(0.4 < s < 0.6 for s in shares), shares


def test_gelu_predicted_ffn_equals_float64_dense_math_on_the_predicted_set(tiny_model, gemma_predicted):
    """Every FFN call of a decode at the minimum budget equals float64 GeGLU math on the source checkpoint's weights
    (GELU's tanh form written out here), restricted to the predicted neurons and thresholded as calibrated."""
    src = open_checkpoint(tiny_model("gemma3"))
    W = {n: src.tensor(n).astype(np.float64) for n in src.names() if ".ffn." in n}
    calls, rt = predicted_ffn_calls(gemma_predicted, PROMPT[:8])
    assert rt.stats.read_bytes > 0 and len(calls) == 8 * src.config.n_layers
    preds, skipped = rt.selector.predictors, 0
    for layer, x, y in calls:
        mask = preds.predict(layer, x, count=False)[0]
        p, x64 = f"layers.{layer}.ffn.", x[0].astype(np.float64)
        g = W[p + "gate.weight"] @ x64
        a = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * (W[p + "up.weight"] @ x64)
        kept = np.abs(a) > preds.act_threshold(layer)
        want = W[p + "down.weight"] @ np.where(mask & kept, a, 0.0)
        assert np.linalg.norm(y[0] - want) <= 1e-5 * np.linalg.norm(want), layer
        skipped += (kept & ~mask).any()
    assert skipped > 0                 # the predictor left out neurons the threshold kept: its set is what decided


def test_gelu_predicted_mode_same_bits_at_every_budget(gemma_predicted, monkeypatch):
    assert_same_bits_at_every_budget(gemma_predicted, "predicted", PROMPT, 8, monkeypatch)
