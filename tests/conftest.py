"""Shared fixtures: tiny random models built by transformers (the oracle), and the real model and text shipped in
tests/data (stories260K, corpus excerpts; see tests/data/README.md)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA.parents[1] / "tools"))       # the tests use tools/make_large_model and memcap
STORIES = DATA / "stories260K"
CORPUS = DATA / "corpus"


@pytest.fixture
def float32_activations():
    """Dot products on float32 x (quant.set_act8 off), for tests whose oracle is the float64 math on the dequantized
    weights: 8-bit activations round x as llama.cpp does, which that oracle does not (tests/test_act8.py has theirs)."""
    from flashinfer_lite.kernels.blocks import ACT8, set_act8
    was = ACT8[0]
    set_act8(False)
    yield
    set_act8(was)


# A toy chat template, so that stories260K can stand in for an instruct model in chat tests.
CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token if loop.first else '' }}[{{ m['role'] }}] {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def stories_with_chat_template(path: Path) -> Path:
    """A copy of stories260K at path whose tokenizer_config.json carries CHAT_TEMPLATE."""
    d = shutil.copytree(STORIES, path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    os.chmod(d / "tokenizer_config.json", 0o644)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def flash_model_with_predictors(root: Path, layers: int, dim: int, ffn: int, heads: int, kv_heads: int) -> Path:
    """A FLASHDIR of float16 bundles (tools/make_large_model.py, ~10% of neurons active per token, 4096 positions)
    with rank-8 predictors trained on a little TinyStories: a model whose FFN the budget decides about."""
    from make_large_model import main as make_large_model
    from predictors.collect import collect
    from predictors.train import train
    from storage.convert import convert
    assert make_large_model([str(root / "hf"), "--layers", str(layers), "--dim", str(dim), "--ffn", str(ffn),
                             "--heads", str(heads), "--kv-heads", str(kv_heads), "--check-tokens", "0"]) == 0
    flash = convert(root / "hf", root / "flash", dtype="f16", progress=False)
    collect(str(flash), [str(CORPUS / "tinystories_cased_197KB.txt")], 128, root / "acts", ctx=128, progress=False)
    train(root / "acts", flash, rank=8, max_rank=8, steps=10, target_recall=0.9, progress=False)
    return Path(flash)


def planner_minimum(refuse) -> tuple[float, str]:
    """(the planner's minimum DRAM budget in MiB, its one-line refusal). refuse(budget) runs the command with
    --dram-budget budget and returns (exit code, stderr), whose last line is the refusal. 1 MiB is refused before any
    work, naming the early estimate (runtime.refuse_below_minimum, EARLY_SLACK_BYTES or more below the planner's);
    0.5 MiB above it the planner refuses and names its own (the estimate starts from the process's RSS, which differs
    by a few tenths of a MiB from one process to the next: a budget the estimate still refuses is raised again)."""
    budget = "1M"
    for _ in range(4):
        rc, err = refuse(budget)
        early = re.search(r"below the minimum ([\d.]+) MiB for this model \(estimated before loading", err)
        if not early:
            break
        budget = f"{float(early.group(1)) + 0.5:.1f}M"
    last = err.strip().splitlines()[-1] if err.strip() else ""
    planned = re.search(r"^error: DRAM budget .* below the minimum ([\d.]+) MiB", last)
    assert rc == 1 and planned, err
    return float(planned.group(1)), err


def run_bench(script: str, *args, timeout: int = 600) -> tuple[dict, str]:
    """(JSON document on stdout, stderr) of `python bench/SCRIPT ARGS...` run from the repository root, which must exit
    0 (its stderr's tail is the failure message)."""
    repo = DATA.parents[1]
    p = subprocess.run([sys.executable, str(repo / "bench" / script), *map(str, args)], cwd=repo,
                       env=dict(os.environ, PYTHONPATH=str(repo)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout), p.stderr


# Tiny architectures, each exercising a code path users' models take. Vocab 512 so stories260K's tokenizer fits.
TINY = {
    "llama-relu": ("llama", dict(hidden_act="relu")),
    "llama-silu-gqa": ("llama", dict(hidden_act="silu", num_key_value_heads=2)),
    "llama-bias-untied": ("llama", dict(hidden_act="silu", attention_bias=True, mlp_bias=True,
                                        tie_word_embeddings=False, rope_theta=500000.0)),
    "mistral": ("mistral", dict(hidden_act="silu", num_key_value_heads=2, sliding_window=6)),
    "qwen2": ("qwen2", dict(hidden_act="silu", num_key_value_heads=2)),
    "qwen3": ("qwen3", dict(hidden_act="silu", num_key_value_heads=2, head_dim=24)),
    # a global layer between sliding ones (window 6 < the tests' 16 tokens), the scores' scale not 1/sqrt(head_dim),
    # a soft cap the logits reach
    "gemma3": ("gemma3", dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                              sliding_window=6, layer_types=["sliding_attention", "full_attention",
                                                             "sliding_attention"], final_logit_softcapping=1.0)),
    "opt": ("opt", dict(do_layer_norm_before=True)),
    "opt-postnorm": ("opt", dict(do_layer_norm_before=False)),
    # d and ffn_dim multiples of 256: rows the K-quants (q4_k, q5_k, q6_k: 256-weight blocks) can hold
    "llama-wide": ("llama", dict(hidden_act="silu", num_key_value_heads=2, hidden_size=256, intermediate_size=512)),
}

# Tiny mixtures of experts (issue 30): 4 or 6 experts of 64 neurons, 2 per token; apart from TINY, whose models the
# dense-FFN tests run with predictors.
_MOE = dict(num_key_value_heads=2, num_experts_per_tok=2)
TINY_MOE = {
    "mixtral": ("mixtral", dict(intermediate_size=64, num_local_experts=4, **_MOE)),
    "qwen2moe": ("qwen2_moe", dict(intermediate_size=96, moe_intermediate_size=64, shared_expert_intermediate_size=80,
                                   num_experts=6, norm_topk_prob=False, **_MOE)),
    "olmoe": ("olmoe", dict(intermediate_size=64, num_experts=4, norm_topk_prob=False, **_MOE)),
    "qwen3moe": ("qwen3_moe", dict(moe_intermediate_size=64, intermediate_size=96, num_experts=6, head_dim=16,
                                   norm_topk_prob=True, **_MOE)),
}
MOE_CLASSES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "olmoe": "Olmoe", "qwen3_moe": "Qwen3Moe"}


def build_tiny(kind: str, path: Path, seed: int = 0) -> Path:
    """save_pretrained a seeded random model of `kind` (TINY or TINY_MOE) into path (safetensors, float32)."""
    import torch
    import transformers as tf
    family, extra = {**TINY, **TINY_MOE}[kind]
    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    if family == "opt":
        cfg = tf.OPTConfig(ffn_dim=160, word_embed_proj_dim=64, **common, **extra)
        model = tf.OPTForCausalLM(cfg)
    elif family in MOE_CLASSES:
        cls = MOE_CLASSES[family]
        model = getattr(tf, cls + "ForCausalLM")(getattr(tf, cls + "Config")(rms_norm_eps=1e-5, **common, **extra))
    else:
        cls_cfg = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
                   "qwen3": tf.Qwen3Config, "gemma3": tf.Gemma3TextConfig}[family]
        cls_model = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
                     "qwen3": tf.Qwen3ForCausalLM, "gemma3": tf.Gemma3ForCausalLM}[family]
        model = cls_model(cls_cfg(**{"intermediate_size": 160, "rms_norm_eps": 1e-5, **common, **extra}))
    # Random init puts biases and norms at 0/1; perturb them so those code paths are actually tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if family != "opt" and "mlp" in name and name.endswith(("weight", "_proj")):
                p.mul_(8.0)  # a tiny random FFN is near-silent; give it a voice in the output
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
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
    from storage.errors import UserError
    try:
        return ensure_default_model(quiet=True)
    except UserError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


