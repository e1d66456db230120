"""Run a model layer by layer over many token segments, so that `collect` and eval's dense reference work on a model
bigger than RAM.

The hidden states of every segment advance together: layer i's weights are loaded, run over every segment, and freed
before layer i+1 loads. Memory: one layer's weights, the hidden states [total tokens, d] float32 (in an unlinked
temporary file, memory-mapped, when larger than HIDDEN_IN_RAM_BYTES; $TMPDIR picks the disk), one segment's work.
A mixture of experts' layer keeps its router and shared expert in memory and loads one routed expert at a time: its
segments' attention runs first, then its FFN over up to MOE_FFN_BYTES of pairs (token, routed expert) at once, so
that each expert is loaded once per such group of segments, not once per segment.

The math is flashinfer_lite.model's (embed_tokens, Block, FeedForward, output_logits): each segment gives what
Transformer.forward gives it from an empty cache as one batch.
"""
from __future__ import annotations

import re
import sys
import tempfile
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

from storage.errors import UserError
from flashinfer_lite.model import load_tensor
from flashinfer_lite.model import Block, KVCache, embed_tokens, layer_ropes, output_logits, rope_tables
from flashinfer_lite.ffn.dense import ExpertBatch, FeedForward, MixtureOfExperts
from flashinfer_lite.kernels.blocks import linear
from flashinfer_lite.process import keep_freed_arrays_out_of_rss

HIDDEN_IN_RAM_BYTES = 256 << 20     # hidden states beyond this live in a memory-mapped temporary file

FFNHook = Callable[[int, int, np.ndarray, np.ndarray], None]   # (layer, segment, x [T, d], activations a [T, n])
ExpertHook = Callable[[int, int, np.ndarray], None]            # (layer, expert, its activations a [rows, n_expert])

MOE_FFN_BYTES = 64 << 20    # a mixture of experts' FFN runs over this many bytes of (token, expert) outputs at once

_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_tensor_names(ckpt) -> list[list[str]]:
    """Per layer, the names of its tensors (`layers.{i}.*`)."""
    out: list[list[str]] = [[] for _ in range(ckpt.config.n_layers)]
    for name in ckpt.names():
        m = _LAYER.match(name)
        if m and int(m[1]) < len(out):
            out[int(m[1])].append(name)
    return out


