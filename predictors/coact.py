"""`flashinfer-lite order-neurons MODEL -o FLASHDIR [--text FILE] [--tokens N] [--force]`: convert a gated model with
its neurons placed by co-activation: the exact gate's down rows of the neurons that fire
together stored next to each other, so that a token's fired set falls into long runs of the file and the reader
(storage.reader: runs whose holes are at most its coalescing gap become one request) reads it in fewer requests.

fired_bits runs the exact gate (ffn.flash.ExactGate, at its calibrated thresholds) over a calibration text and keeps,
per layer and neuron, one bit per token: whether the neuron cleared its threshold. That is T/8 bytes a neuron (1.1 MiB
a layer of the 1.5B's 8,960 neurons for 1,024 tokens), whatever the model's width squared would be.

coact_order then lays each layer's neurons along one path: a token whose fired set is in bundle order a_0, a_1, ...
starts a run at every neuron that fires after one that does not, so the runs of every token sum to half the Hamming
distances between neighbours' bit patterns (plus a term of the first and last neuron): the placement that minimises
requests at a zero gap is a shortest Hamiltonian path under Hamming distance (Ripple, arXiv 2410.19274, builds the
same path on its co-activation graph). Greedy nearest neighbour builds it, starting from the most frequent neuron so
that the hot ones, which fire for nearly every token, make one long run at the front.
"""
from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

import numpy as np
from tqdm import tqdm

from flashinfer_lite.ffn.gate import CALIBRATION_CTX, CALIBRATION_TOKENS
from flashinfer_lite.runtime import load_runtime
from storage.convert import DEFAULT_DTYPE, convert
from storage.errors import UserError
from storage.format import read_layout
from storage.gate_file import DEFAULT_SPARSITY, GATE_FILE
from storage.tokenizer import token_segments

from .calibrate_gate import calibrate


def coact_order(bits: np.ndarray) -> np.ndarray:
    """A layer's neurons in co-activation order: int64 [n], position -> neuron. bits: uint8 [n, bytes], neuron i's
    firing over the calibration tokens (np.packbits along tokens; padding bits 0 in every row). Each step appends the
    not yet placed neuron nearest (Hamming) to the last placed one; a tie goes to the one first in `left` (the rows
    still to place, compacted by moving the last into each hole: deterministic). n steps of n x bytes popcounts:
    ~1 s a 1.5B layer."""
    n = bits.shape[0]
    words = _as_words(bits)
    freq = np.bitwise_count(words).sum(axis=1, dtype=np.int64)
    left = np.arange(n, dtype=np.int64)             # left[:m]: neurons not yet placed, rows[:m] their bits
    rows = words.copy()
    order = np.empty(n, np.int64)
    at = int(np.argmax(freq))                       # the most frequent first (the lowest id of a tie)
    for k in range(n):
        m = n - k
        order[k] = left[at]
        cur = rows[at].copy()
        left[at], rows[at] = left[m - 1], rows[m - 1]   # swap-remove: its place takes the last
        if m > 1:
            at = int(np.argmin(np.bitwise_count(rows[:m - 1] ^ cur).sum(axis=1, dtype=np.int64)))
    return order


