"""Loading a model to run, one pipeline: --dram-budget resolved once (budget.Budget) -> the model's facts
(open_model_files: a budget below the model's minimum refused in the first second, then the model's files as a first
use left them (located), the kernels' warm-up and the process base) -> decide (modes.decide: the FFN mode and its
DRAM plan) -> build (the mode's). Prepare is what a first use lacks, done where its absence is found, once: the
default model's fetch and the conversion into the cache (prepare_files), the kernels compiled in child processes
(open_model_files, before the tokenizer), the default model's predictors trained and the exact gate's thresholds
calibrated (decide_and_build, which then decides again). load() is the library's entry (flashinfer_lite.load), which
generate, chat, serve and eval call; load_runtime() is the same pipeline for a given path, without first-use
training; calibrate_gate builds its uncalibrated model through it too.
"""
from __future__ import annotations

import functools
import gc
import os
import sys
import time
from dataclasses import dataclass, replace
from importlib.util import find_spec
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from storage.cache import cached_conversion, flashdir_for, resolve_model, roughly
from storage.checkpoint import open_checkpoint
from storage.config import ModelConfig
from storage.convert import DEFAULT_DTYPE, layout_for, resident_kinds, resident_names
from storage.errors import UserError, run_child
from storage.format import FlashCheckpoint, FlashLayout, is_flashdir, verify_at_load
from storage.gate_file import DEFAULT_SPARSITY, SPARSITIES, GateCalibration, read_gate_file, write_gate_file
from storage.tokenizer import token_segments

from . import BLAS_THREADS_FROM_USER
from . import default_model
from .budget import HEAP_SLACK_BYTES, BelowMinimum, Budget, positions, resident_matrix_shapes
from .default_model import default_model_path, ensure_default_model
from .ffn.gate import (CALIBRATION_CTX, CALIBRATION_TOKENS, LayerMagnitudes, calibration_seconds,
                       measure_thresholds)
from .kv_pages import KVOptions, writable_directory
from .model import Transformer, open_any
from .modes import (Facts, GateMode, ModelFiles, check_mode, decide, dense_bytes_of, kernels_for,
                    floor_refusal, minimum_bytes, needs_predictors, plans, reach, runs_from_flash)
from .predictor_set import load_expert_freq, load_predictors
from .process import RSS_MARKS, keep_freed_arrays_out_of_rss, mark_rss, peak_rss_bytes, return_freed_heap
from .kernels.blocks import set_act8
from .threads import set_threads
from .warmup import (base_estimate_bytes, base_parts_table, compile_in_child, compiled_stamp, drop_llvm_pages,
                     forget_early_rss, loading_excess_bytes, measure_base_bytes, measure_dense_base_bytes)


def one_blas_thread() -> None:
    """What OPENBLAS_NUM_THREADS=1 in flashinfer_lite/__init__.py does, for a process that loaded numpy first (the
    variable is read once, then): OpenBLAS's spinning threads, beside Numba's, slow SmolLM2's dense FFN by an order
    of magnitude (bench/README.md, "Figures behind the library's comments").
    A user's own OPENBLAS_NUM_THREADS is left alone."""
    if not BLAS_THREADS_FROM_USER:
        threadpool_limits(1, user_api="blas")


# ----------------------------------------------------------------------------------------------------------------------
# The facts decide() is given

def model_facts(source: str | None, cached: bool = True) -> tuple[ModelConfig, FlashLayout, dict]:
    """(config, layout, resident kinds) of the FLASHDIR a run of the model plans with, from a header, config.json or
    manifest alone: its cached conversion's when there is one (cached: a build before this one may have made it,
    e.g. with a q8_0 down), else a source's as conversion will make them (convert.layout_for, resident_kinds).
    source None: the default model, from default_model's record of its header while the file is not fetched yet."""
    if source is None:
        if not default_model_path().is_file():
            return default_model_facts()
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


