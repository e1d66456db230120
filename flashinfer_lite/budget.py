"""The one DRAM budget (--dram-budget): how the bytes the process may keep are split, computed up front. Planning
only, arithmetic on sizes: what a run compiles and measures before it plans is warmup.py's, which FFN mode plans
with which function is modes.py's.

  process base what the process holds before the model's weights load: interpreter, numpy/numba/tokenizers,
               the compiled kernels, the tokenizer, the predictors; measured (RSS), not computed
  resident     attention, norms, FFN down bias (in DRAM; matrices float16 with f16/int8 bundles, in blocks with
               quantized ones)
  head         the head as stored, resident when the budget holds it, else a stream's buffers (read once per token)
  embeddings   on flash: a prompt chunk's rows read per step (place_head)
  kv cache     keys and values in pages (kv_pages): the minimum holds the fixed part (each layer's page being
               filled, the staging of pages read from flash, a step's scores, Quest's bounds), not the pages; what the
               budget has beyond the minimum holds pages first (each layer's first ones, up to the whole context:
               exact attention reads every page every token, as the head is read, so each byte held saves a byte
               read), the rest of the pages go to a file on flash
  buffers      reader gap scratch, kernel scratch, cache bookkeeping (slot maps per neuron), the prefill
               streaming chunk, a prompt chunk's temporaries (prefill_transient_bytes), the heap the prompt's
               transient arrays leave behind
  window       per layer `window_rows` bundle rows for the sliding window (LLM in a Flash)
  hot region   pinned hottest neurons across layers (PowerInfer), filled by neuron_cache.select_hot

Minimum = process base + resident + the head's stream + the embeddings' rows + kv + buffers + a fixed reservation of
MIN_WINDOW_ROWS rows per layer: it does not grow with the active count, because a token's set larger than the window
is computed in window-sized pieces (ffn.flash.FlashFFN.decode_row) to the same bits (ffn.sparse.SparseFFN.accumulate);
a small window only costs reads. What the budget has beyond that holds the head first (place_head), then pins hot
neurons until the window could hold one token's expected set, then goes to the window up to its useful maximum (the
expected active count x window tokens, capped at n_neurons), sharing with the hot region by `hot_share`; whatever one
part cannot use goes to the other.
The process's peak RSS (the kernel's high-water mark, `process.peak_rss_bytes`) is what the budget is held to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from storage import columns
from storage.blocks import row_bytes
from storage.errors import UserError
from storage.format import BUNDLE_ALIGN
from storage.profile import (DEFAULT_GAP_BYTES, DeviceRates, device_rates, reader_defaults, stream_settings,
                             stream_shape)
from storage.reader import MAX_READ_BYTES, parts_span_bytes, span_bytes
from storage.sizes import parse_size
from . import kv_pages
from .model import ATTENTION_HEAD_WORKERS, ATTENTION_KEY_BLOCK, ATTENTION_TILE_ROWS, PREFILL_CHUNK_ROWS, ModelConfig
from .neuron_cache import MAP_BYTES_PER_NEURON, select_hot, staging_rows
from .process import room_bytes, rss_bytes

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
    base_bytes: int             # measured: the process before the weights load (warmup.measure_base_bytes)
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
    floor_bytes: int = 0        # its smallest budget when minimum_bytes is that of a richer plan: plan_gate's every
                                # layer's rows streamed (minimum_bytes: with gate_layers resident), place_head's head
                                # streamed
    head_bytes: int = 0         # of place_head: the head in DRAM, its matrix (resident) or a stream's buffers
    head_read_bytes: int = 0    # of place_head: what a streamed head reads per token (0: resident)
    embed_bytes: int = 0        # of place_head: the embedding rows of a prompt chunk (the table stays on flash)
    kv_dram_pages: int | None = None    # of kv_share: KV pages per layer in DRAM (None: every page)
    contexts: int = 1           # the KV caches planned: one per sequence decoded together
    kv_options: object = None   # how each is kept (kv_pages.KVOptions; None: the defaults)

    @property
    def hot_rows(self) -> int:
        """Total pinned neurons the hot region holds (all layers)."""
        return self.hot_bytes // (self.stride + HOT_ROW_OVERHEAD_BYTES)

    def hot_neurons(self, freqs: list[np.ndarray]) -> list[np.ndarray]:
        """Per layer the bundle ids to pin, from activation frequencies indexed by bundle id."""
        return select_hot(freqs, self.stride, self.hot_rows * self.stride)

    @property
    def used_bytes(self) -> int:
        return (self.base_bytes + self.resident_bytes + self.kv_bytes + self.buffer_bytes + self.window_bytes
                + self.hot_bytes + self.ffn_bytes + self.gate_bytes + self.head_bytes + self.embed_bytes)

    def table(self) -> str:
        rows = [("process base", self.base_bytes, "interpreter, libraries, compiled kernels, tokenizer, "
                                                  "predictors (measured)"),
                *([("resident dense", self.resident_bytes, "attention, norms"),
                   ("head", self.head_bytes, f"streamed from flash, {_mib(self.head_read_bytes)} read per token"
                    if self.head_read_bytes else "resident, as stored"),
                   ("embeddings", self.embed_bytes, "on flash: a prompt chunk's rows read per step")]
                  if self.embed_bytes else
                  [("resident dense", self.resident_bytes, "embeddings, attention, norms, head")]),
                *([("resident ffn", self.ffn_bytes, "every layer's FFN weights, computed dense")] if self.ffn_bytes
                  else []),
                *([("gate|up rows", self.gate_bytes, f"{self.gate_layers} of {self.n_layers} layers resident"
                   + ("" if self.gate_layers == self.n_layers else ", the rest streamed"))]
                  if self.gate_bytes else []),
                ("kv cache", self.kv_bytes, kv_note(self.ctx, self.kv_dram_pages, self.contexts, self.kv_options)),
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


# ----------------------------------------------------------------------------------------------------------------------
# The KV cache's share (kv_pages.KVCache): its fixed part in the minimum, pages from what is left

# contexts, in every function below and in the plans: serve --parallel N's N sequences decoded together, each with a
# KV cache of its own (and its logits between steps); runtime.load's `parallel`, carried by the load's ModelFiles.
# kv_options: how each KV cache is kept (kv_pages.KVOptions: types, Quest; None: the defaults), the load's too


def sequence_extra_bytes(cfg: ModelConfig, contexts: int = 1) -> int:
    """What each sequence beyond the first holds besides its KV cache: its logits [V] between steps, its row of a
    batched step's logits and its log-softmax (float32)."""
    return (contexts - 1) * 3 * cfg.vocab_size * 4


