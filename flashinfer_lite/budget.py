"""The one DRAM budget (--dram-budget): how the bytes the process may keep are split, computed up front.

  resident     embeddings, attention, norms, head, FFN down bias (float32, always in DRAM)
  kv cache     keys and values for the whole context (float32)
  buffers      reader gap scratch, kernel scratch, cache bookkeeping (slot maps per neuron)
  window       per layer `window_rows` bundle rows for the sliding window (LLM in a Flash)
  hot region   pinned hottest neurons across layers (PowerInfer), filled by neuron_cache.select_hot

Minimum = resident + kv + buffers + one token's cold neurons (max_active rows per layer). What the budget has
beyond that goes to the window up to its useful maximum (max_active x window tokens, capped at n_neurons), sharing
with the hot region by `hot_share`; whatever one part cannot use goes to the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashinfer_lite.errors import UserError
from flashinfer_lite.model import KVCache, ModelConfig
from flashinfer_lite.neuron_cache import select_hot
from storage.profile import DEFAULT_GAP_BYTES

# per neuron per layer: slot_of int32 + last_used int64 + seen int64 + out_slots int32 (neuron_cache._Layer)
MAP_BYTES_PER_NEURON = 24
# per window row: neuron_at int32 + ring int32 x window + miss ids/slots int64 x 2
ROW_OVERHEAD_BYTES = 4 + 16
# per hot row: neuron_at int32
HOT_ROW_OVERHEAD_BYTES = 4
# aligned_empty over-allocates one page per matrix
MATRIX_SLACK_BYTES = 4096


@dataclass
class BudgetPlan:
    budget_bytes: int
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

    @property
    def hot_rows(self) -> int:
        """Total pinned neurons the hot region holds (all layers)."""
        return self.hot_bytes // (self.stride + HOT_ROW_OVERHEAD_BYTES)

    def hot_neurons(self, freqs: list[np.ndarray]) -> list[np.ndarray]:
        """Per layer the bundle ids to pin, from activation frequencies indexed by bundle id."""
        return select_hot(freqs, self.stride, self.hot_rows * self.stride)

    @property
    def used_bytes(self) -> int:
        return self.resident_bytes + self.kv_bytes + self.buffer_bytes + self.window_bytes + self.hot_bytes

    def table(self) -> str:
        rows = [("resident dense", self.resident_bytes, "embeddings, attention, norms, head"),
                ("kv cache", self.kv_bytes, f"{self.ctx} positions"),
                ("buffers", self.buffer_bytes, "reader scratch, kernel scratch, slot maps"),
                ("window", self.window_bytes, f"{self.window_rows} rows x {self.n_layers} layers, "
                                              f"window {self.window} tokens"),
                ("hot region", self.hot_bytes, f"{self.hot_rows} pinned neurons"),
                ("unused", self.budget_bytes - self.used_bytes, ""),
                ("budget", self.budget_bytes, f"minimum {_mib(self.minimum_bytes)}")]
        lines = [f"{'DRAM budget':<16}{'MiB':>10}{'%':>7}  note"]
        for name, b, note in rows:
            lines.append(f"{name:<16}{b / 2**20:>10.1f}{100 * b / self.budget_bytes:>6.1f}%  {note}")
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def resident_bytes_for(cfg: ModelConfig, itemsize: int = 4) -> int:
    """Bytes of every non-FFN tensor (+ FFN down bias and norm) as the runtime keeps them."""
    d, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    n = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    if cfg.pos_offset is not None:
        n += (cfg.max_pos + cfg.pos_offset) * d
    norm = d * (2 if cfg.norm == "layer" else 1)
    per_layer = d * q + 2 * d * kv + q * d + 2 * norm
    per_layer += (q + 2 * kv) * cfg.qkv_bias + d * cfg.o_bias + d * cfg.mlp_bias
    n += cfg.n_layers * per_layer + (norm if cfg.pre_norm else 0)
    return n * itemsize


def plan_budget(config, layout, dram_budget_bytes: int, ctx: int, window: int = 5, max_active: int | None = None,
                hot_share: float = 0.5, resident_bytes: int | None = None, threads: int = 2,
                read_scratch_bytes: int = DEFAULT_GAP_BYTES) -> BudgetPlan:
    """Split `dram_budget_bytes` (see module docstring). config: ModelConfig or its dict; layout: FlashLayout.

    max_active: the most cold neurons one token may need per layer (the predictor's cap); default ffn_dim, which
    fits any active set but makes the minimum hold a whole FFN layer per layer.
    resident_bytes: measured size of the resident weights, if known (else computed from the config, float32).
    """
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
    if ctx < 1 or window < 1:
        raise UserError(f"context ({ctx}) and window ({window}) must be at least 1")
    n_layers, stride = layout.n_layers, layout.stride
    n_max = max(layout.n_neurons)
    max_active = n_max if max_active is None else min(int(max_active), n_max)
    if max_active < 1:
        raise UserError(f"max_active must be at least 1, got {max_active}")
    row = stride + ROW_OVERHEAD_BYTES + 4 * window
    res = resident_bytes if resident_bytes is not None else resident_bytes_for(cfg)
    kv = KVCache.nbytes_for(cfg, ctx)
    buffers = (max(read_scratch_bytes, stride) + threads * layout.d * 4 + n_max * 4
               + sum(layout.n_neurons) * MAP_BYTES_PER_NEURON + n_layers * MATRIX_SLACK_BYTES)
    minimum = res + kv + buffers + n_layers * max_active * row
    if dram_budget_bytes < minimum:
        raise UserError(f"DRAM budget {_mib(dram_budget_bytes)} is below the minimum {_mib(minimum)} for this model "
                        f"(resident {_mib(res)}, kv {_mib(kv)} for {ctx} positions, buffers {_mib(buffers)}, "
                        f"one token's {max_active} neurons x {n_layers} layers)")
    extra = dram_budget_bytes - minimum
    win_extra_max = n_layers * (min(n_max, max_active * window) - max_active) * row
    hot_row = stride + HOT_ROW_OVERHEAD_BYTES
    hot_max = sum(layout.n_neurons) * hot_row
    hot = min(int(extra * hot_share), hot_max)
    win_extra = min(extra - hot, win_extra_max)
    hot = min(extra - win_extra, hot_max)  # the window's leftover goes to the hot region
    hot -= hot % hot_row
    rows = max_active + win_extra // (n_layers * row)
    return BudgetPlan(budget_bytes=dram_budget_bytes, resident_bytes=res, kv_bytes=kv, buffer_bytes=buffers,
                      window_rows=rows, window_bytes=n_layers * rows * row, hot_bytes=hot, minimum_bytes=minimum,
                      n_layers=n_layers, stride=stride, ctx=ctx, window=window, max_active=max_active)
