#!/usr/bin/env python3
"""Write a seeded random HF-layout model of a real large shape, streamingly, for the flash benchmarks.

    python tools/make_large_model.py OUT_DIR [--layers 32] [--dim 4096] [--ffn 11008] [--heads 32] [--kv-heads H]
                                             [--head-dim 128] [--vocab 512] [--active 0.10] [--seed 0]
                                             [--gguf f16,q4_0] [--experts E --experts-used K] [--act silu]

Default: Llama-2-7B shape (32 layers, dim 4096, ffn 11008, 32 heads of 128), f16, ProSparse convention
(architecture SparseLlamaForCausalLM, hidden_act "fatrelu", threshold in hidden_act_param).

Why the threshold works: with RMSNorm'ed input (|x|^2 = d, norm weights 1) and gate weights ~ N(0, s^2), each
gate pre-activation is N(0, s^2 d), so t = z_(1-active) * s * sqrt(d) leaves `active` of the neurons above t.
The realised share is measured with the dense math (flashinfer_lite.model) on a few tokens and printed.

The tokenizer is stories260K's (vocab 512): the vocabulary size does not change the FFN I/O being measured.
Tensors are generated row-chunk by row-chunk into one safetensors file whose header is written first, so memory
stays at one chunk whatever the model size. Written to a temp name and renamed at the end.

--gguf f16,q4_0 also writes the same weights as OUT/model.f16.gguf / model.q4_0.gguf (llama architecture, q/k rows
permuted as llama.cpp's converter does, norms float32, every matrix f16 or Q4_0 by gguf.quants.quantize from the
f16 values), one tensor in memory at a time, so llama.cpp can run them (bench/vs_llama_cpp.py). GGUF's llama has
no FATReLU: llama.cpp computes SwiGLU (silu(gate) x up) over the same matrices, so its output differs, but the bytes
it must read per token (every FFN row, dense) are the same.

--act silu: a SwiGLU Llama (LlamaForCausalLM, hidden_act "silu") instead, the function llama.cpp computes on the GGUF
copies: the gated model of the exact-gate bench (issue #28), which has no natural zeros to predict.

--experts E: a mixture of experts of Qwen3-MoE's layout instead (Qwen3MoeForCausalLM: per-head q/k RMSNorm, a
softmax router over E experts of --ffn neurons each, --experts-used of them per token, renormalised), SwiGLU experts
unless --act fatrelu says FATReLU ones (hidden_act "fatrelu", its threshold in hidden_act_param, as for dense).
Random router weights route about uniformly: the worst case for an expert cache.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from storage.safetensors_out import header_bytes  # noqa: E402

STORIES = REPO / "tests" / "data" / "stories260K"
CHUNK_ELEMS = 32 << 20          # values generated per step (128 MiB of float32)


def tensor_plan(a) -> list[tuple[str, tuple[int, ...], float]]:
    """(HF name, shape, init std) of every tensor, in file order. std 0 means ones (norm weights)."""
    d, n, q, kv = a.dim, a.ffn, a.heads * a.head_dim, a.kv_heads * a.head_dim
    s = a.dim ** -0.5
    plan = [("model.embed_tokens.weight", (a.vocab, d), 1.0)]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        if a.experts:
            plan += [(p + "input_layernorm.weight", (d,), 0.0),
                     (p + "self_attn.q_proj.weight", (q, d), s), (p + "self_attn.k_proj.weight", (kv, d), s),
                     (p + "self_attn.v_proj.weight", (kv, d), s), (p + "self_attn.o_proj.weight", (d, q), q ** -0.5),
                     (p + "self_attn.q_norm.weight", (a.head_dim,), 0.0),
                     (p + "self_attn.k_norm.weight", (a.head_dim,), 0.0),
                     (p + "post_attention_layernorm.weight", (d,), 0.0), (p + "mlp.gate.weight", (a.experts, d), s)]
            for e in range(a.experts):
                plan += [(p + f"mlp.experts.{e}.gate_proj.weight", (n, d), s),
                         (p + f"mlp.experts.{e}.up_proj.weight", (n, d), s),
                         (p + f"mlp.experts.{e}.down_proj.weight", (d, n), n ** -0.5)]
            continue
        plan += [(p + "input_layernorm.weight", (d,), 0.0),
                 (p + "self_attn.q_proj.weight", (q, d), s),
                 (p + "self_attn.k_proj.weight", (kv, d), s),
                 (p + "self_attn.v_proj.weight", (kv, d), s),
                 (p + "self_attn.o_proj.weight", (d, q), q ** -0.5),
                 (p + "post_attention_layernorm.weight", (d,), 0.0),
                 (p + "mlp.gate_proj.weight", (n, d), s),
                 (p + "mlp.up_proj.weight", (n, d), s),
                 # down scaled so that the ~active*n firing neurons (SiLU: all n) add O(1) to the residual stream
                 (p + "mlp.down_proj.weight", (d, n), ((a.active if a.act == "fatrelu" else 1.0) * n) ** -0.5)]
    plan += [("model.norm.weight", (d,), 0.0), ("lm_head.weight", (a.vocab, d), s)]
    return plan


def fatrelu_threshold(active: float, gate_std: float, dim: int) -> float:
    return NormalDist().inv_cdf(1.0 - active) * gate_std * dim ** 0.5


def tensor_chunks(k: int, shape, std: float, seed: int):
    """The float16 values of plan tensor k, CHUNK_ELEMS at a time (flat, row-major)."""
    rng = np.random.default_rng([seed, k])     # one generator per tensor: its values do not depend on the others
    n = int(np.prod(shape))
    for lo in range(0, n, CHUNK_ELEMS):
        m = min(CHUNK_ELEMS, n - lo)
        v = np.ones(m, np.float32) if std == 0 else rng.standard_normal(m, dtype=np.float32) * np.float32(std)
        yield v.astype(np.float16)


def write_safetensors(path: Path, plan, seed: int) -> int:
    """Stream every tensor of `plan` as F16 into one safetensors file; returns its size."""
    meta = {"format": "pt", "generator": "flashinfer-lite tools/make_large_model.py", "seed": str(seed)}
    head = header_bytes([(name, np.float16, shape) for name, shape, _ in plan], meta)
    total = len(head) + sum(int(np.prod(shape)) * 2 for _, shape, _ in plan)
    with open(path, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, desc="weights", file=sys.stderr) as bar:
        f.write(head)
        for k, (name, shape, std) in enumerate(plan):
            for v in tensor_chunks(k, shape, std, seed):
                f.write(v.tobytes())
                bar.update(v.nbytes)
        f.flush()
        os.fsync(f.fileno())
    return total


# HF name part -> GGUF name part (llama.cpp's llama architecture)
GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
GGUF_TYPES = ("f16", "q4_0")


def gguf_name(hf: str) -> str:
    stem = hf.removesuffix(".weight")
    if stem.startswith("model.layers."):
        i, part = stem[len("model.layers."):].split(".", 1)
        return f"blk.{i}.{GGUF_NAMES[part]}.weight"
    return f"{GGUF_NAMES[stem]}.weight"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (rotary dims paired adjacently); storage.checkpoint.unpermute_qk undoes
    it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def spm_vocab(tokenizer_json: Path) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece-style BPE tokenizer.json (stories260K's) for GGUF's `llama`
    tokenizer: a token made by an earlier merge scores higher; ids 0-2 are control tokens, <0xNN> bytes."""
    tj = json.loads(tokenizer_json.read_text())
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    tokens = sorted(vocab, key=vocab.get)
    rank = {(m if isinstance(m, str) else " ".join(m)).replace(" ", ""): i for i, m in enumerate(merges)}
    scores = [0.0 if i < 3 or t.startswith("<0x") else -float(rank.get(t, len(merges) + i))
              for i, t in enumerate(tokens)]
    types = [3 if i < 3 else 6 if (t.startswith("<0x") and len(t) == 6) else 1 for i, t in enumerate(tokens)]
    return tokens, scores, types