def kv_minimum_bytes(cfg: ModelConfig, ctx: int, contexts: int = 1, kv_options=None) -> int:
    """The KV caches at their smallest: their fixed parts, every page on flash (kv_pages.fixed_bytes), one per
    context."""
    o = kv_options or kv_pages.KVOptions()
    return contexts * kv_pages.fixed_bytes(cfg, ctx, o) + sequence_extra_bytes(cfg, contexts)


def kv_all_bytes(cfg: ModelConfig, ctx: int, contexts: int = 1, kv_options=None) -> int:
    """The KV caches with every page in DRAM, one per context."""
    o = kv_options or kv_pages.KVOptions()
    return contexts * kv_pages.all_bytes(cfg, ctx, o) + sequence_extra_bytes(cfg, contexts)


def kv_share(cfg: ModelConfig, ctx: int, room: int, contexts: int = 1, kv_options=None) -> tuple[int, int]:
    """(bytes, pages per layer in DRAM of each context's cache) of the KV caches given `room` bytes beyond their
    minimum: as many pages per layer as fit in every context, up to the context's."""
    per_page = kv_pages.dram_page_bytes(cfg, kv_options or kv_pages.KVOptions())
    pages = min(kv_pages.n_pages(ctx), max(0, room) // (per_page * contexts))
    return kv_minimum_bytes(cfg, ctx, contexts, kv_options) + contexts * pages * per_page, pages


def kv_note(ctx: int, dram_pages: int | None, contexts: int = 1, kv_options=None) -> str:
    """The plan's kv line: the context, its pages in DRAM and on flash."""
    o, pages = kv_options or kv_pages.KVOptions(), kv_pages.n_pages(ctx)
    held = pages if dram_pages is None else dram_pages
    quest = f", Quest reads {o.quest_words}" if o.quest else ""
    return (f"{positions(ctx, contexts)}, {o.type_k}/{o.type_v}: {held} of {pages} pages per layer in DRAM, "
            f"{pages - held} on flash{quest}")


def positions(ctx: int, contexts: int = 1) -> str:
    """The KV share's positions, said: "256 positions", or "4 contexts of 256 positions"."""
    return f"{ctx} positions" if contexts == 1 else f"{contexts} contexts of {ctx} positions"


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


def matrix_row_bytes(cols: int, name: str, half: bool, kinds: dict[str, str]) -> int:
    """Bytes of a row of resident matrix `name` as the runtime keeps it (resident_bytes_for)."""
    return row_bytes(cols, kinds[name]) if name in kinds else cols * (2 if half else 4)


def resident_bytes_for(cfg: ModelConfig, half: bool = False, kinds: dict[str, str] | None = None,
                       on_flash: bool = False) -> int:
    """Bytes of every non-FFN tensor (+ FFN down bias and norm; a mixture of experts' routers, shared experts and
    their gates) as the runtime keeps them: matrices (embeddings, attention, lm_head) in the block format `kinds`
    names for them (a quantized FLASHDIR's resident_kinds), else float16 when `half` (half.half_matrix), else float32;
    norms and biases float32. on_flash: without the embeddings and the head (place_head counts them)."""
    kinds = kinds or {}
    matrices = sum(rows * matrix_row_bytes(cols, n, half, kinds)
                   for n, (rows, cols) in resident_matrix_shapes(cfg).items()
                   if not (on_flash and n in ("embed.weight", "lm_head.weight")))
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


def down_scale_bytes(layout, f16: bool) -> int:
    """DRAM of the down columns' scale tables, decoded (storage.columns.decode: resident per layer for the run), 0
    without. f16: the kernels keep the a and m tables float16 (quant.COLUMN_SCALES_F16: a fact of the CPU)."""
    return sum(columns.decoded_bytes(k, layout.d, n, f16) for k, n in
               ((layout.down_column(i), n) for i, n in enumerate(layout.n_neurons)) if k)


def plan_budget(config, layout, dram_budget_bytes: int, ctx: int, window: int = 5, max_active: int | None = None,
                hot_share: float = 0.5, resident_bytes: int | None = None, threads: int = 2,
                gap_bytes: int | None = None, base_bytes: int = 0,
                stream_chunk_bytes: int = 0, stream_depth: int = 1, requested: bool = True, lookahead: bool = False,
                heap_slack_bytes: int = 0, gate: bool = False, contexts: int = 1, kv_options=None) -> BudgetPlan:
    """Split `dram_budget_bytes` (see module docstring). config: ModelConfig or its dict; layout: FlashLayout.

    max_active: the cold neurons one token is expected to need per layer (modes.expected_max_active): sizes the
    window's useful maximum (max_active x window), not the minimum; default ffn_dim.
    resident_bytes: measured size of the resident weights, if known (else computed from the config, float32).
    base_bytes: the process's RSS before the weights load (measure_base_bytes); 0 plans the model's part only.
    stream_chunk_bytes, stream_depth: the streams' chunk and chunks in flight (storage.profile.stream_defaults); a
    chunk 0 if the caller never streams.
    heap_slack_bytes: what the process's heap keeps of transient arrays (HEAP_SLACK_BYTES for a run; 0 plans
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
    kv = kv_minimum_bytes(cfg, ctx, contexts, kv_options)
    buffers = (read_scratch_bytes(layout, gap_bytes) + threads * layout.d * 4 + n_max * 4
               + sum(layout.n_neurons) * (MAP_BYTES_PER_NEURON + layout.bundle_of[0].itemsize)
               + n_layers * MATRIX_SLACK_BYTES
               + stream_transient_bytes(layout, stream_chunk_bytes, stream_depth)
               + prefill_transient_bytes(cfg, ctx, gate, kv_options)
               + heap_slack_bytes
               + (staging_rows(max_active) * stride if lookahead else 0)
               + read_staging_bytes(layout, n_max, gap_bytes) * (2 if lookahead else 1))
    minimum = base_bytes + res + kv + buffers + n_layers * reserve * row
    if dram_budget_bytes < minimum:
        raise BelowMinimum(dram_budget_bytes, minimum, f"process base {_mib(base_bytes)}, resident {_mib(res)}, kv "
                           f"{_mib(kv)} for {positions(ctx, contexts)}, buffers {_mib(buffers)}, window {reserve} "
                           f"rows x {n_layers} layers")
    kv, kv_dram_pages = kv_share(cfg, ctx, dram_budget_bytes - minimum, contexts, kv_options)
    extra = dram_budget_bytes - minimum - (kv - kv_minimum_bytes(cfg, ctx, contexts, kv_options))
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
    return BudgetPlan(budget_bytes=dram_budget_bytes, base_bytes=base_bytes, resident_bytes=res, kv_bytes=kv,
                      buffer_bytes=buffers, window_rows=rows, window_bytes=n_layers * rows * row, hot_bytes=hot,
                      minimum_bytes=minimum, n_layers=n_layers, stride=stride, ctx=ctx, window=window,
                      max_active=max_active, requested=requested, kv_dram_pages=kv_dram_pages,
                      contexts=contexts, kv_options=kv_options)


def plan_gate(config, layout, dram_budget_bytes: int, ctx: int, window: int, sparsity: float,
              layers: int | None = None, parts: dict | None = None, **kw) -> BudgetPlan:
    """The exact-gate FFN's plan (ffn.flash.ExactGate): layout a FlashLayout with the split parts. Every token needs every
    layer's gate|up rows, so they come first: all layers resident when the budget holds them with the minimum
    down-row window, else as many layers as fit, from the first, and the others streamed through the buffers of a
    stream (stream_transient_bytes; what is read then is said by the runtime). The rest is plan_budget's for the
    down rows (window and hot region), with the active count of `sparsity` as its expected set. layers: plan exactly
    this many layers' rows resident (no search; 0: the plan's smallest). parts: the split parts when the layout does
    not carry them (layout.make_part, before conversion). kw: plan_budget's; the streams' settings default to the
    device's (the exact gate streams down rows at every budget below the FFN)."""
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
        except BelowMinimum:
            continue
        p.floor_bytes = plan(0).minimum_bytes      # what the table names: the budget could go down to it
        return p
    return plan(0)        # raises, naming the minimum, when even streaming every layer does not fit


