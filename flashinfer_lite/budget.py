"""The one DRAM budget (--dram-budget): how the bytes the process may keep are split, computed up front.

  runtime      what the process holds before the model's weights load: interpreter, numpy/numba/tokenizers,
               the compiled kernels, the tokenizer, the predictors; measured (RSS), not computed
  resident     embeddings, attention, norms, head, FFN down bias (in DRAM; matrices float16 with f16/int8 bundles,
               in blocks with q8_0/q4_0/q4_1 ones)
  kv cache     keys and values for the whole context (float16, model.KVCache)
  buffers      reader gap scratch, kernel scratch, cache bookkeeping (slot maps per neuron), the prefill
               streaming chunk, a prompt chunk's temporaries (prefill_transient_bytes), the heap the prompt's
               transient arrays leave behind
  window       per layer `window_rows` bundle rows for the sliding window (LLM in a Flash)
  hot region   pinned hottest neurons across layers (PowerInfer), filled by neuron_cache.select_hot

Minimum = runtime + resident + kv + buffers + a fixed reservation of MIN_WINDOW_ROWS rows per layer: it does not grow
with the active count, because a token's set larger than the window is computed in window-sized pieces
(ffn.flash.FlashFFN.decode_row) to the same bits (ffn.sparse.SparseFFN.accumulate); a small window only costs reads.
What the budget has beyond that pins hot neurons until the window could hold one token's expected set, then goes
to the window up to its useful maximum (the expected active count x window tokens, capped at n_neurons), sharing
with the hot region by `hot_share`; whatever one part cannot use goes to the other.
The process's peak RSS (the kernel's high-water mark, `process.peak_rss_bytes`) is what the budget is held to.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage import columns
from storage.format import BUNDLE_ALIGN, expert_parts, read_layout
from storage.profile import DEFAULT_GAP_BYTES, StreamSettings, reader_defaults, stream_defaults
from storage.reader import MAX_READ_BYTES, aligned_empty, bundle_reader, parts_span_bytes

from storage.errors import UserError
from .ffn.experts import expert_ffn, stacks
from .ffn.quant import DENSE_ROW_KERNEL_MAX_T, dense_row_bytes, sparse_ffn
from .ffn.split import SplitKernels, SplitRows
from .kernels.attention import attention_rows
from .kernels.gemv import MATMUL_ROW_KERNEL_MAX_T, WIDEN_BLOCK_BYTES, matmul_t
from .kernels.norm import add_rms_norm_rows, rms_norm_rows
from .model import (ATTENTION_TILE_ROWS, PREFILL_CHUNK_ROWS, ExpertBatch, FeedForward, KVCache, MixtureOfExperts,
                    ModelConfig)
from .neuron_cache import MAP_BYTES_PER_NEURON, NeuronCache, select_hot
from .process import cgroup_room, rss_bytes
from .quant import BLOCK, COLUMN_SCALES_F16, QuantMatrix, quant_matmul_t, quantize, row_bytes

# per window row: neuron_at int32 + ring int32 x window + miss ids/slots int64 x 2 + holes int64
ROW_OVERHEAD_BYTES = 4 + 16 + 8
# per hot row: neuron_at int32
HOT_ROW_OVERHEAD_BYTES = 4
# aligned_empty over-allocates one page per matrix
MATRIX_SLACK_BYTES = 4096
# What the allocator keeps of transient arrays (predictor scores and masks, attention, logits, the sampler's: small
# arrays come from the heap, which does not shrink back): generate's peak RSS over the rest of the plan measured
# 3.5 MiB at most after a short prompt on the 2-layer 8192-neuron model of tests/test_dram_budget.py.
HEAP_SLACK_BYTES = 4 << 20
# The window's per-layer reservation in the minimum budget. Any size gives the same output; a piece is one batched
# read and one kernel pass, so this many rows keep reads large enough to coalesce and the per-piece overhead small
# (SmolLM2: 256 of 1536 neurons, ~0.9 MiB per layer; a 7B layer of 11008: 6 MiB per layer).
MIN_WINDOW_ROWS = 256


@dataclass
class BudgetPlan:
    budget_bytes: int
    runtime_bytes: int          # measured: the process before the weights load (see measure_runtime_bytes)
    resident_bytes: int
    kv_bytes: int
    buffer_bytes: int
    window_rows: int            # per layer
    window_bytes: int           # all layers, including per-row bookkeeping
    hot_bytes: int              # all layers; select_hot fills it
    minimum_bytes: int
    n_layers: int
    stride: int
    ctx: int
    window: int
    max_active: int
    requested: bool = True      # False: no --dram-budget was given, the budget is "room for the whole model"
    ffn_bytes: int = 0          # the whole FFN resident (plan_resident_ffn): no window, no hot region
    gate_bytes: int = 0         # the exact-gate FFN's gate|up rows in DRAM (plan_gate), and its stream buffer
    gate_layers: int = 0        # of plan_gate: the layers whose gate|up rows are resident (from the first)
    floor_bytes: int = 0        # of plan_gate: its smallest budget (every layer's rows streamed); minimum_bytes is
                                # the smallest with gate_layers resident

    @property
    def hot_rows(self) -> int:
        """Total pinned neurons the hot region holds (all layers)."""
        return self.hot_bytes // (self.stride + HOT_ROW_OVERHEAD_BYTES)

    def hot_neurons(self, freqs: list[np.ndarray]) -> list[np.ndarray]:
        """Per layer the bundle ids to pin, from activation frequencies indexed by bundle id."""
        return select_hot(freqs, self.stride, self.hot_rows * self.stride)

    @property
    def used_bytes(self) -> int:
        return (self.runtime_bytes + self.resident_bytes + self.kv_bytes + self.buffer_bytes + self.window_bytes
                + self.hot_bytes + self.ffn_bytes + self.gate_bytes)

    def table(self) -> str:
        rows = [("runtime", self.runtime_bytes, "interpreter, libraries, compiled kernels, tokenizer, "
                                                "predictors (measured)"),
                ("resident dense", self.resident_bytes, "embeddings, attention, norms, head"),
                *([("resident ffn", self.ffn_bytes, "every layer's FFN weights, computed dense")] if self.ffn_bytes
                  else []),
                *([("gate|up rows", self.gate_bytes, f"{self.gate_layers} of {self.n_layers} layers resident"
                   + ("" if self.gate_layers == self.n_layers else ", the rest streamed"))]
                  if self.gate_bytes else []),
                ("kv cache", self.kv_bytes, f"{self.ctx} positions"),
                ("buffers", self.buffer_bytes, "a prompt's widened blocks, kernel scratch, heap" if self.ffn_bytes
                 else "reader scratch, kernel scratch, slot maps, prefill chunk"),
                *([] if self.ffn_bytes else [   # the FFN in RAM has no neuron cache
                    ("window", self.window_bytes, f"{self.window_rows} rows x {self.n_layers} layers, "
                                                  f"window {self.window} tokens"),
                    ("hot region", self.hot_bytes, f"{self.hot_rows} pinned neurons")]),
                ("unused", self.budget_bytes - self.used_bytes, ""),
                ("budget", self.budget_bytes, f"minimum {_mib(self.floor_bytes or self.minimum_bytes)}")]
        return budget_table(rows, self.budget_bytes)


def budget_table(rows: list[tuple[str, int, str]], budget_bytes: int) -> str:
    """A plan's split as printed: per (name, bytes, note) its MiB and share of the budget."""
    lines = [f"{'DRAM budget':<16}{'MiB':>10}{'%':>7}  note"]
    for name, b, note in rows:
        lines.append(f"{name:<16}{b / 2**20:>10.1f}{100 * b / budget_bytes:>6.1f}%  {note}")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def resident_matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """{name: (rows, cols)} of the resident matrices: embeddings, attention, lm_head."""
    d, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"embed.weight": (cfg.vocab_size, d)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    if cfg.pos_offset is not None:
        out["pos_embed.weight"] = (cfg.max_pos + cfg.pos_offset, d)
    for i in range(cfg.n_layers):
        out.update({f"layers.{i}.attn.q.weight": (q, d), f"layers.{i}.attn.k.weight": (kv, d),
                    f"layers.{i}.attn.v.weight": (kv, d), f"layers.{i}.attn.o.weight": (d, q)})
    return out


