"""ModelConfig: every architecture's numbers in one dataclass, checked once, whatever the source (config.json, GGUF
metadata, a FLASHDIR's manifest): what a model file says, so it lives with the files; the model math imports it."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping

from .errors import UserError


ARCHS = ("llama", "opt")
ACTIVATIONS = ("silu", "relu", "drelu", "gelu_tanh")
# Gated activations with no zeros of their own (SwiGLU, GeGLU): the exact gate (ffn.gate) thresholds their
# coefficients, and convert writes its split layout for them alone. The ReLU family's zeros are the predictor's.
EXACT_GATE_ACTS = ("silu", "gelu_tanh")
DEFAULT_MAX_CTX = 4096   # positions of the context when -c is not given (or less: the model's maximum)
NORMS = ("rms", "layer")
ROPE_SCALINGS = {"default": (), "linear": ("factor",),                 # type -> the numbers it needs
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def check_token_id(what: str, v, vocab_size: int) -> None:
    """A token id read from a model file (BOS, EOS, a GGUF's EOT or UNK): an integer in 0..vocab_size-1, else one
    line naming `what`."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
        raise UserError(f"{what} {v!r} outside the vocabulary (0..{vocab_size - 1})")


@dataclass
class ModelConfig:
    arch: str                      # "llama" (Llama, Mistral, Qwen2/3, Gemma 3: its math and the flags below) or "opt"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    glu: bool = True               # act(gate) * up -> down; False: OPT's fc1 -> act -> fc2
    act: str = "silu"              # silu | relu | drelu (relu on gate and up, TurboSparse) | gelu_tanh (GeGLU, Gemma)
    relu_threshold: float = 0.0    # FATReLU (ProSparse): relu gate values <= t count as zero
    norm: str = "rms"              # rms | layer
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_pos: int = 2048
    pos_offset: int | None = None  # OPT: learned positions, row = pos + offset; None: RoPE
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    pre_norm: bool = True          # False: OPT-350m style post-norm blocks
    sliding_window: int | None = None
    sliding_layers: list[bool] | None = None   # which layers attend within sliding_window (None: all, as Mistral)
    rope_theta_sliding: float | None = None    # RoPE base of the sliding layers, unscaled (Gemma 3: 10000); None: as
                                               # the others (rope_theta, rope_scaling)
    post_norms: bool = False       # RMSNorm on the attention and FFN outputs before their residual add (Gemma 3)
    embed_scale: float = 1.0       # token embeddings times this (Gemma: sqrt(dim))
    query_scale: float | None = None   # attention scores q.k times this; None: 1/sqrt(head_dim) (Gemma 3:
                                       # query_pre_attn_scalar ** -0.5)
    logit_softcap: float | None = None  # final logits -> cap * tanh(logits / cap) (Gemma 2, and Gemma 3 if set)
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    # Mixture of experts (0 experts: a dense FFN). Every layer's FFN is then a router over n_experts experts, each a
    # GLU FFN of ffn_dim neurons; n_experts_used of them run per token, weighted by the router's softmax, the chosen
    # weights renormalised to sum to 1 when norm_topk_prob (Mixtral always, Qwen2/3-MoE and OLMoE per config).
    n_experts: int = 0
    n_experts_used: int = 0
    norm_topk_prob: bool = False
    shared_expert_dim: int = 0     # Qwen2-MoE: an always-on GLU FFN of this many neurons, scaled by sigmoid(x.w)
    qk_norm: str | None = None     # RMSNorm of queries and keys before RoPE: "head" (Qwen3, Gemma 3: each head's
                                   # vector on its own) or "all" (OLMoE: every head at once)

    def __post_init__(self):
        """Every field checked here, once, for every source (config.json, GGUF metadata, a FLASHDIR's manifest): an
        impossible number is one line before anything is computed or written, not a crash later."""
        def positive_int(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"invalid model config: {name} must be a positive integer (got {v!r})")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_pos"):
            positive_int(name)
        if self.sliding_window is not None:
            positive_int("sliding_window")
        if self.sliding_layers is not None and (not isinstance(self.sliding_layers, list)
                                                or len(self.sliding_layers) != self.n_layers
                                                or not all(isinstance(b, bool) for b in self.sliding_layers)):
            raise UserError(f"invalid model config: sliding_layers must be {self.n_layers} booleans, one per layer")
        if self.n_experts:
            positive_int("n_experts")
            positive_int("n_experts_used")
            if self.n_experts_used > self.n_experts or not self.glu:
                raise UserError(f"invalid model config: {self.n_experts_used} experts per token of {self.n_experts} "
                                f"(a mixture of experts needs 1..n_experts gated experts)")
        if isinstance(self.shared_expert_dim, bool) or not isinstance(self.shared_expert_dim, int) \
                or self.shared_expert_dim < 0 or (self.shared_expert_dim and not self.n_experts):
            raise UserError(f"invalid model config: shared_expert_dim {self.shared_expert_dim!r}")
        if self.qk_norm not in (None, "head", "all"):
            raise UserError(f"invalid model config: qk_norm {self.qk_norm!r} (supported: head, all)")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"invalid model config: {self.n_heads} attention heads cannot be shared by "
                            f"{self.n_kv_heads} key/value heads (it must divide them)")
        if self.pos_offset is None and self.head_dim % 2:
            raise UserError(f"invalid model config: RoPE needs an even head_dim (got {self.head_dim})")
        choices = {"arch": ARCHS, "act": ACTIVATIONS, "norm": NORMS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"invalid model config: {name} {getattr(self, name)!r} (supported: "
                                f"{', '.join(allowed)})")
        for name in ("norm_eps", "rope_theta", "rope_theta_sliding", "embed_scale", "query_scale", "logit_softcap"):
            v = getattr(self, name)
            if v is None and name not in ("norm_eps", "rope_theta"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise UserError(f"invalid model config: {name} must be a positive number (got {v!r})")
        sc = self.rope_scaling or {}
        kind = sc.get("rope_type", sc.get("type", "default")) if isinstance(sc, dict) else None
        if kind not in ROPE_SCALINGS:
            raise UserError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_SCALINGS)})")
        for key in ROPE_SCALINGS[kind]:
            v = sc.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise UserError(f"invalid model config: rope_scaling {kind} needs a positive {key} (got {v!r})")
        if self.bos_id is not None:
            check_token_id("invalid model config: bos token id", self.bos_id, self.vocab_size)
        if not isinstance(self.eos_ids, list):
            raise UserError(f"invalid model config: eos_ids must be a list of token ids (got {self.eos_ids!r})")
        for eos in self.eos_ids:     # an id past the vocabulary never stops generation; a negative one crashed
            check_token_id("invalid model config: eos token id", eos, self.vocab_size)

    def window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within (None: every earlier position)."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def exact_gate(self) -> bool:
        """A gated model with no zeros of its own (SwiGLU, GeGLU): converted with the split layout, its FFN runs the
        exact gate (ffn.gate) at every budget; a ReLU-family model keeps full bundles for a predictor."""
        return self.glu and self.act in EXACT_GATE_ACTS

    @property
    def default_ctx(self) -> int:
        """The context when -c is not given: the model's, at most DEFAULT_MAX_CTX (the KV cache is preallocated)."""
        return min(self.max_pos, DEFAULT_MAX_CTX)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UserError(f"unknown model config fields: {', '.join(sorted(unknown))}")
        return cls(**d)