def default_model_facts() -> tuple[ModelConfig, FlashLayout, dict]:
    """model_facts of the default model before its first use fetches it: default_model's record of its header."""
    cfg = ModelConfig(**default_model.CONFIG)
    layout = FlashLayout.create(cfg.dim, [cfg.ffn_dim] * cfg.n_layers, default_model.FFN_DTYPES[0], cfg.glu,
                                layer_dtypes=[default_model.FFN_DTYPES] * cfg.n_layers, config=cfg.to_dict())
    kinds = {n: default_model.EMBED_KIND if n == "embed.weight" else default_model.ATTENTION_KIND
             for n in resident_matrix_shapes(cfg)}
    return cfg, layout, kinds


# What the early refusal leaves below its estimate: the process base of two runs differs by well under this
EARLY_SLACK_BYTES = 2 << 20


def refuse_below_minimum(source: str | None, ffn: str, dram_budget: int, ctx: int,
                         base_bytes: int | None = None, contexts: int = 1, kv_options=None) -> None:
    """Raise BelowMinimum when `dram_budget` (bytes) is below what a run of --ffn `ffn` of the model (source None:
    the default model) needs, in the first second: before fetch, conversion, kernel compilation or training spend
    minutes. The model's part is the planner's own (modes.minimum_bytes, on model_facts); the process base is the
    caller's when it fixes one, else warmup.base_estimate_bytes' (exact within EARLY_SLACK_BYTES once this
    installation has run the model). contexts: the sequences decoded together (a KV cache each, kept as kv_options
    says: kv_pages.KVOptions)."""
    cfg, layout, kinds = model_facts(source)
    ctx = context_size(ctx, cfg)
    base = base_estimate_bytes(layout, cfg.vocab_size) if base_bytes is None else base_bytes
    peak = base + loading_excess_bytes(layout) if base_bytes is None else 0     # the loading's, as last measured
    # the heap's slack as the plan will count it: none when the caller plans the model's part alone (base 0)
    minimum = minimum_bytes(cfg, layout, kinds, ffn, ctx, base, heap_slack_bytes=HEAP_SLACK_BYTES if base else 0,
                            contexts=contexts, kv_options=kv_options)   # the plan's: the peak is floor_refusal's
    if not minimum:             # no mode --ffn may run plans one: decide refuses it by name
        return
    refusal = None if dram_budget >= minimum - EARLY_SLACK_BYTES else BelowMinimum(
        dram_budget, minimum - EARLY_SLACK_BYTES, f"estimated before loading: process base about "
        f"{base / 2**20:.1f} MiB, the model's weights, kv cache and buffers for {positions(ctx, contexts)} "
        f"{(minimum - base) / 2**20:.1f} MiB")
    refusal = floor_refusal(dram_budget, refusal, peak - EARLY_SLACK_BYTES, base, estimated=True)
    if refusal is not None:
        raise refusal


