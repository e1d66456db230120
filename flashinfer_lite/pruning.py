"""LazyLLM's prompt pruning (Fu et al. 2024, "LazyLLM: Dynamic Token Pruning for Efficient Long Context LLM
Inference"): the prompt tokens the last prompt token attends to least are not computed by the later layers.

A pruned prompt runs its layers in stages (PRUNING_STAGES); each stage's layers compute only the tokens kept at its
start. At the start of a stage the last prompt token's attention probabilities at the layer before (softmax over that
layer's keys, averaged over the query heads) rank the tokens still computed; the lowest go, so that the share of the
prompt pruned reaches the stage's share of RATIO. The last prompt token is never pruned: its hidden state gives the
logits. Within a stage the kept tokens run through the stage's layers in chunks of PREFILL_CHUNK_ROWS, as
Transformer.forward_rows runs a prompt (so the first stage's bits are an unpruned run's).

The KV cache: a layer holds keys and values of the tokens it computed only, one after the other, keys rotated at their
own positions (RoPE), so a later token's attention at that layer sees the kept tokens where they were. A pruned token
is gone from the later layers for good: this keeps no auxiliary cache to revive it (LazyLLM's Aux Cache). A position
after a pruned prompt sits at slot position - kv.pruned[layer] of a layer; a cache cut inside a pruned prompt forgets
all of it (KVCache.reusable).
"""
from __future__ import annotations

import numpy as np

from storage.errors import UserError
from . import model as model_math      # model.py calls pruned_prefill: its names are read when called, not imported
from .kernels.gemv import widen_rows
from .kv_pages import KVCache

# (where a stage starts, as a share of the layers; the share of RATIO pruned from then on): a third of RATIO's tokens
# at a quarter of the depth, two thirds at half, RATIO over the last quarter of the layers. The layers compute about
# 1 - RATIO / 2 of a prompt's token-layers.
PRUNING_STAGES = ((0.25, 1 / 3), (0.5, 2 / 3), (0.75, 1.0))


def stages(n_layers: int, ratio: float, T: int) -> list[tuple[int, int]]:
    """(first layer, tokens kept from it on) of each stage after the first, of a prompt of T tokens: at least the last
    token, each stage at most as many as the one before."""
    out, kept = [], T
    for at, share in PRUNING_STAGES:
        layer = min(max(round(at * n_layers), 1), n_layers - 1)     # a model of few layers: fewer stages
        kept = min(kept, max(1, T - round(T * ratio * share)))
        if layer < 1:                   # one layer: no stage
            continue
        if out and out[-1][0] == layer:
            out[-1] = (layer, kept)
        else:
            out.append((layer, kept))
    return out


def last_token_weights(model, layer: int, x_last: np.ndarray, kv: KVCache, slot0: int, n: int,
                       rope_last: tuple | None) -> np.ndarray:
    """The last prompt token's attention probabilities at `layer` over the layer's n slots slot0.. (its input x_last
    [1, d]; the layer's keys in kv up to and including its own), averaged over the query heads -> [n] (float64)."""
    block, cfg = model.blocks[layer], model.cfg
    attn = block.attn
    q = attn.qkv(model_math.norm(cfg, x_last, block.attn_norm) if cfg.pre_norm else x_last)[0]      # [1, H, hd]
    if rope_last is not None:
        q = model_math.apply_rope(q, *rope_last)
    S, Hkv, g = slot0 + n, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    q64 = q[0].astype(np.float64).reshape(Hkv, g, -1)                                   # [Hkv, g, hd]
    scores = np.empty((Hkv, g, S))
    for lo in range(0, S, model_math.ATTENTION_KEY_BLOCK):     # a block of keys at a time, as a prompt's attention
        hi = min(S, lo + model_math.ATTENTION_KEY_BLOCK)
        keys, _ = kv.rows(attn.slot, lo, hi)                                             # [hi - lo, Hkv, hd]
        if keys.dtype != np.float32:        # float16 bits, widened by the F16C loop
            wide = np.empty(keys.shape, np.float32)
            widen_rows(keys.reshape(hi - lo, -1), 0, wide.reshape(hi - lo, -1))
            keys = wide
        scores[:, :, lo:hi] = np.einsum("kgd,skd->kgs", q64, keys.astype(np.float64))
    scores = scores.reshape(cfg.n_heads, S)
    scores *= float(attn.scale)
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return p[:, slot0:].mean(axis=0)


def kept_rows(weights: np.ndarray, n_keep: int) -> np.ndarray:
    """Of the tokens still computed (weights [n], the last prompt token's last), the rows of the n_keep kept, in order:
    the last one, and the n_keep - 1 others of the largest weights (ties to the earlier token)."""
    order = np.argsort(-weights[:-1], kind="stable")[:n_keep - 1]
    return np.append(np.sort(order), len(weights) - 1)


def pruned_prefill(model, tokens: np.ndarray, kv: KVCache, ratio: float) -> np.ndarray:
    """Every layer over tokens [T] at positions kv.length.., pruning as the module says; appends them to the cache
    (kv.pruned counts each layer's pruned tokens) and returns the last token's last hidden state [1, d]."""
    cfg, T, pos0 = model.cfg, len(tokens), kv.length
    L = cfg.n_layers
    if any(cfg.window(i) is not None for i in range(L)):
        raise UserError("--prompt-pruning: not for a model with sliding-window layers (a window counts positions, "
                        "a pruned layer's cache holds fewer)")
    x = model_math.embed_tokens(cfg, model.embed, model.pos_embed, tokens, pos0)            # [T, d]
    tables = {id(f): model_math.rope_tables(f, pos0, T) for f in model.inv_freq}
    rows = np.arange(T)                               # the tokens still computed (their index in the prompt)
    base = pos0 - kv.pruned                           # each layer's slot of the prompt's first token
    plan = stages(L, ratio, T)
    starts = [0] + [layer for layer, _ in plan]
    ends = starts[1:] + [L]
    x_last = None                                     # the last token's input to the stage's last layer
    for s, (a, b) in enumerate(zip(starts, ends)):
        if s > 0:
            prev = a - 1
            table = tables[id(model.inv_freq[prev])]
            w = last_token_weights(model, prev, x_last, kv, int(base[prev]), len(rows),
                                   None if table is None else (table[0][-1:], table[1][-1:]))
            keep = kept_rows(w, plan[s - 1][1])
            x, rows = x[keep], rows[keep]
        if s == len(starts) - 1:
            model.prime_head()
        step = model_math.PREFILL_CHUNK_ROWS
        for c0 in range(0, len(rows), step):
            chunk, xc = rows[c0:c0 + step], x[c0:c0 + step]
            for i in range(a, b):
                if i == b - 1 and c0 + len(chunk) == len(rows):
                    x_last = xc[-1:].copy()
                table = tables[id(model.inv_freq[i])]
                rope = None if table is None else (table[0][chunk], table[1][chunk])
                xc = model.block(i, xc, kv, int(base[i]) + c0, rope)
                if model.after_layer is not None:
                    model.after_layer()
            x[c0:c0 + step] = xc
        kv.pruned[a:b] += T - len(rows)
    kv.length = kv.pruned_end = pos0 + T
    return x[-1:]
