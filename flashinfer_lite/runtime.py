"""The flash runtime: a Transformer whose FFN weights stay on flash and whose FFN computes only the active neurons.

Per layer, per token: the active set (by `--ffn`), a cache lookup, one batched read of the misses straight into
their cache rows, and the Numba sparse FFN over those rows.

  dense      every neuron, weights in DRAM (the reference path; needs the whole model in memory)
  oracle     the neurons whose true activation is nonzero (ReLU) or clears the calibrated threshold (SwiGLU);
             needs the dense gate/up weights to know that, so it is a test mode, not a memory-saving one
  predicted  the neurons the low-rank predictor selects: the product

A prompt of many tokens touches most neurons, so prefill can instead stream each layer's whole FFN with large
sequential reads; the runtime picks whichever moves fewer bytes.
`load_runtime()` is the one way generate, chat and eval build a model, so they all run the same code path.
"""
from __future__ import annotations

import os
import re
import sys
import time

import numba
import numpy as np
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from storage.cache import flashdir_for
from storage.format import FlashCheckpoint, is_flashdir, verify_at_load
from storage.reader import BundleReader, aligned_empty
from storage.stats import FlashStats

from . import BLAS_THREADS_FROM_USER
from .budget import (HEAP_SLACK_BYTES, auto_budget_bytes, measure_runtime_bytes,
                     plan_budget, plan_resident_ffn, resident_bytes_for, staging_rows)
from .errors import UserError
from .half import half_matrix
from .loader import load_weights, open_any
from .model import FeedForward, ModelConfig, Transformer
from .neuron_cache import NeuronCache
from .predictor_set import load_predictors
from .process import keep_freed_arrays_out_of_rss
from .quant import sparse_ffn

FFN_MODES = ("auto", "dense", "oracle", "predicted")   # auto: dense when the model fits the budget, else predicted
# FFN tensors that live in the bundles on flash; everything else (including ffn.down.bias) stays resident.
_BUNDLED = re.compile(r"layers\.\d+\.ffn\.(gate|up|down)\.weight|layers\.\d+\.ffn\.(gate|up)\.bias")
# prefill streaming reads a layer in chunks of this size: from 1 MiB up sequential reads run at full device speed,
# and the chunk (budget.stream_transient_bytes) is what the DRAM budget pays for it
STREAM_CHUNK_BYTES = 2 << 20