def resident_bytes_for(cfg: ModelConfig, half: bool = False, kinds: dict[str, str] | None = None) -> int:
    """Bytes of every non-FFN tensor (+ FFN down bias and norm; a mixture of experts' routers, shared experts and
    their gates) as the runtime keeps them: matrices (embeddings, attention, lm_head) in the block format `kinds`
    names for them (a quantized FLASHDIR's resident_kinds), else float16 when `half` (half.half_matrix), else float32;
    norms and biases float32."""
    kinds = kinds or {}
    matrices = sum(rows * row_bytes(cols, kinds[n]) if n in kinds else rows * cols * (2 if half else 4)
                   for n, (rows, cols) in resident_matrix_shapes(cfg).items())
    d, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    norm = d * (2 if cfg.norm == "layer" else 1)
    vectors = cfg.n_layers * (2 * norm + (q + 2 * kv) * cfg.qkv_bias + d * cfg.o_bias + d * cfg.mlp_bias)
    vectors += norm if cfg.pre_norm else 0
    if cfg.qk_norm:                 # per head (Qwen3: [hd] each) or over all heads (OLMoE: [q] and [kv])
        vectors += cfg.n_layers * (2 * cfg.head_dim if cfg.qk_norm == "head" else q + kv)
    if cfg.moe:                     # router [E, d]; shared expert gate, up [s, d], down [d, s] and its gate [1, d]
        s = cfg.shared_expert_dim or 0
        matrices += cfg.n_layers * d * (cfg.n_experts + 3 * s + (s > 0)) * (2 if half else 4)
    return matrices + 4 * vectors


