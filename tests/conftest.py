"""Shared fixtures: tiny random models built by transformers (the oracle), and the real models and text in ../shared."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
STORIES = SHARED / "models" / "stories260K"
CORPUS = SHARED / "corpus"

# Tiny architectures, each exercising a code path users' models take. Vocab 512 so stories260K's tokenizer fits.
TINY = {
    "llama-relu": ("llama", dict(hidden_act="relu")),
    "llama-silu-gqa": ("llama", dict(hidden_act="silu", num_key_value_heads=2)),
    "llama-bias-untied": ("llama", dict(hidden_act="silu", attention_bias=True, mlp_bias=True,
                                        tie_word_embeddings=False, rope_theta=500000.0)),
    "mistral": ("mistral", dict(hidden_act="silu", num_key_value_heads=2, sliding_window=6)),
    "qwen2": ("qwen2", dict(hidden_act="silu", num_key_value_heads=2)),
    "opt": ("opt", dict(do_layer_norm_before=True)),
    "opt-postnorm": ("opt", dict(do_layer_norm_before=False)),
}


def build_tiny(kind: str, path: Path, seed: int = 0) -> Path:
    """save_pretrained a seeded random model of `kind` into path (safetensors, float32)."""
    import torch
    import transformers as tf
    family, extra = TINY[kind]
    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    if family == "opt":
        cfg = tf.OPTConfig(ffn_dim=160, word_embed_proj_dim=64, **common, **extra)
        model = tf.OPTForCausalLM(cfg)
    else:
        cls_cfg = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[family]
        cls_model = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
                     "qwen2": tf.Qwen2ForCausalLM}[family]
        model = cls_model(cls_cfg(intermediate_size=160, rms_norm_eps=1e-5, **common, **extra))
    # Random init puts biases and norms at 0/1; perturb them so those code paths are actually tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if family != "opt" and "mlp" in name and name.endswith("weight"):
                p.mul_(8.0)  # a tiny random FFN is near-silent; give it a voice in the output
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    if STORIES.exists():
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(STORIES / f, path / f)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(kind) -> Path of a saved transformers model (built once per session)."""
    cache: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = build_tiny(kind, tmp_path_factory.mktemp(kind.replace("-", "_")))
        return cache[kind]
    return make


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path to the SmolLM2-135M-Instruct GGUF (fetched into the user cache on first use), or skip."""
    from flashinfer_lite.default_model import ensure_default_model
    from flashinfer_lite.errors import UserError
    try:
        return ensure_default_model(quiet=True)
    except UserError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


def transformers_model(path: Path, **kw):
    import torch
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kw).eval()
