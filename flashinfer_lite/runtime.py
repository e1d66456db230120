"""Building a model to run: from a model path, --ffn, --dram-budget and -c to a Transformer with its FFN source.

  dense      every neuron, weights in DRAM (ffn.dense.FeedForward; a quantized FLASHDIR: ffn.resident.ResidentFFN)
  oracle     the neurons whose true activation is nonzero (ReLU) or clears the calibrated threshold (SwiGLU);
             needs the dense gate/up weights to know that, so it is a test mode, not a memory-saving one
  predicted  the neurons the low-rank predictor selects, read from flash (ffn.flash.FlashFFN): the product for
             ReLU-family models
  gate       a GLU model's exact gate (ffn.flash.ExactGate): every neuron's act(gate.x) * up.x from gate|up rows in DRAM,
             the calibrated threshold, the down rows of the neurons that clear it from flash; one function at every
             budget, and what --ffn auto runs for a gated (SiLU, GELU) model with the split layout

Decide, then build: open_model_files reads what a decision needs, decide (pure) says what runs (the FFN mode and
source, the DRAM plan, whether the default model's predictors must be trained first), build loads it. load() is the
library's entry (flashinfer_lite.load), which generate, chat, serve and eval call; load_runtime() is decide + build
for a given path, without first-use training.
"""
from __future__ import annotations

import gc
import os
import re
import sys
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from storage.cache import cached_conversion, flashdir_for
from storage.checkpoint import open_checkpoint
from storage.convert import DEFAULT_DTYPE, layout_for, resident_kinds, resident_names
from storage.config import EXACT_GATE_ACTS, ModelConfig
from storage.errors import UserError, run_child
from storage.format import FlashCheckpoint, FlashLayout, is_flashdir, verify_at_load
from storage.gate_file import DEFAULT_SPARSITY, SPARSITIES, GateCalibration, read_gate_file, write_gate_file
from storage.half import half_matrix
from storage.sizes import parse_size
from storage.tokenizer import token_segments

from . import BLAS_THREADS_FROM_USER
from . import default_model
from .budget import (HEAP_SLACK_BYTES, BudgetPlan, auto_budget_bytes, down_scale_bytes, measure_runtime_bytes,
                     plan_budget, plan_experts, plan_gate, plan_resident_ffn, resident_bytes_for,
                     resident_matrix_shapes, runtime_estimate_bytes, stream_args, stream_settings)
from .default_model import default_model_path, ensure_default_model
from .ffn.experts import ExpertFFN
from .ffn.flash import FlashFFN
from .ffn.gate import CALIBRATION_CTX, CALIBRATION_TOKENS, LayerMagnitudes, measure_thresholds
from .ffn.resident import ResidentFFN
from .loader import load_weights, open_any
from .model import Transformer
from .ffn.dense import FeedForward
from .predictor_set import describe_calibration, load_expert_freq, load_predictors, read_manifest
from .process import keep_freed_arrays_out_of_rss, return_freed_heap
from .kernels.blocks import set_act8
from .threads import set_threads, step_counts

# auto: a gated (SiLU, GELU) model with the split layout: gate at every budget; a mixture of experts: experts from
# flash; else dense when the model fits, else predicted
FFN_MODES = ("auto", "dense", "oracle", "predicted", "gate", "experts")
# FFN tensors that live in the bundles on flash; everything else (including ffn.down.bias) stays resident.
_BUNDLED = re.compile(r"layers\.\d+\.ffn\.(gate|up|down)\.weight|layers\.\d+\.ffn\.(gate|up)\.bias")
_EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.(gate|up|down)\.weight")   # in ffn.bin's expert chunks
def oracle_selector(cfg: ModelConfig, ckpt, predictors):
    """The true active set: needs the dense gate/up weights in DRAM, so it is a test mode, not a memory-saving one."""
    full_w = {n: ckpt.tensor(n) for n in ckpt.names() if _BUNDLED.fullmatch(n) and ".down." not in n}
    dense = [FeedForward(cfg, full_w, i) for i in range(cfg.n_layers)]  # gate/up only: the activations
    thresholds = [predictors.act_threshold(i) if predictors is not None else 0.0 for i in range(cfg.n_layers)]

    def select(layer: int, x: np.ndarray) -> np.ndarray:
        return np.abs(dense[layer].activations(x)) > thresholds[layer]
    return select


def lookahead_selector(cfg: ModelConfig, weights: dict, predictors):
    """Layer l's predictor on what layer l-1's FFN saw: a guess of l's set one layer early (Deja Vu's lookahead,
    untrained). With pre-norm, layer l-1's FFN input is norm(h) * w_{l-1} (+ b_{l-1}); re-weighting it with layer l's
    norm gives layer l's input as if neither layer l-1's FFN nor layer l's attention had added anything to the
    residual (bench/README.md, "Lookahead predictor", measured the recall cost: mean 0.910 vs 0.911 on SmolLM2)."""
    norms = [(weights.get(f"layers.{i}.ffn_norm.weight"), weights.get(f"layers.{i}.ffn_norm.bias"))
             for i in range(cfg.n_layers)]

    def guess(layer: int, x_prev: np.ndarray) -> np.ndarray:
        (w0, b0), (w1, b1) = norms[layer - 1], norms[layer]
        x = x_prev
        if cfg.pre_norm and w0 is not None and w1 is not None:
            z = x_prev - b0 if b0 is not None else x_prev
            z = np.divide(z, w0, out=np.zeros_like(z), where=w0 != 0)
            x = z * w1 + (b1 if b1 is not None else 0.0)
        return predictors.predict(layer, x.astype(np.float32), count=False)
    return guess


