"""The model math, in numpy: one config, functions named after the math, shapes in comments.

Compute is float32 whatever the weights were stored in. Shapes: T tokens in flight, S positions in the KV cache,
d = dim, H = heads, Hkv = KV heads, hd = head_dim, n = ffn_dim, V = vocab.
The FFN is a pluggable callable so that the sparse flash runtime can replace the dense one layer by layer.
The last section reads a model's tensors as the runtime keeps them (load_weights) and the float32 reference model.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
from tqdm import tqdm

from storage.config import ModelConfig
from storage.checkpoint import Checkpoint, GGUFCheckpoint, drop_mapped_pages, open_checkpoint
from storage.errors import UserError
from storage.format import FlashCheckpoint, is_flashdir
from storage.half import half_matrix
from storage.tokenizer import Tokenizer
from .ffn.dense import FeedForward, MixtureOfExperts
from .kernels.attention import add_tile, head_rows, softmax_tile
from .kernels.blocks import QuantMatrix, linear
from .kernels.norm import add_rms_norm_rows, rms_norm_rows
from .kv_pages import PAGE_POSITIONS, KVCache, KVOptions
from . import pruning
from .threads import numba_threads


# ----------------------------------------------------------------------------------------------------------------------
# Building blocks

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x [T, d] -> [T, d]
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * w


def add_norm(cfg: ModelConfig, h: np.ndarray, delta: np.ndarray, wb: tuple) -> np.ndarray:
    """h += delta (in place: the residual add), then the model's norm of h. RMSNorm: one Numba pass over h."""
    w, b = wb
    if cfg.norm != "rms":
        h += delta
        return norm(cfg, h, wb)
    out = np.empty_like(h)
    add_rms_norm_rows(h, delta, w, cfg.norm_eps, out)
    return out


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    return xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps) * w + b


def rope_inv_freq(cfg: ModelConfig, sliding: bool = False) -> np.ndarray:
    """Inverse frequencies [hd/2] of rotary embeddings, with the scalings that change them. sliding: for the layers
    with a sliding window, which have their own base and no scaling when the config gives one (Gemma 3)."""
    hd = cfg.head_dim
    own_base = sliding and cfg.rope_theta_sliding is not None
    base = cfg.rope_theta_sliding if own_base else cfg.rope_theta
    inv = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    sc = {} if own_base else cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    raise UserError(f"unsupported rope_scaling type '{kind}' (supported: default, linear, llama3)")


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x [T, H, hd]; cos, sin [T, 1, hd/2]. Half-split pairing (HF "rotate_half"), the layout HF checkpoints use.
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def layer_ropes(cfg: ModelConfig) -> list[np.ndarray | None]:
    """Each layer's RoPE inverse frequencies [hd/2] (None: no rotary embeddings, OPT); layers with a sliding window
    share one array, the others another."""
    if cfg.pos_offset is not None:
        return [None] * cfg.n_layers
    inv = {s: rope_inv_freq(cfg, s) for s in (False, True)}
    return [inv[cfg.window(i) is not None] for i in range(cfg.n_layers)]


def rope_tables(inv_freq: np.ndarray | None, pos0: int, T: int) -> tuple | None:
    """(cos, sin) [T, 1, hd/2] for positions pos0..pos0+T-1; None for a model without rotary embeddings."""
    if inv_freq is None:
        return None
    ang = np.arange(pos0, pos0 + T, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]
    return np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]


def norm(cfg: ModelConfig, x: np.ndarray, wb: tuple) -> np.ndarray:
    """The model's norm (RMSNorm or LayerNorm) with weight and bias wb = (w, b)."""
    w, b = wb
    if cfg.norm == "rms":
        out = np.empty(x.shape, np.float32)
        rms_norm_rows(np.ascontiguousarray(x, np.float32), w, cfg.norm_eps, out)
        return out
    return layer_norm(x, w, b, cfg.norm_eps)


# ----------------------------------------------------------------------------------------------------------------------
# Resident weights in float16: half the DRAM, and half the bytes each decoded token streams through linear()