def _as_words(bits: np.ndarray) -> np.ndarray:
    """bits uint8 [n, b] as uint64 [n, ceil(b / 8)] (zero padded: padding adds nothing to a distance)."""
    n, b = bits.shape
    w = -(-b // 8)
    out = np.zeros((n, w * 8), np.uint8)
    out[:, :b] = bits
    return out.view(np.uint64)


def runs(fired: np.ndarray, gap: int = 0) -> int:
    """Requests that read a fired set in file order (bool [n] in bundle order) when holes of at most `gap` rows are
    read through: storage.reader.BundleReader.read_ops' rule (before it splits runs at its largest read)."""
    ids = np.flatnonzero(fired)
    return int(ids.size and 1 + np.count_nonzero(np.diff(ids) - 1 > gap))


def fired_bits(model, ffn, windows, progress: bool = False) -> list[np.ndarray]:
    """Per layer uint8 [n, bytes]: which neurons (in the FLASHDIR's bundle order) cleared the exact gate's
    threshold, one bit per token of `windows` (token id lists), each window run as one prompt. ffn: the exact gate's
    FlashFFN, at the thresholds it was built with."""
    cfg = ffn.cfg
    parts = [[] for _ in range(cfg.n_layers)]

    def keep(layer: int, coef: np.ndarray) -> None:      # coef [T, n]: 0 where the neuron did not clear
        parts[layer].append(np.packbits(coef != 0, axis=0).T)   # [n, ceil(T / 8)], this window's bits
    kv = model.new_cache(max(map(len, windows)))
    ffn.selector.observe = keep
    try:
        for w in tqdm(windows, desc="co-activation", unit="window", disable=not progress, file=sys.stderr):
            kv.reset()
            model.forward(w, kv)
    finally:
        ffn.selector.observe = None
    return [np.ascontiguousarray(np.concatenate(p, axis=1)) for p in parts]


def orders_for(flashdir, text: str | None = None, n_tokens: int | None = None, sparsity: float | None = None,
               progress: bool = False) -> tuple[list[np.ndarray], dict]:
    """(per layer the co-activation order of FLASHDIR's bundles: position -> bundle id, what was measured): the exact
    gate at `sparsity` (calibrated first if gate.json is missing, on n_tokens of the built-in calibration text) over
    n_tokens of `text` (default: that text), in windows of the calibration's context."""
    sparsity = DEFAULT_SPARSITY if sparsity is None else sparsity
    n_tokens = CALIBRATION_TOKENS if n_tokens is None else n_tokens
    builtin = text is None
    if builtin:
        text = (resources.files("predictors") / "calibration.txt").read_text()
    if not (Path(flashdir) / GATE_FILE).exists():      # the thresholds first, with their own progress bar
        calibrate(str(flashdir), n_tokens, progress=progress)
    model, tokenizer, ffn = load_runtime(flashdir, "gate", ctx=CALIBRATION_CTX, verify=False, base_bytes=0,
                                         sparsity=sparsity)
    try:
        ctx = min(CALIBRATION_CTX, ffn.cfg.max_pos)
        windows = list(token_segments(tokenizer, text, n_tokens, ctx, ffn.cfg.bos_id))
        bits = fired_bits(model, ffn, windows, progress)
    finally:
        ffn.reader.close()
        del model, ffn
    orders = []
    for b in tqdm(bits, desc="order", unit="layer", disable=not progress, file=sys.stderr):
        orders.append(coact_order(b))
    info = {"text": "the built-in calibration text (calibration.txt)" if builtin else "a text given to convert",
            "tokens": int(sum(map(len, windows))), "sparsity": float(sparsity)}
    return orders, info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a gated model's HF directory or .gguf file")
    parser.add_argument("-o", "--output", required=True, help="flash directory to create")
    parser.add_argument("--text", metavar="FILE",
                        help="text to measure which neurons fire together on (default: the built-in calibration "
                             "text, the one the exact gate's thresholds come from); never an evaluation text")
    parser.add_argument("--tokens", type=int, default=CALIBRATION_TOKENS,
                        help=f"tokens of it (default {CALIBRATION_TOKENS}; the thresholds take as many of the "
                             f"built-in text)")
    parser.add_argument("--force", action="store_true", help="replace an existing flash directory")


def run(args) -> int:
    if args.tokens < CALIBRATION_CTX:
        raise UserError(f"--tokens must be at least {CALIBRATION_CTX}")
    text = None
    if args.text is not None:
        try:
            text = Path(args.text).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--text {args.text}: cannot read it as UTF-8 text "
                            f"({getattr(e, 'strerror', None) or e})") from None
        if not text.strip():
            raise UserError(f"--text {args.text} is empty")
    out = convert_coact(args.model, args.output, text, args.tokens, force=args.force)
    L = read_layout(out)
    print(f"wrote {out}: {L.n_layers} layers x {L.n_neurons[0]} neurons in co-activation order")
    return 0


def convert_coact(model, output, text: str | None = None, n_tokens: int | None = None, dtype: str = DEFAULT_DTYPE,
                  force: bool = False, progress: bool = True) -> Path:
    """storage.convert.convert with the neurons in co-activation order (orders_for, on a copy in the model's order)."""
    return convert(model, output, dtype=dtype, force=force, progress=progress,
                   order_by=lambda work: orders_for(work, text, n_tokens, progress=progress)[0])