def read_staging_bytes(layout, rows: int, gap_bytes: int | None = None) -> int:
    """The reader's staging buffers for a request of up to `rows` bundles of a layer (storage.reader), at most.
    Bundles in the split parts (PartsReader): each part's rows, and that part's own staging. Packed bundles (a stride
    that is not a multiple of 512): each op's span widened to 512-byte boundaries on both sides; 0 when not packed.
    The ops' spans do not overlap and lie in the layer, so they hold at most the layer plus 1 KiB an op; ops: one per
    bundle at worst, but the reader merges bundles at most gap_rows apart (its coalescing gap in rows; < 0: none), so
    runs start more than gap_rows + 1 bundles apart, and a run is split every MAX_READ_BYTES. (Every
    bundle of a request an op counted 2 MiB against 0.5 with the 56-row gap on the default model.) Streams read into
    their own buffers, unstaged (stream_transient_bytes). gap_bytes: the reader's coalescing gap (reader_gap_bytes)."""
    if not layout.bundled:
        return sum(rows * P.stride + read_staging_bytes(P, rows, gap_bytes) for P in layout.parts.values())
    if layout.stride % BUNDLE_ALIGN == 0:
        return 0
    gap_rows = (reader_gap_bytes(layout) if gap_bytes is None else gap_bytes) // layout.stride
    layer = max(layout.n_neurons) * layout.stride
    splits = layer // MAX_READ_BYTES + 1
    ops = min(rows, max(layout.n_neurons) // (max(gap_rows, -1) + 2) + 1) + splits
    return min(rows * layout.stride, layer) + 2 * BUNDLE_ALIGN * ops


def down_scale_bytes(layout) -> int:
    """DRAM of the down columns' scale tables, decoded (storage.columns.decode: resident per layer for the run), 0
    without."""
    return sum(columns.decoded_bytes(k, layout.d, n, COLUMN_SCALES_F16) for k, n in
               ((layout.down_column(i), n) for i, n in enumerate(layout.n_neurons)) if k)


def plan_budget(config, layout, dram_budget_bytes: int, ctx: int, window: int = 5, max_active: int | None = None,
                hot_share: float = 0.5, resident_bytes: int | None = None, threads: int = 2,
                gap_bytes: int | None = None, runtime_bytes: int = 0,
                stream_chunk_bytes: int = 0, stream_depth: int = 1, requested: bool = True, lookahead: bool = False,
                heap_slack_bytes: int = 0, gate: bool = False) -> BudgetPlan:
    """Split `dram_budget_bytes` (see module docstring). config: ModelConfig or its dict; layout: FlashLayout.

    max_active: the cold neurons one token is expected to need per layer (runtime.expected_max_active): sizes the
    window's useful maximum (max_active x window), not the minimum; default ffn_dim.
    resident_bytes: measured size of the resident weights, if known (else computed from the config, float32).
    runtime_bytes: the process's RSS before the weights load (measure_runtime_bytes); 0 plans the model's part only.
    stream_chunk_bytes, stream_depth: the streams' chunk and chunks in flight (storage.profile.stream_defaults); a
    chunk 0 if the caller never streams.
    heap_slack_bytes: what the process's heap keeps of transient arrays (HEAP_SLACK_BYTES for the runtime; 0 plans
    the model's part only).
    lookahead: the neuron cache keeps staging rows (staging_rows(max_active)) for reads started a layer early.
    gate: the exact gate's plan (plan_gate): a prompt chunk's rows of neurons as prefill_transient_bytes' gate.
    """
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
    if ctx < 1 or window < 1:
        raise UserError(f"context ({ctx}) and window ({window}) must be at least 1")
    n_layers, stride = layout.n_layers, layout.stride
    n_max = max(layout.n_neurons)
    max_active = n_max if max_active is None else min(int(max_active), n_max)
    if max_active < 1:
        raise UserError(f"max_active must be at least 1, got {max_active}")
    reserve = min(n_max, MIN_WINDOW_ROWS)
    row = stride + ROW_OVERHEAD_BYTES + 4 * window
    res = resident_bytes if resident_bytes is not None else resident_bytes_for(cfg)
    kv = KVCache.nbytes_for(cfg, ctx)
    buffers = (read_scratch_bytes(layout, gap_bytes) + threads * layout.d * 4 + n_max * 4
               + sum(layout.n_neurons) * (MAP_BYTES_PER_NEURON + layout.bundle_of[0].itemsize)
               + n_layers * MATRIX_SLACK_BYTES
               + stream_transient_bytes(layout, stream_chunk_bytes, stream_depth)
               + prefill_transient_bytes(cfg, ctx, gate)
               + heap_slack_bytes
               + (staging_rows(max_active) * stride if lookahead else 0)
               + read_staging_bytes(layout, n_max, gap_bytes) * (2 if lookahead else 1))
    minimum = runtime_bytes + res + kv + buffers + n_layers * reserve * row
    if dram_budget_bytes < minimum:
        raise UserError(f"DRAM budget {_mib(dram_budget_bytes)} is below the minimum {_mib(minimum)} for this model "
                        f"(runtime {_mib(runtime_bytes)}, resident {_mib(res)}, kv {_mib(kv)} for {ctx} positions, "
                        f"buffers {_mib(buffers)}, window {reserve} rows x {n_layers} layers)")
    extra = dram_budget_bytes - minimum
    win_extra_max = n_layers * max(0, min(n_max, max_active * window) - reserve) * row
    hot_row = stride + HOT_ROW_OVERHEAD_BYTES
    hot_max = sum(layout.n_neurons) * hot_row
    # A window smaller than one token's set thrashes (each piece evicts the previous ones: no row survives to the next
    # token), so until the window could hold a whole set the extra pins hot neurons, which hit every token; beyond
    # that, the two share it by hot_share.
    hot_first = min(hot_max, n_layers * max(0, min(n_max, max_active) - reserve) * row)
    first = min(extra, hot_first)
    hot = min(first + int((extra - first) * hot_share), hot_max)
    win_extra = min(extra - hot, win_extra_max)
    hot = min(extra - win_extra, hot_max)  # the window's leftover goes to the hot region
    hot -= hot % hot_row
    rows = reserve + win_extra // (n_layers * row)
    return BudgetPlan(budget_bytes=dram_budget_bytes, runtime_bytes=runtime_bytes, resident_bytes=res, kv_bytes=kv,
                      buffer_bytes=buffers, window_rows=rows, window_bytes=n_layers * rows * row, hot_bytes=hot,
                      minimum_bytes=minimum, n_layers=n_layers, stride=stride, ctx=ctx, window=window,
                      max_active=max_active, requested=requested)


def plan_gate(config, layout, dram_budget_bytes: int, ctx: int, window: int, sparsity: float,
              layers: int | None = None, parts: dict | None = None, **kw) -> BudgetPlan:
    """The exact-gate FFN's plan (ffn.gate.GateFFN): layout a FlashLayout with the split parts. Every token needs every
    layer's gate|up rows, so they come first: all layers resident when the budget holds them with the minimum
    down-row window, else as many layers as fit, from the first, and the others streamed through the buffers of a
    stream (stream_transient_bytes; what is read then is said by the runtime). The rest is plan_budget's for the
    down rows (window and hot region), with the active count of `sparsity` as its expected set. layers: plan exactly
    this many layers' rows resident (no search; 0: the plan's smallest). parts: the split parts when the layout does
    not carry them (layout.make_part, before conversion). kw: plan_budget's; the streams' settings default to the
    device's (GateFFN streams down rows at every budget below the FFN)."""
    parts = layout.parts if parts is None else parts
    gu, dn = parts["gate_up"], parts["down"]
    if not kw.get("stream_chunk_bytes"):
        kw.update(stream_args(dn))
    # a gate|up stream's buffers, and its reader's gap scratch (storage.reader.BundleReader of gate_up.bin)
    stream = (stream_transient_bytes(gu, kw["stream_chunk_bytes"], kw.get("stream_depth", 1))
              + read_scratch_bytes(gu))
    rows = [gu.region_bytes(i) for i in range(gu.n_layers)]
    resident = kw.pop("resident_bytes", 0)
    max_active = max(1, int(np.ceil((1.0 - sparsity) * max(dn.n_neurons))))

    def plan(k: int) -> BudgetPlan:
        held = sum(rows[:k]) + (stream if k < len(rows) else 0)
        p = plan_budget(config, dn, dram_budget_bytes, ctx, window, max_active=max_active,
                        resident_bytes=resident + held, gate=True, **kw)
        p.resident_bytes, p.gate_bytes, p.gate_layers = resident, held, k
        return p
    if layers is not None:
        return plan(layers)
    for k in range(len(rows), 0, -1):
        try:
            p = plan(k)
        except UserError:
            continue
        p.floor_bytes = plan(0).minimum_bytes      # what the table names: the budget could go down to it
        return p
    return plan(0)        # raises, naming the minimum, when even streaming every layer does not fit


def dense_ffn_bytes(layout) -> int:
    """DRAM of the FFN in RAM (runtime.resident_model): a quantized layout's DenseLayer rows (each layer's in its
    block formats), else its vectors as the dense FeedForward keeps them (float16 matrices, float32 for f32
    bundles)."""
    if layout.quantized:
        return sum(n * dense_row_bytes(g) for n, g in zip(layout.n_neurons, layout.geometries))
    return sum(layout.n_neurons) * (layout.n_vec * layout.d * (4 if layout.dtype == "f32" else 2)
                                    + 4 * len(layout.scalars))


def plan_resident_ffn(config, layout, dram_budget_bytes: int, ctx: int, resident_bytes: int, runtime_bytes: int = 0,
                      heap_slack_bytes: int = 0, requested: bool = True) -> BudgetPlan | None:
    """The plan of the in-RAM FFN (ffn.resident.ResidentFFN): every layer's weights in DRAM as on flash, plus the prompt's
    widened float32 blocks (gate, up, down: ffn.quant.QuantSparseFFN.dense) and the coefficients; None when that does not
    fit `dram_budget_bytes` (then the FFN runs from flash)."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
    n_max = max(layout.n_neurons)
    buffers = 3 * WIDEN_BLOCK_BYTES + 2 * n_max * 4 + prefill_transient_bytes(cfg, ctx) + heap_slack_bytes
    ffn = dense_ffn_bytes(layout)
    kv = KVCache.nbytes_for(cfg, ctx)
    need = runtime_bytes + resident_bytes + kv + buffers + ffn
    if need > dram_budget_bytes:
        return None
    return BudgetPlan(budget_bytes=dram_budget_bytes, runtime_bytes=runtime_bytes, resident_bytes=resident_bytes,
                      kv_bytes=kv, buffer_bytes=buffers, window_rows=0, window_bytes=0, hot_bytes=0,
                      minimum_bytes=need, n_layers=layout.n_layers, stride=layout.stride, ctx=ctx, window=0,
                      max_active=n_max, requested=requested, ffn_bytes=ffn)


def staging_rows(max_active: int) -> int:
    """Rows of the lookahead staging matrix: a guess larger than this is read in part (the rest on demand)."""
    return min(max_active, MIN_WINDOW_ROWS)


def prefill_transient_bytes(cfg: ModelConfig, ctx: int, gate: bool = False) -> int:
    """Peak bytes of one prompt chunk's temporaries (model.Transformer.forward runs a prompt PREFILL_CHUNK_ROWS tokens
    at a time), float32 unless said:
      rows       per token: the residual stream and its normed copies, q/k/v and their rotated copies, the attention
                 output (~8 x d + 3 x (H + 2 Hkv) x hd), the FFN's rows of neurons (predictor scores, masks,
                 coefficients or the dense FFN's activations: ~4 x n), and one product's input in 8-bit blocks
                 (quant.act8_of: both block sizes, and the prompt's BLAS copy of the rounded values: < 8 bytes a value
                 of the longer of d and n). gate: ffn.gate.GateFFN's rows of neurons are its coefficients (float32),
                 the kernel's row selection and the rows' any-mask (a byte each), and its 8-bit input is x's (d)
      attention  the layer's keys and values widened [ctx, Hkv, hd] x 2, one tile's scores [g x tile, ctx] and its
                 mask (float64 + float32 + bool: model.attention_mask) [tile, ctx]
    SmolLM2 at -c 1024, measured (tracemalloc, a 256-token chunk after 768 cached): the exact gate's chunk peaks at
    7.4 MiB (planned: 13.8), a predicted run's of a 4096-neuron model at 25.4 MiB (planned: 29.8)."""
    U = min(PREFILL_CHUNK_ROWS, ctx)
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    neurons = 6 * cfg.ffn_dim + 8 * cfg.dim if gate else 16 * cfg.ffn_dim + 8 * max(cfg.dim, cfg.ffn_dim)
    rows = U * (4 * (8 * cfg.dim + 3 * qkv) + neurons)
    g = cfg.n_heads // cfg.n_kv_heads
    tile = min(ATTENTION_TILE_ROWS, U)
    attention = 2 * ctx * cfg.n_kv_heads * cfg.head_dim * 4 + tile * ctx * (4 * g + 13)
    return rows + attention