def half_matrices(weights: dict) -> dict:
    """Every matrix of `weights` (attention, embeddings, lm_head; a dense FFN's too if present) as float16, in place.

    One tensor at a time: each float32 array is released as its float16 copy replaces it (unless the caller holds
    another reference), so the transient is one tensor, not a second model."""
    for name in list(weights):
        weights[name] = half_matrix(weights[name])
    return weights


# ----------------------------------------------------------------------------------------------------------------------
# Attention and feed-forward

# Up to this many new tokens (decode), attention runs in Numba calls over its pages (kv_pages.KVCache.attend); more
# (a prompt, a chat turn) as batched numpy matrix products, where BLAS reads each key once for all query rows.
# SmolLM2's shapes, per layer, measured with the one-call kernel these replaced: T = 1 at 200 cached positions 37 vs
# 54 us, T = 4 122 vs 92 us (kernel vs numpy; at 1000 positions the crossover is T = 2-3).
ATTENTION_KERNEL_MAX_T = 2

class Attention:
    def __init__(self, cfg: ModelConfig, w: Mapping[str, np.ndarray], layer: int, kv_slot: int | None = None):
        p = f"layers.{layer}.attn."
        self.cfg, self.layer = cfg, layer
        self.slot = layer if kv_slot is None else kv_slot    # this layer's row in the KV cache
        self.window = cfg.window(layer)
        self.scale = np.float32(1.0 / math.sqrt(cfg.head_dim) if cfg.query_scale is None else cfg.query_scale)
        self.wq, self.wk, self.wv, self.wo = (w[p + n + ".weight"] for n in "qkvo")
        self.bq, self.bk, self.bv, self.bo = (w.get(p + n + ".bias") for n in "qkvo")
        self.q_norm, self.k_norm = w.get(p + "q_norm.weight"), w.get(p + "k_norm.weight")   # qk_norm: Qwen3, Gemma 3, OLMoE
        # q, k and v as one matrix when they share a storage type: one GEMV reads x once, one kernel call instead of
        # three (per layer per token, the call overhead is a fair share of a small model's attention)
        self.wqkv = stacked_rows(self.wq, self.wk, self.wv)
        if self.wqkv is not None:
            self.wq, self.wk, self.wv = row_views(self.wqkv, [self.wq.shape[0], self.wk.shape[0]])
            if isinstance(w, dict):   # the same values as views, so the separate copies go now: one layer's extra
                w.update({p + n + ".weight": m for n, m in zip("qkv", (self.wq, self.wk, self.wv))})

    def __call__(self, x: np.ndarray, kv: KVCache, pos0: int, rope: tuple | None) -> np.ndarray:
        cfg, T = self.cfg, x.shape[0]
        q, k, v = self.qkv(x)
        if T <= ATTENTION_KERNEL_MAX_T:
            out = np.empty((T, cfg.n_heads, cfg.head_dim), np.float32)
            self.decode_attend(q, k, v, kv, pos0, rope, out)
            return linear(out.reshape(T, -1), self.wo, self.bo)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        kv.write(self.slot, pos0, k, v)                        # rounded to float16 (or q8_0) as kv.attend does
        out = prompt_attention(q, kv, self.slot, pos0, self.window, self.scale)
        return linear(out.reshape(T, -1), self.wo, self.bo)

    def rows(self, x: np.ndarray, seqs: list[tuple]) -> np.ndarray:
        """A decode step of B sequences (Transformer.forward_batch): x [B, d], row b the token of seqs[b] = (its
        KVCache, its position, its rope tables). The projections run once over the B rows, attention per sequence
        against its own cache, as a one-token step does. -> [B, d]"""
        cfg, B = self.cfg, x.shape[0]
        q, k, v = self.qkv(x)
        out = np.empty((B, cfg.n_heads, cfg.head_dim), np.float32)
        for b, (kv, pos, rope) in enumerate(seqs):
            self.decode_attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], kv, pos, rope, out[b:b + 1])
        return linear(out.reshape(B, -1), self.wo, self.bo)

    def decode_attend(self, q, k, v, kv: KVCache, pos0: int, rope: tuple | None, out: np.ndarray) -> None:
        """out [T, H, hd] = attention of a few new tokens (T <= ATTENTION_KERNEL_MAX_T) over kv, in its Numba calls."""
        T = q.shape[0]
        no_rope = np.zeros((T, 0), np.float32)             # cos/sin [T, 0]: kv.attend rotates nothing
        cos, sin = (rope[0][:, 0], rope[1][:, 0]) if rope is not None else (no_rope, no_rope)
        kv.attend(self.slot, q, k, v, np.ascontiguousarray(cos), np.ascontiguousarray(sin), pos0,
                  self.window or 0, self.scale, out)

    def qkv(self, x: np.ndarray) -> tuple:
        """The queries [T, H, hd], keys and values [T, Hkv, hd] of x [T, d] (biases added, qk_norm applied), before
        RoPE: kv.attend rotates a few tokens' own, prompt chunks rotate theirs in __call__."""
        cfg, T = self.cfg, x.shape[0]
        H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if self.wqkv is not None:
            qkv = linear(x, self.wqkv)
            cut = (0, H * hd, (H + Hkv) * hd, qkv.shape[1])    # slices, not np.split: ~10 us less per layer
            q, k, v = (np.ascontiguousarray(qkv[:, a:b]) for a, b in zip(cut, cut[1:]))
            q, k, v = (a if b is None else a + b for a, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
            q, k, v = q.reshape(T, H, hd), k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd)
        else:
            q = linear(x, self.wq, self.bq).reshape(T, H, hd)
            k = linear(x, self.wk, self.bk).reshape(T, Hkv, hd)
            v = linear(x, self.wv, self.bv).reshape(T, Hkv, hd)
        if self.q_norm is not None:
            q, k = self.qk_normed(q, self.q_norm), self.qk_normed(k, self.k_norm)
        return q, k, v

    def qk_normed(self, a: np.ndarray, w: np.ndarray) -> np.ndarray:
        """RMSNorm of queries or keys [T, heads, hd] before RoPE: over each head (Qwen3) or all heads at once (OLMoE)."""
        rows = a.reshape(-1, a.shape[-1]) if self.cfg.qk_norm == "head" else a.reshape(a.shape[0], -1)
        return norm(self.cfg, rows, (w, None)).reshape(a.shape)