def one_blas_thread() -> None:
    """What OPENBLAS_NUM_THREADS=1 in flashinfer_lite/__init__.py does, for a process that loaded numpy first (the
    variable is read once, then): OpenBLAS's spinning threads made SmolLM2's dense FFN 296 ms/token instead of 21.
    A user's own OPENBLAS_NUM_THREADS is left alone."""
    if not BLAS_THREADS_FROM_USER:
        threadpool_limits(1, user_api="blas")


def resident_model(ckpt: FlashCheckpoint, progress: bool) -> Transformer:
    """A FLASHDIR's model with every weight in DRAM (--ffn dense, and auto when it fits): a quantized one as stored,
    resident matrices in blocks and the FFN as ResidentFFN; any other as dense FeedForward matrices (float16, float32
    for f32 bundles)."""
    if ckpt.config.moe:    # every expert read from its chunk, kept as stored (float16, float32 or blocks)
        return Transformer(ckpt.config, load_weights(ckpt, progress,
                                                     convert=half_matrix if ckpt.layout.dtype != "f32" else None))
    if not ckpt.layout.quantized:
        return Transformer(ckpt.config, load_weights(ckpt, progress, convert=half_matrix if keeps_float16(ckpt) else None))
    weights = load_weights(ckpt, progress, skip=lambda n: bool(_BUNDLED.fullmatch(n)),
                           convert=half_matrix if ckpt.layout.dtype != "f32" else None)
    down_bias = [weights.get(f"layers.{i}.ffn.down.bias") for i in range(ckpt.config.n_layers)]
    ffn = ResidentFFN(ckpt.config, ckpt, down_bias, progress)
    return Transformer(ckpt.config, weights, ffn=ffn)


def plan_resident(ckpt: FlashCheckpoint, dram_budget, ctx: int, runtime_bytes: int | None, room: int | None = None):
    """The in-RAM plan (budget.plan_resident_ffn) of --ffn auto, or None when the whole model does not fit
    --dram-budget (a size, "auto": room, what the machine can give, None: no limit)."""
    cfg, layout = ckpt.config, ckpt.layout
    if runtime_bytes is None:
        runtime_bytes = measure_runtime_bytes(layout)
    resident = resident_bytes_of(cfg, layout, ckpt.resident_kinds)
    if dram_budget == "auto" and room is None:
        room = auto_budget_bytes()
    budget = {None: 1 << 60, "auto": room}.get(dram_budget, dram_budget)
    return plan_resident_ffn(cfg, layout, budget, ctx, resident, runtime_bytes,
                             heap_slack_bytes=HEAP_SLACK_BYTES if runtime_bytes else 0,
                             requested=dram_budget not in (None, "auto"))


def keeps_float16(ckpt) -> bool:
    """Whether a dense run keeps its matrices float16: a FLASHDIR of float16 (or int8) bundles. Not a quantized one:
    its FFN dequantizes to values float16 would round (its resident matrices stay in blocks: loader.load_tensor)."""
    return isinstance(ckpt, FlashCheckpoint) and ckpt.layout.dtype in ("f16", "int8")


def plan_dram(files: ModelFiles, ffn: str, dram_budget, ctx: int, window: int, lookahead: bool,
              room: int | None) -> tuple[BudgetPlan, tuple[str, ...]]:
    """The BudgetPlan for --dram-budget, and what to say about it: a size, "auto" (the whole model when it fits in
    room, what the machine can give, else that much, said in one line), or None (room for the whole model: every
    neuron pinned, the full window)."""
    ckpt, runtime_bytes = files.ckpt, files.runtime_bytes
    cfg, layout = ckpt.config, ckpt.layout
    max_active = expected_max_active(cfg, files.predictors)
    resident = resident_bytes_of(cfg, layout, ckpt.resident_kinds, ffn)

    def plan_for(budget: int, requested: bool):
        return plan_budget(cfg, layout, budget, ctx, window, max_active=max_active, resident_bytes=resident,
                           runtime_bytes=runtime_bytes, **stream_args(layout), requested=requested,
                           lookahead=lookahead, heap_slack_bytes=HEAP_SLACK_BYTES if runtime_bytes else 0)
    whole = plan_for(1 << 60, False).used_bytes
    if dram_budget == "auto":
        if room >= whole:
            return plan_for(whole, False), ()
        return plan_for(room, True), (f"dram budget: auto = {room / 2**20:.0f} MiB (available memory less a margin); "
                                      f"the model's {whole / 2**20:.0f} MiB do not fit, so the FFN neurons that do "
                                      f"not are read from flash",)
    return (plan_for(whole, False) if dram_budget is None else plan_for(dram_budget, True)), ()


def resident_bytes_of(cfg: ModelConfig, layout, kinds: dict, ffn: str = "dense") -> int:
    """The resident line: float16 bundles take the resident matrices float16 too (half the DRAM, and GEMV reads half
    the bytes), quantized ones in blocks (`kinds`); float32 bundles keep the whole model exact. --ffn oracle adds the
    dense gate/up weights, float32, kept for the run: the true activations need them."""
    resident = resident_bytes_for(cfg, half=layout.dtype != "f32", kinds=kinds) + down_scale_bytes(layout)
    if ffn == "oracle":
        resident += cfg.n_layers * cfg.ffn_dim * cfg.dim * 4 * (2 if cfg.glu else 1)
    return resident