def open_model_files(model, ffn: str, verify: bool = True, progress: bool = False,
                     base_bytes: int | None = None, ctx: int = 0, sparsity: float = DEFAULT_SPARSITY,
                     dram_budget=None, contexts: int = 1, kv_options: KVOptions | None = None) -> ModelFiles:
    """The facts decide() needs. A FLASHDIR backs every mode but dense of an HF directory or GGUF, and auto of one
    that needs no predictors to run from flash when it has to (modes.runs_from_flash); any other runs dense. Such a
    model is converted into the cache on first use, and a launch checks sizes and the verified stamp, not every byte.
    The process base is measured here, on a process that holds everything but the weights (tokenizer, the predictors
    when a mode --ffn may run asks them: modes.needs_predictors, the kernels of the modes --ffn may run:
    modes.kernels_for), unless base_bytes is given. dram_budget: a Budget (or
    what Budget.of takes); a size under the model's minimum is refused before any of that work, the default model's
    fetch included (refuse_below_minimum), for the modes that plan it (dense holds every weight, with no plan).
    contexts: the sequences the run decodes together (load's parallel), each with a KV cache the plans count, kept as
    kv_options says (load's kv; None: the defaults)."""
    check_mode(ffn)
    again = bool(RSS_MARKS) and RSS_MARKS[-1][0] != "numba"       # a load before this one in this process
    RSS_MARKS[:] = [] if again else RSS_MARKS                       # this one's parts start anew
    mark_rss("the process before this load" if again else "flashinfer-lite and the libraries it imports")
    start_peak = peak_rss_bytes()
    forget_early_rss()
    drop_llvm_pages()           # what its import touched: of it, loading the kernels reads back 48 of 67 MiB
    mark_rss("LLVM library pages dropped")
    budget = Budget.of(dram_budget)
    default = model is None
    open_source = functools.cache(open_any)     # a source's header is read once (a 152k vocabulary: 0.1 s)
    flash_backed = (not default and is_flashdir(model)) or runs_from_flash(ffn, None if default else str(model),
                                                                           budget, open_source)
    if budget.requested and flash_backed and plans(ffn):
        refuse_below_minimum(None if default else str(model), ffn, budget.bytes, ctx, base_bytes, contexts,
                             kv_options)
    source, path = located(model, flash_backed) or prepare_files(model, ffn, flash_backed, progress)
    keep_freed_arrays_out_of_rss()  # in a dense run too: a short prompt touches a page of each layer's KV, not 2 MiB
    if not flash_backed or not plans(ffn):     # every weight in DRAM, as stored: no plan, no predictors
        if flash_backed and verify:   # the resident file and the manifest are checked, not only each layer
            verify_at_load(source, progress=progress)
        ckpt = open_source(source)
        files = ModelFiles(source, source, default, flash_backed, ckpt, open_tokenizer(ckpt), None, None,
                           dense_bytes_of(source, ckpt.config), contexts=contexts, kv_options=kv_options)
        if not flash_backed:    # a source's matrices, as stored: its kernels load before them (DenseMode.build)
            base, files.loading_peak_bytes = measure_dense_base_bytes(ckpt, start_peak)
            files.base_bytes = base if base_bytes is None else base_bytes
        return files
    if verify:
        verify_at_load(path, progress=progress)
    ckpt = FlashCheckpoint(path)
    # the one place a load compiles (measure_base_bytes only loads): on a first use of these kernels, the compilers
    # run beside this process before it holds its tokenizer (Qwen2.5's: 49 MiB)
    if base_bytes is None and not compiled_stamp(ckpt.layout).exists():
        compile_in_child(ckpt.layout)
    files = ModelFiles(source, str(path), default, True, ckpt, open_tokenizer(ckpt), None, None,
                       expert_freq=load_expert_freq(path) if ckpt.config.moe else None, contexts=contexts,
                       kv_options=kv_options)
    if needs_predictors(files.facts, ffn):      # in the base only when a mode --ffn may run asks them
        files.predictors = load_predictors(path)
        mark_rss("predictors")
    if base_bytes is None:
        files.base_bytes, files.loading_peak_bytes = measure_base_bytes(ckpt.layout, kernels_for(files.facts, ffn),
                                                                        start_peak)
    else:
        files.base_bytes = base_bytes
    if not ckpt.config.moe or ckpt.layout.experts.split:    # split expert chunks run the exact gate too
        files.gate = read_gate_file(path, ckpt.config.n_layers, ckpt.config.ffn_dim, sparsity)
    return files


def located(model, flash_backed: bool) -> tuple[str, str] | None:
    """(source, path) of a model whose first use is done, as a warm load finds them (its header read, no weight): the
    source (-m, or the default model's file) and the FLASHDIR that backs the run (itself, or the source's conversion
    in the cache, found by the content digest the cache remembers with the files' sizes, mtimes and inodes), or the
    source when none does. None: a first use's work comes first (prepare_files). The default model's file is vouched
    for by that digest as well: its sha256 was checked before it was converted, and a file changed since is a first
    use's work again."""
    if model is None and not flash_backed:      # a dense run of the default model's file: its stamp checked first
        return None
    source = str(default_model_path()) if model is None else str(model)
    if not Path(source).expanduser().exists():
        return None
    if not flash_backed or is_flashdir(source):
        return source, source
    made = cached_conversion(Path(source).expanduser().resolve(), known_only=True)
    return (source, str(made)) if made is not None and is_flashdir(made) else None