# A prompt's attention computes this many query rows of one KV head at a time: its scores are [g x rows, keys], not
# [H, T, S] for the whole prompt (at 3670 tokens that was 485 MiB per array), so the DRAM budget counts them
# (budget.prefill_transient_bytes).
ATTENTION_TILE_ROWS = 64
# ... over the keys and values of this many positions at a time (whole pages at fixed positions, wherever each page
# lives: DRAM or flash changes no bit), an online softmax across them: the temporaries are a block's and a tile's
# whatever the context, and a long prompt never holds a layer's whole KV in DRAM.
ATTENTION_KEY_BLOCK = 16 * PAGE_POSITIONS


def prompt_attention(q: np.ndarray, kv: KVCache, slot: int, pos0: int, sliding_window: int | None,
                     scale: np.float32) -> np.ndarray:
    """Causal attention of q [T, H, hd] (positions pos0..) over the cache's keys and values of layer `slot`
    (positions 0..pos0 + T - 1, this chunk's included), scores q.k times scale -> [T, H, hd]. Per block of
    ATTENTION_KEY_BLOCK positions, per KV head, ATTENTION_TILE_ROWS query rows at a time: the g query heads of a KV
    head stacked as rows, so that one BLAS product reads each key once for all of them; each row's running max m,
    sum l and weighted values acc are rescaled by exp(m_old - m_new) as a block raises its max (flash attention),
    its softmax in one Numba pass per tile (kernels.attention.softmax_tile)."""
    T, H, hd = q.shape
    Hkv = kv.Hkv
    g = H // Hkv
    S = pos0 + T
    acc = np.zeros((Hkv, g, T, hd), np.float32)
    m = np.full((Hkv, g, T), -np.inf, np.float32)
    total = np.zeros((Hkv, g, T), np.float32)
    # scratch per thread, for every call: a flash runtime gives each array over 128 KiB a mapping of its own
    # (process.keep_freed_arrays_out_of_rss), whose pages fault in anew each time (+50% on this function's time)
    B, tile = min(ATTENTION_KEY_BLOCK, S), min(ATTENTION_TILE_ROWS, T)
    rooms = [np.empty(2 * B * hd + g * tile * (B + 2 * hd), np.float32) for _ in range(attention_workers(Hkv))]
    start = 0 if sliding_window is None else max(0, pos0 - sliding_window + 1)
    window = sliding_window or 0
    for b0 in range(start - start % ATTENTION_KEY_BLOCK, S, ATTENTION_KEY_BLOCK):
        b1 = min(b0 + ATTENTION_KEY_BLOCK, S)
        K, V = kv.rows(slot, b0, b1)                                          # [b1 - b0, Hkv, hd]

        def heads(first_head: int, room: np.ndarray) -> None:
            """The block for KV heads first_head, first_head + len(rooms), ... (each head's rows its own)."""
            nk = b1 - b0
            Kh, Vh = room[:nk * hd].reshape(nk, hd), room[nk * hd:2 * nk * hd].reshape(nk, hd)
            rest = room[2 * nk * hd:]
            for c in range(first_head, Hkv, len(rooms)):
                head_rows(K, c, Kh)
                head_rows(V, c, Vh)
                for t0 in range(0, T, ATTENTION_TILE_ROWS):
                    rows = min(ATTENTION_TILE_ROWS, T - t0)
                    first, last = pos0 + t0, pos0 + t0 + rows - 1                 # the tile's positions
                    e = min(b1, last + 1)                                          # keys past `last` no row sees
                    if e <= b0 or (sliding_window is not None and b1 <= first - sliding_window + 1):
                        continue
                    n, M = e - b0, g * rows
                    qt = np.ascontiguousarray(q[t0:t0 + rows, c * g:(c + 1) * g].transpose(1, 0, 2)).reshape(M, hd)
                    P = np.matmul(qt, Kh[:n].T, out=rest[:M * n].reshape(M, n))
                    softmax_tile(P, c, t0, rows, pos0, b0, window, scale, m, total, acc)
                    add_tile(np.matmul(P, Vh[:n], out=rest[M * n:M * (n + hd)].reshape(M, hd)), c, t0, rows, acc)
        if len(rooms) == 1:
            heads(0, rooms[0])
        else:   # numpy and the kernels let go of the GIL: the KV heads' work on as many cores
            list(_attention_pool(len(rooms)).map(heads, range(len(rooms)), rooms))
    acc /= total[..., None]
    return acc.reshape(H, T, hd).transpose(1, 0, 2)