def minimum_bytes(cfg: ModelConfig, layout, kinds: dict, ffn: str, ctx: int, runtime_bytes: int) -> int:
    """The smallest --dram-budget decide() accepts for a sparse run (--lookahead off): plan_dram's minimum, or for
    --ffn auto the in-RAM plan's (plan_resident) when that is smaller, and for the exact gate (auto or gate on a
    SiLU- or GELU-gated model) its plan with every layer's gate|up rows streamed when that is smaller still. A
    mixture of experts (auto or experts): budget.plan_experts' minimum, with the resident file's tensor bytes
    (decide_experts plans with the file's size: its header more)."""
    if cfg.moe:     # other modes: decide_experts names the mode, not the budget
        return plan_experts(cfg, layout.experts, None, ctx, resident_bytes_of(cfg, layout, kinds), runtime_bytes,
                            pin=False).minimum_bytes if ffn in ("auto", "experts") else 0
    candidates = []
    if ffn in ("auto", "gate") and layout.parts and cfg.act in EXACT_GATE_ACTS:     # decide_gate's condition
        candidates.append(plan_gate(cfg, layout, 1 << 60, ctx, 5, DEFAULT_SPARSITY, layers=0,
                                    resident_bytes=resident_bytes_of(cfg, layout, kinds), runtime_bytes=runtime_bytes,
                                    **stream_args(layout),
                                    heap_slack_bytes=HEAP_SLACK_BYTES).minimum_bytes)
        if ffn == "gate":
            return candidates[0]
    sparse = plan_budget(cfg, layout, 1 << 60, ctx, resident_bytes=resident_bytes_of(cfg, layout, kinds, ffn),
                         runtime_bytes=runtime_bytes, **stream_args(layout),
                         heap_slack_bytes=HEAP_SLACK_BYTES).minimum_bytes
    if ffn != "auto":
        return sparse
    in_ram = plan_resident_ffn(cfg, layout, 1 << 60, ctx, resident_bytes_of(cfg, layout, kinds), runtime_bytes,
                               heap_slack_bytes=HEAP_SLACK_BYTES).minimum_bytes
    return min(sparse, in_ram, *candidates)


def model_facts(source: str | None, cached: bool = True) -> tuple[ModelConfig, FlashLayout, dict]:
    """(config, layout, resident kinds) of the FLASHDIR a run of the model plans with, from a header, config.json or
    manifest alone: its cached conversion's when there is one (cached: a build before this one may have made it,
    e.g. with a q8_0 down), else a source's as conversion will make them (convert.layout_for, resident_kinds).
    source None: the default model, from default_model's record of its header while the file is not fetched yet."""
    if source is None:
        if not default_model_path().is_file():
            cfg = ModelConfig(**default_model.CONFIG)
            layout = FlashLayout.create(cfg.dim, [cfg.ffn_dim] * cfg.n_layers, default_model.FFN_DTYPES[0], cfg.glu,
                                        layer_dtypes=[default_model.FFN_DTYPES] * cfg.n_layers, config=cfg.to_dict())
            kinds = {n: default_model.EMBED_KIND if n == "embed.weight" else default_model.ATTENTION_KIND
                     for n in resident_matrix_shapes(cfg)}
            return cfg, layout, kinds
        source = str(default_model_path())
    path = Path(source).expanduser().resolve()
    made = source if is_flashdir(source) or not (cached and path.exists()) else \
        cached_conversion(path, known_only=True)                  # no model read, nothing written
    if made is not None and is_flashdir(made):       # the FLASHDIR the run will use
        ckpt = FlashCheckpoint(made)
        return ckpt.config, ckpt.layout, ckpt.resident_kinds
    ckpt = open_checkpoint(source)
    layout = layout_for(ckpt, DEFAULT_DTYPE)
    return ckpt.config, layout, resident_kinds(ckpt, resident_names(ckpt, layout),
                                               layout.dtype if layout.quantized else None)


# What the early refusal leaves below its estimate: the runtime line of two runs differs by well under this
EARLY_SLACK_BYTES = 2 << 20


def refuse_below_minimum(source: str | None, ffn: str, dram_budget: int, ctx: int) -> None:
    """Raise UserError, naming the minimum, when `dram_budget` (bytes) is below what a sparse run of the model
    (source None: the default model) needs, in the first second: before fetch, conversion, kernel compilation or
    training spend minutes. The model's part is the planner's own (minimum_bytes, on model_facts); the runtime line
    is budget.runtime_estimate_bytes' (exact within EARLY_SLACK_BYTES once this installation has run the model)."""
    cfg, layout, kinds = model_facts(source)
    ctx = context_size(ctx, cfg)
    runtime = runtime_estimate_bytes(layout, cfg.vocab_size)
    minimum = minimum_bytes(cfg, layout, kinds, ffn, ctx, runtime) - EARLY_SLACK_BYTES
    if dram_budget < minimum:
        raise UserError(f"DRAM budget {dram_budget / 2**20:.1f} MiB is below the minimum for this model, at least "
                        f"{minimum / 2**20:.1f} MiB (runtime about {runtime / 2**20:.1f} MiB, the model's weights, "
                        f"kv cache and buffers for {ctx} positions {(minimum - runtime) / 2**20:.1f} MiB)")