def add_llama_metadata(w, layers: int, ctx: int, dim: int, ffn: int, heads: int, kv_heads: int, eps: float,
                       theta: float) -> None:
    """A GGUFWriter's llama hyperparameters and stories260K's SentencePiece vocabulary (BOS 1, EOS 2)."""
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(theta)
    tokens, scores, types = spm_vocab(STORIES / "tokenizer.json")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)


def write_gguf(path: Path, a, plan, qtype: str, threshold: float) -> int:
    """The plan's weights (the same values as the safetensors file) as a llama GGUF whose matrices are `qtype`;
    tensor infos first, then one tensor generated, converted and written at a time. Returns the file size."""
    import gguf
    Q = gguf.GGMLQuantizationType
    raw = {"f16": Q.F16, "q4_0": Q.Q4_0}[qtype]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"flashinfer-lite make_large_model seed {a.seed} ({qtype})")
    w.add_description(f"random Llama weights; the HF copy's activation is FATReLU at {threshold:.4f}, which GGUF's "
                      "llama cannot express: llama.cpp computes SwiGLU on these matrices" if a.act == "fatrelu" else
                      "random SwiGLU Llama weights, as the HF copy")
    add_llama_metadata(w, a.layers, 4096, a.dim, a.ffn, a.heads, a.kv_heads, 1e-5, 10000.0)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_dimension_count(a.head_dim)
    w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
    kinds = [raw if len(shape) == 2 else Q.F32 for _, shape, _ in plan]          # norms stay float32
    for (name, shape, _), kind in zip(plan, kinds):
        nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(shape, kind)))
        w.add_tensor_info(gguf_name(name), shape, np.float32 if kind == Q.F32 else np.float16, nbytes,
                          raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(int(np.prod(gguf.quant_shape_to_byte_shape(s, k))) for (_, s, _), k in zip(plan, kinds))
    with tqdm(total=total, unit="B", unit_scale=True, desc=path.name, file=sys.stderr) as bar:
        for k, ((name, shape, std), kind) in enumerate(zip(plan, kinds)):
            t = np.concatenate(list(tensor_chunks(k, shape, std, a.seed))).reshape(shape)
            if name.endswith("q_proj.weight"):
                t = permute_qk(t, a.heads)
            elif name.endswith("k_proj.weight"):
                t = permute_qk(t, a.kv_heads)
            t = gguf.quants.quantize(t.astype(np.float32) if kind == Q.F32 else t, kind)
            w.write_tensor_data(t)
            bar.update(t.nbytes)
    w.close()
    return path.stat().st_size


def act_fields(a, threshold: float) -> dict:
    """config.json's activation: SwiGLU, or ProSparse's FATReLU with its threshold."""
    return {"hidden_act": "silu"} if a.act == "silu" else {"hidden_act": "fatrelu", "hidden_act_param": threshold}


def hf_config(a, threshold: float) -> dict:
    if a.experts:
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": a.vocab,
                "hidden_size": a.dim, "moe_intermediate_size": a.ffn, "intermediate_size": a.ffn,
                "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
                "head_dim": a.head_dim, "num_experts": a.experts, **act_fields(a, threshold),
                "num_experts_per_tok": a.experts_used, "norm_topk_prob": True, "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": False, "tie_word_embeddings": False,
                "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16", "decoder_sparse_step": 1,
                "mlp_only_layers": [], "flashinfer_lite_bench": {"seed": a.seed}}
    if a.act == "silu":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab,
                "hidden_size": a.dim, "intermediate_size": a.ffn, "num_hidden_layers": a.layers,
                "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
                "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 1,
                "eos_token_id": 2, "torch_dtype": "float16", "flashinfer_lite_bench": {"seed": a.seed}}
    return {"architectures": ["SparseLlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab,
            "hidden_size": a.dim, "intermediate_size": a.ffn, "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
            **act_fields(a, threshold), "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
            "flashinfer_lite_bench": {"seed": a.seed, "target_active": a.active}}


def measure_active_share(model_dir: Path, n_tokens: int, n_layers: int, seed: int) -> list[float]:
    """Run n_tokens random tokens through the first n_layers with the dense math, one layer's weights at a time;
    per layer the share of neurons whose FATReLU activation is nonzero."""
    from storage.checkpoint import open_checkpoint
    from flashinfer_lite.model import Attention, KVCache, rms_norm, rope_inv_freq
    from flashinfer_lite.ffn.dense import FeedForward
    ck = open_checkpoint(model_dir)
    cfg = ck.config
    rng = np.random.default_rng(seed + 1)
    tokens = rng.integers(3, cfg.vocab_size, n_tokens)
    x = ck.tensor("embed.weight")[tokens]                                                   # [T, d]
    kv = KVCache(cfg, n_tokens)
    ang = np.arange(n_tokens, dtype=np.float64)[:, None] * rope_inv_freq(cfg)[None, :]
    rope = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
    shares = []
    for i in tqdm(range(n_layers), desc="active share", unit="layer", file=sys.stderr):
        w = {n: ck.tensor(n) for n in ck.names() if n.startswith(f"layers.{i}.")}
        h = x + Attention(cfg, w, i)(rms_norm(x, w[f"layers.{i}.attn_norm.weight"], cfg.norm_eps), kv, 0, rope)
        f = FeedForward(cfg, w, i)
        xn = rms_norm(h, w[f"layers.{i}.ffn_norm.weight"], cfg.norm_eps)
        a = f.activations(xn)                                                                   # [T, n]
        shares.append(float((a != 0).mean()))
        x = h + f(xn)
        del w, f, a
    return shares


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output directory (outside the repo: it is large)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (multi-head attention)")
    ap.add_argument("--head-dim", type=int, default=None, help="default: dim / heads")
    ap.add_argument("--vocab", type=int, default=512, help="512 uses stories260K's tokenizer")
    ap.add_argument("--active", type=float, default=0.10, help="target share of neurons active per token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-tokens", type=int, default=8, help="tokens for the active-share check (0: skip)")
    ap.add_argument("--check-layers", type=int, default=4, help="layers for the active-share check")
    ap.add_argument("--gguf", default="", help=f"also write these GGUF copies, comma-separated: {', '.join(GGUF_TYPES)}")
    ap.add_argument("--experts", type=int, default=0, help="a mixture of this many experts of --ffn neurons per "
                                                           "layer (Qwen3-MoE's layout; 0: dense)")
    ap.add_argument("--experts-used", type=int, default=8, help="experts routed per token")
    ap.add_argument("--act", choices=("fatrelu", "silu"), default=None,
                    help="the FFN: ProSparse's FATReLU at --active or SwiGLU (default: FATReLU; with --experts SwiGLU)")
    ap.add_argument("--gguf-only", action="store_true",
                    help="write only the --gguf copies and config.json, not the HF weights (13 GB at the 7B shape)")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    a = ap.parse_args(argv)
    a.act = a.act or ("silu" if a.experts else "fatrelu")
    if a.gguf_only and not a.gguf:
        sys.exit("make_large_model: --gguf-only needs --gguf")
    if a.act == "silu":
        a.check_tokens = 0             # the active-share check measures FATReLU neurons
    if a.experts:
        if a.gguf:
            sys.exit("make_large_model: --gguf is not written for --experts (yet)")
        if not 0 < a.experts_used <= a.experts:
            sys.exit("make_large_model: --experts-used must be in 1..--experts")
        a.check_tokens = 0             # the active-share check measures FATReLU neurons: a dense model's
    a.kv_heads = a.kv_heads or a.heads
    a.head_dim = a.head_dim or a.dim // a.heads
    if a.vocab != 512:
        sys.exit("make_large_model: only --vocab 512 is supported (stories260K's tokenizer)")
    if not 0 < a.active < 1:
        sys.exit("make_large_model: --active must be in (0, 1)")
    ggufs = [q for q in a.gguf.split(",") if q]
    if not set(ggufs) <= set(GGUF_TYPES):
        sys.exit(f"make_large_model: --gguf takes {', '.join(GGUF_TYPES)}, not {a.gguf!r}")
    if "q4_0" in ggufs and (a.dim % 32 or a.ffn % 32 or (a.heads * a.head_dim) % 32):
        sys.exit("make_large_model: Q4_0 needs --dim, --ffn and heads x head-dim divisible by 32")
    out = a.out.expanduser().resolve()
    if out.exists():
        if not a.force:
            sys.exit(f"make_large_model: {out} exists (use --force)")
        shutil.rmtree(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        t = fatrelu_threshold(a.active, a.dim ** -0.5, a.dim)
        plan = tensor_plan(a)
        size = 0 if a.gguf_only else write_safetensors(tmp / "model.safetensors", plan, a.seed)
        (tmp / "config.json").write_text(json.dumps(hf_config(a, t), indent=1))
        gguf_bytes = {q: write_gguf(tmp / f"model.{q}.gguf", a, plan, q, t) for q in ggufs}
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (STORIES / name).exists():
                shutil.copy(STORIES / name, tmp / name)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ffn_bytes = 3 * a.layers * a.dim * a.ffn * 2 * max(a.experts, 1)
    info = {"dir": str(out), "bytes": size, "ffn_bytes": ffn_bytes, "act": a.act,
            **({"fatrelu_threshold": t, "target_active": a.active} if a.act == "fatrelu" else {}),
            **{f"gguf_{q}": str(out / f"model.{q}.gguf") for q in ggufs},
            **{f"gguf_{q}_bytes": n for q, n in gguf_bytes.items()}}
    if a.check_tokens > 0 and not a.gguf_only:
        shares = measure_active_share(out, a.check_tokens, min(a.check_layers, a.layers), a.seed)
        info["active_share_per_layer"] = [round(s, 4) for s in shares]
        info["active_share_mean"] = round(float(np.mean(shares)), 4)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