def prepare_files(model, ffn: str, flash_backed: bool, progress: bool) -> tuple[str, str]:
    """A model's first use, before its files are opened: the default model's file fetched and checked by its sha256
    (default_model.ensure_default_model), a source converted into the cache (cache.flashdir_for, announced by its
    line); (source, path) as located finds them from then on."""
    source = str(ensure_default_model()) if model is None else str(model)
    if not flash_backed:
        return source, source
    return source, flashdir_for(source, progress, then=lambda cfg, layout: calibration_next(cfg, layout, ffn))


def open_tokenizer(ckpt):
    """The model's tokenizer, with what building it left free returned to the system (38 of Qwen2.5's 82 MiB, out of
    the peak) and its chat template rendered once, so that jinja2 (6.7 MiB) is in the process base, not first in a
    prompt's; each noted for the base's parts."""
    mark_rss("the model's files opened")
    tokenizer = ckpt.tokenizer()
    return_freed_heap()
    mark_rss(f"tokenizer ({tokenizer.vocab_size} tokens)")
    if tokenizer.chat_template:
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
        except UserError:           # a template that fails fails where it is used, with its own line
            pass
        mark_rss("chat template (jinja2)")
    return tokenizer


def calibration_next(cfg: ModelConfig, layout: FlashLayout, ffn: str) -> tuple[str, float]:
    """For the line announcing a first use's conversion (storage.cache.first_use_line): the exact gate's calibration,
    and roughly how long it takes, when a run of --ffn `ffn` on the conversion's layout runs the exact gate (a new
    conversion has no thresholds yet); else nothing."""
    if not isinstance(next(iter(reach(Facts(cfg, layout, {}), ffn)), None), GateMode):
        return "", 0.0
    return (f", then calibrating the exact gate's thresholds on {CALIBRATION_TOKENS:,} tokens",
            calibration_seconds(cfg))


# ----------------------------------------------------------------------------------------------------------------------
# Decide, prepare, build

def decide_and_build(files: ModelFiles, ffn: str, budget: Budget, ctx: int, window: int = 5, lookahead: bool = False,
                     threads: int | None = None, progress: bool = False, verbose: bool = False,
                     sparsity: float = DEFAULT_SPARSITY, train: bool = True, say: bool = True):
    """(decision, transformer, FFN object or None): decide; prepare what the decision needs first, each a step of its
    own before deciding again (train: the default model's predictors, on first use, in a child process; else a model
    without them is an error naming the commands to run; the exact gate's thresholds, calibrated in this process
    under the budget: seconds); say the decision's notes (say); build."""
    decision = decide(files, ffn, budget, ctx, window, lookahead, verbose)
    if decision.train_predictors:
        if not train:
            raise UserError(f"{files.path} has no predictors yet: train them first (first use of the default model)")
        train_on_first_use(files.path)
        files.predictors = load_predictors(files.path)
        files.base_bytes, peak = measure_base_bytes(files.ckpt.layout, kernels_for(files.facts, ffn))
        files.loading_peak_bytes = max(files.loading_peak_bytes, peak)     # the first loading's stays the floor
        decision = decide(files, ffn, budget, ctx, window, lookahead, verbose)
    if decision.calibrate_gate:        # the first exact-gate run of a FLASHDIR
        calibrate_on_first_use(files, sparsity, budget)
        decision = decide(files, ffn, budget, ctx, window, lookahead, verbose)
    if say:
        if verbose and files.base_bytes:
            print(base_parts_table(files.base_bytes), file=sys.stderr)
        for line in decision.notes:
            print(line, file=sys.stderr)
    built = decision.mode.build(files, decision, threads, progress, verbose)
    built[0].kv_options = run_kv_options(files, decision)
    return (decision, *built)


def run_kv_options(files: ModelFiles, decision) -> KVOptions:
    """The load's KV options (files.kv_options) with the plan's pages in DRAM (none planned: every page), and the file
    of pages on flash next to the model's flash files unless --kv-dir says where (a model run from DRAM: the cache)."""
    o = files.kv_options or KVOptions()
    pages = getattr(decision.plan, "kv_dram_pages", None)
    if o.directory is not None:
        writable_directory(o.directory)
    elif files.path is not None and is_flashdir(files.path) and os.access(files.path, os.W_OK):
        o = replace(o, directory=str(files.path))
    return replace(o, dram_pages=pages)