def predicted_ffn_calls(flashdir, tokens: list[int]) -> tuple[list, object]:
    """([(layer, x [1, d], y [1, d]) for every FFN call], runtime) of decoding tokens one at a time in predicted mode
    at the minimum DRAM budget (so reads, pieces and the window all take part)."""
    from flashinfer_lite.runtime import load_runtime
    probe = load_runtime(flashdir, "predicted", ctx=64, base_bytes=0)[2]
    model, _, rt = load_runtime(flashdir, "predicted", ctx=64, base_bytes=0, dram_budget=probe.plan.minimum_bytes)
    calls, ffn = [], model.ffn

    def record(layer, x):
        y = ffn(layer, x)
        calls.append((layer, x.copy(), y.copy()))
        return y
    model.ffn = record
    kv = model.new_cache(64)
    for t in tokens:
        model.forward([t], kv)
    return calls, rt


def greedy_tokens(model, ids: list[int], n: int, ctx: int = 128) -> list[int]:
    """ids and model's n greedy tokens after them (a batched prompt, then one token at a time)."""
    import numpy as np
    kv = model.new_cache(ctx)
    out, logits = list(ids), model.forward(ids, kv)
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]], kv)
    return out


def transformers_model(path: Path, **kw):
    """The transformers oracle, float32 with eager attention whose keys and values are rounded to float16 first: our
    KV cache stores them so (model.KVCache), and then what is left between the two is float32 summation order."""
    import torch
    import transformers as tf
    kv_float16_in_eager_attention()
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kw).eval()