class LayerStream:
    """Token segments through a checkpoint (storage Checkpoint or FlashCheckpoint), one layer's weights at a time.

        with LayerStream(ckpt, segments) as s:
            s.run(hook)                    # every layer; hook(layer, segment, x, a) sees each FFN's input and a
            for k, logits in s.logits():   # then the final norm and lm_head, segment by segment
                ...

    `convert` is applied to each tensor as it loads (e.g. model.half_matrix, as the dense runtime does for a float16
    FLASHDIR); a quantized FLASHDIR's resident matrices stay in their blocks (model.load_tensor), and with
    keep_blocks a GGUF's matrices and a FLASHDIR's FFN matrices that hold its GGUF's blocks too (as load's dense
    model keeps them).
    """

    def __init__(self, ckpt, segments, convert=None, progress: bool = False, desc: str = "layers",
                 keep_blocks: bool = False):
        self.ckpt, self.cfg, self.keep_blocks = ckpt, ckpt.config, keep_blocks
        self.segments = [np.asarray(w, np.int64) for w in segments]
        if not self.segments or min(len(w) for w in self.segments) == 0:
            raise UserError("empty input: nothing to evaluate")
        self.bounds = np.concatenate([[0], np.cumsum([len(w) for w in self.segments])])   # segment k: rows b[k]:b[k+1]
        self.convert = convert or (lambda a: a)
        self.progress, self.desc = progress, desc
        self.layer_names = layer_tensor_names(ckpt)
        keep_freed_arrays_out_of_rss()    # a freed layer's arrays go back to the system, not to the heap
        shape = (int(self.bounds[-1]), self.cfg.dim)
        self._file = None
        if shape[0] * shape[1] * 4 > HIDDEN_IN_RAM_BYTES:
            self._file = tempfile.TemporaryFile(prefix="flashinfer-lite-hidden-")   # unlinked: nothing left behind
            self.hidden = np.memmap(self._file, np.float32, "w+", shape=shape)
        else:
            self.hidden = np.empty(shape, np.float32)
        self._ran = False

    def __enter__(self) -> "LayerStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.hidden = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def segment(self, k: int) -> np.ndarray:
        """Hidden states [T, d] of segment k (a view: written in place as layers run)."""
        return self.hidden[self.bounds[k]:self.bounds[k + 1]]

    def _load(self, names) -> dict[str, np.ndarray]:
        return {n: load_tensor(self.ckpt, n, self.convert, self.keep_blocks) for n in names}

    def run(self, hook: FFNHook | None = None, expert_hook: ExpertHook | None = None) -> None:
        """Embed every segment, then run every layer over every segment (the dense FFN; `hook` sees its input x and
        activations a before the down projection; in a mixture of experts, expert_hook sees each routed expert's
        activations, and expert_counts [L, E] then holds the router's choices)."""
        cfg, ckpt = self.cfg, self.ckpt
        w = self._load([n for n in ("embed.weight", "pos_embed.weight") if n in ckpt])
        for k, tokens in enumerate(self.segments):
            self.segment(k)[:] = embed_tokens(cfg, w["embed.weight"], w.get("pos_embed.weight"), tokens, 0)
        del w
        ckpt.release()
        inv_freq = layer_ropes(cfg)                 # per layer
        kv = KVCache(cfg, max(len(t) for t in self.segments), n_layers=1)
        bar = tqdm(total=cfg.n_layers * len(self.segments), desc=self.desc, unit="segment", disable=not self.progress,
                   file=sys.stderr)
        self.expert_counts = np.zeros((cfg.n_layers, cfg.n_experts), np.int64) if cfg.moe else None
        for i in range(cfg.n_layers):
            if cfg.moe:
                self._moe_layer(i, kv, inv_freq[i], expert_hook, bar)
                continue
            w = self._load(self.layer_names[i])
            block, dense = Block(cfg, w, i, kv_slot=0), FeedForward(cfg, w, i)
            del w
            for k in range(len(self.segments)):
                h = self.segment(k)
                kv.reset()
                h[:] = block(h, kv, 0, rope_tables(inv_freq[i], 0, len(h)), self._ffn(dense, hook, k))
                bar.update()
            del block, dense    # this layer's weights are gone before the next one loads
            ckpt.release()
        bar.close()
        self._ran = True

    def _moe_layer(self, i: int, kv: KVCache, inv_freq, expert_hook: ExpertHook | None, bar) -> None:
        """Layer i of a mixture of experts over every segment: attention segment by segment, the FFN over groups of
        segments (MOE_FFN_BYTES), its routed experts loaded one at a time (expert_hook sees their activations);
        the router's choices are added to expert_counts[i]."""
        cfg = self.cfg
        w = self._load([n for n in self.layer_names[i] if ".ffn.experts." not in n])
        block = Block(cfg, w, i, kv_slot=0)
        moe = MixtureOfExperts(cfg, w, i, experts=lambda layer, ids: self._experts(layer, ids, expert_hook))
        del w
        group_rows = max(1, MOE_FFN_BYTES // (cfg.n_experts_used * cfg.dim * 4))
        group, inputs = [], []
        for k in range(len(self.segments)):
            h = self.segment(k)
            kv.reset()
            h[:], x = block.attend(h, kv, 0, rope_tables(inv_freq, 0, len(h)))
            group.append(k)
            inputs.append(x)
            if k == len(self.segments) - 1 or sum(map(len, inputs)) + len(self.segments[k + 1]) > group_rows:
                y, row = moe(np.concatenate(inputs)), 0
                for g in group:
                    h = self.segment(g)
                    block.add_ffn(h, y[row:row + len(h)])
                    row += len(h)
                bar.update(len(group))
                group, inputs = [], []
        self.expert_counts[i] = moe.routed
        del block, moe
        self.ckpt.release()

    def _experts(self, layer: int, ids, hook: ExpertHook | None):
        """model.ExpertSource over the checkpoint: one expert's weights in memory at a time."""
        for e in (int(e) for e in ids):
            p = f"layers.{layer}.ffn.experts.{e}."
            ff = FeedForward(self.cfg, self._load([p + m + ".weight" for m in ("gate", "up", "down")]), layer, p)
            if hook is None:
                yield ExpertBatch([e], lambda _, ff=ff: ff)
            else:
                def seen(x, ff=ff, e=e):
                    a = ff.activations(x)
                    hook(layer, e, a)
                    return linear(a, ff.w_down, ff.b_down)
                yield ExpertBatch([e], lambda _, f=seen: f)
            del ff

    @staticmethod
    def _ffn(dense: FeedForward, hook: FFNHook | None, segment: int):
        def ffn(layer: int, x: np.ndarray) -> np.ndarray:
            a = dense.activations(x)
            if hook is not None:
                hook(layer, segment, x, a)
            return linear(a, dense.w_down, dense.b_down)
        return ffn

    def logits(self) -> Iterator[tuple[int, np.ndarray]]:
        """After run(): (segment, logits [T, V]) for each segment in order; the final norm and lm_head load now."""
        if not self._ran:
            raise RuntimeError("LayerStream.logits() before run()")
        cfg = self.cfg
        head = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
        w = self._load([n for n in ("norm.weight", "norm.bias") if n in self.ckpt] + [head])
        try:
            for k in range(len(self.segments)):
                yield k, output_logits(cfg, self.segment(k), (w.get("norm.weight"), w.get("norm.bias")), w[head])
        finally:
            del w
            self.ckpt.release()