def load_runtime(path, ffn: str = "dense", dram_budget: int | str | None = None, ctx: int | None = None,
                 window: int = 5, threads: int | None = None, progress: bool = False, verbose: bool = False,
                 verify: bool = True, base_bytes: int | None = None, lookahead: bool = False,
                 sparsity: float = DEFAULT_SPARSITY, kv: KVOptions | None = None):
    """(model, tokenizer, ffn) for a model path and an FFN mode, through load()'s pipeline without first-use
    training (a model without the predictors its run needs is an error naming the commands to run); ffn is the
    FFN object (None when every weight is in DRAM).

    dram_budget: bytes for everything the process keeps (default: room for the whole model); "auto": the whole model
    when it fits in what the machine can give (budget.auto_budget_bytes), else that much.
    base_bytes: the plan's process base; None measures this process (warmup.measure_base_bytes).
    lookahead: in predicted mode, start each layer's reads one layer early on a guess (modes.lookahead_selector). Off
    by default: on the 7B-shaped bench at a 25% budget the device is the bottleneck and the wrong guesses' extra bytes
    cost more than the early start hides (bench/README.md).
    """
    one_blas_thread()
    kv = kv_options_of(kv)
    budget = Budget.of(dram_budget)
    files = open_model_files(path, ffn, verify, progress, base_bytes, ctx or 0, sparsity, budget, kv_options=kv)
    _, transformer, flash_ffn = decide_and_build(files, ffn, budget, ctx, window, lookahead, threads, progress,
                                                 verbose, sparsity, train=False)
    return transformer, files.tokenizer, flash_ffn


def kv_options_of(kv: KVOptions | None) -> KVOptions:
    """A load's KV options (default: KVOptions()), carried by its files to its plans and its caches; --kv-dir checked
    when the model loads, not when the first page goes to flash mid-answer."""
    kv = kv or KVOptions()
    if kv.directory is not None:
        writable_directory(kv.directory)
    return kv


@dataclass
class Model:
    """What load() returns as `model`: the transformer, its FFN object when the FFN runs from flash (ffn.flash.FlashFFN
    or ffn.experts.ExpertFFN; None when every weight is in DRAM), the context and how long loading took."""
    transformer: Transformer
    ffn: object | None
    ctx: int
    load_ms: float


def load(path: str | None = None, dram_budget: int | str | None = "auto", ffn: str = "auto", ctx: int = 0,
         threads: int | None = None, lookahead: bool = False, verbose: bool = False,
         sparsity: float = DEFAULT_SPARSITY, act8: bool = True, say: bool = True, kv: KVOptions | None = None,
         parallel: int = 1):
    """(model, tokenizer) for an HF directory, a GGUF file or a FLASHDIR, or a repo id in the Hugging Face cache
    (cache.resolve_model); None = the default model (fetched, and its predictors trained, on first use). dram_budget:
    bytes, a size string ("300M"), "auto" (the default: what the machine can give) or None (no limit); ffn as the
    CLI's --ffn; ctx 0: the model's default context. act8: the dot products with weights in 32-weight blocks (q4_0,
    q4_1, q5_0, q5_1, q8_0) round x to 8 bits as llama.cpp does (faster); False keeps x float32, the float math on the
    dequantized weights (blocks.set_act8: for the process).
    say: print the decision's notes and the mode --ffn auto chose (the commands do; the Python API only when
    verbose). A first use's work (download, conversion, training) is announced either way: it takes minutes.
    kv: how the KV cache is kept (kv_pages.KVOptions: cache types, Quest, the directory of its pages on flash;
    default float16, exact). parallel: the sequences decoded together (serve --parallel), each with a KV cache of its
    own: the plan counts that many contexts of ctx positions."""
    t0 = time.perf_counter()
    path = resolve_model(path)
    one_blas_thread()
    set_threads(threads)
    set_act8(act8)
    kv = kv_options_of(kv)
    budget = Budget.of(dram_budget)
    progress = sys.stderr.isatty()
    files = open_model_files(path, ffn, progress=progress, ctx=ctx, sparsity=sparsity, dram_budget=budget,
                             contexts=max(1, int(parallel)), kv_options=kv)
    ctx = context_size(ctx, files.ckpt.config)
    decision, transformer, flash_ffn = decide_and_build(files, ffn, budget, ctx, lookahead=lookahead,
                                                        threads=threads, progress=progress, verbose=verbose,
                                                        sparsity=sparsity, say=say)
    if decision.auto is not None and say:
        fit, whose = decision.auto
        whose = decision.mode.whose(files, whose)
        print(f"ffn: {decision.ffn} (--ffn auto, {f'{fit}; ' if fit else ''}{whose})", file=sys.stderr)
    return Model(transformer, flash_ffn, ctx, (time.perf_counter() - t0) * 1e3), files.tokenizer


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


