"""Sampler statistics, and the safetensors reader against torch on dtypes and sharding users' checkpoints have."""
import json

import numpy as np
import pytest

from storage.checkpoint import SafetensorsFile, open_checkpoint
from storage.errors import UserError
from flashinfer_lite.generate import Sampler
from flashinfer_lite.ffn.dense import softmax


def test_sampler_greedy_and_top_k_1_pick_argmax():
    logits = np.random.default_rng(0).normal(size=100).astype(np.float32)
    assert Sampler(temp=0)(logits) == int(np.argmax(logits))
    assert Sampler(temp=1.5, top_k=1, top_p=1.0, seed=3)(logits) == int(np.argmax(logits))


def test_a_tiny_temperature_samples_as_the_float64_softmax_says():
    """--temp 1e-310 divided the logits into inf and took inf - inf = NaN ("Probabilities contain NaN"). The tempered
    softmax in float64 (shifted first) puts all the mass on the top logit for these temperatures: so must the draw."""
    rng = np.random.default_rng(0)
    for temp in (1e-310, 5e-324, 1e-300, 1e-30):
        for seed in range(20):
            logits = (rng.normal(size=64) * 30).astype(np.float32)
            z = logits.astype(np.float64)
            p = np.exp((z - z.max()) / temp)
            assert p.max() == 1.0 and p.sum() == 1.0       # the oracle: one token has it all
            s = Sampler(temp=temp, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
            assert s(logits) == int(np.argmax(p)), temp


def test_sampler_frequencies_follow_the_tempered_softmax():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    s = Sampler(temp=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    counts = np.bincount([s(logits) for _ in range(20000)], minlength=5) / 20000
    np.testing.assert_allclose(counts, softmax(logits / 0.7), atol=0.015)


def test_sampler_top_p_keeps_the_smallest_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(temp=1.0, top_k=0, top_p=0.75, min_p=0.0, seed=0)
    seen = {s(logits) for _ in range(2000)}
    assert seen == {0, 1}  # 0.5 < 0.75 <= 0.8: the first two tokens make the nucleus


def test_sampler_min_p_and_repeat_penalty_follow_llama_cpp():
    """Against a plain numpy statement of llama.cpp's chain: the penalty on the last n ids (logit / P if positive,
    x P if negative), then min-p on the softmax (keep p >= min_p * max p), then the tempered softmax of what is left."""
    logits = np.array([3.0, 2.5, 1.0, -0.5, -2.0, 0.2], np.float32)
    history = [9, 1, 3, 3, 0]                                     # 9 is outside the last 4
    s = Sampler(temp=0.9, top_k=0, top_p=1.0, min_p=0.1, repeat_penalty=1.3, repeat_last_n=4, seed=0)
    want = logits.astype(np.float64).copy()
    for t in {1, 3, 0}:
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    p = softmax(want)
    keep = p >= 0.1 * p.max()
    q = np.where(keep, np.exp((want - want.max()) / 0.9), 0.0)
    q /= q.sum()
    counts = np.bincount([s(logits, history) for _ in range(20000)], minlength=len(logits)) / 20000
    np.testing.assert_allclose(counts, q, atol=0.015)
    assert counts[~keep].sum() == 0 and keep.sum() < len(logits)     # min-p really dropped something
    # greedy takes the penalty too (llama.cpp applies penalties before the greedy pick)
    assert Sampler(temp=0, repeat_penalty=2.0)(np.array([2.0, 1.5], np.float32), [0]) == 1
    assert Sampler(temp=0)(np.array([2.0, 1.5], np.float32), [0]) == 0


def test_bf16_and_f16_tensors_read_as_torch_widens_them(tmp_path):
    import torch
    from safetensors.torch import save_file
    t = {"a": torch.randn(7, 5).to(torch.bfloat16), "b": torch.randn(3).to(torch.float16), "c": torch.randn(2, 2)}
    save_file(t, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    for k, v in t.items():
        np.testing.assert_array_equal(f.read(k), v.float().numpy())


def test_sharded_checkpoint_reads_like_the_single_file(tiny_model, tmp_path):
    import transformers as tf
    src = tiny_model("qwen2")
    m = tf.AutoModelForCausalLM.from_pretrained(src)
    m.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    a, b = open_checkpoint(src), open_checkpoint(tmp_path)
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        np.testing.assert_array_equal(a.tensor(n), b.tensor(n))


def test_missing_tensor_is_named(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file
    src = tiny_model("llama-relu")
    for f in ("config.json",):
        (tmp_path / f).write_text((src / f).read_text())
    w = load_file(src / "model.safetensors")
    del w["model.layers.1.mlp.down_proj.weight"]
    save_file({k: v.contiguous() for k, v in w.items()}, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="layers.1.ffn.down.weight"):
        open_checkpoint(tmp_path)


def test_hf_rope_scaling_unsupported_type_is_refused(tiny_model, tmp_path):
    import shutil
    d = shutil.copytree(tiny_model("llama-relu"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="yarn"):
        open_checkpoint(d)