# A prompt's attention runs its KV heads on up to this many threads (each head's arithmetic its own: the same bits);
# budget.prefill_transient_bytes counts a tile's scores once per thread.
ATTENTION_HEAD_WORKERS = 2
_POOLS: dict[int, ThreadPoolExecutor] = {}


def attention_workers(kv_heads: int) -> int:
    """Threads prompt_attention runs kv_heads heads on: Numba's thread count (-t), at most ATTENTION_HEAD_WORKERS."""
    return max(1, min(kv_heads, numba_threads(), ATTENTION_HEAD_WORKERS))


def _attention_pool(workers: int) -> ThreadPoolExecutor:
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, "attention")
    return _POOLS[workers]


def stacked_rows(*ms):
    """The matrices' rows one after the other, as one matrix of their type (float arrays of one dtype, or QuantMatrix
    of one kind and width); None when they differ. A matrix that was a view of a mapped file (a GGUF's) leaves its
    pages to the copy: the stack costs no DRAM beyond the file's (drop_mapped_pages)."""
    if all(isinstance(m, QuantMatrix) for m in ms) and len({(m.kind, m.cols) for m in ms}) == 1:
        out = QuantMatrix(np.concatenate([m.q for m in ms]), ms[0].kind, ms[0].cols)
    elif all(isinstance(m, np.ndarray) and m.ndim == 2 for m in ms) and len({(m.dtype, m.shape[1]) for m in ms}) == 1:
        out = np.concatenate(ms)
    else:
        return None
    arrays = [m.q if isinstance(m, QuantMatrix) else m for m in ms]
    for a in arrays:
        drop_mapped_pages(a)
    if not any(a.flags.writeable for a in arrays):   # read-only as the others: the kernels' one Numba specialization
        (out.q if isinstance(out, QuantMatrix) else out).flags.writeable = False
    return out