def kv_float16_in_eager_attention() -> None:
    """Wrap eager_attention_forward of every family we import so it sees key.half().float(), value.half().float()
    (idempotent: float16 values round to themselves; patched once per process)."""
    import importlib
    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma3", "opt", *MOE_CLASSES):
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        eager = mod.eager_attention_forward
        if getattr(eager, "kv_float16", False):
            continue

        def rounded(module, query, key, value, *args, _eager=eager, **kwargs):
            return _eager(module, query, key.half().float(), value.half().float(), *args, **kwargs)
        rounded.kv_float16 = True
        mod.eager_attention_forward = rounded


def assert_same_bits_at_every_budget(path, ffn: str, prompt: list[int], n_decode: int, monkeypatch,
                                     ctx: int = 64, pieces_rows: int = 16) -> dict:
    """Greedy decoding after a batched prompt must give bit-identical logits (and so tokens) with no budget, at the
    minimum budget and above it, on 1 or 2 threads, with overlap on or off, and with prefill through the cache or
    streamed (issue 14). The window's fixed reservation is made `pieces_rows` rows so that at the minimum a token's
    set is computed in several pieces. Returns {config: runtime stats} for further checks."""
    import numba
    import numpy as np

    from flashinfer_lite import budget
    from flashinfer_lite.runtime import load_runtime
    monkeypatch.setattr(budget, "MIN_WINDOW_ROWS", pieces_rows)
    # the process base is left out so that the plan does not depend on this (pytest) process's RSS
    minimum = load_runtime(path, ffn, ctx=ctx, base_bytes=0)[2].plan.minimum_bytes
    most = max(1, numba.config.NUMBA_NUM_THREADS)

    def run(dram_budget=None, threads=most, overlap=True, stream=False):
        model, _, rt = load_runtime(path, ffn, dram_budget=dram_budget, ctx=ctx, base_bytes=0)
        rt.overlap = overlap
        rt.prefer_streaming = lambda layer, sets: stream
        before = numba.get_num_threads()
        numba.set_num_threads(min(threads, most))
        try:
            kv = model.new_cache(ctx)
            out = [model.forward(prompt, kv, all_logits=True)]
            for _ in range(n_decode):
                out.append(model.forward([int(np.argmax(out[-1][-1]))], kv)[None, :])
        finally:
            numba.set_num_threads(before)
        return np.concatenate(out), rt

    want, rt = run()
    stats = {"no budget": rt.stats}
    configs = {"minimum": dict(dram_budget=minimum), "minimum + 1 MiB": dict(dram_budget=minimum + (1 << 20)),
               "minimum, 1 thread": dict(dram_budget=minimum, threads=1),
               "minimum, no overlap": dict(dram_budget=minimum, overlap=False),
               "1 thread, no overlap": dict(threads=1, overlap=False),
               "streaming prefill": dict(stream=True), "minimum, streaming prefill": dict(dram_budget=minimum, stream=True)}
    for name, kw in configs.items():
        got, rt = run(**kw)
        assert np.array_equal(got, want), f"{name}: max |diff| {np.abs(got - want).max()}"
        stats[name] = rt.stats
        if name == "minimum":
            assert rt.plan.window_rows == pieces_rows   # the fixed reservation, whatever the active count
    assert stats["minimum"].read_bytes > stats["no budget"].read_bytes   # the small window really re-read
    assert stats["streaming prefill"].streamed_layers > 0 and stats["no budget"].streamed_layers == 0
    return stats