def stream_transient_bytes(layout, chunk_bytes: int, depth: int = 1) -> int:
    """Peak bytes of a stream's buffers (storage.reader.RowStream, a layer's rows read whole: ffn.flash's prefill
    streaming, ffn.gate's down rows and gate|up rows): its chunks in flight (stream_shape), each its span widened to
    512-byte boundaries (the kernels compute on the bundles as read, nothing is widened or staged). The arrays of
    [chunk tokens, neurons] (predictor masks, coefficients) are prefill_transient_bytes'."""
    if chunk_bytes <= 0:
        return 0
    rows, depth = stream_shape(layout, chunk_bytes, depth)
    return depth * parts_span_bytes(layout, rows)


def reader_gap_bytes(layout) -> int:
    """The coalescing gap storage.reader.BundleReader uses on `layout`'s file: its device profile's, else the
    default (a layout not on disk)."""
    return reader_defaults(layout.device_path, layout.stride).gap_bytes if layout.flashdir is not None \
        else DEFAULT_GAP_BYTES


def read_scratch_bytes(layout, gap_bytes: int | None = None) -> int:
    """The reader's scratch for the gaps it reads over (BundleReader: its coalescing gap in rows, at least one row;
    PartsReader: each part's reader's). gap_bytes: the gap, if not the device profile's (reader_gap_bytes)."""
    if not layout.bundled:
        return sum(read_scratch_bytes(P, gap_bytes) for P in layout.parts.values())
    gap = reader_gap_bytes(layout) if gap_bytes is None else gap_bytes
    return max(1, gap // layout.stride) * layout.stride


def stream_settings(layout) -> StreamSettings:
    """The chunk size and depth a FLASHDIR's layers are streamed with (the device's, storage.profile.stream_defaults):
    the FFNs read with them and the DRAM plan counts their buffers (stream_args)."""
    return stream_defaults(layout.device_path if layout.flashdir is not None else None)


def stream_args(layout) -> dict:
    """plan_budget's stream arguments for `layout`: the buffers of stream_settings."""
    s = stream_settings(layout)
    return {"stream_chunk_bytes": s.chunk_bytes, "stream_depth": s.depth}


def stream_shape(layout, chunk_bytes: int, depth: int) -> tuple[int, int]:
    """(bundles a stream's chunk holds, chunks in flight) for `layout`: chunk_bytes of bundles, never more than a
    layer has, and no more chunks than a layer fills (more would hold a second layer's rows)."""
    rows = min(max(1, chunk_bytes // layout.stride), max(layout.n_neurons))
    return rows, max(1, min(int(depth), -(-max(layout.n_neurons) // rows)))


# ----------------------------------------------------------------------------------------------------------------------
# Measuring the process

AUTO_MARGIN_SHARE = 0.05            # --dram-budget auto leaves this share of the room free (and at least the floor)
AUTO_MARGIN_FLOOR = 128 << 20


def auto_budget_bytes() -> int:
    """--dram-budget auto: what this process holds now plus what the machine (and its memory cgroup, if capped) can
    still give, less a margin (AUTO_MARGIN_SHARE, at least AUTO_MARGIN_FLOOR) for everything else."""
    import psutil
    room = int(psutil.virtual_memory().available)
    capped = cgroup_room()
    if capped is not None:
        room = min(room, capped)
    total = room + rss_bytes()
    return max(0, total - max(AUTO_MARGIN_FLOOR, int(total * AUTO_MARGIN_SHARE)))


def compile_kernels(layout, steps: list[int] | None = None, source: str | None = None) -> None:
    """Run every kernel of a run once: the neuron cache, the sparse FFN on two real bundles of `layout` (and the
    dense FFN over them, for a quantized layout), attention and the norms, the resident matrices' kernels.

    Numba compiles them (or loads them from its on-disk cache) on first call, with the argument types of that call;
    these are the types the runtime uses (uint8 bundle matrix viewed as the layout's dtype, int32 rows, float32
    vectors), so their machine code is in memory now, before the weights, and not on the first token.
    steps: indices into compile_steps(layout, source) (default: all); source: as compile_steps'.
    """
    all_steps = compile_steps(layout, source)
    for i in range(len(all_steps)) if steps is None else steps:
        all_steps[i]()


def compile_steps(layout, source: str | None = None) -> list:
    """compile_kernels' work in pieces that compile_in_child can give one child process each (the compiler's memory
    grows with what one process compiles). source "gate": only what ffn.gate.GateFFN's runs use (not the bundle FFN's
    nor the in-RAM FFN's kernels: loaded, they would add 7.6 MiB to SmolLM2's runtime line); None: every kernel."""
    if layout.experts is not None:
        return [*expert_steps(layout), *resident_steps(layout)]
    k = min(2, layout.n_neurons[0])
    x = np.zeros(layout.d, np.float32)

    def bundles():
        """Two real bundles [k, stride] as the cache keeps them, and their rows (int32 like the cache's slots)."""
        B = aligned_empty((k, layout.stride), np.uint8)
        with bundle_reader(layout, threads=1) as reader:
            reader.read(0, np.arange(k), dest=B, slots=np.arange(k))
        return B, np.arange(k, dtype=np.int32)

    def neuron_cache():
        with bundle_reader(layout, threads=1) as reader:
            NeuronCache([k], layout.stride, reader, capacity=k, window=1).fetch(0, np.arange(k))

    kind = layout.down_column(0) if layout.n_layers else None       # columns: tables of the right types
    scales = [columns.zero_tables(kind, layout.d, layout.n_neurons[0])] if kind else None

    def sparse():
        B, rows = bundles()
        sparse_ffn(layout, max_active=k, down_scales=scales)(B, rows, x, np.zeros_like(x))

    def dense():                # runtime.ResidentFFN: decode rows and a prompt's widened blocks
        if kind:                # down columns: the GGUF's matrices through model.FeedForward (one kernel, any kind)
            m = lambda shape: QuantMatrix.of(("q8_0", quantize(np.zeros(shape, np.float32), "q8_0")))  # noqa: E731
            w = {"gate.weight": m((BLOCK, layout.d)), "up.weight": m((BLOCK, layout.d)),
                 "down.weight": m((layout.d, BLOCK))}
            ffn = FeedForward(ModelConfig.from_dict(layout.config), w, 0, prefix="")
            for T in (1, DENSE_ROW_KERNEL_MAX_T + 1):
                ffn(np.zeros((T, layout.d), np.float32))
            return
        B, _ = bundles()
        kernel = sparse_ffn(layout, max_active=k, down_scales=scales)
        layer = kernel.dense_layer(B)
        for T in (1, DENSE_ROW_KERNEL_MAX_T + 1):
            kernel.dense(layer, np.zeros((T, layout.d), np.float32), np.zeros((T, layout.d), np.float32))

    def gate():                 # ffn.gate.GateFFN: coefficients over gate|up rows, the down sum over down rows
        gu, dn = layout.parts["gate_up"], layout.parts["down"]
        rows = SplitRows(gu.geometry_of(0), dn.geometry_of(0), layout.config.get("act", "silu"),
                         layout.config.get("relu_threshold"), scales and scales[0], gu.quantized)   # layer 0's
        for T in (1, 2):        # a decoded token; a prompt's rows (the down sum's tiles: another kernel)
            X, coef = np.zeros((T, layout.d), np.float32), np.zeros((T, k), np.float32)
            rows.coefficients(np.zeros((k, gu.stride), np.uint8), X, coef, 0.0)
            rows.accumulate(aligned_empty((k, dn.stride), np.uint8), np.arange(k, dtype=np.int32), coef,
                            np.zeros_like(X))

    steps = [neuron_cache, *([sparse, dense] if layout.quantized else [sparse]), *([gate] if layout.parts else [])]
    if source == "gate":
        steps = [step for step in steps if step not in (sparse, dense)]
    return [*steps, *resident_steps(layout)]


def resident_steps(layout) -> list:
    """compile_steps of what every run has: attention and the norms, and the resident matrices' kernels, float16 (and,
    in a quantized FLASHDIR, the blocks' too: one compiled function serves every kind): decode (row kernel, serial
    and parallel), prefill (widened blocks), the embedding lookup."""
    d = layout.d if layout.d % BLOCK == 0 else BLOCK

    def attention():
        x, X = np.zeros(layout.d, np.float32), np.zeros((1, layout.d), np.float32)
        rms_norm_rows(X, x, 1e-5, np.empty_like(X))
        add_rms_norm_rows(X, X.copy(), x, 1e-5, np.empty_like(X))
        qkv, cache_bits = np.zeros((1, 1, 2), np.float32), np.zeros((1, 1, 2), np.uint16)
        for half in (1, 0):          # with RoPE, without (model.Attention's T <= ATTENTION_KERNEL_MAX_T path)
            cos = np.zeros((2, 1, half), np.float32)[:1, 0]
            attention_rows(qkv.copy(), qkv.copy(), qkv.copy(), cos, cos, cache_bits, cache_bits, 0, 0,
                           np.float32(1.0), np.empty_like(qkv))

    def half_matrices():
        w16 = np.zeros((2, d), np.float16)
        for T in (1, MATMUL_ROW_KERNEL_MAX_T + 1):
            matmul_t(np.zeros((T, d), np.float32), w16, parallel_min_work=0)
        matmul_t(np.zeros((1, d), np.float32), w16)

    def block_matrices():
        wq = quantize(np.zeros((2, d), np.float32), "q8_0")
        for T in (1, MATMUL_ROW_KERNEL_MAX_T + 1):
            quant_matmul_t(np.zeros((T, d), np.float32), wq, "q8_0", parallel_min_work=0)
        quant_matmul_t(np.zeros((1, d), np.float32), wq, "q8_0")
        QuantMatrix.of(("q8_0", wq))[np.zeros(1, np.int64)]

    # float32 resident matrices stay float32 (runtime.load_runtime): BLAS, no kernel
    return [attention, *([half_matrices] if layout.dtype != "f32" else []),
            *([block_matrices] if layout.quantized else [])]


def expert_steps(layout) -> list:
    """compile_steps of a mixture of experts (ffn.experts.ExpertFFN): model.MixtureOfExperts over one zeroed chunk,
    for a decoded token and a prompt's rows; split chunks through the exact gate's kernels (ffn.split.SplitKernels)."""
    E, cfg = layout.experts, ModelConfig.from_dict(layout.config)
    chunk = np.zeros((1, E.chunk), np.uint8)
    if E.split:
        parts = expert_parts(layout)
        kernels = SplitKernels(parts["gate_up"], parts["down"], cfg.act, cfg.relu_threshold)

    def gated(x):               # ExpertCache.gated's kernels: every coefficient, then the down sum of two neurons
        coef, y = np.zeros((x.shape[0], E.n), np.float32), np.zeros_like(x)
        kernels.coefficients(E.heads(chunk[0]), x, coef, 0.0, 0)
        kernels.accumulate(E.columns(chunk[0]), np.arange(2, dtype=np.int32), np.ascontiguousarray(coef[:, :2]), y, 0)
        return y

    def experts(layer, ids):
        ids = [int(e) for e in ids]
        if E.split:
            return [ExpertBatch(ids, None, run=lambda ids, xs: [gated(x) for x in xs])]
        return [ExpertBatch(ids, lambda e: expert_ffn(cfg, E, chunk[0], 0, e), chunk if stacks(cfg, E) else None,
                            [0] * len(ids), E)]

    def mixture():
        w = {"layers.0.ffn.router.weight": np.zeros((cfg.n_experts, layout.d), np.float32)}
        if cfg.shared_expert_dim:     # resident, in blocks: quant_ffn's decode row (one function serves every kind)
            shapes = {"gate": (BLOCK, layout.d), "up": (BLOCK, layout.d), "down": (layout.d, BLOCK)}
            for m, shape in shapes.items():
                w[f"layers.0.ffn.shared.{m}.weight"] = QuantMatrix.of(
                    ("q8_0", quantize(np.zeros(shape, np.float32), "q8_0"))) if layout.quantized else \
                    np.zeros(shape, np.float16)
            w["layers.0.ffn.shared_gate.weight"] = np.zeros((1, layout.d), np.float32)
        moe = MixtureOfExperts(cfg, w, 0, experts=experts)
        for T in (1, DENSE_ROW_KERNEL_MAX_T + 1):
            moe(np.zeros((T, layout.d), np.float32))

    return [mixture]


def measure_runtime_bytes(layout, source: str | None = None) -> int:
    """The plan's runtime line: RSS after compile_kernels (of the FFN source's kernels: compile_steps), measured in
    this process just before the weights load.

    Measured rather than a constant because it differs by platform, library versions and tokenizer (SmolLM2's takes
    ~43 MiB, stories260K's ~2 MiB). The kernels are compiled in a child process first (compile_in_child), so this
    process only loads their machine code from Numba's on-disk cache: compiling would leave ~80 MiB of the
    compiler's memory in this process (and in its peak) on a first run, and not on the next. In a process that
    already holds other things (a test run, a notebook) they count too: the budget is the process's.
    What loading the kernels added, and what the line added to the RSS of the early refusal (runtime_estimate_bytes),
    are kept in the compile stamp for the next run's estimate.
    """
    import gc
    if not compiled_stamp(layout).exists():
        compile_in_child(layout)
    loaded, before = compiled_stamp(layout).exists(), rss_bytes()
    compile_kernels(layout, source=source)
    gc.collect()
    rss = rss_bytes()
    if loaded:                  # only loaded from the cache (never compiled here): figures of this installation
        remember(layout, {"kernels": rss - before,
                          **({model_key(layout): rss - _early_rss} if _early_rss is not None else {})})
    return rss


# Until this installation has measured them (the compile stamp keeps what it measured): what loading the kernels from
# Numba's cache adds to RSS (45-65 MiB measured for SmolLM2 q4_1 and stories260K f16, Numba 0.6x, Linux x86-64,
# 2026-11: the lowest, as the estimate is a lower bound), and what a tokenizer takes per vocabulary entry
# (tokenizers 0.2x: SmolLM2's 49,152 entries 43 MiB, stories260K's 512 entries 2 MiB).
KERNELS_DEFAULT_BYTES = 44 << 20
TOKENIZER_BYTES_PER_TOKEN = 800
# RSS of this process when runtime_estimate_bytes last ran: the start of what measure_runtime_bytes records
_early_rss: int | None = None


def runtime_estimate_bytes(layout, vocab_size: int) -> int:
    """The runtime line a run of `layout` will measure (measure_runtime_bytes), estimated before the model is fetched,
    converted, compiled or trained: this process's RSS now plus what the line added to it when this installation
    last ran the model (kept in the compile stamp; the smallest seen), else the kernels (the stamp's figure, or
    KERNELS_DEFAULT_BYTES) and the tokenizer (TOKENIZER_BYTES_PER_TOKEN per vocabulary entry)."""
    global _early_rss
    _early_rss = rss_bytes()
    record = stamp_record(layout)
    extra = record.get(model_key(layout))
    if extra is None:
        extra = record.get("kernels", KERNELS_DEFAULT_BYTES) + TOKENIZER_BYTES_PER_TOKEN * vocab_size
    return _early_rss + extra


def model_key(layout) -> str:
    """What names a model in the stamp's record: its config and bundle kinds (a FLASHDIR and the source it was
    converted from give the same)."""
    import hashlib
    import json
    key = json.dumps([layout.config, layout.dtype, layout.down_dtype], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def stamp_record(layout) -> dict:
    """The figures compiled_stamp(layout) keeps: {"kernels": bytes, model_key: bytes}; {} when none (or unreadable)."""
    import json
    try:
        record = json.loads(compiled_stamp(layout).read_text() or "{}")
    except (OSError, ValueError, RecursionError):
        return {}
    return {k: v for k, v in record.items() if isinstance(v, int)} if isinstance(record, dict) else {}


def remember(layout, figures: dict) -> None:
    """Keep in the stamp the smaller of each figure and the one it holds (best effort: a read-only cache keeps none)."""
    import json
    import os
    old = stamp_record(layout)
    record = {**old, **{k: max(0, min(v, old.get(k, v))) for k, v in figures.items()}}
    if record == old:
        return
    path = compiled_stamp(layout)
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def compile_in_child(layout) -> None:
    """compile_kernels in a child process, which fills Numba's on-disk cache, leaves compiled_stamp(layout) there
    and exits, returning the compiler's memory with it. Without a FLASHDIR on disk (a layout built in memory) or
    when the child fails, this process compiles instead: its runtime line is then larger, never wrong."""
    import subprocess
    if layout.flashdir is None:
        return
    if sys.stderr.isatty():     # progress, like the bars: an error stays one line in a log
        print("compiling the kernels once for this installation (Numba; a minute or more) ...", file=sys.stderr)
    n = len(compile_steps(layout))
    for i in range(n):          # one child per step: each one's peak is the libraries and one step's compiler
        subprocess.run([sys.executable, "-m", "flashinfer_lite.budget", str(layout.flashdir), str(i),
                        "stamp" if i == n - 1 else ""],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=False)


def compiled_stamp(layout):
    """The file, in Numba's cache directory, that says compile_kernels ran there for these kernels and the argument
    types of `layout`: its name hashes Numba's and Python's versions, the kernel modules' files (as Numba's own index
    keys them: mtime and size) and what of the layout decides the types. Emptying the cache directory removes it."""
    import hashlib

    import numba

    here = Path(__file__).parent      # every module holding a kernel: kernels/, ffn/, the block formats, the cache
    files = [*sorted((here / "kernels").glob("*.py")), *sorted((here / "ffn").glob("*.py")), here / "quant.py",
             here / "neuron_cache.py", Path(__file__)]
    key = [numba.__version__, sys.version, *[(str(f.relative_to(here)), f.stat().st_mtime_ns, f.stat().st_size)
                                             for f in files],
           layout.d % BLOCK == 0, layout.dtype, layout.down_dtype, layout.vectors, layout.biases, bool(layout.parts),
           layout.experts and (layout.experts.dtypes, layout.experts.split)]
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    return Path(attention_rows._cache.cache_path) / f"flashinfer-lite-kernels-{digest}.stamp"


if __name__ == "__main__":     # compile_in_child's child: python -m flashinfer_lite.budget FLASHDIR STEP [stamp]
    _layout = read_layout(sys.argv[1], check_size=False)
    compile_kernels(_layout, steps=[int(sys.argv[2])])
    if sys.argv[3:] == ["stamp"]:
        try:
            compiled_stamp(_layout).touch()
        except OSError:         # a read-only cache: the next run compiles in a child again, as this one did
            pass


# ----------------------------------------------------------------------------------------------------------------------
# A mixture of experts: the budget buys whole experts (ffn.experts.ExpertCache)

# Expert slots per layer at the minimum: one expert computed while the next is read into the other.
MIN_EXPERT_SLOTS = 2


@dataclass
class ExpertPlan:
    """The DRAM split of a mixture of experts run from flash: what stays resident, then per layer `slots` whole
    experts (chunk bytes each), `pinned` of them the most routed ones on calibration text, the rest an LRU."""
    budget_bytes: int
    runtime_bytes: int
    resident_bytes: int
    kv_bytes: int
    buffer_bytes: int
    slots: int                  # per layer
    pinned: int                 # per layer, of the slots (0 without calibration counts)
    chunk: int
    n_layers: int
    n_experts: int
    ctx: int
    minimum_bytes: int
    requested: bool = True

    @property
    def experts_bytes(self) -> int:
        return self.n_layers * self.slots * self.chunk

    @property
    def used_bytes(self) -> int:
        return self.runtime_bytes + self.resident_bytes + self.kv_bytes + self.buffer_bytes + self.experts_bytes

    def table(self) -> str:
        rows = [("runtime", self.runtime_bytes, "interpreter, libraries, tokenizer, kernels (measured)"),
                ("resident dense", self.resident_bytes, "embeddings, attention, routers, shared experts, norms"),
                ("kv cache", self.kv_bytes, f"{self.ctx} positions"),
                ("buffers", self.buffer_bytes, "prefill chunk, heap"),
                ("experts", self.experts_bytes, f"{self.slots} of {self.n_experts} experts x {self.n_layers} layers "
                                                f"({self.pinned} pinned per layer), {self.chunk / 2**20:.2f} MiB each"),
                ("unused", self.budget_bytes - self.used_bytes, ""),
                ("budget", self.budget_bytes, f"minimum {_mib(self.minimum_bytes)}")]
        return budget_table(rows, self.budget_bytes)


def plan_experts(cfg: ModelConfig, experts, dram_budget_bytes: int | None, ctx: int, resident_bytes: int,
                 runtime_bytes: int, pin: bool, requested: bool = True) -> ExpertPlan:
    """Slots per layer for whole experts (experts: storage.experts.ExpertLayout) in what the budget leaves after the
    runtime, the resident weights, the KV cache and a prompt chunk's temporaries; None: every expert. pin: calibration
    counts exist, so half the slots hold the most routed experts (at least MIN_EXPERT_SLOTS stay an LRU)."""
    kv = KVCache.nbytes_for(cfg, ctx)
    buffers = prefill_transient_bytes(cfg, ctx) + HEAP_SLACK_BYTES
    if experts.split:     # ffn.experts.gated, k experts at a time: their coefficients [rows, n] (up to a prompt
        # chunk's rows each) and their column reads' staging (packed rows: storage.reader)
        k = cfg.n_experts_used
        buffers += k * (min(PREFILL_CHUNK_ROWS, ctx) * experts.n * 4 + experts.n * experts.column_stride + 2 * 512)
    fixed = runtime_bytes + resident_bytes + kv + buffers
    # split: a slot also has a mask of the down columns it holds
    per_slot = cfg.n_layers * (experts.chunk + (experts.n if experts.split else 0))
    minimum = fixed + MIN_EXPERT_SLOTS * per_slot
    E = cfg.n_experts
    budget = fixed + E * per_slot if dram_budget_bytes is None else dram_budget_bytes
    if budget < minimum:
        raise UserError(f"DRAM budget {_mib(budget)} is below the minimum {_mib(minimum)} for this mixture of experts "
                        f"({MIN_EXPERT_SLOTS} experts per layer of {_mib(experts.chunk)} each, resident "
                        f"{_mib(resident_bytes)}, kv {_mib(kv)} for {ctx} positions, runtime {_mib(runtime_bytes)})")
    slots = min(E, (budget - fixed) // per_slot)
    pinned = min(slots // 2, slots - MIN_EXPERT_SLOTS) if pin and slots < E else (slots if slots == E else 0)
    return ExpertPlan(budget, runtime_bytes, resident_bytes, kv, buffers, slots, max(0, pinned), experts.chunk,
                      cfg.n_layers, E, ctx, minimum, requested)