def expected_max_active(cfg: ModelConfig, predictors) -> int:
    """The active count the window is sized for (its useful maximum is this x window tokens): twice the mean
    active count when the neuron frequencies say it, else half the layer. Not in the minimum
    (budget.MIN_WINDOW_ROWS)."""
    n = cfg.ffn_dim
    if predictors is None:
        return max(1, n // 2)
    mean = max(float(predictors.neuron_freq(i).sum()) for i in range(cfg.n_layers))
    return int(min(n, max(16, 2 * mean)))


# ----------------------------------------------------------------------------------------------------------------------
# Decide, then build. open_model_files reads what a decision needs (converting a model into the cache when a FLASHDIR
# must back the run); decide, a pure function of those facts and the flags, says what runs; build loads it. load() is
# the library's entry (flashinfer_lite.load): the CLI's commands and the API call it, and it runs first-use training
# as a step of its own, between deciding and building.


@dataclass
class ModelFiles:
    """What decide() knows about a model, read before anything is decided."""
    source: str                     # the model as named: -m, or the default model's file
    path: str                       # the FLASHDIR when flash_backed, else source
    default: bool                   # the default model: its predictors may be trained on first use
    flash_backed: bool              # a FLASHDIR backs the run: ckpt is its FlashCheckpoint
    ckpt: object                    # FlashCheckpoint, or the source's checkpoint (a dense run of an HF dir or GGUF)
    tokenizer: object
    predictors: object              # PredictorSet or None
    runtime_bytes: int | None       # the plan's runtime line (None: no plan will be made)
    dense_bytes: int = 0            # DRAM a dense run of the source needs (a GGUF keeps its blocks: its file size)
    expert_freq: object = None      # a mixture of experts: [L, E] routings counted on calibration text, or None
    gate: object = None             # storage.gate_file.GateCalibration at the run's sparsity, or None

    @property
    def exact_gate(self) -> bool:
        """A gated (SiLU, GELU) model with the split layout: --ffn auto runs the exact gate (ffn.gate) at every budget.
        ReLU-family models keep the predictor over full bundles (their zeros are what it predicts)."""
        L = self.ckpt.layout if self.flash_backed else None
        return L is not None and bool(L.parts) and self.ckpt.config.act in EXACT_GATE_ACTS

    def runs_gate(self, ffn: str) -> bool:
        """Whether --ffn `ffn` runs the exact gate: asked for, or auto on such a model (decide_gate; the runtime line
        measures the gate's kernels alone then)."""
        return ffn == "gate" or (ffn == "auto" and self.exact_gate)

    @property
    def trained(self) -> bool:
        return self.predictors is not None and self.predictors.has_predictors


@dataclass(frozen=True)
class Decision:
    """What a run will be: the FFN mode, the FFN source it implies, the DRAM plan, and what must happen first."""
    ffn: str                        # dense | oracle | predicted | gate (auto decided)
    plan: object                    # BudgetPlan (None: a dense run without a plan)
    train_predictors: bool          # the default model's predictors must be trained first (then decide again)
    lookahead: bool
    notes: tuple[str, ...] = ()     # stderr lines for before the weights load
    auto: tuple[str, str] | None = None   # --ffn auto's reason: (what it chose and why, whose predictors)
    calibrate_gate: bool = False    # gate: the thresholds must be calibrated first (then decide again)

    @property
    def source(self) -> str:
        """The FFN source: "flash" (FlashFFN) or "dram" (every weight in DRAM: FeedForward, or ResidentFFN)."""
        return "dram" if self.ffn == "dense" else "flash"


def open_model_files(model, ffn: str, verify: bool = True, progress: bool = False,
                     runtime_bytes: int | None = None, ctx: int = 0, sparsity: float = DEFAULT_SPARSITY,
                     dram_budget: int | str | None = None) -> ModelFiles:
    """The facts decide() needs. A FLASHDIR backs every mode but dense of an HF directory or GGUF, and auto of one
    that needs no predictors to run from flash when it has to: a mixture of experts (its router says which experts
    run), or a SiLU- or GELU-gated model (the exact gate) given a --dram-budget, or under `auto` one that does not fit
    in DRAM; any other runs dense. Such a model is converted into the cache on first use, and a launch checks sizes
    and the verified stamp, not every byte. The runtime line is measured here, on a process that holds everything
    but the weights (tokenizer, predictors, compiled kernels). dram_budget: load's (bytes, "auto" or None); in bytes,
    one under the model's minimum is refused before any of that work, the default model's fetch included
    (refuse_below_minimum), for the runs that plan it (the dense ones hold every weight, with no plan)."""
    if ffn not in FFN_MODES:
        raise UserError(f"unknown --ffn mode '{ffn}' (choose from {', '.join(FFN_MODES)})")
    default = model is None
    flash_backed = (not default and is_flashdir(model)) or ffn in ("oracle", "predicted", "gate", "experts") \
        or (ffn == "auto" and (default or from_flash_first_use(model, dram_budget)))
    if isinstance(dram_budget, int) and flash_backed and ffn != "dense":
        refuse_below_minimum(None if default else str(model), ffn, dram_budget, ctx)
    source = str(ensure_default_model()) if default else str(model)
    if not flash_backed or ffn == "dense":     # every weight in DRAM, as stored: no plan, no predictors
        if flash_backed and verify:   # the resident file and the manifest are checked, not only each layer
            verify_at_load(source, progress=progress)
        ckpt = open_any(source)
        return ModelFiles(source, source, default, flash_backed, ckpt, ckpt.tokenizer(), None, None,
                          dense_bytes_of(source, ckpt.config))
    keep_freed_arrays_out_of_rss()
    path = flashdir_for(source, progress)
    if verify:
        verify_at_load(path, progress=progress)
    ckpt = FlashCheckpoint(path)
    files = ModelFiles(source, str(path), default, True, ckpt, ckpt.tokenizer(), load_predictors(path), None,
                       expert_freq=load_expert_freq(path) if ckpt.config.moe else None)
    if runtime_bytes is None:
        runtime_bytes = measure_runtime_bytes(ckpt.layout, "gate" if files.runs_gate(ffn) else None)
    files.runtime_bytes = runtime_bytes
    if not ckpt.config.moe or ckpt.layout.experts.split:    # split expert chunks run the exact gate too
        files.gate = read_gate_file(path, ckpt.config.n_layers, ckpt.config.ffn_dim, sparsity)
    return files


def from_flash_first_use(source: str, dram_budget) -> bool:
    """Whether --ffn auto converts an HF directory or GGUF (from its header alone) on first use to run it from flash:
    a mixture of experts always; a SiLU- or GELU-gated model given a --dram-budget (bytes), or under `auto` when its
    dense weights (a GGUF's file, else float32) do not fit what the machine can give (the exact gate needs no
    predictors; a ReLU-family model needs trained ones, and is told so)."""
    source = str(source)
    cfg = open_checkpoint(source).config
    if cfg.moe:
        return True
    if not cfg.glu or cfg.act not in EXACT_GATE_ACTS or dram_budget is None:
        return False
    return dram_budget != "auto" or dense_bytes_of(source, cfg) > auto_budget_bytes()


def dense_bytes_of(source: str, cfg: ModelConfig) -> int:
    """DRAM a dense run of an HF directory or GGUF needs: a GGUF keeps its blocks (about its file's size), anything
    else counts float32."""
    if source.endswith(".gguf") and os.path.isfile(source):
        return os.path.getsize(source)
    return resident_bytes_for(cfg) + cfg.n_layers * cfg.ffn_dim * cfg.dim * 4 * (3 if cfg.glu else 2)


def decide(files: ModelFiles, ffn: str, dram_budget=None, ctx: int | None = None, window: int = 5,
           lookahead: bool = False, room: int | None = None, verbose: bool = False) -> Decision:
    """What runs, from the model's facts and the flags; nothing is loaded, nothing printed. dram_budget: bytes,
    "auto" (room: what the machine can give, budget.auto_budget_bytes) or None (no limit). --ffn auto: a SiLU-gated
    model with the split layout runs the exact gate at every budget (decide_gate: one function, the same tokens at
    any budget); any other model dense when the whole model fits the budget (in RAM nothing is gained by predicting:
    every neuron from DRAM is exact and faster), else predicted, which needs predictors (the default model's are
    trained first)."""
    cfg = files.ckpt.config
    ctx = ctx or cfg.default_ctx
    if cfg.moe and files.flash_backed and ffn != "dense":
        return decide_experts(files, ffn, dram_budget, ctx, room, verbose, lookahead)
    if ffn == "dense" or (ffn == "auto" and not files.flash_backed):
        if dram_budget not in (None, "auto"):
            raise UserError("--dram-budget applies to --ffn predicted/oracle; --ffn dense keeps every weight in DRAM"
                            if ffn == "dense" else
                            f"--dram-budget needs a sparse FFN, and {files.source} has no predictors: run "
                            f"`flashinfer-lite collect` and `flashinfer-lite train-predictor`, or use --ffn oracle")
        notes = ()
        if dram_budget == "auto" and files.dense_bytes > room:
            notes = (f"note: {files.source} needs about {files.dense_bytes / 2**20:.0f} MiB in DRAM dense and "
                     f"{room / 2**20:.0f} MiB is available; to run it from flash, make its predictors: "
                     f"`flashinfer-lite convert`, `flashinfer-lite collect`, `flashinfer-lite train-predictor` "
                     f"(docs/PREDICTORS.md)",)
        auto = ("", f"{files.source} has no trained predictors") if ffn == "auto" else None
        return Decision("dense", None, False, False, notes, auto)
    if files.runs_gate(ffn):
        return decide_gate(files, ffn, dram_budget, ctx, window, room, verbose)
    whose = ("the default model" if files.default else
             f"{files.source} has {'trained' if files.trained else 'no trained'} predictors")
    if ffn == "auto":
        resident = plan_resident(files.ckpt, dram_budget, ctx, files.runtime_bytes, room)
        if resident is not None:
            notes = (resident.table(),) if verbose or resident.requested else ()
            return Decision("dense", resident, False, False, notes, ("the whole model fits in DRAM", whose))
        if not files.trained and not files.default:
            raise UserError(f"{files.path} does not fit the DRAM budget and has no predictors to run it from flash: "
                            f"run `flashinfer-lite collect` and `flashinfer-lite train-predictor`")
        auto = ("from flash", whose)
        ffn = "predicted"
    else:
        auto = None
        if ffn == "predicted" and not files.trained and not files.default:
            raise UserError(f"{files.path} has no predictors: run `flashinfer-lite collect` and "
                            f"`flashinfer-lite train-predictor`")
    lookahead = lookahead and ffn == "predicted"   # the guess is a predictor's
    # planned before any weight loads: a budget too small fails before the work (before first-use training too)
    plan, notes = plan_dram(files, ffn, dram_budget, ctx, window, lookahead, room)
    if verbose or plan.requested:
        notes += (plan.table(),)
    return Decision(ffn, plan, ffn == "predicted" and not files.trained, lookahead, notes, auto)


def decide_experts(files: ModelFiles, ffn: str, dram_budget, ctx: int, room: int | None, verbose: bool,
                   lookahead: bool = False) -> Decision:
    """A mixture of experts from a FLASHDIR: its experts read from flash through the expert cache, as many per layer
    as the budget holds (every one with no budget). No predictor: the router says exactly which experts run."""
    ckpt = files.ckpt
    split = ckpt.layout.experts.split
    if ffn not in ("auto", "experts") and not (ffn == "gate" and split):
        raise UserError(f"--ffn {ffn} predicts neurons of a dense FFN; a mixture of experts runs --ffn auto (its "
                        f"experts read from flash as the router picks them), dense, or gate (the exact gate inside "
                        f"each expert: convert with --expert-chunks split)" + ("" if ffn != "gate" else
                        f"; {files.path} has whole expert chunks"))
    if ffn == "gate" and files.gate is None:
        return Decision("gate", None, False, False, (), None, calibrate_gate=True)
    resident = os.path.getsize(ckpt.flashdir / ckpt.layout.files["resident"])
    budget = room if dram_budget == "auto" else dram_budget
    plan = plan_experts(ckpt.config, ckpt.layout.experts, budget, ctx, resident, files.runtime_bytes,
                        pin=files.expert_freq is not None, requested=dram_budget is not None)
    notes = (plan.table(),) if verbose or plan.requested else ()
    if ffn == "gate":
        notes += (f"gate: inside each routed expert, sparsity {files.gate.sparsity:g}: only the down columns of "
                  f"neurons whose |coefficient| clears the layer's threshold are read",)
    return Decision("gate" if ffn == "gate" else "experts", plan, False, lookahead, notes,
                    ("experts from flash", "the router") if ffn == "auto" else None)


def decide_gate(files: ModelFiles, ffn: str, dram_budget, ctx: int, window: int, room: int | None,
                verbose: bool) -> Decision:
    """The exact gate's decision: its plan (budget.plan_gate) at any budget, including none (every down row in
    DRAM: the same function), and whether its thresholds must be calibrated first."""
    layout, cfg = files.ckpt.layout, files.ckpt.config
    if not layout.parts or not layout.glu:
        raise UserError(f"--ffn gate needs a GLU model converted with the split layout (gate_up.bin, down.bin); "
                        f"{files.path} has none: re-run `flashinfer-lite convert` (--ffn-layout auto or parts)")
    if cfg.act not in EXACT_GATE_ACTS:
        raise UserError(f"--ffn gate is for SiLU- or GELU-gated models; {files.path} uses {cfg.act}: use --ffn "
                        f"predicted")
    why = (f"gated model ({cfg.act}): the exact gate, no predictor",
           "the default model" if files.default else files.source) if ffn == "auto" else None
    if files.gate is None:
        return Decision("gate", None, False, False, (), why, calibrate_gate=True)
    resident = resident_bytes_of(cfg, layout, files.ckpt.resident_kinds)

    def plan_for(budget: int, requested: bool):
        return plan_gate(cfg, layout, budget, ctx, window, files.gate.sparsity, resident_bytes=resident,
                         runtime_bytes=files.runtime_bytes, **stream_args(layout),
                         requested=requested, heap_slack_bytes=HEAP_SLACK_BYTES if files.runtime_bytes else 0)
    whole = plan_for(1 << 60, False).used_bytes
    notes = ()
    if dram_budget is None or (dram_budget == "auto" and room >= whole):
        plan = plan_for(whole, False)
    else:
        plan = plan_for(room if dram_budget == "auto" else dram_budget, True)
    gu = layout.parts["gate_up"]
    if plan.gate_layers < cfg.n_layers:
        streamed = sum(gu.region_bytes(i) for i in range(plan.gate_layers, cfg.n_layers))
        notes += (f"gate: the gate|up rows of {plan.gate_layers} of {cfg.n_layers} layers fit in the DRAM budget; the "
                  f"other {cfg.n_layers - plan.gate_layers} are read from flash as one sequential stream per layer "
                  f"({streamed / 1e6:.1f} MB per token more)",)
    if verbose or plan.requested:
        notes += (plan.table(),)
    return Decision("gate", plan, False, False, notes, why)


def build(files: ModelFiles, decision: Decision, threads: int | None = None, progress: bool = False,
          verbose: bool = False):
    """(model, tokenizer, runtime) as decided; runtime is the FlashFFN, None when every weight is in DRAM."""
    if decision.train_predictors:
        raise UserError(f"{files.path} has no predictors yet: train them first (first use of the default model)")
    if decision.calibrate_gate:
        raise UserError(f"{files.path} has no gate thresholds yet: calibrate them first "
                        f"(python -m predictors.calibrate_gate {files.path})")
    if decision.source == "dram":
        model = resident_model(files.ckpt, progress) if files.flash_backed else \
            Transformer(files.ckpt.config, load_weights(files.ckpt, progress, keep_blocks=True))
        warm_up(model)
        return model, files.tokenizer, None
    ckpt, predictors, cfg = files.ckpt, files.predictors, files.ckpt.config
    if decision.ffn == "experts" or cfg.moe:     # a mixture of experts' gate: inside split expert chunks
        weights = load_weights(ckpt, progress, skip=lambda n: bool(_EXPERT.fullmatch(n)),
                               convert=half_matrix if ckpt.layout.dtype != "f32" else None)
        runtime = ExpertFFN(cfg, ckpt.layout, weights, decision.plan, files.expert_freq, threads=threads,
                            lookahead=decision.lookahead, verbose=verbose,
                            thresholds=files.gate.thresholds if decision.ffn == "gate" else None)
        if verbose:
            print(runtime.reader.describe(), file=sys.stderr)
        return Transformer(cfg, weights, ffn=runtime), files.tokenizer, runtime
    weights = load_weights(ckpt, progress, skip=lambda n: bool(_BUNDLED.fullmatch(n)),
                           convert=half_matrix if ckpt.layout.dtype != "f32" else None)
    down_bias = [weights.get(f"layers.{i}.ffn.down.bias") for i in range(cfg.n_layers)]
    if decision.ffn == "gate":
        runtime = FlashFFN.exact_gate(cfg, ckpt.layout, decision.plan, files.gate, down_bias, threads=threads,
                                      verbose=verbose, down_scales=ckpt.down_scales_all())
        if verbose:
            print(runtime.reader.describe(), file=sys.stderr)
            print(runtime.stream.describe(stream_settings(ckpt.layout).source), file=sys.stderr)
        return Transformer(cfg, weights, ffn=runtime), files.tokenizer, runtime
    select = oracle_selector(cfg, ckpt, predictors) if decision.ffn == "oracle" else predictors.predict
    runtime = FlashFFN.predicted(cfg, ckpt.layout, decision.plan, select, predictors,
                                 down_bias=[weights.get(f"layers.{i}.ffn.down.bias") for i in range(cfg.n_layers)],
                                 threads=threads, verbose=verbose, down_scales=ckpt.down_scales_all(),
                                 lookahead=lookahead_selector(cfg, weights, predictors) if decision.lookahead else None)
    if verbose:
        print(runtime.reader.describe(), file=sys.stderr)
        print(runtime.stream.describe(stream_settings(ckpt.layout).source), file=sys.stderr)
    return Transformer(cfg, weights, ffn=runtime), files.tokenizer, runtime


def load_runtime(path, ffn: str = "dense", dram_budget: int | str | None = None, ctx: int | None = None, window: int = 5,
                 threads: int | None = None, progress: bool = False, verbose: bool = False, verify: bool = True,
                 runtime_bytes: int | None = None, lookahead: bool = False, sparsity: float = DEFAULT_SPARSITY):
    """(model, tokenizer, runtime) for a model path and an FFN mode: open_model_files, decide, build (no first-use
    training: a model without the predictors its run needs is an error naming the commands to run; the exact gate's
    thresholds are calibrated on first use, as load() does: seconds, in this process under the budget).

    dram_budget: bytes for everything the process keeps (default: room for the whole model); "auto": the whole model
    when it fits in what the machine can give (budget.auto_budget_bytes), else that much.
    runtime_bytes: the plan's runtime line; None measures this process (budget.measure_runtime_bytes).
    lookahead: in predicted mode, start each layer's reads one layer early on a guess (lookahead_selector). Off by
    default: on the 7B-shaped bench at a 25% budget the device is the bottleneck and the wrong guesses' extra bytes
    cost more than the early start hides (bench/README.md).
    """
    one_blas_thread()
    files = open_model_files(path, ffn, verify, progress, runtime_bytes, sparsity=sparsity)
    room = auto_budget_bytes() if dram_budget == "auto" else None
    decision = decide(files, ffn, dram_budget, ctx, window, lookahead, room, verbose)
    if decision.calibrate_gate:
        calibrate_on_first_use(files, sparsity, room if dram_budget == "auto" else dram_budget)
        decision = decide(files, ffn, dram_budget, ctx, window, lookahead, room, verbose)
    for line in decision.notes:
        print(line, file=sys.stderr)
    return build(files, decision, threads, progress, verbose)


@dataclass
class Model:
    """What load() returns as `model`: the transformer, its flash runtime (None when every weight is in DRAM), the
    context and how long loading took."""
    transformer: Transformer
    runtime: FlashFFN | None
    ctx: int
    load_ms: float


def load(path: str | None = None, dram_budget: int | str | None = "auto", ffn: str = "auto", ctx: int = 0,
         threads: int | None = None, lookahead: bool = False, verbose: bool = False,
         sparsity: float = DEFAULT_SPARSITY, act8: bool = True):
    """(model, tokenizer) for an HF directory, a GGUF file or a FLASHDIR; None = the default model (fetched, and its
    predictors trained, on first use). dram_budget: bytes, a size string ("300M"), "auto" (the default: what the
    machine can give) or None (no limit); ffn as the CLI's --ffn; ctx 0: the model's default context. act8: the dot
    products with weights in 32-weight blocks (q4_0, q4_1, q5_0, q5_1, q8_0) round x to 8 bits as llama.cpp does
    (faster); False keeps x float32, the float math on the dequantized weights (blocks.set_act8: for the process)."""
    t0 = time.perf_counter()
    one_blas_thread()
    set_threads(threads)
    set_act8(act8)
    budget = parse_size(dram_budget) if isinstance(dram_budget, str) and dram_budget != "auto" else dram_budget
    progress = sys.stderr.isatty()
    files = open_model_files(path, ffn, progress=progress, ctx=ctx, sparsity=sparsity, dram_budget=budget)
    ctx = context_size(ctx, files.ckpt.config)
    room = auto_budget_bytes() if budget == "auto" else None
    decision = decide(files, ffn, budget, ctx, lookahead=lookahead, room=room, verbose=verbose)
    if decision.train_predictors:      # the default model's first sparse run: a step of its own, then decide again
        train_on_first_use(files.path)
        files.predictors = load_predictors(files.path)
        files.runtime_bytes = measure_runtime_bytes(files.ckpt.layout)
        decision = decide(files, ffn, budget, ctx, lookahead=lookahead, room=room, verbose=verbose)
    if decision.calibrate_gate:        # the first exact-gate run of a FLASHDIR: seconds, under the budget
        calibrate_on_first_use(files, sparsity, budget if isinstance(budget, int) else room)
        decision = decide(files, ffn, budget, ctx, lookahead=lookahead, room=room, verbose=verbose)
    for line in decision.notes:
        print(line, file=sys.stderr)
    transformer, tokenizer, runtime = build(files, decision, threads, progress, verbose)
    if decision.auto is not None:
        fit, whose = decision.auto
        if files.default and decision.ffn == "predicted":
            whose = f"{whose}; {default_model_predictors(files.path)}"
        if decision.ffn == "gate":
            whose = f"{whose}; sparsity {files.gate.sparsity:g}, thresholds calibrated on {files.gate.calibration.get('text', '?')}"
        print(f"ffn: {decision.ffn} (--ffn auto, {f'{fit}; ' if fit else ''}{whose})", file=sys.stderr)
    return Model(transformer, runtime, ctx, (time.perf_counter() - t0) * 1e3), tokenizer


def warm_up(model: Transformer) -> None:
    """One decode step on a scratch cache at each thread count a step may run on (threads.StepThreads), as llama.cpp
    warms up at load: the decode's kernels load from Numba's cache here, in the load time, not in the first token's
    (45-60 ms of a 7-10 ms step for SmolLM2's Q4_K_M, 2026-11-24: it set decode's P99). Every weight in DRAM only: a
    flash runtime's step would read weights, and count them."""
    n = numba.get_num_threads()
    try:
        for t in step_counts(n):
            numba.set_num_threads(t)
            model.forward([model.cfg.bos_id or 0], model.new_cache(1))
    finally:
        numba.set_num_threads(n)


def context_size(ctx: int, cfg: ModelConfig) -> int:
    """-c: 0 means the model's default context (at most DEFAULT_MAX_CTX)."""
    ctx = ctx or cfg.default_ctx
    if ctx <= 0:
        raise UserError(f"context size must be positive, got {ctx}")
    if ctx > cfg.max_pos:
        raise UserError(f"context size {ctx} exceeds the model's maximum of {cfg.max_pos}")
    return ctx


def train_on_first_use(flashdir: str) -> None:
    """Train the default model's predictors in a child process (predictors/first_use.py): this process never imports
    torch, and its memory is not what training needed. The child's progress and its one error line go to stderr."""
    if find_spec("torch") is None:
        raise UserError("training the default model's predictors on first use needs torch: "
                        "pip install 'flashinfer-lite[train]' (or run with --ffn dense)")
    run_child([sys.executable, "-m", "predictors.first_use", str(flashdir)])


def calibrate_gate(files: ModelFiles, dram_budget: int | None = None, n_tokens: int = CALIBRATION_TOKENS,
                   progress: bool = False) -> None:
    """Calibrate the exact gate's thresholds of files' FLASHDIR (ffn.gate.measure_thresholds, on the built-in
    calibration text: predictors/calibration.txt, written for the project, never an evaluation text) and write them
    to FLASHDIR/gate.json. The model runs in this process under dram_budget (bytes; None: no limit), planned like
    the run after it, and is freed before that run: a child process beside this one would hold a second copy of the
    libraries and the runtime (a cold first run under a memory cgroup equal to the budget was killed so)."""
    from importlib import resources
    cfg = files.ckpt.config
    no_threshold = (np.zeros(cfg.ffn_dim, np.float32),) * cfg.n_layers
    files.gate = GateCalibration(0.0, (-1.0,) * cfg.n_layers, no_threshold, {})
    ctx = min(CALIBRATION_CTX, cfg.max_pos)
    # beside the model: the magnitudes' bins, and a window's [ctx, n] arrays of magnitudes, bins and masks
    held = cfg.n_layers * LayerMagnitudes.nbytes(cfg.ffn_dim, SPARSITIES) + 4 * ctx * cfg.ffn_dim * 4
    model, tokenizer, ffn = build(files, decide(files, "gate", None if dram_budget is None else dram_budget - held,
                                                ctx))
    text = (resources.files("predictors") / "calibration.txt").read_text()
    windows = list(token_segments(tokenizer, text, n_tokens, ctx, cfg.bos_id))
    try:
        by_sparsity = measure_thresholds(model, ffn, windows, SPARSITIES, progress)
    finally:
        ffn.reader.close()
        del model, ffn
    write_gate_file(files.path, cfg.ffn_dim, {"text": "the built-in calibration text (calibration.txt)",
                                              "tokens": int(sum(map(len, windows)))}, by_sparsity)
    del by_sparsity
    gc.collect()
    return_freed_heap()


def calibrate_on_first_use(files: ModelFiles, sparsity: float, dram_budget: int | None = None) -> None:
    """calibrate_gate on a FLASHDIR's first exact-gate run, under the run's budget; then read the thresholds into
    files.gate (decide again after)."""
    progress = sys.stderr.isatty()
    if progress:                # on a terminal, with its progress bar; a script's stderr keeps its one error line
        print(f"gate: calibrating the thresholds of {files.path} once, on first use", file=sys.stderr)
    calibrate_gate(files, dram_budget, progress=progress)
    files.gate = read_gate_file(files.path, files.ckpt.config.n_layers, files.ckpt.config.ffn_dim, sparsity)


def default_model_predictors(flashdir: str) -> str:
    record = (read_manifest(flashdir) or {}).get("calibration")
    how = f"trained on first use from {describe_calibration(record)}" if record else "trained with train-predictor"
    return f"its predictors were {how}"