def row_views(m, counts: list[int]) -> list:
    """m's rows split after each of `counts` rows: views, no copies (QuantMatrix rows of blocks stay contiguous)."""
    cuts = np.cumsum(counts).tolist()
    if isinstance(m, QuantMatrix):
        return [QuantMatrix(q, m.kind, m.cols) for q in np.split(m.q, cuts)]
    return np.split(m, cuts)


def attention_mask(pos0: int, T: int, sliding_window: int | None, first: int = 0) -> np.ndarray:
    # [T, S - first] additive mask of keys first .. S - 1: query at position pos0+i sees keys j <= pos0+i (and
    # j > pos0+i-sliding_window: Mistral).
    qpos = np.arange(pos0, pos0 + T)[:, None]
    kpos = np.arange(first, pos0 + T)[None, :]
    ok = kpos <= qpos
    if sliding_window is not None:
        ok &= kpos > qpos - sliding_window
    return np.where(ok, 0.0, -np.inf).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------------
# Transformer

# A prompt runs through the model in chunks of this many tokens (llama.cpp's micro-batch): every layer's temporaries
# (FFN rows, attention tiles, predictor scores) are a chunk's whatever the prompt's length, so the DRAM budget can
# count them (budget.prefill_transient_bytes). The chunking does not depend on the budget, so neither do the bits.
PREFILL_CHUNK_ROWS = 256

FFNFn = Callable[[int, np.ndarray], np.ndarray]  # (layer, x [T, d]) -> y [T, d]


class Block:
    """One decoder layer over the canonical weights `layers.{layer}.*`: attention and the FFN, each with its norm
    (before it, or after the residual add for post-norm models; with post_norms, also a norm of each one's output
    before its residual add). Needs only that layer's weights, so layers can also be run one at a time
    (predictors/layerwise.py); kv_slot is the layer's row in the KV cache (default: layer).
    """

    def __init__(self, cfg: ModelConfig, w: Mapping[str, np.ndarray], layer: int, kv_slot: int | None = None):
        self.cfg, self.layer = cfg, layer
        self.attn = Attention(cfg, w, layer, kv_slot)
        self.attn_norm = (w.get(f"layers.{layer}.attn_norm.weight"), w.get(f"layers.{layer}.attn_norm.bias"))
        self.ffn_norm = (w.get(f"layers.{layer}.ffn_norm.weight"), w.get(f"layers.{layer}.ffn_norm.bias"))
        self.attn_post_norm = (w.get(f"layers.{layer}.attn_post_norm.weight"), None)     # post_norms
        self.ffn_post_norm = (w.get(f"layers.{layer}.ffn_post_norm.weight"), None)

    def __call__(self, x: np.ndarray, kv: KVCache, pos0: int, rope, ffn: FFNFn) -> np.ndarray:
        return self.layer_with(x, lambda a: self.attn(a, kv, pos0, rope), ffn)

    def rows(self, x: np.ndarray, seqs: list[tuple], ffn: FFNFn) -> np.ndarray:
        """This layer over a decode step of B sequences (Transformer.forward_batch): x [B, d], row b the token of
        seqs[b] = (its KVCache, position, rope tables); attention per sequence, the FFN once over the B rows."""
        return self.layer_with(x, lambda a: self.attn.rows(a, seqs), ffn)

    def layer_with(self, x: np.ndarray, attention, ffn: FFNFn) -> np.ndarray:
        """The layer's math with `attention` (normed input [T, d] -> its attention output [T, d])."""
        cfg, i = self.cfg, self.layer
        if cfg.pre_norm:
            h, h_normed = self.attend_with(x, attention)
            self.add_ffn(h, ffn(i, h_normed))
            return h
        h = norm(cfg, x + attention(x), self.attn_norm)
        return norm(cfg, h + ffn(i, h), self.ffn_norm)

    def attend(self, x: np.ndarray, kv: KVCache, pos0: int, rope) -> tuple[np.ndarray, np.ndarray]:
        """A pre-norm layer's first half: (the residual stream after attention, the FFN's normed input)."""
        return self.attend_with(x, lambda a: self.attn(a, kv, pos0, rope))

    def attend_with(self, x: np.ndarray, attention) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg
        h = x.copy()                                           # the residual stream; the caller's x is left as is
        a = attention(norm(cfg, x, self.attn_norm))
        if cfg.post_norms:
            a = norm(cfg, a, self.attn_post_norm)
        return h, add_norm(cfg, h, a, self.ffn_norm)

    def add_ffn(self, h: np.ndarray, f: np.ndarray) -> None:
        """A pre-norm layer's second half: the FFN's output f added to the residual stream h, in place."""
        h += norm(self.cfg, f, self.ffn_post_norm) if self.cfg.post_norms else f