def plan_resident_ffn(config, layout, dram_budget_bytes: int, ctx: int, resident_bytes: int, ffn_bytes: int,
                      scratch_bytes: int, base_bytes: int = 0, heap_slack_bytes: int = 0,
                      requested: bool = True, contexts: int = 1, kv_options=None) -> BudgetPlan | None:
    """The plan of the in-RAM FFN (ffn.resident.ResidentFFN): every layer's weights in DRAM as on flash (ffn_bytes:
    modes.dense_ffn_bytes), plus the prompt's widened float32 blocks (scratch_bytes: gate, up, down of
    ffn.quant.QuantSparseFFN.dense) and the coefficients; None when that does not fit `dram_budget_bytes` (then the
    FFN runs from flash)."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
    n_max = max(layout.n_neurons)
    buffers = (scratch_bytes + 2 * n_max * 4 + prefill_transient_bytes(cfg, ctx, kv_options=kv_options)
               + heap_slack_bytes)
    ffn = ffn_bytes
    kv = kv_all_bytes(cfg, ctx, contexts, kv_options)       # every weight in DRAM: every KV page too
    need = base_bytes + resident_bytes + kv + buffers + ffn
    if need > dram_budget_bytes:
        return None
    return BudgetPlan(budget_bytes=dram_budget_bytes, base_bytes=base_bytes, resident_bytes=resident_bytes,
                      kv_bytes=kv, buffer_bytes=buffers, window_rows=0, window_bytes=0, hot_bytes=0,
                      minimum_bytes=need, n_layers=layout.n_layers, stride=layout.stride, ctx=ctx, window=0,
                      max_active=n_max, requested=requested, ffn_bytes=ffn, contexts=contexts,
                      kv_options=kv_options)


# ----------------------------------------------------------------------------------------------------------------------
# How the exact gate reads a token's rows: planned for time, not bytes

# Tokens sampled from the activation frequencies to price a layer's sparse reads (their coalesced runs): a fixed seed,
# so a plan is one function of the profile, the budget and the statistics
SAMPLED_TOKENS = 16
# A sparse layer's reads go through the neuron cache in window-sized pieces, each read and waited for after the layer's
# coefficients (nothing runs ahead of them): a piece's round trip (cache bookkeeping, read planning, submit, wait) took
# about 2 ms on the real 1.5B at 520M on a loaded 2-core machine (1.15 s of waits for 588 pieces a token; fio there:
# 0.1 ms for one 4 KiB read, 0.4 ms for 256 KiB), so one is priced at 1 ms on top of its bytes.
SPARSE_PIECE_S = 1e-3


@dataclass(frozen=True)
class TokenReads:
    """Per layer how a decoded token's FFN rows come (plan_reads): gate_up[i] "resident" or "stream"; down[i]
    "resident" (its pinned rows and window hold the layer), "stream" (read whole, in order) or "sparse" (the neurons
    that count, their rows in coalesced runs, window-sized pieces one after the other); the modeled seconds of each
    way to read layer i's down rows (stream_s, sparse_s: 0 for a resident layer) and of its gate|up stream; pinned:
    per layer the bundle ids the hot region holds."""
    gate_up: tuple[str, ...]
    down: tuple[str, ...]
    gate_up_s: tuple[float, ...]
    stream_s: tuple[float, ...]
    sparse_s: tuple[float, ...]
    pinned: tuple[np.ndarray, ...]
    rates: DeviceRates
    placement: str          # "hottest rows" or "whole layers": how the hot region was filled

    @property
    def seconds(self) -> float:
        """The modeled read time of a token: every streamed matrix at the sequential rate, sparse layers at the random
        rate of their runs."""
        down = {"resident": lambda i: 0.0, "stream": lambda i: self.stream_s[i], "sparse": lambda i: self.sparse_s[i]}
        return sum(self.gate_up_s) + sum(down[c](i) for i, c in enumerate(self.down))

    def following(self, part: str, layer: int) -> int:
        """The layer after `layer` (cyclic: a next token's first after the last) whose `part` rows stream, or -1."""
        ways = self.gate_up if part == "gate_up" else self.down
        n = len(ways)
        return next((j % n for j in range(layer + 1, layer + 1 + n) if ways[j % n] == "stream"), -1)

    def describe(self) -> str:
        """Lines for -v: per way of reading, its layers and modeled milliseconds, and the token's total."""
        def spans(ways, want):
            idx = [i for i, w in enumerate(ways) if w == want]
            out, start = [], None
            for k, i in enumerate(idx):
                start = i if start is None else start
                if k + 1 == len(idx) or idx[k + 1] != i + 1:
                    out.append(f"{start}" if start == i else f"{start}-{i}")
                    start = None
            return ",".join(out) or "none"
        r = self.rates
        lines = [f"reads planned for time ({r.source}: sequential {r.seq_Bps / 1e9:.2f} GB/s), "
                 f"{1e3 * self.seconds:.1f} ms of reads per token; hot region: {self.placement}",
                 f"  gate|up resident: layers {spans(self.gate_up, 'resident')}; streamed: layers "
                 f"{spans(self.gate_up, 'stream')} ({1e3 * sum(self.gate_up_s):.1f} ms)"]
        for way in ("resident", "stream", "sparse"):
            idx = [i for i, w in enumerate(self.down) if w == way]
            if idx:
                times = "" if way == "resident" else (
                    f" (streamed {1e3 * sum(self.stream_s[i] for i in idx):.1f} ms against sparse "
                    f"{1e3 * sum(self.sparse_s[i] for i in idx):.1f} ms)")
                lines.append(f"  down {way}: layers {spans(self.down, way)}{times}")
        return "\n".join(lines)


def sparse_read(p: np.ndarray, stride: int, gap_rows: int, rng) -> tuple[float, float, float]:
    """(bytes, requests, rows) per token, averaged over SAMPLED_TOKENS tokens drawn from neuron probabilities p (bundle
    order; 0 for rows already in DRAM), of reading each token's rows as the reader does: runs of rows at most
    gap_rows apart read as one request, widened to 512-byte boundaries."""
    draws = rng.random((SAMPLED_TOKENS, p.size)) < p
    nbytes = requests = 0
    for row in draws:
        ids = np.flatnonzero(row)
        if not ids.size:
            continue
        new = np.r_[True, np.diff(ids) - 1 > gap_rows]
        first, last = ids[new], ids[np.r_[new[1:], True]]
        requests += first.size
        nbytes += int(np.sum(-(-(last + 1 - first) * stride // BUNDLE_ALIGN) * BUNDLE_ALIGN + BUNDLE_ALIGN))
    return nbytes / SAMPLED_TOKENS, requests / SAMPLED_TOKENS, float(draws.sum()) / SAMPLED_TOKENS


def plan_reads(gate_up, down, gate_layers: int, window_rows: int, hot_rows: int, freq: list[np.ndarray],
               rates: DeviceRates, gap_rows: int) -> TokenReads:
    """The exact gate's reads of a token, chosen to take the least time on a device of `rates`: gate|up rows of the
    first gate_layers layers resident (plan_gate), the others streamed; the hot region's hot_rows pinned down rows
    either the hottest across layers (freq: per layer each neuron's share of calibration tokens, bundle order) or
    whole layers (the window's rows make up the rest), whichever the model says is faster; then per layer whose rows
    the cache cannot hold, a stream of the whole layer or sparse reads of the neurons that count, whichever is
    faster (a sparse layer pays SPARSE_PIECE_S per window-sized piece besides its bytes at the random rate of its
    runs' size). Pinned rows of a layer that streams save nothing (the stream reads them too), so whole layers can beat
    the hottest rows: on the real 1.5B at 520M the gate fires 59% of the neurons, and sparse 1.1 KB rows read far
    slower than a stream. Deterministic: a function of its arguments (sparse_read's draws have a fixed seed)."""
    n = list(down.n_neurons)
    L = len(n)
    stream_s = [down.region_bytes(i) / rates.seq_Bps for i in range(L)]

    def down_s(i: int, pins: np.ndarray) -> tuple[str, float]:
        if pins.size + window_rows >= n[i]:
            return "resident", 0.0
        p = np.asarray(freq[i], np.float64).copy()
        p[pins] = 0.0
        nbytes, requests, rows = sparse_read(p, down.stride, gap_rows, np.random.default_rng(i))
        if not requests:
            return "sparse", 0.0
        pieces = math.ceil(rows / max(window_rows, 1))
        return "sparse", nbytes / rates.random_Bps(nbytes / requests) + pieces * SPARSE_PIECE_S

    def price(pins: list[np.ndarray]):
        ways, sparse = [], []
        for i in range(L):
            way, t = down_s(i, pins[i])
            sparse.append(t)
            ways.append(way if way == "resident" or t < stream_s[i] else "stream")
        cost = sum(0.0 if w == "resident" else min(stream_s[i], sparse[i]) for i, w in enumerate(ways))
        return cost, ways, sparse

    hottest = select_hot(list(freq), down.stride, hot_rows * down.stride)
    # whole layers: the layers whose reads cost the most first, each needing its rows beyond the window
    base = price([np.zeros(0, np.int64)] * L)
    order = sorted(range(L), key=lambda i: (-min(stream_s[i], base[2][i]), i))
    whole, left = [np.zeros(0, np.int64)] * L, hot_rows
    for i in order:
        need = max(0, n[i] - window_rows)
        if 0 < need <= left:        # its hottest rows pinned, the window holds the coldest
            whole[i] = np.sort(np.argsort(-np.asarray(freq[i]), kind="stable")[:need]).astype(np.int64)
            left -= need
    rest = select_hot([np.zeros(0) if whole[i].size else f for i, f in enumerate(freq)], down.stride,
                      left * down.stride)
    whole = [w if w.size else r for w, r in zip(whole, rest)]
    candidates = [("hottest rows", hottest, price(hottest)), ("whole layers", whole, price(whole))]
    placement, pins, (_, ways, sparse) = min(candidates, key=lambda c: c[2][0])      # a tie keeps the hottest rows
    gu = [gate_up.region_bytes(i) / rates.seq_Bps if i >= gate_layers else 0.0 for i in range(L)]
    return TokenReads(gate_up=tuple("resident" if i < gate_layers else "stream" for i in range(L)),
                      down=tuple(ways), gate_up_s=tuple(gu), stream_s=tuple(stream_s),
                      sparse_s=tuple(sparse), pinned=tuple(pins), rates=rates, placement=placement)


def gate_reads(layout, plan: BudgetPlan, calibration) -> TokenReads:
    """plan_reads for an exact-gate run of `plan` on a FLASHDIR's split layout, with the calibration's neuron
    frequencies, the device's profiled rates (storage.profile.device_rates) and the down reader's coalescing gap."""
    gu, dn = layout.parts["gate_up"], layout.parts["down"]
    return plan_reads(gu, dn, plan.gate_layers, plan.window_rows, plan.hot_rows, list(calibration.freq),
                      device_rates(dn.device_path if dn.flashdir is not None else None),
                      reader_gap_bytes(dn) // dn.stride)


# ----------------------------------------------------------------------------------------------------------------------
# The token embeddings and the head (flash_matrix.FlashMatrix): the table stays on flash, a step reads its tokens'
# rows; the head is resident when the budget holds it, else streamed from flash once per token

def head_name(cfg: ModelConfig) -> str:
    """The matrix the head multiplies by: lm_head, or the token embeddings when tied (one matrix, both uses)."""
    return "embed.weight" if cfg.tie_embeddings else "lm_head.weight"


def stream_rows(stride: int, chunk_bytes: int, block_rows: int) -> int:
    """Rows of a streamed head's chunk: chunk_bytes of rows, in whole blocks of `block_rows` (at least one: those
    gemv.matmul_widened multiplies a prompt's rows by, flash_matrix.widened_rows), so that the streamed product makes
    the resident one's calls on the same shapes."""
    return max(1, chunk_bytes // stride // block_rows) * block_rows


@dataclass(frozen=True)
class HeadSizes:
    """What a plan holds for the token embeddings and the head (head_sizes)."""
    stored_bytes: int       # the head as stored: its DRAM resident, what it reads per token streamed
    stream_bytes: int       # a head stream's buffers
    embed_bytes: int        # a prompt chunk's embedding rows as read: rows, the reads' staging, the readers' scratch

    @property
    def streams(self) -> bool:
        """Whether the head can stream in less DRAM than it takes resident (a head of a chunk or two cannot)."""
        return self.stream_bytes < self.stored_bytes

    @property
    def minimum_bytes(self) -> int:
        """What a plan holds for them at its smallest: the head's stream (or the head, when it does not stream) and
        the embeddings' rows."""
        return min(self.stream_bytes, self.stored_bytes) + self.embed_bytes


def head_sizes(cfg: ModelConfig, half: bool, kinds: dict[str, str], ctx: int, stream_chunk_bytes: int,
               stream_depth: int, block_rows: int) -> HeadSizes:
    """HeadSizes of a run whose resident matrices are kept as resident_bytes_for says (half, kinds), with the
    stream settings the FFN has (storage.profile.stream_settings: one device) and chunks in whole blocks of
    block_rows (stream_rows). A stream's chunk is read into its own
    buffer widened to 512-byte boundaries, one more 512 when its region is off them (storage.reader); a lookup of a
    prompt chunk's rows reads each run of consecutive rows widened so into a staging buffer, then into its rows."""
    V, d = cfg.vocab_size, cfg.dim
    stride = matrix_row_bytes(d, head_name(cfg), half, kinds)
    rows = min(stream_rows(stride, stream_chunk_bytes, block_rows), V)
    depth = max(1, min(stream_depth, -(-V // rows)))
    e = matrix_row_bytes(d, "embed.weight", half, kinds)
    U = min(PREFILL_CHUNK_ROWS, ctx)
    return HeadSizes(stored_bytes=V * stride, stream_bytes=depth * (span_bytes(rows, stride) + BUNDLE_ALIGN),
                     embed_bytes=U * (2 * e + 2 * BUNDLE_ALIGN) + e + stride)


def place_head(plan, sizes: HeadSizes, budget_bytes: int) -> BudgetPlan:
    """The plan with the head resident when the budget holds it, else streamed; the embeddings on flash either way.
    plan(budget_bytes, held) is the mode's plan with `held` bytes more resident (raising BelowMinimum below its
    minimum). The head comes before the FFN's rows: it is read whole every token, so each byte of it held saves a
    byte read per token, as a gate|up row does (plan_gate holds the head before them, an equal trade), where a hot
    down row saves its read only on the tokens its neuron fires for. The minimum is the streamed head's (the resident
    one's when a stream would take no less: HeadSizes.streams)."""
    low = plan(1 << 60, sizes.minimum_bytes)
    try:
        p, head = plan(budget_bytes, sizes.stored_bytes + sizes.embed_bytes), sizes.stored_bytes
    except BelowMinimum:
        if not sizes.streams:
            raise
        p, head = plan(budget_bytes, sizes.stream_bytes + sizes.embed_bytes), sizes.stream_bytes
        p.head_read_bytes = sizes.stored_bytes
    p.resident_bytes -= head + sizes.embed_bytes
    p.head_bytes, p.embed_bytes = head, sizes.embed_bytes
    p.floor_bytes = low.floor_bytes or low.minimum_bytes
    return p


def prefill_transient_bytes(cfg: ModelConfig, ctx: int, gate: bool = False, kv_options=None) -> int:
    """Peak bytes of one prompt chunk's temporaries (model.Transformer.forward runs a prompt PREFILL_CHUNK_ROWS tokens
    at a time), float32 unless said:
      rows       per token: the residual stream and its normed copies, q/k/v and their rotated copies, the attention
                 output (~8 x d + 3 x (H + 2 Hkv) x hd), the FFN's rows of neurons (predictor scores, masks,
                 coefficients or the dense FFN's activations: ~4 x n), and one product's input in 8-bit blocks
                 (blocks.act8_of: both block sizes, and the prompt's BLAS copy of the rounded values: < 8 bytes a value
                 of the longer of d and n). gate: ffn.flash.ExactGate's rows of neurons are its coefficients (float32),
                 the kernel's row selection and the rows' any-mask (a byte each), and its 8-bit input is x's (d)
      attention  a block's keys and values (model.ATTENTION_KEY_BLOCK positions, whatever the context) gathered
                 from their pages (float16, or float32 from q8_0: kv_pages.KVCache.rows) and widened [block, Hkv, hd]
                 x 2, one tile's scores [g x tile, block] and its mask (float64 + float32 + bool:
                 model.attention_mask) [tile, block] per thread of the KV heads (model.attention_workers), the
                 chunk's running sums and output [rows, H, hd] x 2, the chunk's keys and values encoded for their
                 pages (q8_0's rounding: ~4 float32 copies)
      pruning    with kv_options.prompt_pruning (pruning.pruned_prefill): every prompt token's hidden state [T, d]
                 between stages and the kept ones' copy, the last token's attention scores over the prompt (float64
                 [H, T], x 3), T up to ctx
    SmolLM2 at -c 1024, measured (tracemalloc, a 256-token chunk after 768 cached): the exact gate's chunk peaks at
    7.4 MiB (planned: 13.8), a predicted run's of a 4096-neuron model at 25.4 MiB (planned: 29.8)."""
    U = min(PREFILL_CHUNK_ROWS, ctx)
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    neurons = 6 * cfg.ffn_dim + 8 * cfg.dim if gate else 16 * cfg.ffn_dim + 8 * max(cfg.dim, cfg.ffn_dim)
    rows = U * (4 * (8 * cfg.dim + 3 * qkv) + neurons)
    g = cfg.n_heads // cfg.n_kv_heads
    tile = min(ATTENTION_TILE_ROWS, U)
    B, kv = min(ATTENTION_KEY_BLOCK, ctx), cfg.n_kv_heads * cfg.head_dim
    workers = min(ATTENTION_HEAD_WORKERS, cfg.n_kv_heads)
    attention = 2 * B * kv * 8 + workers * tile * B * (4 * g + 13) + 2 * U * cfg.n_heads * (cfg.head_dim + 1) * 4 \
        + 2 * U * kv * 16
    pruning = 2 * ctx * cfg.dim * 4 + 3 * cfg.n_heads * ctx * 8 if kv_options and kv_options.prompt_pruning else 0
    return rows + attention + pruning


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


def stream_args(layout) -> dict:
    """plan_budget's stream arguments for `layout`: the buffers of stream_settings."""
    s = stream_settings(layout)
    return {"stream_chunk_bytes": s.chunk_bytes, "stream_depth": s.depth}


# ----------------------------------------------------------------------------------------------------------------------
# The budget asked for, resolved once: bytes, "auto" (what the machine can give) or none

AUTO_MARGIN_SHARE = 0.05            # --dram-budget auto leaves this share of the room free (and at least the floor)
AUTO_MARGIN_FLOOR = 128 << 20


def auto_budget_bytes() -> int:
    """--dram-budget auto: what this process holds now plus what the machine (and its memory cgroup, if capped) can
    still give, less a margin (AUTO_MARGIN_SHARE, at least AUTO_MARGIN_FLOOR) for everything else."""
    total = room_bytes() + rss_bytes()
    return max(0, total - max(AUTO_MARGIN_FLOOR, int(total * AUTO_MARGIN_SHARE)))


@dataclass(frozen=True)
class Budget:
    """--dram-budget resolved once, at the start of a load (Budget.of): `bytes` None means no limit (room for the
    whole model); auto means bytes is what the machine can give (auto_budget_bytes), so a model that fits in it is
    planned whole, as with no limit."""
    bytes: int | None
    auto: bool = False

    @staticmethod
    def of(dram_budget) -> "Budget":
        """From bytes, a size string ("300M"), "auto", None or a Budget."""
        if isinstance(dram_budget, Budget):
            return dram_budget
        if isinstance(dram_budget, str):
            return Budget(auto_budget_bytes(), True) if dram_budget == "auto" else Budget(parse_size(dram_budget))
        return Budget(dram_budget)

    @property
    def requested(self) -> bool:
        """A size was asked for (not auto, not none)."""
        return self.bytes is not None and not self.auto

    def split(self, whole: int) -> tuple[int, bool]:
        """(bytes to plan with, requested) for a plan whose every part is in DRAM at `whole` bytes: the whole when
        there is no limit or auto has room for it; else the budget, which the plan then fills."""
        if self.bytes is None or (self.auto and self.bytes >= whole):
            return whole, False
        return self.bytes, True

    def less(self, held: int) -> "Budget":
        """The size left for a model run beside `held` bytes (calibration's arrays; auto's room becomes a size, planned
        as one): no limit stays none."""
        return self if self.bytes is None else Budget(self.bytes - held)


class BelowMinimum(UserError):
    """A budget below a plan's minimum: one wording for every plan and for the early estimate, and the two numbers for
    a caller that retries at the minimum (the benches)."""

    def __init__(self, budget_bytes: int, minimum_bytes: int, parts: str):
        super().__init__(f"DRAM budget {_mib(budget_bytes)} is below the minimum {_mib(minimum_bytes)} for this "
                         f"model ({parts})")
        self.budget_bytes, self.minimum_bytes = budget_bytes, minimum_bytes


# ----------------------------------------------------------------------------------------------------------------------
# A mixture of experts: the budget buys whole experts (ffn.experts.ExpertCache)

# Expert slots per layer at the minimum: one expert computed while the next is read into the other.
MIN_EXPERT_SLOTS = 2


@dataclass
class ExpertPlan:
    """The DRAM split of a mixture of experts run from flash: what stays resident, then per layer `slots` whole
    experts (chunk bytes each), `pinned` of them the most routed ones on calibration text, the rest an LRU."""
    budget_bytes: int
    base_bytes: int
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
    kv_dram_pages: int | None = None    # of kv_share: KV pages per layer in DRAM (None: every page)
    contexts: int = 1           # the KV caches planned: one per sequence decoded together
    kv_options: object = None   # how each is kept (kv_pages.KVOptions; None: the defaults)

    @property
    def experts_bytes(self) -> int:
        return self.n_layers * self.slots * self.chunk

    @property
    def used_bytes(self) -> int:
        return self.base_bytes + self.resident_bytes + self.kv_bytes + self.buffer_bytes + self.experts_bytes

    def table(self) -> str:
        rows = [("process base", self.base_bytes, "interpreter, libraries, tokenizer, kernels (measured)"),
                ("resident dense", self.resident_bytes, "embeddings, attention, routers, shared experts, norms"),
                ("kv cache", self.kv_bytes, kv_note(self.ctx, self.kv_dram_pages, self.contexts, self.kv_options)),
                ("buffers", self.buffer_bytes, "prefill chunk, heap"),
                ("experts", self.experts_bytes, f"{self.slots} of {self.n_experts} experts x {self.n_layers} layers "
                                                f"({self.pinned} pinned per layer), {self.chunk / 2**20:.2f} MiB each"),
                ("unused", self.budget_bytes - self.used_bytes, ""),
                ("budget", self.budget_bytes, f"minimum {_mib(self.minimum_bytes)}")]
        return budget_table(rows, self.budget_bytes)


def plan_experts(cfg: ModelConfig, experts, dram_budget_bytes: int | None, ctx: int, resident_bytes: int,
                 base_bytes: int, pin: bool, requested: bool = True, contexts: int = 1,
                 kv_options=None) -> ExpertPlan:
    """Slots per layer for whole experts (experts: storage.experts.ExpertLayout) in what the budget leaves after the
    process base, the resident weights, the KV cache and a prompt chunk's temporaries; None: every expert. pin:
    calibration counts exist, so half the slots hold the most routed experts (at least MIN_EXPERT_SLOTS stay an LRU)."""
    kv = kv_minimum_bytes(cfg, ctx, contexts, kv_options)
    buffers = prefill_transient_bytes(cfg, ctx, kv_options=kv_options) + HEAP_SLACK_BYTES
    if experts.split:     # ffn.experts.gated, k experts at a time: their coefficients [rows, n] (up to a prompt
        # chunk's rows each) and their column reads' staging (packed rows: storage.reader)
        k = cfg.n_experts_used
        buffers += k * (min(PREFILL_CHUNK_ROWS, ctx) * experts.n * 4 + experts.n * experts.column_stride + 2 * 512)
    fixed = base_bytes + resident_bytes + kv + buffers
    # split: a slot also has a mask of the down columns it holds
    per_slot = cfg.n_layers * (experts.chunk + (experts.n if experts.split else 0))
    minimum = fixed + MIN_EXPERT_SLOTS * per_slot
    E = cfg.n_experts
    pages = kv_all_bytes(cfg, ctx, contexts, kv_options) - kv       # every KV page in DRAM
    budget = fixed + pages + E * per_slot if dram_budget_bytes is None else dram_budget_bytes
    if budget < minimum:
        raise BelowMinimum(budget, minimum, f"a mixture of experts: {MIN_EXPERT_SLOTS} experts per layer of "
                           f"{_mib(experts.chunk)} each, resident {_mib(resident_bytes)}, kv {_mib(kv)} for "
                           f"{positions(ctx, contexts)}, process base {_mib(base_bytes)}")
    kv, kv_dram_pages = kv_share(cfg, ctx, budget - minimum, contexts, kv_options)     # KV pages first
    slots = min(E, (budget - fixed - (kv - kv_minimum_bytes(cfg, ctx, contexts, kv_options))) // per_slot)
    pinned = min(slots // 2, slots - MIN_EXPERT_SLOTS) if pin and slots < E else (slots if slots == E else 0)
    return ExpertPlan(budget, base_bytes, resident_bytes, kv, buffers, slots, max(0, pinned), experts.chunk,
                      cfg.n_layers, E, ctx, minimum, requested, kv_dram_pages, contexts, kv_options)