class FlashFFN:
    """The FFN of every layer, computed from bundles on flash through the neuron cache.

    plan: the budget.BudgetPlan that sizes the neuron cache (window rows, hot bytes, window tokens).
    select(layer, x [T, d]) -> bool [T, n_neurons] by original neuron id: which neurons to compute (the predictor,
    the oracle, or a replayed trace).
    predictors: the PredictorSet of the FLASHDIR, if any: its neuron frequencies choose the pinned hot neurons and its
    act_threshold (per layer) is the SwiGLU magnitude under which a computed neuron counts as not fired.
    down_bias: per layer the FFN down bias (resident; None where the model has none).
    overlap: compute on the resident rows while the misses are read (False: read, then compute; for measuring).
    lookahead(layer, x [1, d]) -> bool [1, n_neurons]: a guess of `layer`'s set from the previous layer's FFN input
    x, so its reads start one layer early (Deja Vu); the exact set still decides, a wrong guess costs only bytes.
    """

    def __init__(self, cfg: ModelConfig, layout, plan, select, predictors=None, down_bias=None,
                 threads: int | None = None, overlap: bool = True, lookahead=None, verbose: bool = False):
        self.cfg, self.layout, self.plan, self.select, self.predictors = cfg, layout, plan, select, predictors
        self.verbose, self.overlap, self.lookahead = verbose, overlap, lookahead
        self.stats = FlashStats.for_layers(cfg.n_layers, cfg.ffn_dim)
        self.down_bias = list(down_bias) if down_bias is not None else [None] * cfg.n_layers
        # bundle id -> original neuron id is layout.order; selections speak original ids.
        self.bundle_of = [np.argsort(o).astype(np.int64) for o in layout.order]
        self.act_threshold = [predictors.act_threshold(i) if predictors is not None else 0.0
                              for i in range(cfg.n_layers)]
        self.reader = BundleReader(layout, threads=threads)
        hot = None
        if predictors is not None and plan.hot_bytes:
            hot = plan.hot_neurons([predictors.neuron_freq(i)[layout.order[i]] for i in range(cfg.n_layers)])
        self.cache = NeuronCache(layout.n_neurons, layout.stride, self.reader, capacity=plan.window_rows,
                                 window=plan.window, hot=hot,
                                 staging_rows=staging_rows(plan.max_active) if lookahead else 0, stats=self.stats)
        self.kernel = sparse_ffn(layout, act=cfg.act, relu_threshold=self._relu_threshold(),
                                 max_active=max(layout.n_neurons))
        self._coef = np.zeros(max(layout.n_neurons), np.float32)   # one piece's coefficients
        self._chunk = None  # prefill streaming buffer, allocated on first use (counted in the plan's buffers)
        self._pass_lookups = 0   # hits + misses when the current forward pass began

    def _relu_threshold(self) -> float | None:
        if self.cfg.act == "silu":
            return None
        return self.cfg.relu_threshold

    # -- choosing neurons ---------------------------------------------------------------------------------------------
    def active_ids(self, layer: int, x: np.ndarray) -> list[np.ndarray]:
        """Per row of x [T, d]: sorted bundle ids to compute."""
        t0 = time.perf_counter()
        mask = self.select(layer, x)
        self.stats.predictor_s += time.perf_counter() - t0
        return [np.sort(self.bundle_of[layer][np.flatnonzero(m)]) for m in mask]

    # -- the FFN ----------------------------------------------------------------------------------------------------
    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[0]
        if layer == 0:                  # a forward pass starts
            self._pass_lookups = self.stats.hits + self.stats.misses
        ids = self.active_ids(layer, x)
        y = np.empty_like(x)
        if T > 1 and self.prefer_streaming(layer, ids):
            self.stream_layer(layer, x, y, ids)
            self.stats.streamed_layers += 1
            n_active = T * self.layout.n_neurons[layer]
        else:
            n_active = 0
            for t in range(T):
                n_active += self.decode_row(layer, x[t], ids[t], y[t])
        if self.down_bias[layer] is not None:
            y += self.down_bias[layer]
        self.stats.rows[layer] += T
        self.stats.active[layer] += n_active
        if layer == self.cfg.n_layers - 1:
            self._close_pass(T)
        return y

    def decode_row(self, layer: int, x: np.ndarray, ids: np.ndarray, out: np.ndarray) -> int:
        """out[:] = sparse FFN of one token over `ids` (sorted); returns how many neurons actually fired.

        The sum runs over `ids` in sorted order whatever the cache holds (SparseFFN.accumulate): a set larger than
        the window is computed in window-sized pieces accumulated one after the other, and with overlap the rows
        already in DRAM get their coefficients while the misses are read. Neither changes a bit of the output, so
        the budget, -t and overlap do not change the tokens (tests/test_runtime.py)."""
        out[:] = 0.0
        fired = 0
        cap = self.plan.window_rows
        X, Y = x[None, :], out[None, :]
        for start in range(0, len(ids), cap):
            f = self.cache.start_fetch(layer, ids[start:start + cap])
            if self.lookahead is not None and start == 0 and layer + 1 < self.cfg.n_layers:
                self._prefetch_next(layer + 1, x)
            coef = self._coef[: len(f.slots)][None, :]
            if self.overlap and f.reading:
                # The misses are in flight: the resident rows' coefficients meanwhile, on one thread, so that a
                # core stays free for the reader threads issuing and completing the reads.
                n_threads = numba.get_num_threads()
                numba.set_num_threads(1)
                try:
                    self._coefficients(layer, f.slots, np.flatnonzero(~f.new), X, coef)
                finally:
                    numba.set_num_threads(n_threads)
                f.finish()
                self._coefficients(layer, f.slots, np.flatnonzero(f.new), X, coef)
            else:
                f.finish()
                self._coefficients(layer, f.slots, None, X, coef)
            t0 = time.perf_counter()
            self.kernel.accumulate(self.cache.matrix(layer), f.slots, coef, Y)
            self.stats.compute_s += time.perf_counter() - t0
            fired += int(np.count_nonzero(coef))   # 0 = did not fire
        return fired

    def _prefetch_next(self, layer: int, x: np.ndarray) -> None:
        """Queue the reads of the next layer's guessed set behind this layer's: they run during this layer's compute
        and the next layer's attention."""
        t0 = time.perf_counter()
        guess = self.lookahead(layer, x[None, :])[0]
        self.stats.predictor_s += time.perf_counter() - t0
        self.cache.prefetch(layer, np.sort(self.bundle_of[layer][np.flatnonzero(guess)]))

    def _coefficients(self, layer: int, slots: np.ndarray, js, X: np.ndarray, coef: np.ndarray,
                      sel: np.ndarray | None = None, B: np.ndarray | None = None) -> None:
        """coef[:, js] for bundle rows slots[js] of B (default: the layer's cache matrix). SwiGLU neurons under the
        calibrated magnitude threshold count as not fired, inside the kernel."""
        if js is not None and not len(js):
            return
        t0 = time.perf_counter()
        t = self.act_threshold[layer] if self.act_threshold[layer] > 0 else -1.0
        self.kernel.coefficients(self.cache.matrix(layer) if B is None else B, slots, js, X, coef, sel=sel,
                                 act_threshold=t)
        self.stats.compute_s += time.perf_counter() - t0

    def _close_pass(self, T: int) -> None:
        """Count the pass's T tokens as decode-path tokens if any went through the neuron cache. Token boundaries
        come from the pass, not from decode_row: a batched prompt calls decode_row T times per layer."""
        if self.stats.hits + self.stats.misses > self._pass_lookups:
            self.stats.tokens += T

    # -- prefill streaming ------------------------------------------------------------------------------------------
    def prefer_streaming(self, layer: int, ids: list[np.ndarray]) -> bool:
        """Stream the whole layer when the rows' distinct uncached neurons exceed a third of it: random bundle reads
        move bytes 2-3x slower than large sequential ones on the SSDs measured here."""
        union = np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)
        resident = self.cache.slot_of(layer)[union] >= 0 if union.size else np.zeros(0, bool)
        uncached = int(union.size - np.count_nonzero(resident))
        choice = uncached > self.layout.n_neurons[layer] / 3
        if self.verbose and layer == 0:
            how = "streaming whole layers" if choice else "through the neuron cache"
            print(f"prefill of {len(ids)} tokens: {uncached} uncached neurons in layer 0 -> {how}", file=sys.stderr)
        return choice

    def stream_layer(self, layer: int, x: np.ndarray, y: np.ndarray, ids: list[np.ndarray]) -> None:
        """The FFN of all rows of x over each row's selected bundle ids, reading the layer's bundles in large
        sequential chunks: the same function the cache path computes, only the reads differ."""
        L = self.layout
        selected = np.zeros((x.shape[0], L.n_neurons[layer]), bool)   # [T, n] by bundle id
        for t, row in enumerate(ids):
            selected[t, row] = True
        rows_per_chunk = max(1, STREAM_CHUNK_BYTES // L.stride)
        if self._chunk is None:
            self._chunk = aligned_empty((rows_per_chunk, L.stride), np.uint8)
        y[:] = 0.0
        n = L.n_neurons[layer]
        chunk_rows = np.arange(rows_per_chunk, dtype=np.int32)   # int32 like the cache's rows: the same kernel
        for start in range(0, n, rows_per_chunk):
            m = min(rows_per_chunk, n - start)
            t0 = time.perf_counter()
            rs = self.reader.read(layer, np.arange(start, start + m), dest=self._chunk, slots=np.arange(m))
            self.stats.read_s += time.perf_counter() - t0    # a synchronous read: waited while it was in flight
            self.stats.io_s += rs.io_s
            self.stats.prefill_bytes_read += rs.read_bytes
            # The decode path's kernel and order: each row's selected neurons in bundle order, chunk after chunk,
            # accumulated into the same y[t] (its down bias stays out: it is added once per layer).
            coef = np.empty((x.shape[0], m), np.float32)
            self._coefficients(layer, chunk_rows[:m], None, x, coef,
                               sel=np.ascontiguousarray(selected[:, start:start + m]).view(np.uint8),
                               B=self._chunk[:m])
            t2 = time.perf_counter()
            self.kernel.accumulate(self._chunk[:m], chunk_rows[:m], coef, y)
            self.stats.compute_s += time.perf_counter() - t2


class ResidentFFN:
    """The FFN of a quantized FLASHDIR in DRAM: every layer's bundles read once, kept in their blocks (without the
    bundles' padding: quant.DenseLayer) and computed whole, with no predictor and no neuron cache to consult
    (QuantSparseFFN.dense: one Numba call per layer and token at decode, widened blocks + BLAS for a prompt)."""

    def __init__(self, cfg: ModelConfig, ckpt: FlashCheckpoint, down_bias=None, progress: bool = False):
        L = ckpt.layout
        self.cfg = cfg
        self.kernel = sparse_ffn(L, max_active=max(L.n_neurons))
        self.layers = [self.kernel.dense_layer(ckpt.bundles(i))    # one layer's bundles at a time in transit
                       for i in tqdm(range(L.n_layers), desc="ffn", unit="layer", disable=not progress, leave=False)]
        self.down_bias = list(down_bias) if down_bias is not None else [None] * cfg.n_layers

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty_like(x)
        self.kernel.dense(self.layers[layer], x, y)
        if self.down_bias[layer] is not None:
            y += self.down_bias[layer]
        return y


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
    residual (bench/lookahead.py measures the recall cost: mean 0.910 vs 0.911 on SmolLM2)."""
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


def warn_if_dense_does_not_fit(path, cfg: ModelConfig) -> None:
    """--ffn dense with --dram-budget auto: one line when the weights will not fit, naming what to run. A GGUF keeps
    its blocks (about its file's size), anything else is float32."""
    if str(path).endswith(".gguf") and os.path.isfile(path):
        need = os.path.getsize(path)
    else:
        need = resident_bytes_for(cfg) + cfg.n_layers * cfg.ffn_dim * cfg.dim * 4 * (3 if cfg.glu else 2)
    room = auto_budget_bytes()
    if need > room:
        print(f"note: {path} needs about {need / 2**20:.0f} MiB in DRAM dense and {room / 2**20:.0f} MiB is "
              f"available; to run it from flash, make its predictors: `flashinfer-lite convert`, "
              f"`flashinfer-lite collect`, `flashinfer-lite train-predictor` (docs/PREDICTORS.md)", file=sys.stderr)


def one_blas_thread() -> None:
    """What OPENBLAS_NUM_THREADS=1 in flashinfer_lite/__init__.py does, for a process that loaded numpy first (the
    variable is read once, then): OpenBLAS's spinning threads made SmolLM2's dense FFN 296 ms/token instead of 21.
    A user's own OPENBLAS_NUM_THREADS is left alone."""
    if not BLAS_THREADS_FROM_USER:
        threadpool_limits(1, user_api="blas")


def load_runtime(path, ffn: str = "dense", dram_budget: int | str | None = None, ctx: int | None = None, window: int = 5,
                 threads: int | None = None, progress: bool = False, verbose: bool = False, verify: bool = True,
                 runtime_bytes: int | None = None, lookahead: bool = False, make_predictors=None):
    """(model, tokenizer, runtime) for a model path and an FFN mode; runtime is None for dense.

    A model that is not a FLASHDIR is converted into the cache on first use for the sparse modes.
    dram_budget: bytes for everything the process keeps (default: room for the whole model); "auto": the whole model
    when it fits in what the machine can give (budget.auto_budget_bytes), else that much.
    runtime_bytes: the plan's runtime line; None measures this process (budget.measure_runtime_bytes).
    lookahead: in predicted mode, start each layer's reads one layer early on a guess (lookahead_selector). Off by
    default: on the 7B-shaped bench at a 25% budget the device is the bottleneck and the wrong guesses' extra bytes
    cost more than the early start hides (bench/README.md).
    make_predictors(flashdir): called when --ffn auto must run from flash and the FLASHDIR has no predictors (the
    default model's first use trains them); without it, that is an error naming the commands to run.
    """
    one_blas_thread()
    if ffn not in FFN_MODES:
        raise UserError(f"unknown --ffn mode '{ffn}' (choose from {', '.join(FFN_MODES)})")
    if ffn == "dense":
        return load_dense(path, dram_budget, progress)
    keep_freed_arrays_out_of_rss()
    ckpt, tokenizer, predictors = open_flashdir(path, ffn, verify, progress)
    cfg = ckpt.config
    ctx = ctx or cfg.default_ctx
    if ffn == "auto":
        # In RAM nothing is gained by predicting: the whole FFN computed from DRAM is both exact and faster
        dense = plan_resident(ckpt, dram_budget, ctx, runtime_bytes)
        if dense is not None:
            if verbose or dense.requested:
                print(dense.table(), file=sys.stderr)
            return resident_model(ckpt, progress), tokenizer, None
        if (predictors is None or not predictors.has_predictors) and make_predictors is not None:
            if isinstance(dram_budget, int):   # below even the sparse minimum: refused before minutes of training
                plan_dram(ckpt, None, "predicted", dram_budget, ctx, window,
                          runtime_bytes, lookahead)
            make_predictors(str(ckpt.path))
            predictors = load_predictors(ckpt.path)
        if predictors is None or not predictors.has_predictors:
            raise UserError(f"{ckpt.path} does not fit the DRAM budget and has no predictors to run it from flash: "
                            f"run `flashinfer-lite collect` and `flashinfer-lite train-predictor`")
        ffn = "predicted"
    lookahead = lookahead and ffn == "predicted"   # the guess is a predictor's
    # Planned before any weight loads: a budget too small fails before the work, and the runtime line is measured
    # on a process that holds everything but the weights (tokenizer, predictors, compiled kernels included).
    plan = plan_dram(ckpt, predictors, ffn, dram_budget, ctx, window, runtime_bytes,
                     lookahead)
    if verbose or plan.requested:
        print(plan.table(), file=sys.stderr)
    weights = load_weights(ckpt, progress, skip=lambda n: bool(_BUNDLED.fullmatch(n)),
                           convert=half_matrix if ckpt.layout.dtype != "f32" else None)
    select = oracle_selector(cfg, ckpt, predictors) if ffn == "oracle" else predictors.predict
    runtime = FlashFFN(cfg, ckpt.layout, plan, select, predictors,
                       down_bias=[weights.get(f"layers.{i}.ffn.down.bias") for i in range(cfg.n_layers)],
                       threads=threads, verbose=verbose,
                       lookahead=lookahead_selector(cfg, weights, predictors) if lookahead else None)
    if verbose:
        print(runtime.reader.describe(), file=sys.stderr)
    return Transformer(cfg, weights, ffn=runtime), tokenizer, runtime


def resident_model(ckpt: FlashCheckpoint, progress: bool) -> Transformer:
    """A FLASHDIR's model with every weight in DRAM (--ffn dense, and auto when it fits): a quantized one as stored,
    resident matrices in blocks and the FFN as ResidentFFN; any other as dense FeedForward matrices (float16, float32
    for f32 bundles)."""
    if not ckpt.layout.quantized:
        return Transformer(ckpt.config, load_weights(ckpt, progress, convert=half_matrix if dense_half(ckpt) else None))
    weights = load_weights(ckpt, progress, skip=lambda n: bool(_BUNDLED.fullmatch(n)),
                           convert=half_matrix if ckpt.layout.dtype != "f32" else None)
    down_bias = [weights.get(f"layers.{i}.ffn.down.bias") for i in range(ckpt.config.n_layers)]
    ffn = ResidentFFN(ckpt.config, ckpt, down_bias, progress)
    return Transformer(ckpt.config, weights, ffn=ffn)


def plan_resident(ckpt: FlashCheckpoint, dram_budget, ctx: int, runtime_bytes: int | None):
    """The in-RAM plan (budget.plan_resident_ffn) of --ffn auto, or None when the whole model does not fit
    --dram-budget (a size, "auto": what the machine can give, None: no limit)."""
    cfg, layout = ckpt.config, ckpt.layout
    if runtime_bytes is None:
        runtime_bytes = measure_runtime_bytes(layout)
    resident = resident_bytes_for(cfg, half=layout.dtype != "f32", kinds=ckpt.resident_kinds)
    budget = {None: 1 << 60, "auto": auto_budget_bytes()}.get(dram_budget, dram_budget)
    return plan_resident_ffn(cfg, layout, budget, ctx, resident, runtime_bytes,
                             heap_slack_bytes=HEAP_SLACK_BYTES if runtime_bytes else 0,
                             requested=dram_budget not in (None, "auto"))


def load_dense(path, dram_budget, progress: bool):
    """--ffn dense: every weight in DRAM. A float16 FLASHDIR runs with float16 matrices (so dense and oracle compare
    like for like), a quantized one as stored (resident matrices in blocks, the FFN as ResidentFFN over its bundles);
    an HF directory stays float32, the reference checked against transformers, and a GGUF keeps its matrices in
    their block formats where storage/blocks.py has them (loader.load_tensor)."""
    if dram_budget not in (None, "auto"):
        raise UserError("--dram-budget applies to --ffn predicted/oracle; --ffn dense keeps every weight in DRAM")
    if is_flashdir(path):      # as open_flashdir: the resident file and the manifest are checked, not only each layer
        verify_at_load(path, progress=progress)
    ckpt = open_any(path)
    if dram_budget == "auto":
        warn_if_dense_does_not_fit(path, ckpt.config)
    if isinstance(ckpt, FlashCheckpoint):
        return resident_model(ckpt, progress), ckpt.tokenizer(), None
    weights = load_weights(ckpt, progress, keep_blocks=True)
    return Transformer(ckpt.config, weights), ckpt.tokenizer(), None


def dense_half(ckpt) -> bool:
    """Whether a dense run keeps its matrices float16: a FLASHDIR of float16 (or int8) bundles. Not a quantized one:
    its FFN dequantizes to values float16 would round (its resident matrices stay in blocks: loader.load_tensor)."""
    return isinstance(ckpt, FlashCheckpoint) and ckpt.layout.dtype in ("f16", "int8")


def open_flashdir(path, ffn: str, verify: bool, progress: bool):
    """(FlashCheckpoint, tokenizer, PredictorSet or None) of the FLASHDIR for `path`: an HF directory or GGUF file is
    converted into the cache on first use; a launch checks sizes and the verified stamp, not every byte."""
    path = flashdir_for(path, progress)
    if verify:
        verify_at_load(path, progress=progress)
    ckpt = FlashCheckpoint(path)
    predictors = load_predictors(path)
    if ffn == "predicted" and (predictors is None or not predictors.has_predictors):
        raise UserError(f"{path} has no predictors: run `flashinfer-lite collect` and `flashinfer-lite train-predictor`")
    return ckpt, ckpt.tokenizer(), predictors


def plan_dram(ckpt, predictors, ffn: str, dram_budget, ctx: int, window: int, runtime_bytes: int | None,
              lookahead: bool):
    """The BudgetPlan for --dram-budget: a size, "auto" (the whole model when it fits in what the machine can give,
    else that much, said in one line), or None (room for the whole model: every neuron pinned, the full window)."""
    cfg, layout = ckpt.config, ckpt.layout
    max_active = expected_max_active(cfg, predictors)
    if runtime_bytes is None:
        runtime_bytes = measure_runtime_bytes(layout)
    # float16 bundles: the resident matrices go float16 too (half the DRAM, and GEMV reads half the bytes), quantized
    # ones in blocks; float32 bundles keep the whole model exact.
    resident = resident_bytes_for(cfg, half=layout.dtype != "f32", kinds=ckpt.resident_kinds)
    if ffn == "oracle":  # the true activations need the dense gate/up weights, float32, kept for the run
        resident += cfg.n_layers * cfg.ffn_dim * cfg.dim * 4 * (2 if cfg.glu else 1)

    def plan_for(budget: int, requested: bool):
        return plan_budget(cfg, layout, budget, ctx, window, max_active=max_active, resident_bytes=resident,
                           runtime_bytes=runtime_bytes, stream_chunk_bytes=STREAM_CHUNK_BYTES, requested=requested,
                           lookahead=lookahead, heap_slack_bytes=HEAP_SLACK_BYTES if runtime_bytes else 0)
    whole = plan_for(1 << 60, False).used_bytes
    if dram_budget == "auto":
        room = auto_budget_bytes()
        if room >= whole:
            return plan_for(whole, False)
        print(f"dram budget: auto = {room / 2**20:.0f} MiB (available memory less a margin); the model's "
              f"{whole / 2**20:.0f} MiB do not fit, so the FFN neurons that do not are read from flash",
              file=sys.stderr)
        return plan_for(room, True)
    return plan_for(whole, False) if dram_budget is None else plan_for(dram_budget, True)


def expected_max_active(cfg: ModelConfig, predictors) -> int:
    """The active count the window is sized for (its useful maximum is this x window tokens): twice the mean
    active count when the neuron frequencies say it, else half the layer. Not in the minimum
    (budget.MIN_WINDOW_ROWS)."""
    n = cfg.ffn_dim
    if predictors is None:
        return max(1, n // 2)
    mean = max(float(predictors.neuron_freq(i).sum()) for i in range(cfg.n_layers))
    return int(min(n, max(16, 2 * mean)))
