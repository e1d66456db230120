"""Qwen2, Qwen3 and Gemma 3 next to Llama (issue 27): tiny random transformers models as the oracle, in every FFN mode
and at every DRAM budget, and the refusal of what is not supported."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from conftest import assert_same_bits_at_every_budget, greedy_tokens, transformers_model
from flashinfer_lite.loader import load_weights
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
