"""The dense numpy path against transformers, the independent oracle, for every architecture we import."""
import numpy as np
import pytest

from storage.checkpoint import open_checkpoint
from flashinfer_lite.model import load_reference, load_weights
from flashinfer_lite.model import Transformer

from conftest import STORIES, TINY, TINY_MOE, greedy_tokens, transformers_model


def incremental_logits(model: Transformer, ids: list[int], prefill: int) -> np.ndarray:
    """Logits for every position: a batched prefill of `prefill` tokens, then one-token decode steps."""
    kv = model.new_cache(64)
    rows = [model.forward(ids[:prefill], kv, all_logits=True)]
    rows += [model.forward([t], kv)[None] for t in ids[prefill:]]
    return np.concatenate(rows)


@pytest.mark.parametrize("kind", sorted(TINY) + sorted(TINY_MOE))
def test_tiny_random_models_match_transformers(tiny_model, kind):
    import torch
    path = tiny_model(kind)
    ckpt = open_checkpoint(path)
    ours = Transformer(ckpt.config, load_weights(ckpt))
    ids = np.random.default_rng(1).integers(3, 512, size=16).tolist()
    got = incremental_logits(ours, ids, prefill=7)
    with torch.no_grad():
        want = transformers_model(path)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(want).max() > 0.1  # the oracle says something, so agreement means something
    # float32 rounding of the two implementations grows with the reduction length, as sqrt(d): 1e-4 at d = 64
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, (ckpt.config.dim / 64) ** 0.5))


def test_mistral_sliding_window_is_exercised(tiny_model):
    # The window (6) is shorter than the prompt (16): without the window mask the last logits must differ.
    path = tiny_model("mistral")
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    assert cfg.sliding_window == 6
    w = load_weights(ckpt)
    ids = np.random.default_rng(1).integers(3, 512, size=16).tolist()
    windowed = Transformer(cfg, w).forward(ids, Transformer(cfg, w).new_cache(32), all_logits=True)
    cfg.sliding_window = None
    full = Transformer(cfg, w)
    unwindowed = full.forward(ids, full.new_cache(32), all_logits=True)
    assert np.abs(windowed[-1] - unwindowed[-1]).max() > 1e-3


def test_stories260k_greedy_100_tokens_equal_transformers():
    import torch
    model, tok = load_reference(STORIES)
    ids = tok.encode("Once upon a time")
    out = greedy_tokens(model, ids, 100, ctx=256)
    hf = transformers_model(STORIES)
    want = hf.generate(torch.tensor([ids]), max_new_tokens=100, min_new_tokens=100, do_sample=False)[0].tolist()
    assert out == want
    assert tok.decode(out).startswith("Once upon a time, there was a little girl named Lily.")


def test_smollm2_gguf_matches_transformers(smollm2_gguf):
    import torch
    model, tok = load_reference(smollm2_gguf)
    hf = transformers_model(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ids = tok.encode("The capital of France is")
    kv = model.new_cache(128)
    logits = model.forward(ids, kv, all_logits=True)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    # Both sides dequantize the same Q4_1 weights and round K/V to float16; what is left is float32 summation order,
    # except that it flips some keys' float16 rounding by an ulp, which SmolLM2's sharp attention carries to ~5e-3
    # on logits up to ~27 (float16 K/V itself moves them ~1.5e-2 from float32 K/V).
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-2)
    out, last = list(ids), logits[-1]
    for _ in range(32):
        out.append(int(np.argmax(last)))
        if out[-1] in tok.eos_ids:
            break
        last = model.forward([out[-1]], kv)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0].tolist()
    assert out == ref
    assert "Paris" in tok.decode(out[len(ids):])


def test_smollm2_tokenizer_and_template_match_transformers(smollm2_gguf):
    from transformers import AutoTokenizer
    _, tok = load_reference(smollm2_gguf)
    hf = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for text in ["The capital of France is", "Hello world, it's  a test!\n\nNew line éà 日本 <|im_end|>"]:
        assert tok.encode(text) == hf(text).input_ids
        assert tok.decode(tok.encode(text)) == hf.decode(hf(text).input_ids, skip_special_tokens=True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name?"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_prosparse_fatrelu_matches_transformers_with_the_same_activation(tiny_model, tmp_path):
    """ProSparse ships SparseLlamaForCausalLM with hidden_act "fatrelu": relu that zeroes gate values <= t."""
    import json
    import shutil
    import torch
    src = tiny_model("llama-relu")
    d = shutil.copytree(src, tmp_path / "prosparse")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["SparseLlamaForCausalLM"], hidden_act="fatrelu", hidden_act_param=0.3)
    (d / "config.json").write_text(json.dumps(cfg))
    ckpt = open_checkpoint(d)
    assert ckpt.config.act == "relu" and ckpt.config.relu_threshold == 0.3
    ours = Transformer(ckpt.config, load_weights(ckpt))
    ids = np.random.default_rng(2).integers(3, 512, size=16).tolist()
    got = incremental_logits(ours, ids, prefill=5)
    hf = transformers_model(src)  # same weights, plain relu; give it FATReLU as the oracle's activation
    for layer in hf.model.layers:
        layer.mlp.act_fn = torch.nn.Threshold(0.3, 0.0)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
        plain = transformers_model(src)(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert np.abs(want - plain).max() > 1e-3  # the threshold changed the output, so the check has teeth


@pytest.mark.parametrize("kind", sorted(TINY_MOE))
def test_tiny_moe_greedy_tokens_equal_transformers_and_every_part_counts(tiny_model, kind):
    """Greedy decoding of each mixture of experts equals transformers'; and the parts that make it one (the router's
    top-k with its renormalisation, the shared expert, q/k norms) each change the logits, so the match has teeth."""
    import torch
    from flashinfer_lite import model as M
    path = tiny_model(kind)
    ckpt = open_checkpoint(path)
    cfg, w = ckpt.config, load_weights(ckpt)
    ids = np.random.default_rng(3).integers(3, 512, size=9).tolist()
    out = greedy_tokens(Transformer(cfg, w), ids, 12, ctx=64)
    hf = transformers_model(path)
    want = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0].tolist()
    assert out == want
    base = Transformer(cfg, w).forward(ids, Transformer(cfg, w).new_cache(32), all_logits=True)
    changes = {"one expert": dict(n_experts_used=1), "renormalised": dict(norm_topk_prob=not cfg.norm_topk_prob)}
    if cfg.shared_expert_dim:
        changes["no shared expert"] = dict(shared_expert_dim=0)
    for what, change in changes.items():
        other = M.ModelConfig(**{**cfg.to_dict(), **change})
        got = Transformer(other, w).forward(ids, Transformer(other, w).new_cache(32), all_logits=True)
        assert np.abs(got - base).max() > 1e-3, what
    if cfg.qk_norm:
        w2 = {n: (np.ones_like(t) if n.endswith(("q_norm.weight", "k_norm.weight")) else t) for n, t in w.items()}
        got = Transformer(cfg, w2).forward(ids, Transformer(cfg, w2).new_cache(32), all_logits=True)
        assert np.abs(got - base).max() > 1e-3, "q/k norm weights"