def calibrate_gate(files: ModelFiles, dram_budget=None, n_tokens: int = CALIBRATION_TOKENS,
                   progress: bool = False) -> None:
    """Calibrate the exact gate's thresholds of files' FLASHDIR (ffn.gate.measure_thresholds, on the built-in
    calibration text: predictors/calibration.txt, written for the project, never an evaluation text) and write them
    to FLASHDIR/gate.json. The model, with no threshold, runs in this process under dram_budget (a Budget or what
    Budget.of takes; none: no limit), decided and built by the load pipeline (decide_and_build) as the run after it
    will be, and is freed before that run: a child process beside this one would hold a second copy of the
    libraries and the process base enough to get a cold first run killed under a memory cgroup equal to the budget."""
    from importlib import resources
    cfg = files.ckpt.config
    no_threshold = (np.zeros(cfg.ffn_dim, np.float32),) * cfg.n_layers
    files.gate = GateCalibration(0.0, (-1.0,) * cfg.n_layers, no_threshold, {})
    ctx = min(CALIBRATION_CTX, cfg.max_pos)
    # beside the model: the magnitudes' bins, and a window's [ctx, n] arrays of magnitudes, bins and masks
    held = cfg.n_layers * LayerMagnitudes.nbytes(cfg.ffn_dim, SPARSITIES) + 4 * ctx * cfg.ffn_dim * 4
    _, model, ffn = decide_and_build(files, "gate", Budget.of(dram_budget).less(held), ctx, say=False)
    tokenizer = files.tokenizer
    text = (resources.files("predictors") / "calibration.txt").read_text()
    windows = list(token_segments(tokenizer, text, n_tokens, ctx, cfg.bos_id))
    try:
        by_sparsity = measure_thresholds(model, ffn, windows, SPARSITIES, progress, spill_dir=files.path)
    finally:
        ffn.reader.close()
        del model, ffn
    write_gate_file(files.path, cfg.ffn_dim, {"text": "the built-in calibration text (calibration.txt)",
                                              "tokens": int(sum(map(len, windows)))}, by_sparsity)
    del by_sparsity
    gc.collect()
    return_freed_heap()


def calibrate_on_first_use(files: ModelFiles, sparsity: float, dram_budget=None) -> None:
    """calibrate_gate on a FLASHDIR's first exact-gate run, under the run's budget; then read the thresholds into
    files.gate (decide again after). A read-only FLASHDIR (a container image, NFS, squashfs) is refused before the
    work, naming the command that writes gate.json where it is writable: calibrating in memory instead would run the
    model over CALIBRATION_TOKENS tokens at every launch, silently (a model larger than its budget streams its gate|up
    rows from flash for every window of them: minutes for a 7B)."""
    if not os.access(files.path, os.W_OK):
        raise UserError(f"{files.path} has no gate thresholds (gate.json) and is read-only: write them once where it "
                        f"is writable (python -m predictors.calibrate_gate {files.path}), or run --ffn dense")
    progress = sys.stderr.isatty()
    if progress:                # on a terminal, with its progress bar; a script's stderr keeps its one error line
        print(f"gate: calibrating the thresholds of {files.path} once, on first use: "
              f"{roughly(calibration_seconds(files.ckpt.config))}", file=sys.stderr)
    calibrate_gate(files, dram_budget, progress=progress)
    files.gate = read_gate_file(files.path, files.ckpt.config.n_layers, files.ckpt.config.ffn_dim, sparsity)
