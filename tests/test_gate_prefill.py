"""The exact gate's prompt kernels (ffn/quant.py: quant_gate_coefficients over rows_dot8, quant_ffn_accumulate_rows):
a prompt's rows, computed many at a time, have the bits each row has alone (a decoded token's), so the prefill chunk
does not change the function; and the coefficients are llama.cpp's integer dot products (float64 oracle, test_act8).
"""
from __future__ import annotations

import numpy as np
import pytest

from flashinfer_lite import model as model_module
from flashinfer_lite.ffn.quant import QuantSparseFFN
from flashinfer_lite.kernels.neurons import quant_ffn_accumulate, quant_ffn_accumulate_rows
from flashinfer_lite.ffn.flash import SplitRows
from flashinfer_lite.kernels.blocks import KINDS, dequantize, quantize
from flashinfer_lite.runtime import load_runtime
from storage.format import FlashLayout, pack_bundles
from conftest import kquant_blocks
from test_act8 import oracle_dot, q8k_blocks
from test_exact_gate import IDS, gated  # noqa: F401  (the module's fixture: the tiny SiLU llama, split and calibrated)
from test_kdown import bundles_with_columns


K_QUANTS = ("q4_k", "q5_k", "q6_k")


class GateUp:
    """What SplitRows.coefficients reads of itself, for gate|up rows H uint8 [n, gate bytes + up bytes] made here
    (SiLU, no scales or biases)."""

    def __init__(self, gate: str, up: str, d: int):
        from storage.blocks import row_bytes
        self.kind, self.up_kind = KINDS[gate].code, KINDS[up].code
        self.n, self.up_n = row_bytes(d, gate), row_bytes(d, up)
        self.up_at, self.quantized, self.act, self.threshold = self.n, True, 1, np.float32(-np.inf)   # silu
        self.s_gate = self.s_up = self.bg = self.bu = -1


def blocks(w: np.ndarray, kind: str) -> np.ndarray:
    return kquant_blocks(w, kind.upper()) if kind in K_QUANTS else quantize(w, kind)


def oracle(W: np.ndarray, kind: str, x: np.ndarray) -> np.ndarray:
    """llama.cpp's dot products of W's rows with x in float64 on its exact integers: x's q8_0 / q8_1 blocks, or for
    the K-quants its q8_K blocks times gguf's dequantized rows."""
    if kind not in K_QUANTS:
        return np.array([oracle_dot(r, kind, x)[0] for r in W])
    q, dx = q8k_blocks(x)
    xr = (q.reshape(-1, 256) * dx[:, None].astype(np.float64)).reshape(-1)
    return dequantize(W, kind, x.shape[0]).astype(np.float64) @ xr


@pytest.mark.parametrize("gate, up", [("q4_1", "q4_1"), ("q8_0", "q5_0"), ("q4_0", "q5_1"), ("q4_k", "q4_k"),
                                      ("q5_k", "q6_k"), ("q5_0", "q4_k")])
def test_gate_coefficients_are_one_rows_bits_and_llama_cpps_integers(gate, up):
    rng = np.random.default_rng(7)
    d, n, T = 256, 40, 11                 # T: a tile of rows_dot8's rows, then three rows one at a time
    Wg, Wu = (blocks((rng.standard_normal((n, d)) * 0.3).astype(np.float32), k) for k in (gate, up))
    pad = np.zeros((n, -(Wg.shape[1] + Wu.shape[1]) % 4), np.uint8)    # rows of whole float32 slots, as bundles'
    H = np.ascontiguousarray(np.concatenate([Wg, Wu, pad], axis=1))
    X = rng.standard_normal((T, d)).astype(np.float32)
    k = GateUp(gate, up, d)
    coef = np.empty((T, n), np.float32)
    SplitRows.coefficients(k, H, X, coef, -1.0)
    for t in range(T):                    # each row alone: the bits of the same row among others
        one = np.empty((1, n), np.float32)
        SplitRows.coefficients(k, H, X[t:t + 1].copy(), one, -1.0)
        assert np.array_equal(one[0].view(np.uint32), coef[t].view(np.uint32)), t
    g, u = (np.array([oracle(W, k, X[t]) for t in range(T)]) for W, k in ((Wg, gate), (Wu, up)))
    want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(coef, want, rtol=0, atol=2e-5 * np.abs(want).max())
    # the calibrated threshold: |c| <= t counts as 0, the rest unchanged
    t = float(np.median(np.abs(coef)))
    cut = np.empty_like(coef)
    SplitRows.coefficients(k, H, X, cut, t)
    assert np.array_equal(cut, np.where(np.abs(coef) <= t, 0, coef)) and 0.3 < np.mean(cut == 0) < 0.7


def accumulate_args(ffn):
    return (ffn.down_at, ffn.down_kind.code, ffn.down_kind.weights, ffn.down_kind.block_bytes, ffn.out_block,
            ffn.s_neuron, ffn.S)


@pytest.mark.parametrize("down", ["q6_k.col", "q5_1.col", "q4_1.col", "q8_0", "q4_1"])
def test_prompt_down_sum_is_one_rows_bits(down):
    rng = np.random.default_rng(8)
    if down.endswith(".col"):            # a GGUF's down kept exactly, as columns (storage.columns)
        ffn, B, *_ = bundles_with_columns(down[:-4])
        d, n = ffn.d, B.shape[0]
    else:                                # down rows along d
        d, n = 256, 300
        L = FlashLayout.create(d, [n], "q8_0", True, down_dtype=down)
        B = pack_bundles(L, [(rng.standard_normal((n, d)) * 0.2).astype(np.float32) for _ in range(3)])
        ffn = QuantSparseFFN.from_layout(L, act="silu", max_active=n)
    slots = np.sort(rng.choice(n, n * 3 // 4, replace=False)).astype(np.int32)
    T = 37
    coef = (rng.standard_normal((T, len(slots))) * (rng.random((T, len(slots))) < 0.6)).astype(np.float32)
    coef[5] = 0                          # a row with no neuron, and neurons no row needs
    coef[:, 10:20] = 0
    Y0 = rng.standard_normal((T, d)).astype(np.float32)    # sums already begun (a set in pieces)
    Y = Y0.copy()
    quant_ffn_accumulate_rows(B, B.view(np.float32), slots, coef, Y, *accumulate_args(ffn))
    for t in range(T):
        y = Y0[t:t + 1].copy()
        quant_ffn_accumulate(B, B.view(np.float32), slots, np.ascontiguousarray(coef[t:t + 1]), y,
                             *accumulate_args(ffn))
        assert np.array_equal(y[0].view(np.uint32), Y[t].view(np.uint32)), t
    assert not np.array_equal(Y, Y0)


def test_the_gate_gives_the_same_bits_for_every_prefill_chunk(gated, monkeypatch):  # noqa: F811
    """A prompt through the exact gate in chunks of 1 (every row a decode step), 3 and 256 rows: the same logits,
    bit for bit (the prompt kernels for many rows, the decode kernels for one)."""
    model, _, rt = load_runtime(gated["q8_0"], "gate", ctx=64, base_bytes=0)
    got = {}
    for rows in (256, 3, 1):
        monkeypatch.setattr(model_module, "PREFILL_CHUNK_ROWS", rows)
        kv = model.new_cache(64)
        got[rows] = model.forward(IDS, kv, all_logits=True)
    assert np.array_equal(got[3], got[256]) and np.array_equal(got[1], got[256])
    assert rt.stats.active.sum() < 0.8 * rt.stats.rows.sum() * 160     # the threshold dropped neurons
