"""The FFN modes (--ffn), one registry: each mode says what it applies to, how it plans under a DRAM budget, which
kernels it needs compiled and how it is built. decide() runs the first mode that applies; the early minimum, the
warm-up's kernels and the build loop over MODES. This is the one module that compares mode names: a new mode is a
class here and a line in MODES.

  experts    a mixture of experts from a FLASHDIR: whole experts read from flash as the router picks them
             (ffn.experts.ExpertFFN); with split expert chunks, --ffn gate runs the exact gate inside each expert
  gate       a GLU model's exact gate (ffn.flash.ExactGate): every neuron's act(gate.x) * up.x from gate|up rows in
             DRAM, the calibrated threshold, the down rows of the neurons that clear it from flash; one function at
             every budget, and what --ffn auto runs for a gated (SiLU, GELU) model with the split layout
  dense      every neuron, weights in DRAM (ffn.dense.FeedForward; a quantized FLASHDIR: ffn.resident.ResidentFFN);
             --ffn auto's choice when the whole model fits the budget
  predicted  the neurons the low-rank predictor selects, read from flash (ffn.flash.FlashFFN): the product for
             ReLU-family models
  oracle     the neurons whose true activation is nonzero (ReLU) or clears the calibrated threshold (SwiGLU); needs
             the dense gate/up weights to know that, so it is a test mode, not a memory-saving one
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

import numpy as np

from storage.checkpoint import open_checkpoint
from storage.config import ModelConfig
from storage.errors import UserError
from storage.format import FlashCheckpoint
from storage.gate_file import DEFAULT_SPARSITY
from storage.half import half_matrix
from .budget import (HEAP_SLACK_BYTES, BelowMinimum, Budget, HeadSizes, down_scale_bytes, gate_reads, head_name,
                     head_sizes, place_head, plan_budget, plan_experts, plan_gate, plan_resident_ffn,
                     resident_bytes_for, stream_args, stream_settings)
from .flash_matrix import FlashMatrix, widened_rows
from .ffn.experts import ExpertFFN
from .ffn.flash import FlashFFN
from .ffn.quant import dense_row_bytes
from .ffn.resident import ResidentFFN
from .kernels.gemv import WIDEN_BLOCK_BYTES
from .model import Transformer, load_tensor, load_weights
from .ffn.dense import FeedForward
from .predictor_set import describe_calibration, read_manifest
from .kernels.blocks import COLUMN_SCALES_F16
from .warmup import FFN_STEPS, warm_up

# FFN tensors that live in the bundles on flash; everything else (including ffn.down.bias) stays resident.
_BUNDLED = re.compile(r"layers\.\d+\.ffn\.(gate|up|down)\.weight|layers\.\d+\.ffn\.(gate|up)\.bias")
# Left to load_head, as the plan places them (the runs with a BudgetPlan from flash: gate, predicted, oracle)
_HEAD = ("embed.weight", "lm_head.weight")
_EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.(gate|up|down)\.weight")   # in ffn.bin's expert chunks
AUTO = "auto"


# ----------------------------------------------------------------------------------------------------------------------
# What a decision is made on, and what it is

@dataclass(frozen=True)
class Facts:
    """What the registry asks of a model before any file is opened for a run: its config, the layout of the FLASHDIR
    that backs the run (None: none does, a dense run of an HF directory or GGUF), its resident kinds, and the contexts
    the run decodes together (serve --parallel: a KV cache each) and how each is kept (kv_pages.KVOptions; None: the
    defaults)."""
    cfg: ModelConfig
    layout: object
    kinds: dict
    contexts: int = 1
    kv_options: object = None

    @property
    def exact_gate(self) -> bool:
        """The exact gate runs this model under --ffn auto: a gated (SiLU, GELU) model with the split layout."""
        return self.layout is not None and bool(self.layout.parts) and self.cfg.exact_gate


@dataclass
class ModelFiles:
    """What decide() knows about a model, read before anything is decided (runtime.open_model_files)."""
    source: str                     # the model as named: -m, or the default model's file
    path: str                       # the FLASHDIR when flash_backed, else source
    default: bool                   # the default model: its predictors may be trained on first use
    flash_backed: bool              # a FLASHDIR backs the run: ckpt is its FlashCheckpoint
    ckpt: object                    # FlashCheckpoint, or the source's checkpoint (a dense run of an HF dir or GGUF)
    tokenizer: object
    predictors: object              # PredictorSet or None
    base_bytes: int | None          # the process base: the plan's, or a dense run's of a source (None: none measured)
    dense_bytes: int = 0            # DRAM a dense run of the source needs (a GGUF keeps its blocks: its file size)
    expert_freq: object = None      # a mixture of experts: [L, E] routings counted on calibration text, or None
    gate: object = None             # storage.gate_file.GateCalibration at the run's sparsity, or None
    loading_peak_bytes: int = 0     # RSS while the kernels loaded, before LLVM's pages left it (the minimum's floor:
                                    # minimum_bytes; warmup.measure_base_bytes)
    contexts: int = 1               # sequences decoded together (runtime.load's parallel): a KV cache each
    kv_options: object = None       # how each KV cache is kept (kv_pages.KVOptions, runtime.load's kv; None: defaults)

    @property
    def facts(self) -> Facts:
        layout = self.ckpt.layout if self.flash_backed else None
        return Facts(self.ckpt.config, layout, self.ckpt.resident_kinds if self.flash_backed else {}, self.contexts,
                     self.kv_options)

    @property
    def trained(self) -> bool:
        return self.predictors is not None and self.predictors.has_predictors

    def minimum_bytes(self, ffn: str, ctx: int, window: int = 5) -> int:
        """minimum_bytes of a run of these files: their FLASHDIR's facts, the process base measured and the loading's
        peak (what decide refuses below; the benches' minimum)."""
        c = self.ckpt
        return minimum_bytes(c.config, c.layout, c.resident_kinds, ffn, ctx, self.base_bytes or 0, window,
                             HEAP_SLACK_BYTES if self.base_bytes else 0, self.loading_peak_bytes, self.contexts,
                             self.kv_options)


@dataclass(frozen=True)
class Decision:
    """What a run will be: the FFN mode, the DRAM plan, and what must happen first."""
    mode: "Mode"
    plan: object                    # BudgetPlan or ExpertPlan (None: a dense run without a plan)
    train_predictors: bool          # the default model's predictors must be trained first (then decide again)
    lookahead: bool
    notes: tuple[str, ...] = ()     # stderr lines for before the weights load
    auto: tuple[str, str] | None = None   # --ffn auto's reason: (what it chose and why, whose predictors)
    calibrate_gate: bool = False    # gate: the thresholds must be calibrated first (then decide again)
    name: str = ""                  # the mode as said (a mixture of experts' exact gate: "gate"); default mode.name

    @property
    def ffn(self) -> str:
        return self.name or self.mode.name


# ----------------------------------------------------------------------------------------------------------------------
# Sizes a mode plans with

def resident_bytes_of(cfg: ModelConfig, layout, kinds: dict, dense_gate_up: bool = False,
                      on_flash: bool = False) -> int:
    """The resident line: float16 bundles take the resident matrices float16 too (half the DRAM, and GEMV reads half
    the bytes), quantized ones in blocks (`kinds`); float32 bundles keep the whole model exact. dense_gate_up: the
    dense gate/up weights, float32, kept for the run (--ffn oracle: the true activations need them). on_flash: without
    the embeddings and the head (head_sizes_of: placed by budget.place_head)."""
    resident = resident_bytes_for(cfg, half=layout.dtype != "f32", kinds=kinds, on_flash=on_flash) + \
        down_scale_bytes(layout, COLUMN_SCALES_F16)
    if dense_gate_up:
        resident += cfg.n_layers * cfg.ffn_dim * cfg.dim * 4 * (2 if cfg.glu else 1)
    return resident


def head_sizes_of(cfg: ModelConfig, layout, kinds: dict, ctx: int) -> HeadSizes:
    """budget.head_sizes of a run from `layout`'s FLASHDIR: its matrices kept as resident_bytes_of says, its device's
    stream settings."""
    s = stream_settings(layout)
    return head_sizes(cfg, layout.dtype != "f32", kinds, ctx, s.chunk_bytes, s.depth, widened_rows(cfg.dim))


def load_head(ckpt, weights: dict, plan, verbose: bool = False) -> None:
    """The token embeddings and the head into `weights` as `plan` places them (budget.place_head): the embeddings a
    FlashMatrix (rows read per step), the head resident as load_weights keeps it or a FlashMatrix streamed per
    token; tied, one matrix with both uses (resident: the rows are looked up in it)."""
    s = stream_settings(ckpt.layout)
    name = head_name(ckpt.config)
    on_flash = lambda n: FlashMatrix(*ckpt.rows_layout(n), s.chunk_bytes, s.depth)  # noqa: E731
    weights[name] = on_flash(name) if plan.head_read_bytes else load_tensor(ckpt, name, convert_of(ckpt.layout))
    if name != "embed.weight":
        weights["embed.weight"] = on_flash("embed.weight")
    if verbose:
        for n in dict.fromkeys(("embed.weight", name)):
            m, head = weights[n], n == name
            use = "the embeddings and the head" if n == "embed.weight" and head else "the head" if head else \
                "the embeddings"
            print(f"{n} ({use}): " + (m.describe(head) if isinstance(m, FlashMatrix) else "resident, as stored"),
                  file=sys.stderr)


def dense_ffn_bytes(layout) -> int:
    """DRAM of the FFN in RAM (DenseMode.build): a quantized layout's DenseLayer rows (each layer's in its block
    formats), else its vectors as the dense FeedForward keeps them (float16 matrices, float32 for f32 bundles)."""
    if layout.quantized:
        return sum(n * dense_row_bytes(g) for n, g in zip(layout.n_neurons, layout.geometries))
    return sum(layout.n_neurons) * (layout.n_vec * layout.d * (4 if layout.dtype == "f32" else 2)
                                    + 4 * len(layout.scalars))


def plan_in_ram(cfg: ModelConfig, layout, kinds: dict, budget, ctx: int, base_bytes: int,
                heap_slack_bytes: int | None = None, contexts: int = 1, kv_options=None):
    """The in-RAM FFN's plan (budget.plan_resident_ffn: every layer's weights as on flash, the prompt's widened
    blocks), or None when the whole model does not fit `budget` (a Budget, or what Budget.of takes). The heap's
    slack is counted with a process base (default)."""
    budget = Budget.of(budget)
    heap = (HEAP_SLACK_BYTES if base_bytes else 0) if heap_slack_bytes is None else heap_slack_bytes
    return plan_resident_ffn(cfg, layout, 1 << 60 if budget.bytes is None else budget.bytes, ctx,
                             resident_bytes_of(cfg, layout, kinds), dense_ffn_bytes(layout), 3 * WIDEN_BLOCK_BYTES,
                             base_bytes, heap_slack_bytes=heap, requested=budget.requested, contexts=contexts,
                             kv_options=kv_options)


def expected_max_active(cfg: ModelConfig, predictors) -> int:
    """The active count the window is sized for (its useful maximum is this x window tokens): twice the mean
    active count when the neuron frequencies say it, else half the layer. Not in the minimum
    (budget.MIN_WINDOW_ROWS)."""
    n = cfg.ffn_dim
    if predictors is None:
        return max(1, n // 2)
    mean = max(float(predictors.neuron_freq(i).sum()) for i in range(cfg.n_layers))
    return int(min(n, max(16, 2 * mean)))


def keeps_float16(ckpt) -> bool:
    """Whether a dense run keeps its matrices float16: a FLASHDIR of float16 (or int8) bundles. Not a quantized one:
    its FFN dequantizes to values float16 would round (its resident matrices stay in blocks: model.load_tensor)."""
    return isinstance(ckpt, FlashCheckpoint) and ckpt.layout.dtype in ("f16", "int8")


def convert_of(layout):
    """load_weights' conversion of resident matrices: float16 unless the FLASHDIR is float32."""
    return half_matrix if layout.dtype != "f32" else None


def say_readers(ffn, layout, verbose: bool) -> None:
    if verbose:
        print(ffn.reader.describe(), file=sys.stderr)
        if getattr(ffn, "stream", None) is not None:
            print(ffn.stream.describe(stream_settings(layout).source), file=sys.stderr)


# ----------------------------------------------------------------------------------------------------------------------
# The modes

class Mode:
    """One --ffn mode. applies: whether --ffn `ffn` may run this mode on a model of these facts; conditional: whether
    that also depends on the budget (fits); then decide (its plan), minimum (its plan's smallest budget, None: it
    refuses by name, not by budget; heap: the heap's slack it counts), kernels (warmup.FFN_STEPS it needs loaded before the process base is measured)
    and build ((transformer, FFN object or None))."""
    name: str
    help: str
    kernels: tuple[str, ...] = FFN_STEPS
    flash: bool = True              # asked for by name, it runs from a FLASHDIR (a source is converted first)
    predictors: bool = False        # it asks the FLASHDIR's predictor set (predictor_set.load_predictors)

    def applies(self, facts: Facts, ffn: str) -> bool:
        return ffn == self.name

    def conditional(self, facts: Facts, ffn: str) -> bool:
        return False

    def fits(self, files: ModelFiles, ffn: str, budget: Budget, ctx: int) -> bool:
        return True

    def minimum(self, facts: Facts, ffn: str, ctx: int, window: int, base_bytes: int, heap: int) -> int | None:
        raise NotImplementedError

    def decide(self, files: ModelFiles, ffn: str, budget: Budget, ctx: int, window: int, lookahead: bool,
               verbose: bool) -> Decision:
        raise NotImplementedError

    def build(self, files: ModelFiles, decision: Decision, threads, progress: bool, verbose: bool):
        raise NotImplementedError

    def whose(self, files: ModelFiles, whose: str) -> str:
        """--ffn auto's line: what to add to whose decision it was."""
        return whose


class ExpertsMode(Mode):
    name = "experts"
    help = "a mixture of experts' experts read from flash as its router picks them"

    def applies(self, facts, ffn):
        return facts.cfg.moe and facts.layout is not None and ffn != DenseMode.name

    def minimum(self, facts, ffn, ctx, window, base_bytes, heap):
        if ffn not in (AUTO, self.name):        # other modes: decide names the mode, not the budget
            return None
        return plan_experts(facts.cfg, facts.layout.experts, None, ctx,
                            resident_bytes_of(facts.cfg, facts.layout, facts.kinds), base_bytes,
                            pin=False, contexts=facts.contexts, kv_options=facts.kv_options).minimum_bytes

    def decide(self, files, ffn, budget, ctx, window, lookahead, verbose):
        """Its experts read from flash through the expert cache, as many per layer as the budget holds (every one
        with no budget). No predictor: the router says exactly which experts run. --ffn gate on split expert chunks
        runs the exact gate inside each expert."""
        ckpt = files.ckpt
        split = ckpt.layout.experts.split
        gate = ffn == GateMode.name
        if ffn not in (AUTO, self.name) and not (gate and split):
            raise UserError(f"--ffn {ffn} predicts neurons of a dense FFN; a mixture of experts runs --ffn auto (its "
                            f"experts read from flash as the router picks them), dense, or gate (the exact gate "
                            f"inside each expert: convert with --expert-chunks split)" + ("" if not gate else
                            f"; {files.path} has whole expert chunks"))
        if gate and files.gate is None:
            return Decision(self, None, False, False, (), None, calibrate_gate=True, name=ffn)
        resident = os.path.getsize(ckpt.flashdir / ckpt.layout.files["resident"])
        plan = plan_experts(ckpt.config, ckpt.layout.experts, budget.bytes, ctx, resident, files.base_bytes,
                            pin=files.expert_freq is not None, requested=budget.bytes is not None,
                            contexts=files.contexts, kv_options=files.kv_options)
        notes = (plan.table(),) if verbose or plan.requested else ()
        if gate:
            notes += (f"gate: inside each routed expert, sparsity {files.gate.sparsity:g}: only the down columns of "
                      f"neurons whose |coefficient| clears the layer's threshold are read",)
        return Decision(self, plan, False, lookahead, notes,
                        ("experts from flash", "the router") if ffn == AUTO else None, name=ffn if gate else "")

    def build(self, files, decision, threads, progress, verbose):
        ckpt, cfg = files.ckpt, files.ckpt.config
        weights = load_weights(ckpt, progress, skip=lambda n: bool(_EXPERT.fullmatch(n)),
                               convert=convert_of(ckpt.layout))
        gate = decision.ffn == GateMode.name
        ffn = ExpertFFN(cfg, ckpt.layout, weights, decision.plan, files.expert_freq, threads=threads,
                        lookahead=decision.lookahead, verbose=verbose,
                        thresholds=files.gate.thresholds if gate else None)
        if verbose:
            print(ffn.reader.describe(), file=sys.stderr)
        return Transformer(cfg, weights, ffn=ffn), ffn


class GateMode(Mode):
    name = "gate"
    help = "a gated model's exact gate: gate|up in DRAM, the down rows of the neurons that clear it from flash"
    kernels = ("neuron_cache", "gate")      # not the bundle FFN's nor the in-RAM FFN's

    def applies(self, facts, ffn):
        return ffn == self.name or (ffn == AUTO and facts.exact_gate)

    def minimum(self, facts, ffn, ctx, window, base_bytes, heap):
        """Its plan with every layer's gate|up rows streamed (budget.plan_gate, layers=0)."""
        if not facts.exact_gate:        # decide names what the model lacks
            return None
        head = head_sizes_of(facts.cfg, facts.layout, facts.kinds, ctx)
        return plan_gate(facts.cfg, facts.layout, 1 << 60, ctx, window, DEFAULT_SPARSITY, layers=0,
                         resident_bytes=resident_bytes_of(facts.cfg, facts.layout, facts.kinds, on_flash=True)
                         + head.minimum_bytes, base_bytes=base_bytes,
                         **stream_args(facts.layout), heap_slack_bytes=heap, contexts=facts.contexts,
                         kv_options=facts.kv_options).minimum_bytes

    def decide(self, files, ffn, budget, ctx, window, lookahead, verbose):
        """Its plan (budget.plan_gate) at any budget, including none (every down row in DRAM: the same function),
        and whether its thresholds must be calibrated first."""
        layout, cfg = files.ckpt.layout, files.ckpt.config
        if not layout.parts or not layout.glu:
            raise UserError(f"--ffn gate needs a GLU model converted with the split layout (gate_up.bin, down.bin); "
                            f"{files.path} has none: re-run `flashinfer-lite convert` (--ffn-layout auto or parts)")
        if not cfg.exact_gate:
            raise UserError(f"--ffn gate is for SiLU- or GELU-gated models; {files.path} uses {cfg.act}: use --ffn "
                            f"predicted")
        why = (f"gated model ({cfg.act}): the exact gate, no predictor",
               "the default model" if files.default else files.source) if ffn == AUTO else None
        if files.gate is None:
            return Decision(self, None, False, False, (), why, calibrate_gate=True)
        resident = resident_bytes_of(cfg, layout, files.ckpt.resident_kinds, on_flash=True)
        head = head_sizes_of(cfg, layout, files.ckpt.resident_kinds, ctx)

        def plan_for(budget_bytes: int, requested: bool):
            return place_head(lambda b, held: plan_gate(
                cfg, layout, b, ctx, window, files.gate.sparsity, resident_bytes=resident + held,
                base_bytes=files.base_bytes, **stream_args(layout), requested=requested,
                heap_slack_bytes=HEAP_SLACK_BYTES if files.base_bytes else 0, contexts=files.contexts,
                kv_options=files.kv_options), head,
                budget_bytes)
        plan = plan_for(*budget.split(plan_for(1 << 60, False).used_bytes))
        notes = ()
        gu = layout.parts["gate_up"]
        if plan.gate_layers < cfg.n_layers:
            streamed = sum(gu.region_bytes(i) for i in range(plan.gate_layers, cfg.n_layers))
            notes += (f"gate: the gate|up rows of {plan.gate_layers} of {cfg.n_layers} layers fit in the DRAM budget; "
                      f"the other {cfg.n_layers - plan.gate_layers} are read from flash as one sequential stream per "
                      f"layer ({streamed / 1e6:.1f} MB per token more)",)
        if verbose or plan.requested:
            notes += (plan.table(),)
        return Decision(self, plan, False, False, notes, why)

    def build(self, files, decision, threads, progress, verbose):
        ckpt, cfg = files.ckpt, files.ckpt.config
        weights = load_weights(ckpt, progress, skip=lambda n: bool(_BUNDLED.fullmatch(n)) or n in _HEAD,
                               convert=convert_of(ckpt.layout))
        load_head(ckpt, weights, decision.plan, verbose)
        down_bias = [weights.get(f"layers.{i}.ffn.down.bias") for i in range(cfg.n_layers)]
        ffn = FlashFFN.exact_gate(cfg, ckpt.layout, decision.plan, files.gate, down_bias, threads=threads,
                                  verbose=verbose, down_scales=ckpt.down_scales_all(),
                                  reads=gate_reads(ckpt.layout, decision.plan, files.gate))
        say_readers(ffn, ckpt.layout, verbose)
        return Transformer(cfg, weights, ffn=ffn), ffn

    def whose(self, files, whose):
        return (f"{whose}; sparsity {files.gate.sparsity:g}, thresholds calibrated on "
                f"{files.gate.calibration.get('text', '?')}")


class DenseMode(Mode):
    name = "dense"
    help = "every neuron, weights in DRAM"
    flash = False

    def applies(self, facts, ffn):
        return ffn in (self.name, AUTO)

    def conditional(self, facts, ffn):
        """--ffn auto on a FLASHDIR: dense only when the whole model fits (in RAM nothing is gained by predicting:
        every neuron from DRAM is exact and faster)."""
        return ffn == AUTO and facts.layout is not None

    def fits(self, files, ffn, budget, ctx):
        return not self.conditional(files.facts, ffn) or \
            plan_in_ram(files.ckpt.config, files.ckpt.layout, files.ckpt.resident_kinds, budget, ctx,
                        files.base_bytes, contexts=files.contexts, kv_options=files.kv_options) is not None

    def minimum(self, facts, ffn, ctx, window, base_bytes, heap):
        """--ffn dense holds every weight with no plan; auto's in-RAM plan has a minimum."""
        if not self.conditional(facts, ffn):
            return None
        return plan_in_ram(facts.cfg, facts.layout, facts.kinds, None, ctx, base_bytes, heap,
                           facts.contexts, facts.kv_options).minimum_bytes

    def decide(self, files, ffn, budget, ctx, window, lookahead, verbose):
        if self.conditional(files.facts, ffn):
            whose = "the default model" if files.default else \
                f"{files.source} has {'trained' if files.trained else 'no trained'} predictors"
            plan = plan_in_ram(files.ckpt.config, files.ckpt.layout, files.ckpt.resident_kinds, budget, ctx,
                               files.base_bytes, contexts=files.contexts, kv_options=files.kv_options)
            notes = (plan.table(),) if verbose or plan.requested else ()
            return Decision(self, plan, False, False, notes, ("the whole model fits in DRAM", whose))
        if budget.requested:
            raise UserError("--dram-budget applies to --ffn predicted/oracle; --ffn dense keeps every weight in DRAM"
                            if ffn == self.name else
                            f"--dram-budget needs a sparse FFN, and {files.source} has no predictors: run "
                            f"`flashinfer-lite collect` and `flashinfer-lite train-predictor`, or use --ffn oracle")
        notes = ()
        if budget.auto and files.dense_bytes > budget.bytes:
            notes = (f"note: {files.source} needs about {files.dense_bytes / 2**20:.0f} MiB in DRAM dense and "
                     f"{budget.bytes / 2**20:.0f} MiB is available; to run it from flash, make its predictors: "
                     f"`flashinfer-lite convert`, `flashinfer-lite collect`, `flashinfer-lite train-predictor` "
                     f"(docs/PREDICTORS.md)",)
        auto = ("", f"{files.source} has no trained predictors") if ffn == AUTO else None
        return Decision(self, None, False, False, notes, auto)

    def build(self, files, decision, threads, progress, verbose):
        """A FLASHDIR's model with every weight in DRAM: a quantized one as stored, resident matrices in blocks and the
        FFN as ResidentFFN; any other as dense FeedForward matrices (float16, float32 for f32 bundles). A source's as
        stored (a GGUF keeps its blocks)."""
        ckpt = files.ckpt
        if not files.flash_backed:      # its kernels are loaded (runtime.open_model_files: warmup.dense_warm_up)
            return Transformer(ckpt.config, load_weights(ckpt, progress, keep_blocks=True)), None
        if ckpt.config.moe:    # every expert read from its chunk, kept as stored (float16, float32 or blocks)
            model = Transformer(ckpt.config, load_weights(ckpt, progress, convert=convert_of(ckpt.layout)))
        elif not ckpt.layout.quantized:
            model = Transformer(ckpt.config, load_weights(ckpt, progress,
                                                          convert=half_matrix if keeps_float16(ckpt) else None))
        else:
            weights = load_weights(ckpt, progress, skip=lambda n: bool(_BUNDLED.fullmatch(n)),
                                   convert=convert_of(ckpt.layout))
            down_bias = [weights.get(f"layers.{i}.ffn.down.bias") for i in range(ckpt.config.n_layers)]
            model = Transformer(ckpt.config, weights, ffn=ResidentFFN(ckpt.config, ckpt, down_bias, progress))
        warm_up(model)
        return model, None


class PredictedMode(Mode):
    predictors = True           # its selector and its window's expected set (OracleMode: the activation thresholds)
    name = "predicted"
    help = "the neurons the low-rank predictor selects, read from flash"

    def applies(self, facts, ffn):
        return ffn in (self.name, AUTO)

    def dense_gate_up(self) -> bool:
        return False

    def minimum(self, facts, ffn, ctx, window, base_bytes, heap):
        head = head_sizes_of(facts.cfg, facts.layout, facts.kinds, ctx)
        return plan_budget(facts.cfg, facts.layout, 1 << 60, ctx, window,
                           resident_bytes=resident_bytes_of(facts.cfg, facts.layout, facts.kinds,
                                                            self.dense_gate_up(), on_flash=True)
                           + head.minimum_bytes,
                           base_bytes=base_bytes, **stream_args(facts.layout), heap_slack_bytes=heap,
                           contexts=facts.contexts, kv_options=facts.kv_options).minimum_bytes

    def check(self, files, ffn):
        if not files.trained and not files.default:
            raise UserError(f"{files.path} does not fit the DRAM budget and has no predictors to run it from flash: "
                            f"run `flashinfer-lite collect` and `flashinfer-lite train-predictor`" if ffn == AUTO else
                            f"{files.path} has no predictors: run `flashinfer-lite collect` and "
                            f"`flashinfer-lite train-predictor`")

    def decide(self, files, ffn, budget, ctx, window, lookahead, verbose):
        """The plan (budget.plan_budget) for the budget: a size; auto: the whole model when it fits, else that much,
        said in one line; none: room for the whole model (every neuron pinned, the full window). Planned before any
        weight loads: a budget too small fails before the work (before first-use training too)."""
        self.check(files, ffn)
        cfg, layout = files.ckpt.config, files.ckpt.layout
        lookahead = lookahead and self.guesses()
        resident = resident_bytes_of(cfg, layout, files.ckpt.resident_kinds, self.dense_gate_up(), on_flash=True)
        head = head_sizes_of(cfg, layout, files.ckpt.resident_kinds, ctx)

        def plan_for(budget_bytes: int, requested: bool):
            return place_head(lambda b, held: plan_budget(
                cfg, layout, b, ctx, window, max_active=expected_max_active(cfg, files.predictors),
                resident_bytes=resident + held, base_bytes=files.base_bytes, **stream_args(layout),
                requested=requested, lookahead=lookahead,
                heap_slack_bytes=HEAP_SLACK_BYTES if files.base_bytes else 0, contexts=files.contexts,
                kv_options=files.kv_options), head,
                budget_bytes)
        whole = plan_for(1 << 60, False).used_bytes
        plan, notes = plan_for(*budget.split(whole)), ()
        if budget.auto and plan.requested:
            notes = (f"dram budget: auto = {budget.bytes / 2**20:.0f} MiB (available memory less a margin); the "
                     f"model's {whole / 2**20:.0f} MiB do not fit, so the FFN neurons that do not are read from "
                     f"flash",)
        if verbose or plan.requested:
            notes += (plan.table(),)
        return Decision(self, plan, self.guesses() and not files.trained, lookahead, notes,
                        ("from flash", "the default model" if files.default else
                         f"{files.source} has {'trained' if files.trained else 'no trained'} predictors")
                        if ffn == AUTO else None)

    def guesses(self) -> bool:
        """Its set is a predictor's guess: it can be trained on first use, and looked ahead."""
        return True

    def select(self, files, weights):
        return files.predictors.predict

    def build(self, files, decision, threads, progress, verbose):
        ckpt, predictors, cfg = files.ckpt, files.predictors, files.ckpt.config
        weights = load_weights(ckpt, progress, skip=lambda n: bool(_BUNDLED.fullmatch(n)) or n in _HEAD,
                               convert=convert_of(ckpt.layout))
        load_head(ckpt, weights, decision.plan, verbose)
        ffn = FlashFFN.predicted(cfg, ckpt.layout, decision.plan, self.select(files, weights), predictors,
                                 down_bias=[weights.get(f"layers.{i}.ffn.down.bias") for i in range(cfg.n_layers)],
                                 threads=threads, verbose=verbose, down_scales=ckpt.down_scales_all(),
                                 lookahead=lookahead_selector(cfg, weights, predictors) if decision.lookahead else None)
        say_readers(ffn, ckpt.layout, verbose)
        return Transformer(cfg, weights, ffn=ffn), ffn

    def whose(self, files, whose):
        return f"{whose}; {default_model_predictors(files.path)}" if files.default else whose


class OracleMode(PredictedMode):
    name = "oracle"
    help = "the truly active neurons (a test mode: it keeps the dense gate/up weights to know them)"

    def applies(self, facts, ffn):
        return ffn == self.name

    def dense_gate_up(self) -> bool:
        return True

    def check(self, files, ffn):
        pass

    def guesses(self) -> bool:
        return False

    def select(self, files, weights):
        return oracle_selector(files.ckpt.config, files.ckpt, files.predictors)


# In the order decide() asks them; auto is no mode of its own: the first that applies and fits
MODES = (ExpertsMode(), GateMode(), DenseMode(), PredictedMode(), OracleMode())
FFN_MODES = (AUTO, *(m.name for m in MODES))        # --ffn's choices
AUTO_HELP = ("experts for a mixture of experts; gate for a SiLU- or GELU-gated model with the split layout (the "
             "default model: thresholds calibrated on first use); else dense when the model fits the budget, else "
             "predicted")


def ffn_help() -> str:
    """--ffn's help, from the registry."""
    return "; ".join([*(f"{m.name}: {m.help}" for m in MODES), f"auto (default): {AUTO_HELP}"])


def check_mode(ffn: str) -> None:
    if ffn not in FFN_MODES:
        raise UserError(f"unknown --ffn mode '{ffn}' (choose from {', '.join(FFN_MODES)})")


def reach(facts: Facts, ffn: str) -> list[Mode]:
    """The modes --ffn `ffn` may run on a model of these facts, in decide()'s order: those that apply, up to the
    first whose choice does not depend on the budget."""
    found = []
    for mode in MODES:
        if mode.applies(facts, ffn):
            found.append(mode)
            if not mode.conditional(facts, ffn):
                break
    return found


def decide(files: ModelFiles, ffn: str, budget=None, ctx: int | None = None, window: int = 5,
           lookahead: bool = False, verbose: bool = False) -> Decision:
    """What runs, from the model's facts and the flags; nothing is loaded, nothing printed. budget: a Budget (or what
    Budget.of takes)."""
    check_mode(ffn)
    budget = Budget.of(budget)
    ctx = ctx or files.ckpt.config.default_ctx
    for mode in reach(files.facts, ffn):
        if mode.fits(files, ffn, budget, ctx):
            try:
                decision, refusal = mode.decide(files, ffn, budget, ctx, window, lookahead, verbose), None
            except BelowMinimum as e:
                decision, refusal = None, e
            if budget.requested:
                refusal = floor_refusal(budget.bytes, refusal, files.loading_peak_bytes, files.base_bytes)
            if refusal is not None:
                raise refusal from None
            return decision
    raise UserError(f"--ffn {ffn} does not apply to {files.source}")


def floor_refusal(budget_bytes: int, refusal: BelowMinimum | None, peak_bytes: int, base_bytes: int,
                  estimated: bool = False) -> BelowMinimum | None:
    """minimum_bytes' rule for a budget, in one place: at least the plan's minimum and the loading's peak. refusal:
    the plan's (None: the budget holds the plan). The refusal to raise (the plan's, or below_loading_peak's when the
    peak is the higher floor), else None. decide applies it to what it measured, runtime.refuse_below_minimum to its
    estimate before loading."""
    if refusal is None and budget_bytes >= peak_bytes:
        return None
    if refusal is not None and refusal.minimum_bytes >= peak_bytes:
        return refusal
    return below_loading_peak(budget_bytes, peak_bytes, base_bytes, estimated)


def below_loading_peak(budget_bytes: int, peak_bytes: int, base_bytes: int, estimated: bool = False) -> BelowMinimum:
    """The refusal of a budget under the loading's peak (minimum_bytes' floor), measured (decide) or estimated before
    loading (runtime.refuse_below_minimum): one wording."""
    about = "about " if estimated else ""
    return BelowMinimum(budget_bytes, peak_bytes, f"{'estimated before loading: ' if estimated else ''}loading the "
                        f"kernels takes the process to {about}{peak_bytes / 2**20:.1f} MiB from a process base of "
                        f"{about}{base_bytes / 2**20:.1f} MiB, over the plan's minimum")


def minimum_bytes(cfg: ModelConfig, layout, kinds: dict, ffn: str, ctx: int, base_bytes: int,
                  window: int = 5, heap_slack_bytes: int = HEAP_SLACK_BYTES, loading_peak_bytes: int = 0,
                  contexts: int = 1, kv_options=None) -> int:
    """The smallest --dram-budget a run of --ffn `ffn` may be planned with (--lookahead off), on the layout its
    FLASHDIR has (or conversion will make): the smallest of the minimums of the modes it may run (reach), with the
    process base `base_bytes` and the heap's slack (a run plans with HEAP_SLACK_BYTES; one that plans the model's
    part alone, base 0, without); 0 when none plans one (--ffn dense; a mode a mixture of experts refuses by name).
    A mixture of experts' counts the resident file's tensor bytes (decide plans with the file's size: its header
    more). At least `loading_peak_bytes`: the most the process held while loading (warmup.measure_base_bytes' peak),
    which decide refuses a budget under too: a small model's plan can be below it (its weights less than the LLVM
    pages dropped once the kernels are loaded), and would promise a peak the process has already passed."""
    facts = Facts(cfg, layout, kinds, contexts, kv_options)
    found = [m.minimum(facts, ffn, ctx, window, base_bytes, heap_slack_bytes) for m in reach(facts, ffn)]
    found = [b for b in found if b is not None]
    return max(min(found), loading_peak_bytes) if found else 0


def kernels_for(facts: Facts, ffn: str) -> set[str]:
    """The FFN kernels (warmup.FFN_STEPS) a run of --ffn `ffn` may use: what the process base is measured with."""
    return {k for m in reach(facts, ffn) for k in m.kernels}


def needs_predictors(facts: Facts, ffn: str) -> bool:
    """Whether a run of --ffn `ffn` may ask the FLASHDIR's predictor set (a mode it may run says so): loaded then,
    before the process base is measured; the exact gate and a mixture of experts never do."""
    return any(m.predictors for m in reach(facts, ffn))


def runs_from_flash(ffn: str, source: str | None, budget: Budget, open_source=open_checkpoint) -> bool:
    """Whether --ffn `ffn` runs a model named by `source` (None: the default model, a GGUF) from a FLASHDIR,
    converting it into the cache on first use. A mode asked for by name: as the mode says. auto: the default model;
    a mixture of experts always; a SiLU- or GELU-gated model given a --dram-budget, or under auto when its dense
    weights (a GGUF's file, else float32) do not fit what the machine can give (the exact gate needs no predictors; a
    ReLU-family model needs trained ones, and is told so). open_source: what opens the source's checkpoint."""
    if ffn != AUTO:
        return next(m for m in MODES if m.name == ffn).flash
    if source is None:
        return True
    cfg = open_source(str(source)).config
    if cfg.moe:
        return True
    if not cfg.exact_gate or budget.bytes is None:
        return False
    return not budget.auto or dense_bytes_of(str(source), cfg) > budget.bytes


def plans(ffn: str) -> bool:
    """Whether --ffn `ffn` plans the budget (every mode but dense, which holds every weight)."""
    return ffn != DenseMode.name


def predicts(ffn: str) -> bool:
    """Whether --ffn `ffn` names the predicted mode (a predictor's set: eval reports the predictor's share)."""
    return ffn == PredictedMode.name


def dense_bytes_of(source: str, cfg: ModelConfig) -> int:
    """DRAM a dense run of an HF directory or GGUF needs: a GGUF keeps its blocks (about its file's size), anything
    else counts float32."""
    if source.endswith(".gguf") and os.path.isfile(source):
        return os.path.getsize(source)
    return resident_bytes_for(cfg) + cfg.n_layers * cfg.ffn_dim * cfg.dim * 4 * (3 if cfg.glu else 2)


# ----------------------------------------------------------------------------------------------------------------------
# The selectors the predicted and oracle modes build with

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


def default_model_predictors(flashdir: str) -> str:
    record = (read_manifest(flashdir) or {}).get("calibration")
    how = f"trained on first use from {describe_calibration(record)}" if record else "trained with train-predictor"
    return f"its predictors were {how}"
