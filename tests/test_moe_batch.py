"""A layer's routed experts in one kernel call (issue 30): ffn.quant.quant_experts computes every (row, expert) pair
of a decode step over the expert cache's slots at once. Oracles: float64 math on the weights gguf.quants dequantizes
(storage.experts.ExpertLayout.unpack), and quant_ffn, the one-expert kernel, for the bits."""
from __future__ import annotations

import numpy as np
import pytest

from flashinfer_lite.ffn.quant import quant_experts, quant_ffn
from flashinfer_lite.kernels.blocks import BLOCK, QuantMatrix
from storage.experts import ExpertLayout
from test_kernels import dense_coefficients, dense_ffn, numba_threads, rel_err


@pytest.mark.parametrize("dtypes", [("q4_0",) * 3, ("q8_0", "q4_1", "q5_0")])
def test_every_pair_in_one_call_equals_float64_and_the_one_expert_kernel(dtypes, float32_activations):
    """float32 x: float64 math on the dequantized weights and quant_ffn's bits; 8-bit x (the default): quant_ffn's
    bits, x and the coefficients rounded the same way whichever pairs share the call."""
    from flashinfer_lite.kernels.blocks import set_act8
    rng = np.random.default_rng(3)
    d, n, E = 3 * BLOCK, 9 * BLOCK, 5
    L = ExpertLayout(d, n, E, 1, dtypes)
    w = [{m: rng.standard_normal(L.shape(m)).astype(np.float32) / np.sqrt(L.shape(m)[1])
          for m in ("gate", "up", "down")} for _ in range(E)]
    slot_of = [3, 0, 4, 1, 2]                                  # expert e sits in slot slot_of[e] of the stack
    S = np.zeros((E, L.chunk), np.uint8)
    for e in range(E):
        S[slot_of[e]] = L.pack(w[e])
    X = rng.standard_normal((2, d)).astype(np.float32) * 3
    every = [(0, 4), (1, 4), (0, 1), (1, 0), (0, 2)]           # (row, expert): a row routed to several experts
    for threads, act8, pairs in ((1, False, every), (2, False, every), (1, True, every), (2, True, every),
                                 (2, True, every[:1])):         # fewer pairs than threads: each pair split in tasks
        set_act8(act8)              # float32_activations sets the default back after the test
        O = np.full((len(pairs), d), np.nan, np.float32)
        with numba_threads(threads):
            quant_experts(S, L, X, [t for t, _ in pairs], [slot_of[e] for _, e in pairs], range(len(pairs)), O,
                          "silu", 0.0)
        for q, (t, e) in enumerate(pairs):
            dq = L.unpack(S[slot_of[e]])
            ref = dense_ffn(dq, dense_coefficients(dq, X[t], True, "silu", None))
            assert act8 or rel_err(O[q], ref) < 1e-5, (threads, q)
            mats = [QuantMatrix(a, k, L.shape(m)[1]) for m, (k, a) in zip(("gate", "up", "down"),
                                                                         L.matrices(S[slot_of[e]]))]
            assert np.array_equal(O[q], quant_ffn(X[t:t + 1], *mats, "silu", 0.0)[0]), (threads, q)


def test_a_decode_step_is_one_kernel_call_per_layer(tiny_model, tmp_path, monkeypatch):
    """With every expert in DRAM, each layer of a decoded token computes its routed experts in one quant_experts call
    (a prompt's experts with more rows go through their own matrix products)."""
    import flashinfer_lite.ffn.dense as dense_module
    from flashinfer_lite.runtime import load_runtime
    from storage.convert import convert
    flash = convert(tiny_model("qwen3moe"), tmp_path / "flash", dtype="q4_0", progress=False)
    model, _, rt = load_runtime(flash, "auto", dram_budget=None, base_bytes=0)
    calls = []
    real = dense_module.quant_experts
    monkeypatch.setattr(dense_module, "quant_experts", lambda *a, **k: (calls.append(len(a[3])), real(*a, **k)))
    kv = model.new_cache(32)
    model.forward([5, 6, 7], kv)
    calls.clear()
    model.forward([8], kv)
    cfg = rt.cfg
    assert calls == [cfg.n_experts_used] * cfg.n_layers


def test_auto_runs_an_hf_mixture_of_experts_from_flash(tiny_model, tmp_path, monkeypatch):
    """--ffn auto on an HF mixture of experts converts it on first use and reads its experts through the expert cache
    (it needs no predictors): at the minimum budget the logits are the bits of the converted model in DRAM."""
    from flashinfer_lite.ffn.experts import ExpertFFN
    from flashinfer_lite.runtime import load_runtime
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path / "cache"))
    src = tiny_model("olmoe")
    _, _, rt = load_runtime(src, "auto", base_bytes=0)
    assert isinstance(rt, ExpertFFN)
    flash = next((tmp_path / "cache").rglob("manifest.json")).parent
    want = load_runtime(flash, "dense")[0]
    model, _, rt = load_runtime(src, "auto", dram_budget=rt.plan.minimum_bytes, base_bytes=0)
    prompt = [5, 9, 200, 31, 7]
    got = model.forward(prompt, model.new_cache(16), all_logits=True)
    assert np.array_equal(got, want.forward(prompt, want.new_cache(16), all_logits=True)) and rt.stats.misses > 0
