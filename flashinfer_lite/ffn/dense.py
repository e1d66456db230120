"""The dense FFNs, every weight in DRAM: FeedForward (one layer's, also one expert's) and MixtureOfExperts (a router
over experts, from DRAM or from an expert source such as ffn.experts' cache). FeedForward is the reference the sparse
FFNs are checked against; over a GGUF's matrices in blocks its decode rows are one Numba call (quant_ffn).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np

from storage.config import ModelConfig
from storage.experts import ExpertLayout

from ..kernels.blocks import SILU_LANES, QuantMatrix, linear, prompt_silu_ok, silu_coefficient_rows
from ..kernels.neurons import (QUANT_FFN_ACTS, act_code, activations, add_weighted_rows, coefficients_of_products,
                               threshold_of)
from .quant import DENSE_ROW_KERNEL_MAX_T, quant_experts, quant_ffn


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


class FeedForward:
    """Dense FFN: GLU y = a(x) Wd^T + bd with a = act(x Wg^T + bg) * (x Wu^T + bu);
    MLP y = act(x W1^T + b1) W2^T + b2."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, np.ndarray], layer: int, prefix: str | None = None):
        p = f"layers.{layer}.ffn." if prefix is None else prefix    # prefix: one expert's (MixtureOfExperts)
        self.cfg = cfg
        self.w_gate, self.b_gate = w.get(p + "gate.weight"), w.get(p + "gate.bias")
        self.w_up, self.b_up = w[p + "up.weight"], w.get(p + "up.bias")
        self.w_down, self.b_down = w.get(p + "down.weight"), w.get(p + "down.bias")  # absent: activations only
        # matrices in blocks (a GGUF's) and no gate/up bias: a decode step's FFN is one Numba call (quant_ffn)
        mats = (self.w_up, self.w_down) + ((self.w_gate,) if cfg.glu else ())
        self.fused = (all(isinstance(m, QuantMatrix) for m in mats) and self.b_gate is None and self.b_up is None
                      and cfg.act in QUANT_FFN_ACTS)

    def activations(self, x: np.ndarray) -> np.ndarray:
        # x [T, d] -> a [T, n]; what a sparse FFN predicts and skips where it is zero
        c = self.cfg
        t = threshold_of(c.act, c.relu_threshold)
        g, u = linear(x, self.w_gate, self.b_gate) if c.glu else None, linear(x, self.w_up, self.b_up)
        if (c.glu and c.act == "silu" and x.shape[0] > DENSE_ROW_KERNEL_MAX_T and u.shape[1] % SILU_LANES == 0
                and u.dtype == np.float32 and u.flags.c_contiguous and prompt_silu_ok(silu_reference)):
            silu_coefficient_rows(np.ascontiguousarray(g, np.float32), u)   # a prompt's: 8 at a time, the same bits
            return u
        return activations(c.act, g, u, t)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] <= DENSE_ROW_KERNEL_MAX_T and self.fused:
            y = quant_ffn(x, self.w_gate, self.w_up, self.w_down, self.cfg.act, self.cfg.relu_threshold)
            return y if self.b_down is None else y + self.b_down
        return linear(self.activations(x), self.w_down, self.b_down)

def silu_reference(g: np.ndarray, u: np.ndarray) -> None:
    """u[:] = the SiLU GLU coefficients of g and u by the decode path's scalar kernel (what blocks.prompt_silu_ok checks
    the prompt's kernel against)."""
    coefficients_of_products(g, u, np.zeros((g.shape[1], 0), np.float32), True, act_code("silu"),
                             threshold_of("silu", None), -1, -1)