def embed_tokens(cfg: ModelConfig, embed: np.ndarray, pos_embed: np.ndarray | None, tokens: np.ndarray,
                 pos0: int) -> np.ndarray:
    """Hidden states [T, d] of tokens [T] at positions pos0..: token embeddings (times embed_scale; plus OPT's
    learned positions)."""
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise UserError(f"token id out of range for vocabulary of {cfg.vocab_size}")
    x = embed[tokens].astype(np.float32)                       # [T, d] (a QuantMatrix dequantizes just these rows)
    if cfg.embed_scale != 1.0:
        x *= np.float32(cfg.embed_scale)
    if pos_embed is not None:
        x = x + pos_embed[pos0 + cfg.pos_offset: pos0 + len(tokens) + cfg.pos_offset]
    return x


def output_logits(cfg: ModelConfig, x: np.ndarray, final_norm: tuple, lm_head: np.ndarray) -> np.ndarray:
    """Logits [T, V] of the last layer's hidden states [T, d]: the final norm (if the model has one), lm_head, and the
    soft cap (if the model has one)."""
    if final_norm[0] is not None:
        x = norm(cfg, x, final_norm)
    logits = linear(x, lm_head)
    if cfg.logit_softcap is not None:
        cap = np.float32(cfg.logit_softcap)
        logits = np.tanh(logits / cap) * cap
    return logits