# K-quant blocks: byte offsets of their float16 scales, and the scale that gives weights of about the tensor's size
KQUANT_UNITS = {"Q4_K": ((0, 2), 1 / 300), "Q5_K": ((0, 2), 1 / 600), "Q6_K": ((208,), 1 / 600)}


def kquant_blocks(t, kind: str):
    """uint8 [rows, row bytes] of K-quant blocks in place of matrix t (gguf.quants cannot quantize into K-quants):
    random nibbles, high bits and sub-block scales (every pattern llama.cpp's quantizer can write decodes the same
    way), float16 scales sized to t's spread. The model is then whatever the blocks dequantize to (gguf.quants)."""
    import numpy as np
    from storage.blocks import row_bytes
    halves, unit = KQUANT_UNITS[kind]
    rows, cols = t.shape
    rng = np.random.default_rng(cols * rows + len(kind))
    rb = row_bytes(cols, kind.lower())
    q = rng.integers(0, 256, (rows * rb // (rb // (cols // 256)), rb // (cols // 256)), dtype=np.uint8)
    for o in halves:
        q[:, o:o + 2] = (np.abs(rng.normal(0, 1, q.shape[0])) * unit * float(np.std(t))
                         ).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return q.reshape(rows, rb)


def write_llama_gguf(ckpt, path: Path, types: dict | None = None, edit=None) -> Path:
    """A llama-architecture GGUF of a checkpoint's weights (stories260K's SentencePiece-style vocabulary, as
    ReluLLaMA / ProSparse GGUFs ship), written with the gguf package as llama.cpp's converter would: q/k rows
    permuted. types: {canonical name: GGML type name} for tensors stored other than float32, quantized by gguf.quants
    (llama.cpp's reference). edit(writer): changes the metadata after it is added (a damaged or hostile file's)."""
    import gguf
    import numpy as np
    from make_large_model import add_llama_metadata, permute_qk    # as the bench models' GGUF writer does
    c = ckpt.config
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_metadata(w, c.n_layers, c.max_pos, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.norm_eps, c.rope_theta)
    if edit is not None:
        edit(w)
    names = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if not c.tie_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(c.n_layers):
        names.update({f"layers.{i}.attn_norm.weight": f"blk.{i}.attn_norm.weight",
                      f"layers.{i}.ffn_norm.weight": f"blk.{i}.ffn_norm.weight",
                      f"layers.{i}.attn.q.weight": f"blk.{i}.attn_q.weight",
                      f"layers.{i}.attn.k.weight": f"blk.{i}.attn_k.weight",
                      f"layers.{i}.attn.v.weight": f"blk.{i}.attn_v.weight",
                      f"layers.{i}.attn.o.weight": f"blk.{i}.attn_output.weight",
                      f"layers.{i}.ffn.gate.weight": f"blk.{i}.ffn_gate.weight",
                      f"layers.{i}.ffn.up.weight": f"blk.{i}.ffn_up.weight",
                      f"layers.{i}.ffn.down.weight": f"blk.{i}.ffn_down.weight"})
    for ours, theirs in names.items():
        t = np.ascontiguousarray(ckpt.tensor(ours), np.float32)
        if ours.endswith("attn.q.weight"):
            t = permute_qk(t, c.n_heads)
        elif ours.endswith("attn.k.weight"):
            t = permute_qk(t, c.n_kv_heads)
        kind = (types or {}).get(ours)
        if kind is None:
            w.add_tensor(theirs, np.ascontiguousarray(t))
        else:
            ggml = gguf.GGMLQuantizationType[kind]
            q = kquant_blocks(t, kind) if kind in KQUANT_UNITS else gguf.quants.quantize(np.ascontiguousarray(t), ggml)
            w.add_tensor(theirs, q, raw_dtype=ggml)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
