"""Model files in, canonical float32 tensors out: Hugging Face directories (safetensors) and GGUF files.

Tensors are read one at a time by name, never a whole checkpoint at once. Canonical names (weight [out, in]):
  embed.weight, pos_embed.weight (OPT), lm_head.weight (absent when tied), norm.{weight,bias}
  layers.{i}.attn_norm.*, layers.{i}.attn.{q,k,v,o}.{weight,bias}, layers.{i}.ffn_norm.*
  layers.{i}.ffn.{gate,up,down}.{weight,bias}   (OPT: fc1 -> up, fc2 -> down)
  layers.{i}.attn.{q,k}_norm.weight (qk_norm), layers.{i}.{attn,ffn}_post_norm.weight (post_norms)
A norm weight is the factor the normed vector is multiplied by: Gemma's checkpoints store it less 1 (RMSNorm with
(1 + w)), so their reader adds the 1, as llama.cpp's converter does when it writes a Gemma GGUF.
Model files are untrusted: nothing is unpickled, header sizes are bounded, offsets are checked against the file size,
and every path stays inside the model directory.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import stat
from functools import cached_property
from pathlib import Path

import numpy as np

from storage.errors import UserError
from storage.config import ModelConfig
from storage.tokenizer import Tokenizer
from storage.untrusted import check_finite, hub_blobs, inside, parse_json, read_json

from .blocks import BLOCK_BYTES, check_finite_blocks, row_bytes

MAX_HEADER_BYTES = 100 * 1024 * 1024
# ----------------------------------------------------------------------------------------------------------------------
# safetensors

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16,
              "BOOL": np.bool_}


class SafetensorsFile:
    """A safetensors file read tensor by tensor with os.pread.

    Written here rather than through the safetensors package because its numpy reader cannot return bfloat16,
    the dtype most Llama-family checkpoints ship in; we widen bf16 to float32 ourselves.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)    # a FIFO must not block the open
        except OSError as e:
            raise UserError(f"cannot open {path}: {e.strerror}") from None
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"not a regular file: {path}")
        size = st.st_size
        head = os.pread(self.fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise UserError(f"not a valid safetensors file (bad header length): {path}")
        header = parse_json(os.pread(self.fd, n, 8), "safetensors header", path)
        if not isinstance(header, dict):
            raise UserError(f"not a valid safetensors file (its header is not a JSON object): {path}")
        meta = header.pop("__metadata__", None)
        self.metadata: dict = meta if isinstance(meta, dict) else {}
        data_size = size - 8 - n
        self.entries: dict[str, tuple[bool, np.dtype, tuple, int]] = {}  # name -> (is_bf16, raw dtype, shape, offset)
        count = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
        for name, e in header.items():
            try:
                dtype = np.dtype(_ST_DTYPES[e["dtype"]])
                shape, offsets = e["shape"], e["data_offsets"]
                if not (isinstance(shape, list) and all(count(s) for s in shape) and isinstance(offsets, list)
                        and len(offsets) == 2 and all(count(o) for o in offsets)):
                    raise ValueError
                shape, (begin, end) = tuple(shape), offsets
            except (KeyError, TypeError, ValueError):
                raise UserError(f"unsupported or corrupt tensor entry '{name}' in {path}") from None
            if end > data_size:
                raise UserError(f"truncated safetensors file {path}: tensor '{name}' ends at byte {8 + n + end} "
                                f"but the file has {size}")
            # Python integers: a product of huge dims must not wrap around int64 into a plausible size
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise UserError(f"corrupt safetensors file {path}: size of tensor '{name}' does not match its shape")
            self.entries[name] = (e["dtype"] == "BF16", dtype, shape, 8 + n + begin)

    def read(self, name: str, raw: bool = False) -> np.ndarray:
        """The tensor as float32 (bf16, f16 and integers widened), or with raw as stored."""
        bf16, raw_dtype, shape, offset = self.entries[name]
        nbytes = math.prod(shape) * raw_dtype.itemsize
        buf = bytearray(nbytes)
        view, done = memoryview(buf), 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise UserError(f"short read in {self.path} at tensor '{name}'")
            done += got
        a = np.frombuffer(buf, dtype=raw_dtype).reshape(shape)  # float32: the array owns buf, no second copy
        if raw:
            return a
        if bf16:  # bf16 is the top half of a float32; shifted in place, so one widened copy at a time
            w = a.astype(np.uint32)
            w <<= 16
            return w.view(np.float32)
        return a.astype(np.float32) if a.dtype != np.float32 else a

    def close(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


# ----------------------------------------------------------------------------------------------------------------------
# Hugging Face directories

# SparseLlamaForCausalLM: ProSparse's Llama with FATReLU (hidden_act "fatrelu", threshold in hidden_act_param).
MOE_HF = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
SUPPORTED_HF = ("LlamaForCausalLM", "SparseLlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                "Qwen3ForCausalLM", "Gemma3ForCausalLM", "OPTForCausalLM", *MOE_HF)

_LLAMA_NAMES = [
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)", r"layers.\1.attn.\2.\3"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.(weight|bias)", r"layers.\1.ffn.\2.\3"),
    (r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight", r"layers.\1.attn.\2_norm.weight"),
    # mixtures of experts: the router, each expert's GLU (Mixtral's w1, w3, w2 are gate, up, down), a shared expert
    (r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight", r"layers.\1.ffn.router.weight"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", r"layers.\1.ffn.experts.\2.\3.weight"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight", r"layers.\1.ffn.experts.\2.gate.weight"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight", r"layers.\1.ffn.experts.\2.up.weight"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight", r"layers.\1.ffn.experts.\2.down.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.weight", r"layers.\1.ffn.shared.\2.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight", r"layers.\1.ffn.shared_gate.weight"),
]
# Gemma 3: four norms a layer; its post_attention_layernorm norms the attention's output, not the FFN's input
_GEMMA_NAMES = [
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.attn_post_norm.weight"),
    (r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", r"layers.\1.ffn_post_norm.weight"),
] + _LLAMA_NAMES
_OPT_NAMES = [
    (r"(?:model\.)?decoder\.embed_tokens\.weight", "embed.weight"),
    (r"(?:model\.)?decoder\.embed_positions\.weight", "pos_embed.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"(?:model\.)?decoder\.final_layer_norm\.(weight|bias)", r"norm.\1"),
    (r"(?:model\.)?decoder\.layers\.(\d+)\.self_attn_layer_norm\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"(?:model\.)?decoder\.layers\.(\d+)\.final_layer_norm\.(weight|bias)", r"layers.\1.ffn_norm.\2"),
    (r"(?:model\.)?decoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", r"layers.\1.attn.\2.\3"),
    (r"(?:model\.)?decoder\.layers\.(\d+)\.self_attn\.out_proj\.(weight|bias)", r"layers.\1.attn.o.\2"),
    (r"(?:model\.)?decoder\.layers\.(\d+)\.fc1\.(weight|bias)", r"layers.\1.ffn.up.\2"),
    (r"(?:model\.)?decoder\.layers\.(\d+)\.fc2\.(weight|bias)", r"layers.\1.ffn.down.\2"),
]


def canonical_names(names, rules) -> dict[str, str]:
    """{canonical name: file's name} for the names a rule table (regex, replacement) recognises."""
    compiled = [(re.compile(a + r"\Z"), b) for a, b in rules]
    out = {}
    for name in names:
        for rx, repl in compiled:
            if rx.match(name):
                out[rx.sub(repl, name)] = name
                break
    return out


def _get(cfg: dict, key: str, default=None, required: bool = False):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if required:
        raise UserError(f"config.json lacks required field '{key}'")
    return default


def _count(cfg: dict, key: str, default=None, required: bool = False, tensors: int | None = None) -> int:
    """A config.json field that counts something: a positive integer, checked before any arithmetic uses it.
    tensors: the checkpoint's tensor count, which bounds a count of things that each have tensors of their own
    (layers, experts) before any loop runs over them."""
    v = _get(cfg, key, default, required)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"config.json: '{key}' must be a positive integer (got {v!r})")
    if tensors is not None and v > tensors:
        raise UserError(f"config.json: '{key}' is {v}, more than the checkpoint's {tensors} tensors (every "
                        f"one of them has tensors of its own)")
    return v


def _act(name: str, arch: str) -> str:
    acts = {"silu": "silu", "swish": "silu", "relu": "relu", "fatrelu": "relu", "gelu_pytorch_tanh": "gelu_tanh"}
    if name not in acts:
        raise UserError(f"unsupported activation '{name}' for {arch} (supported: {', '.join(acts)})")
    return acts[name]


def _eos_ids(*values) -> list[int]:
    ids: list[int] = []
    for v in values:
        for i in (v if isinstance(v, list) else [v]):
            if i is not None and i not in ids:      # anything else is ModelConfig's to refuse
                ids.append(i)
    return ids


def hf_config(cfg: dict, generation: dict | None = None, tensors: int | None = None) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json, refusing fields whose math we do not implement. tensors: how many
    the checkpoint holds (bounds the layer and expert counts)."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_HF:
        raise UserError(f"unsupported architecture {arch!r} in config.json (supported: {', '.join(SUPPORTED_HF)})")
    gen = generation or {}
    eos = _eos_ids(cfg.get("eos_token_id"), gen.get("eos_token_id"))
    dim = _count(cfg, "hidden_size", required=True)
    heads = _count(cfg, "num_attention_heads", required=True)
    common = dict(vocab_size=_count(cfg, "vocab_size", required=True), dim=dim,
                  n_layers=_count(cfg, "num_hidden_layers", required=True, tensors=tensors), n_heads=heads,
                  max_pos=_count(cfg, "max_position_embeddings", 2048), bos_id=cfg.get("bos_token_id"), eos_ids=eos)
    if arch == "OPTForCausalLM":
        if _get(cfg, "word_embed_proj_dim", dim) != dim:
            raise UserError("unsupported OPT field word_embed_proj_dim != hidden_size (project_in/out, as in OPT-350m)")
        if not _get(cfg, "layer_norm_elementwise_affine", True):
            raise UserError("unsupported OPT field layer_norm_elementwise_affine=false")
        bias = _get(cfg, "enable_bias", True)
        pre = _get(cfg, "do_layer_norm_before", True)
        return ModelConfig(arch="opt", n_kv_heads=heads, head_dim=dim // heads, ffn_dim=_count(cfg, "ffn_dim", required=True),
                           glu=False, act=_act(_get(cfg, "activation_function", "relu"), arch), norm="layer",
                           norm_eps=1e-5, pos_offset=2, tie_embeddings=_get(cfg, "tie_word_embeddings", True),
                           qkv_bias=bias, o_bias=bias, mlp_bias=bias, pre_norm=pre, **common)
    if arch == "Gemma3ForCausalLM":
        return gemma3_config(cfg, common)
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None) or _get(cfg, "rope_theta", 10000.0)
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    window = None
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window")
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        raise UserError(f"unsupported {arch} field use_sliding_window=true")
    qkv_bias = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or bool(cfg.get("attention_bias", False))
    moe = moe_fields(cfg, arch, tensors) if arch in MOE_HF else \
        {"qk_norm": "head" if arch == "Qwen3ForCausalLM" else None}
    if arch == "MixtralForCausalLM":
        window = cfg.get("sliding_window")
    cfg_out = ModelConfig(arch="llama", n_kv_heads=_count(cfg, "num_key_value_heads", heads),
                          head_dim=_count(cfg, "head_dim", dim // heads),
                          ffn_dim=moe.pop("ffn_dim", None) or _count(cfg, "intermediate_size", required=True),
                          glu=True, act=_act(_get(cfg, "hidden_act", "silu"), arch),
                          relu_threshold=float(cfg.get("hidden_act_param") or 0.0)
                          if cfg.get("hidden_act") == "fatrelu" else 0.0, norm="rms",
                          norm_eps=_get(cfg, "rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
                          tie_embeddings=bool(_get(cfg, "tie_word_embeddings", False)), qkv_bias=qkv_bias,
                          o_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
                          sliding_window=window, **moe, **common)
    return cfg_out


def gemma3_config(cfg: dict, common: dict) -> ModelConfig:
    """Gemma 3's text model: GeGLU, four RMSNorms a layer, q/k norms, embeddings times sqrt(d), scores times
    query_pre_attn_scalar^-1/2, sliding-window layers (RoPE base 10000) interleaved with global ones."""
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            raise UserError(f"unsupported Gemma 3 field {key}={cfg[key]!r}")
    n_layers, dim = common["n_layers"], common["dim"]
    types = cfg.get("layer_types")
    if types is None:     # configs before layer_types: every sliding_window_pattern-th layer is global
        pattern = _count(cfg, "sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or \
            not set(types) <= {"sliding_attention", "full_attention"}:
        raise UserError(f"config.json: layer_types must name sliding_attention or full_attention for each of the "
                        f"{n_layers} layers")
    rope = cfg.get("rope_parameters") or {}
    full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    theta = full.pop("rope_theta", None) or _get(cfg, "rope_theta", 1_000_000.0)
    theta_local = local.pop("rope_theta", None) or _get(cfg, "rope_local_base_freq", 10_000.0)
    if local.get("rope_type", "default") != "default":
        raise UserError(f"unsupported Gemma 3 rope_type {local['rope_type']!r} on the sliding layers")
    scaling = cfg.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    head_dim = _count(cfg, "head_dim", dim // common["n_heads"])
    softcap = cfg.get("final_logit_softcapping")
    return ModelConfig(arch="llama", n_kv_heads=_count(cfg, "num_key_value_heads", common["n_heads"]),
                       head_dim=head_dim, ffn_dim=_count(cfg, "intermediate_size", required=True), glu=True,
                       act=_act(_get(cfg, "hidden_activation", _get(cfg, "hidden_act", "gelu_pytorch_tanh")),
                                "Gemma3ForCausalLM"),
                       norm="rms", norm_eps=_get(cfg, "rms_norm_eps", 1e-6), rope_theta=float(theta),
                       rope_scaling=scaling, rope_theta_sliding=float(theta_local),
                       tie_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
                       qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
                       sliding_window=_count(cfg, "sliding_window", 4096),
                       sliding_layers=[t == "sliding_attention" for t in types], qk_norm="head", post_norms=True,
                       embed_scale=math.sqrt(dim),
                       query_scale=_count(cfg, "query_pre_attn_scalar", head_dim) ** -0.5,
                       logit_softcap=softcap, **common)
def moe_fields(cfg: dict, arch: str, tensors: int | None = None) -> dict:
    """ModelConfig's mixture-of-experts fields of an MoE config.json, refusing the variants we do not compute: dense
    layers among the expert ones (decoder_sparse_step, mlp_only_layers), OLMoE's clip_qkv, sliding windows."""
    if _get(cfg, "decoder_sparse_step", 1) != 1 or _get(cfg, "mlp_only_layers", []):
        raise UserError(f"unsupported {arch} fields decoder_sparse_step != 1 / mlp_only_layers (dense layers among "
                        f"the expert ones)")
    if cfg.get("clip_qkv") is not None:
        raise UserError(f"unsupported {arch} field clip_qkv={cfg['clip_qkv']!r}")
    if arch != "MixtralForCausalLM" and cfg.get("use_sliding_window"):
        raise UserError(f"unsupported {arch} field use_sliding_window=true")
    experts_key = "num_local_experts" if "num_local_experts" in cfg and "num_experts" not in cfg else "num_experts"
    out = dict(n_experts=_count(cfg, experts_key, required=True, tensors=tensors),
               n_experts_used=_count(cfg, "num_experts_per_tok", required=True),
               norm_topk_prob=True if arch == "MixtralForCausalLM" else bool(_get(cfg, "norm_topk_prob", False)),
               qk_norm={"Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "all"}.get(arch))
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        out["ffn_dim"] = _count(cfg, "moe_intermediate_size", required=True)
    if arch == "Qwen2MoeForCausalLM" and _get(cfg, "shared_expert_intermediate_size", 0):
        out["shared_expert_dim"] = _count(cfg, "shared_expert_intermediate_size")
    return out


class Checkpoint:
    """Lazy access to a model's tensors under canonical names. Subclasses fill config, _index and read."""

    config: ModelConfig
    path: Path

    def names(self) -> list[str]:
        return list(self._index)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` as float32, finite (a NaN or inf is one line naming it: check_finite)."""
        if name not in self._index:
            raise UserError(f"{self.path}: missing tensor '{name}'")
        return check_finite(self._read(name), self.where(name))

    def where(self, name: str) -> str:
        """Tensor `name` as the user finds it: the file, and the tensor's name in it."""
        return f"{self.path}: tensor {name}"

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape tensor(name) will have, without reading it."""
        raise NotImplementedError

    def quantized(self, name: str) -> tuple[str, np.ndarray] | None:
        """(kind, uint8 [rows, row_bytes]) when the file stores matrix `name` in a block format of storage/blocks.py
        (rows as tensor(name)'s), so that convert can copy its blocks verbatim; else None."""
        return None

    def block_kind(self, name: str) -> str | None:
        """The block format quantized(name) would return the matrix in, read from the header alone."""
        return None

    def precision(self, name: str) -> str:
        """The flash dtype that keeps tensor `name`'s precision (convert --dtype auto)."""
        return "f16"

    def tokenizer(self) -> Tokenizer:
        raise NotImplementedError

    def release(self) -> None:
        """Let go of what reading tensors left in memory (nothing here): layer-streaming calls this after each
        layer so that no layer's bytes outlive its turn."""

    def check_complete(self) -> None:
        """Every tensor the math needs is present (a clear error now instead of a KeyError mid-load), and of the shape
        the config implies (check_shapes)."""
        c, need = self.config, ["embed.weight"]
        ffn = 1 + 3 * c.n_experts + 4 * bool(c.shared_expert_dim) if c.moe else 3 if c.glu else 2
        per_layer = 4 + ffn + 2 + 2 * bool(c.qk_norm) + 2 * c.post_norms
        if c.n_layers * per_layer > len(self._index):     # before a name is listed: the counts come from the file
            raise UserError(f"{self.path}: {c.n_layers} layers of {per_layer} tensors each, but the file holds "
                            f"{len(self._index)} tensors")
        if not c.tie_embeddings:
            need.append("lm_head.weight")
        if c.pos_offset is not None:
            need.append("pos_embed.weight")
        for i in range(c.n_layers):
            need += [f"layers.{i}.attn.{p}.weight" for p in "qkvo"]
            need += ffn_tensor_names_of(c, i)
            need += [f"layers.{i}.attn.{p}_norm.weight" for p in "qk"] if c.qk_norm else []
            need += [f"layers.{i}.attn_norm.weight", f"layers.{i}.ffn_norm.weight"]
            if c.post_norms:
                need += [f"layers.{i}.attn_post_norm.weight", f"layers.{i}.ffn_post_norm.weight"]
        missing = [n for n in need if n not in self._index]
        if missing:
            raise UserError(f"{self.path}: checkpoint lacks {len(missing)} tensors, e.g. '{missing[0]}'")
        check_shapes(c, {n: self.shape(n) for n in self._index}, self.path)


def ffn_tensor_names_of(c: ModelConfig, layer: int) -> list[str]:
    """The FFN matrices layer `layer` of a model needs: gate, up, down; a mixture of experts': its router, every
    expert's gate, up and down, and its shared expert's."""
    if not c.moe:
        return [f"layers.{layer}.ffn.{p}.weight" for p in (("gate", "up", "down") if c.glu else ("up", "down"))]
    p = f"layers.{layer}.ffn."
    names = [p + "router.weight"] + [f"{p}experts.{e}.{m}.weight" for e in range(c.n_experts) for m in GLU]
    if c.shared_expert_dim:
        names += [f"{p}shared.{m}.weight" for m in GLU] + [p + "shared_gate.weight"]
    return names


GLU = ("gate", "up", "down")


def expected_shape(c: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The shape the model math (and every kernel) assumes for canonical tensor `name`; None for names it never
    reads."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    fixed = {"embed.weight": (c.vocab_size, c.dim), "lm_head.weight": (c.vocab_size, c.dim),
             "norm.weight": (c.dim,), "norm.bias": (c.dim,)}
    if c.pos_offset is not None:
        fixed["pos_embed.weight"] = (c.max_pos + c.pos_offset, c.dim)
    if name in fixed:
        return fixed[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if not m or int(m[1]) >= c.n_layers:
        return None
    per_layer = {"attn_norm.weight": (c.dim,), "attn_norm.bias": (c.dim,), "ffn_norm.weight": (c.dim,),
                 "ffn_norm.bias": (c.dim,), "attn.q.weight": (q, c.dim), "attn.k.weight": (kv, c.dim),
                 "attn.v.weight": (kv, c.dim), "attn.o.weight": (c.dim, q), "attn.q.bias": (q,), "attn.k.bias": (kv,),
                 "attn.v.bias": (kv,), "attn.o.bias": (c.dim,), "ffn.gate.weight": (c.ffn_dim, c.dim),
                 "ffn.up.weight": (c.ffn_dim, c.dim), "ffn.down.weight": (c.dim, c.ffn_dim),
                 "ffn.gate.bias": (c.ffn_dim,), "ffn.up.bias": (c.ffn_dim,), "ffn.down.bias": (c.dim,),
                 "attn_post_norm.weight": (c.dim,), "ffn_post_norm.weight": (c.dim,)}
    if c.qk_norm:
        per_layer.update({"attn.q_norm.weight": (c.head_dim if c.qk_norm == "head" else q,),
                          "attn.k_norm.weight": (c.head_dim if c.qk_norm == "head" else kv,)})
    if c.moe:
        s = c.shared_expert_dim
        per_layer.update({"ffn.router.weight": (c.n_experts, c.dim), "ffn.shared.gate.weight": (s, c.dim),
                          "ffn.shared.up.weight": (s, c.dim), "ffn.shared.down.weight": (c.dim, s),
                          "ffn.shared_gate.weight": (1, c.dim)})
        e = re.fullmatch(r"ffn\.experts\.(\d+)\.(gate|up|down)\.weight", m[2])
        if e:
            return None if int(e[1]) >= c.n_experts else (c.dim, c.ffn_dim) if e[2] == "down" else (c.ffn_dim, c.dim)
    return per_layer.get(m[2])


def check_shapes(c: ModelConfig, shapes: dict[str, tuple], src) -> None:
    """Every tensor of `shapes` ({canonical name: shape}) that the math reads has the shape the config implies, norms
    and biases included: a kernel indexes by the config's numbers, never by an array's length, so a wrong shape is
    one line here instead of reads past an array later. convert (Checkpoint.check_complete), verify and load
    (FlashCheckpoint) all call this."""
    for name, shape in shapes.items():
        want = expected_shape(c, name)
        if want is not None and tuple(shape) != want:
            raise UserError(f"{src}: tensor {name} has shape {list(shape)}, but the config implies {list(want)}")


class HFCheckpoint(Checkpoint):
    def __init__(self, path: Path):
        self.path = path
        raw = read_json(path / "config.json", "config.json")
        gen = read_json(path / "generation_config.json", "generation_config.json") \
            if (path / "generation_config.json").exists() else None
        index_path = path / "model.safetensors.index.json"
        if index_path.exists():
            weight_map = read_json(index_path, "model.safetensors.index.json").get("weight_map")
            if not isinstance(weight_map, dict):
                raise UserError(f"model.safetensors.index.json has no weight_map: {index_path}")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
            hint = f" (found {pickled[0]}: pickled checkpoints are not loaded; convert to safetensors)" if pickled else ""
            raise UserError(f"no .safetensors weights in {path}{hint}")
        what = "model.safetensors.index.json" if index_path.exists() else "weights file"
        blobs = hub_blobs(path)
        self._files = [SafetensorsFile(inside(path, f, what, blobs)) for f in files]
        self.config = hf_config(raw, gen, tensors=sum(len(f.entries) for f in self._files))
        gemma = (raw.get("architectures") or [None])[0] == "Gemma3ForCausalLM"
        rules = _OPT_NAMES if self.config.arch == "opt" else _GEMMA_NAMES if gemma else _LLAMA_NAMES
        self._norm_shift = 1.0 if gemma else 0.0      # RMSNorm with (1 + w)
        self._index: dict[str, tuple[SafetensorsFile, str]] = {}
        for f in self._files:
            self._index.update({c: (f, n) for c, n in canonical_names(f.entries, rules).items()})
        if self.config.tie_embeddings:
            self._index.pop("lm_head.weight", None)
        self.check_complete()

    def _read(self, name: str) -> np.ndarray:
        f, hf_name = self._index[name]
        a = f.read(hf_name)
        if self._norm_shift and name.endswith("norm.weight"):
            a += np.float32(self._norm_shift)
        return a

    def shape(self, name: str) -> tuple[int, ...]:
        f, hf_name = self._index[name]
        return f.entries[hf_name][2]

    def where(self, name: str) -> str:
        f, hf_name = self._index[name]
        return f"{f.path}: tensor {hf_name}"

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dir(self.path, self.config)


# ----------------------------------------------------------------------------------------------------------------------
# GGUF (llama, qwen2, qwen3 and gemma3 architectures)

# The GGUF tensor types read, each with the flash dtype that keeps its precision (convert --dtype auto): the block
# formats the kernels compute on (storage/blocks.py) are copied verbatim; Q3_K and Q2_K, which they do not, go to q4_1.
GGUF_TYPES = {"F32": "f16", "F16": "f16", "BF16": "f16", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1",
              "Q5_0": "q5_0", "Q5_1": "q5_1", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "Q3_K": "q4_1",
              "Q2_K": "q4_1"}

_GGUF_NAMES = [
    (r"token_embd\.weight", "embed.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"output_norm\.weight", "norm.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"layers.\1.attn_norm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"layers.\1.attn.q.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"layers.\1.attn.k.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"layers.\1.attn.v.\2"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"layers.\1.attn.o.\2"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.(weight|bias)", r"layers.\1.ffn.\2.\3"),
    (r"blk\.(\d+)\.attn_([qk])_norm\.weight", r"layers.\1.attn.\2_norm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", r"layers.\1.attn_post_norm.weight"),     # Gemma 3
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"layers.\1.ffn_post_norm.weight"),
    # mixtures of experts: the router, a shared expert and its gate; the experts' 3-D tensors are split by
    # GGUFCheckpoint (_GGUF_EXPERTS)
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", r"layers.\1.ffn.router.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight", r"layers.\1.ffn.shared.\2.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", r"layers.\1.ffn.shared_gate.weight"),
]
# blk.N.ffn_{gate,up,down}_exps.weight: every expert of a layer in one tensor, ne = [cols, rows, experts] (llama.cpp
# stores the experts' matrices back to back, each as a 2-D tensor would be)
_GGUF_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen2moe", "qwen3moe")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving (GGUF pairs rotary dims adjacently; HF math splits them in halves)."""
    # llama.cpp wrote w.reshape(H, 2, r, ...).swapaxes(1, 2); this is its inverse.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF metadata value types (the format's spec): struct formats of the scalars, 8 = string, 9 = array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# the element types of the float tensors (gguf.GGUFReader's numpy dtypes); the others (BF16 too) are bytes
_GGUF_ELEMENTS = {"F32": np.float32, "F16": np.float16}


class GGUFArray:
    """An array field of a GGUF header (the vocabulary, the merges), skipped by GGUFHeader: its length, the GGUF value
    type of its items and the offset of the first are kept, and gguf_array reads it when it is asked for."""
    def __init__(self, n: int, item: int = _GGUF_STRING, at: int = 0):
        self.n, self.item, self.at = n, item, at

    def __len__(self) -> int:
        return self.n


def gguf_array(m, a: GGUFArray) -> list:
    """The values of array field `a` of the file mapped as m: Python numbers or strings (as gguf.GGUFReader's
    contents()), read from the bytes GGUFHeader bounded. An array of arrays is not read (no field used has one)."""
    if a.item in _GGUF_SCALARS:
        return np.frombuffer(m, np.dtype("<" + _GGUF_SCALARS[a.item]), a.n, a.at).tolist()
    if a.item != _GGUF_STRING:
        raise UserError("a GGUF array of arrays is not read")
    out, at = [], a.at
    for _ in range(a.n):
        n = int.from_bytes(m[at:at + 8], "little")
        out.append(m[at + 8:at + 8 + n].decode("utf-8"))
        at += 8 + n
    return out


def file_map_of(a: np.ndarray) -> mmap.mmap | None:
    """The mapped file array `a` is a view of (np.frombuffer over an mmap, as GGUFCheckpoint's tensors), else None."""
    while isinstance(a, np.ndarray):
        a = a.base
    a = a.obj if isinstance(a, memoryview) else a
    return a if isinstance(a, mmap.mmap) else None


def drop_mapped_pages(a: np.ndarray) -> None:
    """When `a` is a view of a mapped file (file_map_of), madvise(MADV_DONTNEED) on the whole pages under it: out of
    this process's RSS, still in the page cache, mapped again by a later read. For a copy that replaces the view, so
    that the process does not hold its bytes twice. Pages `a` shares with a neighbour at either end are left (a
    neighbour in the same huge page of the page cache is unmapped with it, and mapped again when read)."""
    m = file_map_of(a)
    if m is None or not a.flags.c_contiguous or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = a.__array_interface__["data"][0] - np.frombuffer(m, np.uint8, 1).__array_interface__["data"][0]
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if 0 <= start and end > first and start + a.nbytes <= len(m):
        m.madvise(mmap.MADV_DONTNEED, first, end - first)


GGML_MAX_DIMS = 4


class GGUFHeader:
    """A GGUF file's metadata and tensor table, read without gguf.GGUFReader: that reader builds numpy arrays for every
    token and merge (SmolLM2's 98k of them: 160 MiB of RSS and seconds), where deciding what a run needs (the config,
    the tensors' kinds and shapes, the cache key) reads scalars only. Array fields are skipped, their lengths kept.
    Untrusted: every length and offset is checked against the file's size.

    fields: {key: value} (GGUFArray for arrays); tensors: {name: (GGML type name, dims as the file lists them)};
    data: {name: the file offset of its first byte}; size: the file's size when read."""

    def __init__(self, path: Path):
        import struct

        import gguf
        self.path = path
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                self._m, self._at = m, 4
                try:
                    if m[:4] != b"GGUF" or self._scalar("I") not in (2, 3):
                        raise ValueError("not GGUF version 2 or 3")
                    n_tensors, n_fields = self._scalar("Q"), self._scalar("Q")
                    if n_tensors > len(m) or n_fields > len(m):       # each takes at least a byte
                        raise ValueError("counts beyond the file's size")
                    self.fields = {}
                    for _ in range(n_fields):
                        key = self._string()
                        self.fields[key] = self._value(self._scalar("I"))
                    tensors = []
                    for _ in range(n_tensors):
                        name, n_dims = self._string(), self._scalar("I")
                        if n_dims > GGML_MAX_DIMS:
                            raise ValueError(f"tensor {name} has {n_dims} dimensions")
                        dims = tuple(self._scalar("Q") for _ in range(n_dims))
                        kind, offset = gguf.GGMLQuantizationType(self._scalar("I")), self._scalar("Q")
                        tensors.append((name, kind, dims, offset))
                    align = self.fields.get("general.alignment", 32)
                    if not isinstance(align, int) or not 0 < align <= 1 << 20:
                        raise ValueError(f"alignment {align}")
                    start = -(-self._at // align) * align
                    self.tensors, self.data = {}, {}
                    for name, kind, dims, offset in tensors:
                        block, size = gguf.GGML_QUANT_SIZES[kind]
                        count = math.prod(dims)
                        if count % block or start + offset + count // block * size > len(m):
                            raise ValueError(f"tensor {name} lies beyond the file's end")
                        if name in self.tensors:
                            raise ValueError(f"tensor {name} is listed twice")
                        self.tensors[name] = (kind.name, dims)
                        self.data[name] = start + offset
                    self.size = len(m)
                finally:
                    del self._m
        except (ValueError, KeyError, struct.error, OSError, UnicodeDecodeError) as e:
            raise UserError(f"not a valid GGUF file: {path} ({type(e).__name__}: {e})") from None

    def _scalar(self, fmt: str):
        import struct
        v = struct.unpack_from("<" + fmt, self._m, self._at)[0]
        self._at += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar("Q")
        if self._at + n > len(self._m):
            raise ValueError("a string runs beyond the file's end")
        self._at += n
        return self._m[self._at - n:self._at].decode("utf-8")

    def _value(self, kind: int, depth: int = 0):
        import struct
        if kind in _GGUF_SCALARS:
            return self._scalar(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return self._string()
        if kind != _GGUF_ARRAY or depth > 1:
            raise ValueError(f"metadata value type {kind}")
        item, n = self._scalar("I"), self._scalar("Q")
        at = self._at
        if n > len(self._m):
            raise ValueError("an array longer than the file")
        if item in _GGUF_SCALARS:               # skipped whole
            self._at += n * struct.calcsize(_GGUF_SCALARS[item])
        else:
            for _ in range(n):
                if item == _GGUF_STRING:        # skipped string by string: no text decoded
                    length = self._scalar("Q")
                    self._at += length
                else:
                    self._value(item, depth + 1)
        if self._at > len(self._m):
            raise ValueError("an array runs beyond the file's end")
        return GGUFArray(n, item, at)

    def field(self, key: str, default=None):
        return self.fields.get(key, default)


class GGUFCheckpoint(Checkpoint):
    """A GGUF file: its config and tensor table from the header alone (GGUFHeader); the file is mapped when a tensor
    or an array field (the vocabulary) is first read. Tensors are views of that map: a dense model computes on the
    file's pages as llama.cpp does, and holds no copy of them (no gguf.GGUFReader: it builds an array for every token
    and merge, 490 MiB and 15 s for a 152k vocabulary)."""

    def __init__(self, path: Path):
        self.path = path
        h = GGUFHeader(path)
        self._fields, self._offsets, self._size = h.fields, h.data, h.size
        arch = h.field("general.architecture")
        if arch not in GGUF_ARCHS:
            raise UserError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})")
        self.arch = arch
        need = lambda k: _required_field(h, f"{arch}.{k}")  # noqa: E731

        def field(k: str, default=None):
            """{arch}.k from the header; an array's values (the header keeps only where they are) from the file."""
            return self.field(f"{arch}.{k}", default)
        dim, heads = int(need("embedding_length")), int(need("attention.head_count"))
        if dim < 1 or heads < 1:
            raise UserError(f"{path}: GGUF embedding_length and attention.head_count must be positive "
                            f"(got {dim}, {heads})")
        for name, (kind, _) in h.tensors.items():
            if kind not in GGUF_TYPES:
                raise UserError(f"{path}: tensor {name} has GGUF type {kind}, which is not supported "
                                f"(supported: {', '.join(GGUF_TYPES)})")
        self._tensors = h.tensors
        self._index = canonical_names(h.tensors, _GGUF_NAMES)      # canonical name -> the file's
        moe, self._expert_of = {}, {}     # canonical name of one expert's matrix -> its index in the 3-D tensor
        # Counts that loops run over, bounded by the file before any does: a layer has tensors of its own; an
        # expert, a [rows, cols] matrix of the config's size in each 3-D expert tensor (checked below before its
        # experts are listed), whose bytes GGUFHeader found in the file
        n_layers = _bounded(h, f"{arch}.block_count", len(h.tensors), "tensors (each layer has its own)")
        if field("expert_count"):
            moe = dict(n_experts=_bounded(h, f"{arch}.expert_count"), n_experts_used=int(need("expert_used_count")),
                       # llama.cpp renormalises the chosen weights for Mixtral and Qwen3-MoE, not Qwen2-MoE
                       norm_topk_prob=arch != "qwen2moe")
            if arch != "llama":
                moe["ffn_dim"] = int(need("expert_feed_forward_length"))
            if field("expert_shared_feed_forward_length"):
                moe["shared_expert_dim"] = int(field("expert_shared_feed_forward_length"))
            cols_rows = {"gate": (dim, moe.get("ffn_dim") or int(need("feed_forward_length")))}
            cols_rows["up"], cols_rows["down"] = cols_rows["gate"], cols_rows["gate"][::-1]
            for t, (_, dims) in h.tensors.items():
                m = _GGUF_EXPERTS.fullmatch(t)
                if m:
                    if tuple(dims) != (*cols_rows[m[2]], moe["n_experts"]):
                        raise UserError(f"{path}: {t} holds {list(dims)}, not {moe['n_experts']} experts of "
                                        f"{list(cols_rows[m[2]])}")
                    for e in range(moe["n_experts"]):
                        self._index[f"layers.{m[1]}.ffn.experts.{e}.{m[2]}.weight"] = t
                        self._expert_of[f"layers.{m[1]}.ffn.experts.{e}.{m[2]}.weight"] = e
        tokens = h.field("tokenizer.ggml.tokens") or []
        kv_heads = int(field("attention.head_count_kv", heads))
        head_dim = int(field("attention.key_length", dim // heads))
        if int(field("rope.dimension_count", head_dim)) != head_dim:
            raise UserError(f"unsupported GGUF field {arch}.rope.dimension_count != head dim (partial rotary)")
        scaling = None
        stype = field("rope.scaling.type")
        if stype not in (None, "none"):
            if stype != "linear":
                raise UserError(f"unsupported GGUF rope scaling '{stype}' (supported: linear)")
            scaling = {"rope_type": "linear", "factor": float(field("rope.scaling.factor", 1.0))}
        bos = h.field("tokenizer.ggml.bos_token_id")
        eos = h.field("tokenizer.ggml.eos_token_id")
        ffn_dim = moe.pop("ffn_dim", None) or int(need("feed_forward_length"))
        per_arch = gemma3_gguf_fields(field, n_layers, dim, heads, head_dim) if arch == "gemma3" else {"act": "silu"}
        self.config = ModelConfig(
            arch="llama", vocab_size=int(field("vocab_size", len(tokens))), dim=dim,
            n_layers=n_layers, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, ffn_dim=ffn_dim,
            glu=True, norm="rms", norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(field("rope.freq_base", 10000.0)), rope_scaling=scaling,
            max_pos=int(field("context_length", 2048)),
            tie_embeddings="lm_head.weight" not in self._index,
            qkv_bias="layers.0.attn.q.bias" in self._index, o_bias="layers.0.attn.o.bias" in self._index,
            mlp_bias="layers.0.ffn.up.bias" in self._index,
            qk_norm="head" if "layers.0.attn.q_norm.weight" in self._index else None,
            bos_id=bos, eos_ids=[] if eos is None else [eos],
            **per_arch, **moe)
        self.check_complete()

    def field(self, key: str, default=None):
        """Metadata field `key`: a scalar or string as the header read it, an array's values read from the file."""
        v = self._fields.get(key, default)
        if not isinstance(v, GGUFArray):
            return v
        try:
            return gguf_array(self._file, v)
        except UnicodeDecodeError as e:
            raise UserError(f"not a valid GGUF file: {self.path} (field {key}: {e})") from None

    @cached_property
    def _file(self) -> mmap.mmap:
        """The file mapped read-only and shared (PROT_READ, MAP_SHARED): every tensor is a view of it, nothing can
        write through one, and the pages read are the page cache's (RSS counts them while they are mapped)."""
        try:
            with open(self.path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot map {self.path}: {e}") from None
        if len(m) < self._size:     # cut since its header was read: a page beyond the end would be a SIGBUS
            m.close()
            raise UserError(f"{self.path} is shorter than when its header was read ({self._size} bytes)")
        return m

    def _kind(self, name: str) -> str:
        return self._tensors[self._index[name]][0]

    def _tensor(self, name: str) -> tuple[str, np.ndarray]:
        """(its GGML type name, its data as gguf.GGUFReader shapes it: [..., row bytes] of uint8 in a block format,
        else the element type, dims reversed; one expert's slice of a 3-D expert tensor): a view of the mapped file,
        not read."""
        import gguf
        t = self._index[name]
        kind, dims = self._tensors[t]
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        shape = tuple(int(n) for n in reversed(dims))
        dtype = _GGUF_ELEMENTS.get(kind)
        if dtype is None:
            dtype, shape = np.uint8, (*shape[:-1], shape[-1] // block * size)
        data = np.frombuffer(self._file, dtype, math.prod(shape), self._offsets[t]).reshape(shape)
        return kind, data[self._expert_of[name]] if name in self._expert_of else data

    def _read(self, name: str) -> np.ndarray:
        import gguf
        ggml, data = self._tensor(name)
        kind = self.block_kind(name)
        if kind is not None:           # a NaN or inf scale named as such, before it spreads over its block
            check_finite_blocks(data, kind, self.where(name))
        try:
            with np.errstate(all="ignore"):    # non-finite values: one line from tensor()'s check, no warning
                a = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[ggml])
        except Exception as e:
            raise UserError(f"cannot dequantize GGUF tensor {self._index[name]} ({ggml}): {e}") from None
        a = np.asarray(a, dtype=np.float32).reshape(self.shape(name))
        if a.ndim == 1 and not a.flags.writeable:     # a norm or a bias: a copy of its own, not a view of the file
            a = a.copy()
        if self.arch != "llama":      # NeoX RoPE (half-split, as HF): llama.cpp's converter left q and k as they were
            return a
        if name.endswith("attn.q.weight") or name.endswith("attn.q.bias"):
            a = unpermute_qk(a, self.config.n_heads)
        elif name.endswith("attn.k.weight") or name.endswith("attn.k.bias"):
            a = unpermute_qk(a, self.config.n_kv_heads)
        return a

    def shape(self, name: str) -> tuple[int, ...]:
        dims = self._tensors[self._index[name]][1]
        if name in self._expert_of:                   # one expert: [rows, cols] of ne = [cols, rows, experts]
            return int(dims[1]), int(dims[0])
        if name.endswith("shared_gate.weight"):       # a vector [d] in the file, the [1, d] matrix of the math
            return (1, int(dims[0]))
        return tuple(int(s) for s in reversed(dims))

    def where(self, name: str) -> str:
        expert = f" (expert {self._expert_of[name]})" if name in self._expert_of else ""
        return f"{self.path}: tensor {self._index[name]}{expert}"

    def block_kind(self, name: str) -> str | None:
        kind, shape = self._kind(name).lower(), self.shape(name)
        return kind if kind in BLOCK_BYTES and len(shape) == 2 else None

    def quantized(self, name: str) -> tuple[str, np.ndarray] | None:
        """(kind, uint8 [rows, row_bytes]): a read-only view of the mapped file (q and k of a llama GGUF: a copy)."""
        kind, shape = self.block_kind(name), self.shape(name)
        if kind is None:
            return None
        ggml, q = self._tensor(name)
        if q.dtype != np.uint8 or q.shape != (shape[0], row_bytes(shape[1], kind)):
            raise UserError(f"{self.path}: GGUF tensor {self._index[name]} ({ggml}) holds {q.dtype}{list(q.shape)}, "
                            f"not the blocks of a {list(shape)} matrix")
        check_finite_blocks(q, kind, self.where(name))
        return kind, self._unpermuted(name, q)

    def stored_matrix(self, name: str) -> np.ndarray | None:
        """Matrix `name` when the file stores it as float16 or float32, as stored (float16 keeps its type: not
        widened to float32): a read-only view of the mapped file (q and k of a llama GGUF: a copy); else None."""
        ggml, a = self._tensor(name)
        if ggml not in ("F16", "F32") or a.ndim != 2 or name in self._expert_of:
            return None
        return self._unpermuted(name, check_finite(a, self.where(name)))

    def _unpermuted(self, name: str, a: np.ndarray) -> np.ndarray:
        """Rows `a` of matrix `name` in the math's order: llama.cpp interleaved the rows of q and k (llama only), so
        those are un-permuted (whole rows move, blocks and all) into a read-only copy, and the file's pages under the
        view leave RSS; any other is `a`."""
        heads = {"attn.q.weight": self.config.n_heads, "attn.k.weight": self.config.n_kv_heads}.get(
            name.split(".", 2)[-1]) if self.arch == "llama" else None
        if heads is None:
            return a
        out = np.ascontiguousarray(unpermute_qk(a, heads))
        out.flags.writeable = False
        drop_mapped_pages(a)
        return out

    def precision(self, name: str) -> str:
        return GGUF_TYPES[self._kind(name)]

    def release(self) -> None:
        # the file is memory-mapped read-only: its pages read so far count in RSS until dropped (re-read on demand)
        if "_file" in self.__dict__ and hasattr(mmap, "MADV_DONTNEED"):
            self._file.madvise(mmap.MADV_DONTNEED)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf(self.field, self.config)


def gemma3_gguf_fields(field, n_layers: int, dim: int, heads: int, head_dim: int) -> dict:
    """The ModelConfig fields of a gemma3 GGUF, read as llama.cpp reads them: the norm weights hold 1 + w already (its
    converter added the 1); without a sliding_window_pattern key every 6th layer is global and the sliding layers'
    RoPE base is 10000; scores are scaled by 1/sqrt(head_dim), except 1/sqrt(dim / heads) for the 62-layer 27B
    (its query_pre_attn_scalar), which the file does not record."""
    window = field("attention.sliding_window")
    pattern = field("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        sliding = [bool(b) for b in pattern]
    elif isinstance(pattern, int) and pattern >= 1:
        sliding = [i % pattern < pattern - 1 for i in range(n_layers)]
    else:
        raise UserError(f"GGUF field gemma3.attention.sliding_window_pattern must be a positive integer or one "
                        f"boolean per layer (got {pattern!r})")
    softcap = field("final_logit_softcapping")
    return dict(act="gelu_tanh", post_norms=True, embed_scale=math.sqrt(dim),
                query_scale=(dim / heads if n_layers == 62 else head_dim) ** -0.5,
                sliding_window=None if not window else int(window), sliding_layers=sliding if window else None,
                rope_theta_sliding=float(field("rope.freq_base_swa", 10000.0)),
                logit_softcap=None if not softcap else float(softcap))


def _bounded(header: GGUFHeader, key: str, most: int | None = None, what: str = "") -> int:
    """A GGUF count field (layers, experts): a positive integer, at most `most` (what the file holds of `what`)."""
    v = _required_field(header, key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"GGUF field {key} must be a positive integer (got {v!r})")
    if most is not None and v > most:
        raise UserError(f"GGUF field {key} is {v}, more than the file's {most} {what}")
    return v


def _required_field(header: GGUFHeader, key: str):
    v = header.field(key)
    if v is None:
        raise UserError(f"GGUF file lacks required field '{key}'")
    return v


# ----------------------------------------------------------------------------------------------------------------------

def _gguf_magic(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def open_checkpoint(path) -> Checkpoint:
    """An HF directory or a .gguf file (a flash directory is opened by storage.format.FlashCheckpoint)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"model not found: {p}")
    if p.is_dir():
        if not (p / "config.json").exists():
            raise UserError(f"not a Hugging Face model directory (no config.json): {p}")
        return HFCheckpoint(p)
    if p.suffix.lower() == ".gguf" or _gguf_magic(p):   # a hub cache's blob (a .gguf symlink's target): no suffix
        if not p.is_file():
            raise UserError(f"not a regular file: {p}")
        return GGUFCheckpoint(p)
    raise UserError(f"unrecognised model path (expected an HF directory or a .gguf file): {p}")