class Transformer:
    """Decoder-only transformer over canonical weight names (see checkpoint.py).

    `weights` maps canonical names to float32 arrays; matrices may be float16 (half_matrices) or QuantMatrix (a
    quantized FLASHDIR's), and the embeddings and head a FlashMatrix (flash_matrix.py: left on flash, looked up by
    rows and streamed through the same product; a tied one is one matrix with both uses). `ffn` replaces the
    dense FFN (the flash runtime plugs in here); it receives the normed FFN input of a layer and returns that layer's
    FFN output.
    """

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray], ffn: FFNFn | None = None):
        self.cfg = cfg
        w = weights
        self.embed = w["embed.weight"]                                          # [V, d]
        self.pos_embed = w.get("pos_embed.weight")                              # [P, d] (OPT)
        self.lm_head = self.embed if cfg.tie_embeddings else w["lm_head.weight"]  # [V, d]
        self.norm_w, self.norm_b = w.get("norm.weight"), w.get("norm.bias")
        self.blocks = [Block(cfg, w, i) for i in range(cfg.n_layers)]
        self.dense_ffn = None
        if ffn is None:
            self.dense_ffn = [(MixtureOfExperts if cfg.moe else FeedForward)(cfg, w, i) for i in range(cfg.n_layers)]
            ffn = lambda layer, x: self.dense_ffn[layer](x)  # noqa: E731
        self.ffn = ffn
        self.after_layer: Callable[[], None] | None = None    # called after each layer (threads.StepThreads.step)
        self.inv_freq = layer_ropes(cfg)                                       # per layer: [hd/2] or None
        self.kv_options: KVOptions | None = None     # how new_cache keeps the KV (runtime: the plan's); None: defaults

    def new_cache(self, capacity: int) -> KVCache:
        """A KV cache of `capacity` positions, kept as kv_options says (the run's flags and plan)."""
        return KVCache(self.cfg, capacity, options=self.kv_options or KVOptions())

    def block(self, i: int, x: np.ndarray, kv: KVCache, pos0: int, rope: tuple | None) -> np.ndarray:
        return self.blocks[i](x, kv, pos0, rope, self.ffn)

    def forward(self, tokens, kv: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run tokens [T] at positions kv.length.. and append them to the cache. Returns logits [T, V] or [V]."""
        tokens = np.asarray(tokens, dtype=np.int64)
        T, pos0 = len(tokens), kv.length
        if T == 0:
            raise UserError("empty input: nothing to evaluate")
        if pos0 + T > kv.capacity:
            raise UserError(f"context overflow: {pos0 + T} tokens do not fit the context of {kv.capacity}")
        ratio = kv.options.prompt_pruning
        if ratio and not all_logits and T > ATTENTION_KERNEL_MAX_T:     # a prompt's, LazyLLM's (pruning.py)
            x = pruning.pruned_prefill(self, tokens, kv, ratio)
            return output_logits(self.cfg, x, (self.norm_w, self.norm_b), self.lm_head)[0]
        logits = []
        for start in range(0, T, PREFILL_CHUNK_ROWS):
            chunk = tokens[start:start + PREFILL_CHUNK_ROWS]
            head = all_logits or start + len(chunk) == T
            if head:
                self.prime_head()
            x = self.forward_rows(chunk, kv)                                     # [t, d]
            if head:
                logits.append(output_logits(self.cfg, x if all_logits else x[-1:], (self.norm_w, self.norm_b),
                                            self.lm_head))                       # [t, V]
        return np.concatenate(logits) if all_logits else logits[-1][0]

    def forward_batch(self, tokens, caches: list[KVCache]) -> np.ndarray:
        """One decode step of B sequences: token b at position caches[b].length of its own cache, appended to it.
        Returns logits [B, V]. The projections, the FFN and the head run once over the B rows (each layer's weights
        read once for the batch; a flash FFN's rows for the union of the neurons the rows need), attention per
        sequence against its own cache. Every kernel gives a row the bits it has alone (kernels.blocks' 8-bit
        activations are rounded per row; ffn.flash sums each row in bundle order), so row b is
        forward([tokens[b]], caches[b]) (tests/test_batch.py). Not float32 matrices: BLAS sums a [B, d] product in
        another order than a one-row product (stories260K dense: 7e-4 apart in logits)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(tokens) != len(caches) or not len(caches):
            raise ValueError(f"forward_batch: {len(tokens)} tokens for {len(caches)} caches")
        for kv in caches:
            if kv.length >= kv.capacity:
                raise UserError(f"context overflow: {kv.length + 1} tokens do not fit the context of {kv.capacity}")
        cfg = self.cfg
        x = np.concatenate([embed_tokens(cfg, self.embed, self.pos_embed, tokens[b:b + 1], kv.length)
                            for b, kv in enumerate(caches)])                  # [B, d]
        tables = {id(f): [rope_tables(f, kv.length, 1) for kv in caches] for f in self.inv_freq}
        self.prime_head()
        flash = hasattr(self.ffn, "decoding")       # a flash FFN: told the rows are decoded tokens, not a prompt's
        if flash:
            self.ffn.decoding = True
        try:
            for i in range(cfg.n_layers):
                ropes = tables[id(self.inv_freq[i])]
                x = self.blocks[i].rows(x, [(kv, kv.length - int(kv.pruned[i]), r) for kv, r in zip(caches, ropes)],
                                        self.ffn)
                if self.after_layer is not None:
                    self.after_layer()
        finally:
            if flash:
                self.ffn.decoding = False
        for kv in caches:
            kv.length += 1
        return output_logits(cfg, x, (self.norm_w, self.norm_b), self.lm_head)

    def prime_head(self) -> None:
        """Start reading a head streamed from flash (FlashMatrix.prime), so that its first chunks land while the
        layers run."""
        prime = getattr(self.lm_head, "prime", None)
        if prime is not None:
            prime()

    def forward_rows(self, tokens: np.ndarray, kv: KVCache) -> np.ndarray:
        """Every layer over tokens [t] (one chunk) at positions kv.length..; appends them to the cache and returns
        the last layer's hidden states [t, d]. A layer that pruned a prompt before (pruning.py) holds them at slots
        kv.pruned[layer] fewer."""
        pos0 = kv.length
        x = embed_tokens(self.cfg, self.embed, self.pos_embed, tokens, pos0)    # [t, d]
        tables = {id(f): rope_tables(f, pos0, len(tokens)) for f in self.inv_freq}   # one per distinct base
        for i in range(self.cfg.n_layers):
            x = self.block(i, x, kv, pos0 - int(kv.pruned[i]), tables[id(self.inv_freq[i])])
            if self.after_layer is not None:
                self.after_layer()
        kv.length = pos0 + len(tokens)
        return x


# ----------------------------------------------------------------------------------------------------------------------
# From a model path to its tensors: `open_any(path)`, `load_weights(ckpt)`, and `load_reference(path)`: the float32
# model every other run is checked against.

def open_any(path) -> Checkpoint:
    """A checkpoint over an HF directory, a .gguf file, or a FLASHDIR made by `flashinfer-lite convert`."""
    if is_flashdir(path):
        return FlashCheckpoint(path)
    return open_checkpoint(Path(path))


def load_tensor(ckpt: Checkpoint, name: str, convert=None, keep_blocks: bool = False):
    """A tensor as the runtime keeps it: a FLASHDIR's matrix stored in a block format stays in it (a QuantMatrix),
    anything else float32 through `convert` (e.g. half.half_matrix). A GGUF's blocks are dequantized (the float32
    reference of load_reference()) unless keep_blocks (--ffn dense: a quarter of the DRAM, and the quantized kernels);
    with keep_blocks, a FLASHDIR's FFN matrices that hold its GGUF's blocks exactly are those blocks too
    (FlashCheckpoint.ffn_blocks), so a dense pass computes the GGUF's numbers, and a GGUF's matrices are views of the
    mapped file (its float16 ones kept float16): the file's pages are the model's DRAM, as in llama.cpp."""
    flashdir = isinstance(ckpt, FlashCheckpoint)
    stored = ckpt.quantized(name) if keep_blocks or flashdir else None
    if stored is None and keep_blocks and flashdir:
        stored = ckpt.ffn_blocks(name)
    if stored is not None:
        return QuantMatrix.of(stored)
    mapped = ckpt.stored_matrix(name) if keep_blocks and isinstance(ckpt, GGUFCheckpoint) else None
    if mapped is not None:
        return mapped
    half = ckpt.stored_half(name) if flashdir and convert is half_matrix else None
    if half is not None:      # what half_matrix would keep, read as is: not widened to float32 and rounded back
        return half
    return convert(ckpt.tensor(name)) if convert else ckpt.tensor(name)


def load_weights(ckpt: Checkpoint, progress: bool = False, skip=lambda name: False, convert=None,
                 keep_blocks: bool = False) -> dict:
    """Tensors read one by one as load_tensor keeps them; `skip(name)` leaves some on flash (the sparse runtime's
    FFN); `convert` is applied to each as it is read, so no second copy of the model exists."""
    names = [n for n in ckpt.names() if not skip(n)]
    it = tqdm(names, desc="loading", unit="tensor", disable=not progress, leave=False)
    return {n: load_tensor(ckpt, n, convert, keep_blocks) for n in it}


def load_reference(path, progress: bool = False) -> tuple[Transformer, Tokenizer]:
    """The reference model: every weight in DRAM as float32 (a GGUF's dequantized), the dense FFN."""
    ckpt = open_any(path)
    tokenizer = ckpt.tokenizer()
    return Transformer(ckpt.config, load_weights(ckpt, progress)), tokenizer
