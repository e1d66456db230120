"""Warm-up: the kernels a run needs, compiled (or loaded from Numba's on-disk cache) before the weights load, in child
processes the first time (compile_in_child), with a stamp in Numba's cache that says so; the process base the plan
counts is measured after them (measure_base_bytes). Which kernels a run needs is its FFN mode's (modes.MODES:
each declares its compile steps); budget.py plans, this module spends time and memory.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import numba

import numpy as np

from storage import columns
from storage.config import ModelConfig
from storage.errors import UserError
from storage.files import write_best_effort
from storage.format import expert_parts, read_layout
from storage.reader import aligned_empty, bundle_reader
from storage._watch import watcher
from .ffn.experts import expert_ffn, stacks
from .ffn.quant import DENSE_ROW_KERNEL_MAX_T, sparse_ffn
from .ffn.flash import SplitKernels, SplitRows
from .kernels.attention import add_tile, head_rows, rotate_rows, softmax_tile
from .kv_pages import KVCache, KVOptions
from .kernels.gemv import MATMUL_ROW_KERNEL_MAX_T, matmul_t
from .kernels.norm import add_rms_norm_rows, rms_norm_rows
from .ffn.dense import ExpertBatch, FeedForward, MixtureOfExperts
from .model import Transformer, load_weights
from .neuron_cache import NeuronCache
from .process import (RSS_MARKS, cgroup_room, drop_file_pages, mark_rss, peak_rss_bytes, return_freed_heap,
                      room_bytes, rss_bytes)
from storage.blocks import row_bytes
from .kernels.blocks import BLOCK, DOT8_ROWS, QuantMatrix, quant_matmul_t
from .threads import step_counts

def load_kernels_lean() -> None:
    """Make Numba's on-disk cache load a kernel without refreshing its target context first. The refresh imports and
    registers every implementation Numba has (numba.np, numba.typed, numba.cpython...: 26 MiB of SmolLM2's process
    base), which only compiling uses; loading needs the runtime system (NRT) the machine code calls, initialized here
    as the refresh would. A kernel compiled in this process still has it all: Numba's compiler refreshes itself.
    A Numba whose cache lacks what this relies on keeps its own loading."""
    from numba.core import caching
    from numba.core.runtime import rtsys
    cache = caching.Cache
    if getattr(cache.load_overload, "lean", False) or not all(
            hasattr(cache, n) for n in ("_load_overload", "_guard_against_spurious_io_errors")):
        return

    def load_overload(self, sig, target_context):
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)
    load_overload.lean = True
    cache.load_overload = load_overload


load_kernels_lean()     # before any kernel of this process loads: the runtime imports this module first

# The FFN kernels compile_steps knows, in the order it runs them (a mode's `kernels` names some of them)
FFN_STEPS = ("neuron_cache", "sparse", "dense", "gate")


def compile_kernels(layout, steps: list[int] | None = None, kernels=None) -> None:
    """Run every kernel of a run once: the neuron cache, the sparse FFN on two real bundles of `layout` (and the
    dense FFN over them, for a quantized layout), attention and the norms, the resident matrices' kernels.

    Numba compiles them (or loads them from its on-disk cache) on first call, with the argument types of that call;
    these are the types the runtime uses (uint8 bundle matrix viewed as the layout's dtype, int32 rows, float32
    vectors), so their machine code is in memory now, before the weights, and not on the first token.
    steps: indices into compile_steps(layout, kernels) (default: all); kernels: as compile_steps'.
    """
    all_steps = compile_steps(layout, kernels)
    for i in range(len(all_steps)) if steps is None else steps:
        all_steps[i]()


def compile_steps(layout, kernels=None) -> list:
    """compile_kernels' work in pieces that compile_in_child can give one child process each (the compiler's memory
    grows with what one process compiles). kernels: the FFN_STEPS a run's modes need (modes.kernels_for: the exact
    gate's runs skip the bundle FFN's and the in-RAM FFN's kernels, which loaded would add 7.6 MiB to SmolLM2's
    process base); None: every kernel the layout has."""
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

    def dense(T: int):          # ffn.resident.ResidentFFN: decode rows (T = 1) or a prompt's widened blocks
        def step():
            if kind:            # down columns: the GGUF's matrices through ffn.dense.FeedForward (one kernel, any kind)
                m = lambda shape: QuantMatrix.of(("q8_0", zero_q8_0(shape)))  # noqa: E731
                w = {"gate.weight": m((BLOCK, layout.d)), "up.weight": m((BLOCK, layout.d)),
                     "down.weight": m((layout.d, BLOCK))}
                FeedForward(ModelConfig.from_dict(layout.config), w, 0, prefix="")(np.zeros((T, layout.d), np.float32))
                return
            B, _ = bundles()
            kernel = sparse_ffn(layout, max_active=k, down_scales=scales)
            X = np.zeros((T, layout.d), np.float32)
            kernel.dense(kernel.dense_layer(B), X, np.zeros_like(X))
        step.__name__ = f"dense ({T} row{'s' if T > 1 else ''})"
        return step

    def gate(layer: int, what: str):
        """ffn.flash.ExactGate's kernels for the block kinds of layer `layer` (a kernel per kind: kernels.neurons
        .gate_coefficients_for, gate_down_for): its coefficients over gate|up rows into a whole array, or into a slice
        of one (a streamed layer's last chunk fills one: FlashFFN.coefficients; its own type), or its down sum over
        down rows (of a prompt's rows, and of a decoded token's where those take other kernels: down rows, not
        columns). A step per kernel: each is a large one to compile, and a child's memory grows with what it
        compiles (two in one child took SmolLM2's q4_1 FLASHDIR to 367 MB)."""
        def step():
            gu, dn = layout.parts["gate_up"], layout.parts["down"]
            column = layout.down_column(layer)
            tables = columns.zero_tables(column, layout.d, layout.n_neurons[layer]) if column else None
            rows = SplitRows(gu.geometry_of(layer), dn.geometry_of(layer), layout.config.get("act", "silu"),
                             layout.config.get("relu_threshold"), tables, gu.quantized)
            H = np.zeros((k, gu.stride), np.uint8)
            for T in (2, 1) if what == "down sums" and not column else (2,):
                X, coef = np.zeros((T, layout.d), np.float32), np.zeros((T, k + 1), np.float32)
                if what == "down sums":
                    Y = np.zeros_like(X)
                    rows.begin(np.zeros((T, dn.n_neurons[layer]), np.float32))     # down columns: integer sums
                    rows.accumulate(aligned_empty((k, dn.stride), np.uint8), np.arange(k, dtype=np.int32),
                                    np.ascontiguousarray(coef[:, :k]), Y)
                    rows.finish(Y)
                else:
                    rows.coefficients(H, X, coef[:, :k] if what == "coefficients of a chunk" else
                                      np.ascontiguousarray(coef[:, :k]), 0.0)
        step.__name__ = f"gate ({what}, layer {layer}'s kinds)"
        return step

    def gate_steps() -> list:
        """gate's steps, for the first layer of each distinct block kinds (a Q4_K_M GGUF's layers mix them)."""
        gu, dn = layout.parts["gate_up"], layout.parts["down"]
        heads, downs = {}, {}
        for i in range(layout.n_layers):
            heads.setdefault(gu.dtypes_of(i), i)
            downs.setdefault(dn.dtypes_of(i), i)
        return [*(gate(i, what) for i in heads.values() for what in ("coefficients", "coefficients of a chunk")),
                *(gate(i, "down sums") for i in downs.values())]

    have = {"neuron_cache": [neuron_cache], "sparse": [sparse],
            **({"dense": [dense(T) for T in (1, DENSE_ROW_KERNEL_MAX_T + 1)]} if layout.quantized else {}),
            **({"gate": gate_steps()} if layout.parts else {})}
    return [*(s for n in FFN_STEPS if n in have and (kernels is None or n in kernels) for s in have[n]),
            *resident_steps(layout)]


def zero_q8_0(shape: tuple[int, int]) -> np.ndarray:
    """A zero matrix [rows, cols] in q8_0 blocks, as storage.blocks.quantize writes it (every byte 0: scale and
    weights), without gguf's quantizer: the kernels' types are all a warm-up needs, and importing gguf would add
    4.6 MiB to the process base of a run that never quantizes."""
    return np.zeros((shape[0], row_bytes(shape[1], "q8_0")), np.uint8)


def resident_steps(layout) -> list:
    """compile_steps of what every run has: attention and the norms, and the resident matrices' kernels, float16 (and,
    in a quantized FLASHDIR, the blocks' too: one compiled function serves every kind): decode (row kernel, serial
    and parallel), prefill (widened blocks), the embedding lookup."""
    d = layout.d if layout.d % BLOCK == 0 else BLOCK

    def attention():
        x, X = np.zeros(layout.d, np.float32), np.zeros((1, layout.d), np.float32)
        rms_norm_rows(X, x, 1e-5, np.empty_like(X))
        add_rms_norm_rows(X, X.copy(), x, 1e-5, np.empty_like(X))
        # pages of float16 bits, and of float32 (q8_0's, dequantized); with RoPE and without (model.Attention's
        # T <= ATTENTION_KERNEL_MAX_T path)
        for kind in ("f16", "q8_0"):
            cache = KVCache(SimpleNamespace(n_layers=1, n_heads=1, n_kv_heads=1, head_dim=32), 1,
                            options=KVOptions(kind, kind))
            qkv = np.zeros((1, 1, 32), np.float32)
            for half in (16, 0):
                cos = np.zeros((2, 1, half), np.float32)[:1, 0]
                cache.attend(0, qkv.copy(), qkv.copy(), qkv.copy(), cos, cos, 0, 0, np.float32(1.0),
                             np.empty_like(qkv))
            K, V = cache.rows(0, 0, 1)         # a prompt's (model.prompt_attention)
            acc, rows = np.zeros((1, 1, 1, 32), np.float32), np.zeros((1, 32), np.float32)
            head_rows(K, 0, rows)
            softmax_tile(np.zeros((1, 1), np.float32), 0, 0, 1, 0, 0, 0, np.float32(1.0),
                         np.zeros((1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32), acc)
            add_tile(rows, 0, 0, 1, acc)

    def half_matrices():
        w16 = np.zeros((2, d), np.float16)
        for T in (1, MATMUL_ROW_KERNEL_MAX_T + 1):
            matmul_t(np.zeros((T, d), np.float32), w16, parallel_min_work=0)
        matmul_t(np.zeros((1, d), np.float32), w16)

    def block_matrices(T: int, parallel: bool):
        """A step per kernel of blocks.quant_matmul_t (its kernels hold every kind's loops: the four in one child
        took it to 457 MB), T rows: a decode GEMV (1), a prompt's tiles (more; blocks.quant_tile), in parallel or
        serial; the embedding lookup with the serial GEMV."""
        def step():
            wq = zero_q8_0((2, d))
            quant_matmul_t(np.zeros((T, d), np.float32), wq, "q8_0", parallel_min_work=0 if parallel else 1 << 62)
            if T == 1 and not parallel:
                QuantMatrix.of(("q8_0", wq))[np.zeros(1, np.int64)]
        step.__name__ = f"block_matrices ({T} row{'s' if T > 1 else ''}, {'parallel' if parallel else 'serial'})"
        return step

    def ring_watcher():         # the io_uring Ring's watcher, compiled by a run's first io_uring reader: here
        watcher()               # for a mixture of experts too, whose warm-up opens no reader

    # float32 resident matrices stay float32 (runtime.load_runtime): BLAS, no kernel
    blocks = [block_matrices(T, parallel) for T, parallel in
              ((1, True), (MATMUL_ROW_KERNEL_MAX_T + 1, True), (1, False), (DOT8_ROWS + 1, False))]
    return [attention, *([half_matrices] if layout.dtype != "f32" else []), *(blocks if layout.quantized else []),
            *([ring_watcher] if sys.platform == "linux" else [])]


def expert_steps(layout) -> list:
    """compile_steps of a mixture of experts (ffn.experts.ExpertFFN): model.MixtureOfExperts over one zeroed chunk,
    for a decoded token and a prompt's rows; split chunks through the exact gate's kernels (ffn.flash.SplitKernels)."""
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
                    ("q8_0", zero_q8_0(shape))) if layout.quantized else \
                    np.zeros(shape, np.float16)
            w["layers.0.ffn.shared_gate.weight"] = np.zeros((1, layout.d), np.float32)
        moe = MixtureOfExperts(cfg, w, 0, experts=experts)
        for T in (1, DENSE_ROW_KERNEL_MAX_T + 1):
            moe(np.zeros((T, layout.d), np.float32))

    return [mixture]


def measure_base_bytes(layout, kernels=None, start_peak: int | None = None) -> tuple[int, int]:
    """(the plan's process base, the loading's peak). The base: RSS after compile_kernels (of the FFN source's
    kernels: compile_steps), measured in this process just before the weights load.

    Measured rather than a constant because it differs by platform, library versions and tokenizer (SmolLM2's takes
    16 MiB, Qwen2.5's 50, stories260K's 3). The load compiles the kernels in child processes first (compile_in_child,
    when compiled_stamp is missing: runtime.open_model_files, before the tokenizer), so this process only loads their
    machine code from Numba's on-disk cache: compiling would leave ~80 MiB of the compiler's memory in this process
    (and in its peak) on a first run, and not on the next; without the stamp they compile here, a larger base. Then
    the heap's free pages go back to the system and the LLVM library's pages leave the resident set (drop_llvm_pages:
    48 MiB). In a process that already holds other things (a test run, a notebook) they count too: the budget is the
    process's.
    Each step is noted (process.mark_rss) for the parts -v prints (base_parts).
    The loading's peak: the most this process held while loading (a floor of the minimum budget: a small model's
    plan can be under it; modes.minimum_bytes): RSS before LLVM's pages were dropped, or the process's peak
    (VmHWM) when it grew since `start_peak` (the peak when the load began: the one reached within a step, or while
    the tokenizer parsed its file), not one an earlier load of this process reached.
    What loading the kernels added, what the line added to the RSS of the early refusal (base_estimate_bytes) and how
    far the loading's peak went over the base are kept in the compile stamp for the next run's estimate.
    """
    loaded, before = compiled_stamp(layout).exists(), rss_bytes()
    for i, step in enumerate(compile_steps(layout, kernels)):
        step()
        mark_rss(f"kernels: {step.__name__}" + (" (and Numba's runtime, LLVM's start)" if i == 0 else ""))
    rss, peak = settle_base(start_peak)
    global _early_rss
    early, _early_rss = _early_rss, None    # this load's own estimate, once: a later load's would be another's RSS
    if loaded:                  # only loaded from the cache (never compiled here): figures of this installation
        key = model_key(layout)
        remember(layout, {"kernels": rss - before,
                          key + " loading": peak - rss, key + " base": rss,
                          **({key: rss - early} if early is not None else {})})
    return rss, peak


def settle_base(start_peak: int | None) -> tuple[int, int]:
    """(the process base, the loading's peak) once the kernels are loaded (measure_base_bytes says what each is): the
    heap's free pages returned, then LLVM's pages dropped, each noted for base_parts."""
    import gc
    gc.collect()
    return_freed_heap()
    mark_rss("freed heap returned (malloc_trim)")
    peak = RSS_MARKS[-1][1]
    drop_llvm_pages()
    mark_rss("LLVM library pages dropped")
    high = peak_rss_bytes()     # after the drop: the kernel updates the high-water mark as it unmaps
    if start_peak is not None and high > start_peak:
        peak = max(peak, high)
    return RSS_MARKS[-1][1], peak


def measure_dense_base_bytes(ckpt, start_peak: int | None = None) -> tuple[int, int]:
    """measure_base_bytes for a dense run of `ckpt`'s matrices as stored (an HF directory or a GGUF): its kernels
    loaded by dense_warm_up (compiled in this process the first time: no layout to give a child), the base measured
    before the weights load."""
    dense_warm_up(ckpt)
    mark_rss("kernels: dense (and Numba's runtime, LLVM's start)")
    return settle_base(start_peak)


def drop_llvm_pages() -> int:
    """Drop the LLVM library's pages (60-70 MiB, what its code and tables took at import and at loading the first
    kernel) from this process's RSS once every kernel of the run is loaded: machine code loaded from Numba's cache
    runs without LLVM; only compiling or loading another kernel runs it (and reads its pages back in, which
    tests/test_process_base.py checks a run does not do). Returns the bytes dropped."""
    from llvmlite.binding import ffi
    return drop_file_pages(Path(ffi.lib._name).name)


def base_parts(base: int) -> list[tuple[str, int]]:
    """The process base `base` in parts, (what, bytes): the RSS each mark_rss of this process added since the one
    before it (the first: since the process began), and what came after the last mark. They sum to base."""
    parts, last = [], 0
    for what, rss in RSS_MARKS:
        parts.append((what, rss - last))
        last = rss
    if base != last:
        parts.append(("since the last mark", base - last))
    return parts


def base_parts_table(base: int) -> str:
    """base_parts as -v prints them: one line each, MiB, after the total."""
    return "\n".join([f"process base {base / 2**20:10.1f} MiB, by part (RSS each added):",
                      *(f"  {what:<50}{b / 2**20:+8.1f}" for what, b in base_parts(base))])


# Until this installation has measured them (the compile stamp keeps what it measured): what loading the kernels from
# Numba's cache adds to RSS once LLVM's pages are dropped again (12.7 MiB for stories260K f16, 20.1 for SmolLM2 q4_1,
# 11.1 for Qwen2.5-0.5B's q5_0 FLASHDIR, Numba 0.6x, Linux x86-64: the lowest, as the estimate is a lower bound), and
# what a tokenizer keeps per vocabulary entry once its parse's free heap is returned (tokenizers 0.2x: SmolLM2's
# 49,152 entries 16.3 MiB, Qwen2.5's 151,936 entries 49.8 MiB).
KERNELS_DEFAULT_BYTES = 10 << 20
TOKENIZER_BYTES_PER_TOKEN = 320
# RSS of this process when base_estimate_bytes last ran: the start of what measure_base_bytes records
_early_rss: int | None = None


def forget_early_rss() -> None:
    """A load starts: an estimate an earlier load of this process made (and never measured against: it was refused,
    or ran dense) is not this one's start. A test worker once recorded its 1 GB of growth since such an estimate as
    the line's part, and the next run's early refusal named 1.1 GB for a 94 MiB model."""
    global _early_rss
    _early_rss = None


def base_estimate_bytes(layout, vocab_size: int) -> int:
    """The process base a run of `layout` will measure (measure_base_bytes), estimated before the model is fetched,
    converted, compiled or trained: this process's RSS now plus what the line added to it when this installation
    last ran the model (kept in the compile stamp; the smallest seen), else the kernels (the stamp's figure, or
    KERNELS_DEFAULT_BYTES) and the tokenizer (TOKENIZER_BYTES_PER_TOKEN per vocabulary entry); at most the smallest
    base a run of it measured: the RSS at this point moves by megabytes from one process to the next on a busy
    machine (the suite saw an estimate 8 MiB over the planner's minimum, refusing budgets the plan takes), the base
    far less. A lower bound is what the early refusal needs: the planner refuses what it let through."""
    global _early_rss
    _early_rss = rss_bytes()
    record = stamp_record(layout)
    extra = record.get(model_key(layout))
    if extra is None:
        extra = record.get("kernels", KERNELS_DEFAULT_BYTES) + TOKENIZER_BYTES_PER_TOKEN * vocab_size
    estimate = _early_rss + extra
    return min(estimate, record.get(model_key(layout) + " base", estimate))


def loading_excess_bytes(layout) -> int:
    """How far over its process base the loading of a run of `layout` went (measure_base_bytes' peak less its base),
    as the compile stamp keeps it (the smallest seen); 0 until this installation has run the model."""
    return stamp_record(layout).get(model_key(layout) + " loading", 0)


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
    old = stamp_record(layout)
    record = {**old, **{k: min(v, old.get(k, v)) for k, v in figures.items()}}
    if record == old:
        return
    write_best_effort(compiled_stamp(layout), json.dumps(record))


# The most one compile child's RSS reached (Numba 0.6x, Linux x86-64; about 105 MiB of it the libraries imported,
# 170 once Numba compiled a first parallel kernel), each step alone with an empty cache: the resident blocks' prompt
# tiles in parallel (blocks.quant_tiles_kernel, every kind's loops) 312 MiB; the dense FFN's prompt path 280, the
# exact gate's down sum 267 and coefficients 252 (SmolLM2's q4_1 FLASHDIR; Qwen2.5-0.5B's q5_0 within a few MiB of
# them): what a memory cgroup must leave beside the process on a first use
COMPILE_CHILD_BYTES = 315 << 20
# One child compiling every step peaks at about 800 MiB (SmolLM2's q4_1 FLASHDIR 765 MiB, Qwen2.5-0.5B's 797, an
# empty Numba cache); where the room holds twice that, one child does all: each further child starts the libraries again
ONE_CHILD_ROOM_BYTES = 1600 << 20


def compile_in_child(layout) -> None:
    """compile_kernels in a child process, which fills Numba's on-disk cache, leaves compiled_stamp(layout) there
    and exits, returning the compiler's memory with it. Without a FLASHDIR on disk (a layout built in memory) or
    when the child fails, this process compiles instead: its process base is then larger, never wrong. A child
    killed by a memory cgroup's limit is refused in one line that says what a first use needs: this process would
    not compile within that limit either."""
    import signal
    import subprocess
    if layout.flashdir is None:
        return
    if sys.stderr.isatty():     # progress, like the bars: an error stays one line in a log
        print("compiling the kernels once for this installation (Numba; a minute or more) ...", file=sys.stderr)
    n = len(compile_steps(layout))
    if room_bytes() >= ONE_CHILD_ROOM_BYTES:
        groups = [list(range(n))]       # room for every step's compiler in one child: one start of the libraries
    else:                               # one child per step: each one's peak is the libraries and one step's compiler
        groups = [[i] for i in range(n)]
    for k, steps in enumerate(groups):
        child = subprocess.Popen([sys.executable, "-m", "flashinfer_lite.warmup", str(layout.flashdir),
                                  ",".join(map(str, steps)), "stamp" if k == len(groups) - 1 else ""],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        try:                    # the OOM killer's first choice in a memory cgroup, not the run that started it
            Path(f"/proc/{child.pid}/oom_score_adj").write_text("1000")
        except OSError:
            pass
        if child.wait() == -signal.SIGKILL and cgroup_room() is not None:
            held = rss_bytes()
            raise UserError(f"a first use compiles the kernels (once for this installation), and this memory "
                            f"cgroup's limit killed the compiler: it takes about {COMPILE_CHILD_BYTES >> 20} MiB "
                            f"beside this process's {held >> 20} MiB; give the first use a limit of about "
                            f"{(held + COMPILE_CHILD_BYTES) >> 20} MiB (later runs load the compiled kernels and "
                            f"need only their --dram-budget)")


def compiled_stamp(layout):
    """The file, in Numba's cache directory, that says compile_kernels ran there for these kernels and the argument
    types of `layout`: its name hashes Numba's and Python's versions, the kernel modules' files (as Numba's own index
    keys them: mtime and size) and what of the layout decides the types. Emptying the cache directory removes it."""
    import hashlib

    here = Path(__file__).parent      # every module holding a kernel: kernels/ (the block formats too), ffn/, the cache
    files = [*sorted((here / "kernels").glob("*.py")), *sorted((here / "ffn").glob("*.py")), here / "neuron_cache.py",
             here / "budget.py", Path(__file__)]
    key = [numba.__version__, sys.version, *[(str(f.relative_to(here)), f.stat().st_mtime_ns, f.stat().st_size)
                                             for f in files],
           layout.d % BLOCK == 0, layout.dtype, layout.down_dtype, layout.vectors, layout.biases, bool(layout.parts),
           layout.experts and (layout.experts.dtypes, layout.experts.split)]
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    return Path(rotate_rows._cache.cache_path) / f"flashinfer-lite-kernels-{digest}.stamp"


def kernel_sources(modules) -> tuple[dict[Path, set[Path]], list[Path]]:
    """({cache directory: the sources cached there}, the sources a kernel may have inlined) of the Numba kernels that
    `modules` define with cache=True: their own files, and the files of the project modules those import (a kernel
    inlines the kernels and the constants it names, which Numba's index does not key: it keys the kernel's own file)."""
    import re
    from numba.core.dispatcher import Dispatcher
    dirs: dict[Path, set[Path]] = {}
    for m in modules:
        for f in vars(m).values():
            if isinstance(f, Dispatcher) and f.py_func.__module__ == m.__name__ and hasattr(f._cache, "cache_path"):
                dirs.setdefault(Path(f._cache.cache_path), set()).add(Path(m.__file__))
    sources = {f for fs in dirs.values() for f in fs}
    for f in list(sources):     # `from .rows import dot`, `from storage.blocks import BLOCK`: a file beside them
        for dots, name in re.findall(r"^\s*from\s+(\.*)([\w.]*)\s+import", f.read_text(), re.M):
            top = name.split(".")[0]
            base = f.parents[len(dots) - 1] if dots else next(
                (p for p in f.parents if (p / top).is_dir() or (p / f"{top}.py").is_file()), None)
            if base is None:
                continue
            target = base.joinpath(*name.split(".")) if name else base
            sources.update(t for t in (target.with_suffix(".py"), target / "__init__.py") if t.is_file())
    return dirs, sorted(sources)


def drop_stale_kernels(modules=None) -> bool:
    """Remove the Numba cache's kernels of `modules` (default: every project module that defines one) when the sources
    they may have inlined (kernel_sources) changed since the cache was filled, and the compile stamps that vouched for
    them: Numba would load a kernel whose own file did not change with the code it inlined from a file that did (or
    that moved: ModuleNotFoundError). A stamp named by a hash of those sources' bytes, in the first kernel's cache
    directory, says the cache is theirs. Their bytes are read only when their sizes or mtimes changed since a stamp
    named by those (as Numba's own index keys a kernel's file) was left: every import checks, so every launch would
    hash them. Best effort (a read-only cache stays as it is). True when it removed any."""
    import hashlib
    if modules is None:
        modules = [m for n, m in list(sys.modules.items())
                   if n.split(".")[0] in ("flashinfer_lite", "storage") and getattr(m, "__file__", None)]
    dirs, sources = kernel_sources(modules)
    if not dirs:
        return False
    stats = repr([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in sources]).encode()
    seen = min(dirs) / f"flashinfer-lite-sources-stat-{hashlib.sha256(stats).hexdigest()[:16]}.stamp"
    if seen.exists():
        return False
    digest = hashlib.sha256()
    for f in sources:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    stamp = min(dirs) / f"flashinfer-lite-sources-{digest.hexdigest()[:16]}.stamp"
    if stamp.exists():          # the same bytes, touched or copied: the cache is still theirs
        write_best_effort(seen, "")
        return False
    removed = False
    for d in dirs:      # a kernel cache directory holds only its source directory's kernels: all of them go
        for f in [*d.glob("*.nbi"), *d.glob("*.nbc"), *d.glob("flashinfer-lite-*.stamp")]:
            try:
                f.unlink()
                removed = True
            except OSError:
                pass
    write_best_effort(stamp, "")
    write_best_effort(seen, "")
    return removed


def warm_up(model: Transformer) -> None:
    """One decode step on a scratch cache at each thread count a step may run on (threads.StepThreads), as llama.cpp
    warms up at load: the decode's kernels load from Numba's cache here, in the load time, not in the first token's
    (45-60 ms of a 7-10 ms step for SmolLM2's Q4_K_M: it set decode's P99). Every weight in DRAM only: a flash FFN's
    step would read weights, and count them."""
    n = numba.get_num_threads()
    try:
        for t in step_counts(n):
            numba.set_num_threads(t)
            model.forward([model.cfg.bos_id or 0], model.new_cache(1))
    finally:
        numba.set_num_threads(n)


# The prompt lengths a dense warm-up runs, at the most threads, before its decode steps: each side of every length the
# kernels switch at (the FFN's fused row kernel and attention's kernel up to 2 rows; the matrices' row kernel up to
# 12, its parallel form at the most work; widened blocks above). A decode step at each thread count loads the serial
# forms; nothing else depends on the thread count.
DENSE_WARM_UP_ROWS = (MATMUL_ROW_KERNEL_MAX_T + 1, MATMUL_ROW_KERNEL_MAX_T, DENSE_ROW_KERNEL_MAX_T)


def layer_storage(ckpt, layer: int) -> tuple:
    """What decides the kernels (and their argument types) a layer of `ckpt` runs on: its tensors' block kinds (None:
    stored as floats) and precisions, by name within the layer."""
    prefix = f"layers.{layer}."
    return tuple(sorted((n[len(prefix):], ckpt.block_kind(n), ckpt.precision(n))
                        for n in ckpt.names() if n.startswith(prefix)))


def dense_warm_up(ckpt) -> None:
    """Load the kernels a dense run of `ckpt` (an HF directory or a GGUF, its matrices as stored: DenseMode.build)
    calls, before its weights are loaded: on a model of the first layer of each storage (layer_storage) with the
    embeddings and the head, a prompt's chunk of each DENSE_WARM_UP_ROWS length, and a decode step at each thread count
    a step may run on. Its tensors are the run's own arrays (a GGUF's: read-only views of the mapped file, a type of
    their own to Numba), so the run loads no kernel later, and LLVM's pages, dropped after this, stay out of a peak
    that holds the whole file. The file's pages this read leave RSS with it (ckpt.release): the run maps them again."""
    cfg = ckpt.config
    first: dict[tuple, int] = {}
    for i in range(cfg.n_layers):
        first.setdefault(layer_storage(ckpt, i), i)
    layers = sorted(first.values())
    renamed = {f"layers.{i}.": f"layers.{j}." for j, i in enumerate(layers)}

    def name_in_model(n: str) -> str | None:      # its name in the model of `layers`; None: a layer left out
        if not n.startswith("layers."):
            return n
        prefix = n[:n.index(".", 7) + 1]
        return renamed[prefix] + n[len(prefix):] if prefix in renamed else None
    weights = load_weights(ckpt, skip=lambda n: name_in_model(n) is None, keep_blocks=True)
    small = dataclasses.replace(cfg, n_layers=len(layers), sliding_layers=None if cfg.sliding_layers is None else
                                [cfg.sliding_layers[i] for i in layers])
    model = Transformer(small, {name_in_model(n): w for n, w in weights.items()})
    kv = model.new_cache(sum(DENSE_WARM_UP_ROWS))
    for rows in DENSE_WARM_UP_ROWS:
        model.forward_rows(np.full(rows, cfg.bos_id or 0, np.int64), kv)
    warm_up(model)              # the decode step at each thread count
    del model, weights, kv
    ckpt.release()


drop_stale_kernels()    # before any kernel of this process loads: every kernel module is imported (above)


if __name__ == "__main__":     # compile_in_child's child: python -m flashinfer_lite.warmup FLASHDIR STEPS [stamp]
    _layout = read_layout(sys.argv[1], check_size=False)
    compile_kernels(_layout, steps=[int(i) for i in sys.argv[2].split(",")])
    if sys.argv[3:] == ["stamp"]:
        try:
            compiled_stamp(_layout).touch()
        except OSError:         # a read-only cache: the next run compiles in a child again, as this one did
            pass