def route(cfg: ModelConfig, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The router's choice, as transformers computes it: softmax over the experts' logits [T, E] (float32), the
    n_experts_used most probable (ties: the lower expert id), their probabilities renormalised to sum to 1 when
    norm_topk_prob (Mixtral's softmax of the top-k logits is the same numbers). -> (ids, weights) [T, k]."""
    p = softmax(logits.astype(np.float32), axis=-1)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :cfg.n_experts_used]
    weights = np.take_along_axis(p, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids, weights

@dataclass
class ExpertBatch:
    """Experts in DRAM at once, as an ExpertSource hands them over: ids, and expert(e) the FeedForward of each. With
    a stack (uint8 [rows, layout.chunk]: storage.experts' chunks, every matrix in a block format; expert ids[i] in row
    slots[i]), their decode rows compute in one kernel call (ffn.quant.quant_experts). With run, run(ids, xs) computes
    them all at once instead (split chunks: ffn.experts, their column reads in flight together)."""
    ids: list[int]
    expert: Callable[[int], FeedForward]
    stack: np.ndarray | None = None
    slots: list[int] | None = None
    layout: ExpertLayout | None = None
    run: Callable[[list[int], list[np.ndarray]], list[np.ndarray]] | None = None

ExpertSource = Callable[[int, np.ndarray], Iterable[ExpertBatch]]  # (layer, ids) -> batches covering every id

class MixtureOfExperts:
    """A mixture-of-experts FFN: y = sum over the k experts the router picks of weight_e * expert_e(x) (each expert a
    GLU FeedForward), plus Qwen2-MoE's shared expert scaled by sigmoid(x . w_shared_gate).

    experts(layer, ids) yields ExpertBatch-es covering `ids`, in any order: one of the weights in DRAM by default;
    the flash runtime's expert cache (ffn.experts) first those it holds, then the rest as their reads land. A batch is
    computed as it arrives: an expert with at most DENSE_ROW_KERNEL_MAX_T rows (a decode step) by quant_ffn's row
    kernel, all of a stacked batch's such rows in one call; an expert with more rows (a prompt) by its FeedForward,
    whose matrix products read it once for all of them. The experts' outputs are summed afterwards, per row in
    ascending expert id: one summation order (transformers' too) whatever arrived first and whatever shared a
    call, so the bits do not depend on the cache."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, np.ndarray], layer: int, experts: ExpertSource | None = None):
        p = f"layers.{layer}.ffn."
        self.cfg, self.layer = cfg, layer
        self.router = w[p + "router.weight"]                                        # [E, d]
        self.shared = FeedForward(cfg, w, layer, p + "shared.") if cfg.shared_expert_dim else None
        self.shared_gate = w.get(p + "shared_gate.weight")                          # [1, d]
        self.experts = experts or (lambda layer, ids: [ExpertBatch(
            [int(e) for e in ids], lambda e: FeedForward(cfg, w, layer, f"{p}experts.{e}."))])
        self.routed = np.zeros(cfg.n_experts, np.int64)     # tokens routed to each expert so far (calibration counts)

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return route(self.cfg, linear(x, self.router))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids, weights = self.route(x)                                                # [T, k] each
        self.routed += np.bincount(ids.ravel(), minlength=len(self.routed))
        # every (row, expert) pair, by expert id then row: pair q's output is O[q]
        row = np.repeat(np.arange(x.shape[0]), ids.shape[1])
        order = np.lexsort((row, ids.ravel()))
        pair_e, pair_t = ids.ravel()[order], row[order]
        pair_w = np.ascontiguousarray(weights.ravel()[order], dtype=np.float32)
        experts, first, count = np.unique(pair_e, return_index=True, return_counts=True)
        pairs = {int(e): slice(a, a + c) for e, a, c in zip(experts, first, count)}         # expert -> its pairs
        O = np.empty((len(order), x.shape[1]), np.float32)
        for batch in self.experts(self.layer, experts):
            if batch.run is not None:
                for e, out in zip(batch.ids, batch.run(batch.ids, [x[pair_t[pairs[e]]] for e in batch.ids])):
                    O[pairs[e]] = out
                continue
            rows, slots, dest = [], [], []
            for i, e in enumerate(batch.ids):
                q = pairs[e]
                if batch.stack is not None and q.stop - q.start <= DENSE_ROW_KERNEL_MAX_T:
                    rows += pair_t[q].tolist()
                    slots += [batch.slots[i]] * (q.stop - q.start)
                    dest += range(q.start, q.stop)
                else:
                    O[q] = batch.expert(e)(x[pair_t[q]])
            if rows:
                quant_experts(batch.stack, batch.layout, x, rows, slots, dest, O, self.cfg.act,
                              self.cfg.relu_threshold)
        y = np.zeros(x.shape, np.float32)
        add_weighted_rows(y, O, pair_t, pair_w)                                     # a row picks e at most once
        if self.shared is not None:
            gate = 1.0 / (1.0 + np.exp(-linear(x, self.shared_gate)))                # [T, 1]
            y += gate.astype(np.float32) * self.shared(x)
        return y
