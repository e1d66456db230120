"""The decode step's Numba kernels (the paged attention of kv_pages.KVCache.attend, rms_norm_rows, add_rms_norm_rows)
against float64 numpy math, and the model's two attention paths (kernel, batched numpy) against each other. The cache
writes float16 with numpy's rounding (to nearest even), as F16C does (checked in test_kernels.py)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from flashinfer_lite import model as model_math
from flashinfer_lite.kernels.norm import add_rms_norm_rows, rms_norm_rows
from flashinfer_lite.kv_pages import KVCache, KVOptions
from flashinfer_lite.model import load_reference

from conftest import STORIES

RTOL = 1e-5


# ---------------------------------------------------------------------------------------------------------------
# Attention: float64 oracle over the float16 keys and values the kernel wrote

def rope64(x, pos, inv_freq):
    # x [T, heads, hd] float64 rotated at positions pos [T] (half-split pairing, as model.apply_rope)
    ang = pos[:, None] * inv_freq[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    h = x.shape[-1] // 2
    return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], axis=-1)


def attention64(q, K, V, pos0, window):
    # q [T, H, hd] float64, K, V [S, Hkv, hd] float64 -> [T, H, hd]
    T, H, hd = q.shape
    g = H // K.shape[1]
    out = np.zeros((T, H, hd))
    for t in range(T):
        pos = pos0 + t
        lo = max(0, pos - window + 1) if window else 0
        for h in range(H):
            s = K[lo:pos + 1, h // g] @ q[t, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h] = p @ V[lo:pos + 1, h // g] / p.sum()
    return out


@pytest.mark.parametrize("T,pos0,window,rope", [(1, 0, 0, True), (1, 37, 0, True), (3, 20, 0, True),
                                                (1, 37, 5, True), (4, 9, 3, True), (2, 11, 0, False)])
@pytest.mark.parametrize("dram_pages", [None, 0])
def test_paged_attention_matches_float64(T, pos0, window, rope, dram_pages, tmp_path):
    """kv_pages.KVCache.attend, pages in DRAM (None: all) or on flash (0), against float64 attention over the float16
    keys and values the cache holds."""
    rng = np.random.default_rng(T * 100 + pos0)
    H, Hkv, hd, cap = 6, 2, 64, 80
    cfg = SimpleNamespace(n_layers=1, n_heads=H, n_kv_heads=Hkv, head_dim=hd)
    kv = KVCache(cfg, cap, options=KVOptions(dram_pages=dram_pages, directory=str(tmp_path)))
    q = rng.standard_normal((T, H, hd)).astype(np.float32) * 2
    k = rng.standard_normal((T, Hkv, hd)).astype(np.float32) * 2
    v = rng.standard_normal((T, Hkv, hd)).astype(np.float32)
    K0 = rng.standard_normal((pos0, Hkv, hd)).astype(np.float32)     # earlier positions
    V0 = rng.standard_normal((pos0, Hkv, hd)).astype(np.float32)
    kv.write(0, 0, K0, V0)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd))
    pos = np.arange(pos0, pos0 + T, dtype=np.float64)
    if rope:
        ang = pos[:, None] * inv_freq[None, :]
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        q64, k64 = rope64(q.astype(np.float64), pos, inv_freq), rope64(k.astype(np.float64), pos, inv_freq)
    else:
        cos = sin = np.zeros((T, 0), np.float32)
        q64, k64 = q.astype(np.float64), k.astype(np.float64)
    out = np.empty((T, H, hd), np.float32)
    kv.attend(0, q, k, v, cos, sin, pos0, window, np.float32(1.0 / np.sqrt(hd)), out)

    K, V = (b.view(np.float16).astype(np.float64) for b in kv.rows(0, 0, pos0 + T))
    new = slice(pos0, pos0 + T)
    # the new rows: float16 of the (rotated) keys and values, within float16's rounding; the earlier ones as written
    np.testing.assert_allclose(K[new], k64, rtol=2 ** -11, atol=1e-6)
    assert np.array_equal(V[new], v.astype(np.float16).astype(np.float64))
    assert np.array_equal(K[:pos0], K0.astype(np.float16).astype(np.float64))
    assert (kv.on_flash > 0) == (dram_pages == 0 and pos0 + T >= 32)
    # the output over the float16 keys and values now in the cache
    want = attention64(q64, K, V, pos0, window)
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=RTOL * np.abs(want).max())


# ---------------------------------------------------------------------------------------------------------------
# The model's two attention paths give the same logits

def test_a_prompts_attention_has_the_same_bits_on_one_thread_or_two():
    """A prompt's attention runs its KV heads on Numba's thread count (model.attention_workers, at most 2): each head's
    arithmetic is its own, so the logits of every row are the same bits on one thread or two."""
    from test_kernels import numba_threads
    model, tok = load_reference(STORIES)
    ids = tok.encode("Once upon a time, there was a little dog who liked to run in the park with his friends")
    assert model.cfg.n_kv_heads > 1 and len(ids) > model_math.ATTENTION_KERNEL_MAX_T
    out = []
    for threads in (1, 2):
        with numba_threads(threads):
            assert model_math.attention_workers(model.cfg.n_kv_heads) == threads
            out.append(model.forward(ids, model.new_cache(64), all_logits=True))
    assert np.array_equal(out[0].view(np.uint32), out[1].view(np.uint32))


def test_kernel_and_batched_attention_agree(monkeypatch):
    """Every token decoded one at a time through the paged kernels (kv_pages.KVCache.attend) vs every token in one
    batched numpy pass: both
    read the same float16 cache, so they differ by float32 order (and its occasional float16 rounding flip)."""
    model, tok = load_reference(STORIES)
    ids = tok.encode("Once upon a time, there was a little dog")
    monkeypatch.setattr(model_math, "ATTENTION_KERNEL_MAX_T", 0)     # all numpy
    kv = model.new_cache(32)
    batched = model.forward(ids, kv, all_logits=True)
    monkeypatch.setattr(model_math, "ATTENTION_KERNEL_MAX_T", 1)     # T = 1: the kernel
    kv2 = model.new_cache(32)
    stepped = np.stack([model.forward([t], kv2) for t in ids])
    assert kv.kinds == ("f16", "f16") and kv.length == kv2.length == len(ids)
    np.testing.assert_allclose(stepped, batched, rtol=0, atol=5e-4 * np.abs(batched).max())   # measured 1.2e-4
    for layer in range(model.cfg.n_layers):
        for a, b in zip(kv2.rows(layer, 0, len(ids)), kv.rows(layer, 0, len(ids))):
            np.testing.assert_allclose(a.view(np.float16).astype(np.float32), b.view(np.float16).astype(np.float32),
                                       rtol=2 ** -10, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# A prompt's attention (model.prompt_attention, kernels.attention.softmax_tile) against float64

def test_the_softmax_exp_is_within_an_ulp_of_float64_and_zero_below_its_range():
    """exp_nonpositive, the prompt kernel's vectorizable exp: within 1 ulp of float64's exp rounded to float32 over
    [-87, 0] (measured 0.98 ulp), 0 at -inf and below -87."""
    from numba import njit
    from flashinfer_lite.kernels.attention import exp_nonpositive

    @njit
    def exps(x, out):
        for i in range(x.size):
            out[i] = exp_nonpositive(x[i])
    x = np.concatenate([-np.linspace(0, 87, 200_001, dtype=np.float32),
                        np.float32([-87.01, -100, -1e30, -np.inf])])
    got = np.empty_like(x)
    exps(x, got)
    ok = x >= -87
    want = np.exp(x[ok].astype(np.float64))
    assert (np.abs(got[ok] - want) <= np.spacing(want.astype(np.float32))).all()
    assert not got[~ok].any()


@pytest.mark.parametrize("H,Hkv,hd", [(6, 2, 16), (7, 1, 64), (4, 4, 32)])
@pytest.mark.parametrize("lengths", [(3,), (65,), (130, 1, 70, 29)])
def test_prompt_attention_in_chunks_matches_float64(H, Hkv, hd, lengths, monkeypatch):
    """model.prompt_attention over a prompt given in chunks (`lengths`: each chunk's keys written, then its queries
    attend over every earlier position in the cache and its own), query tiles of 64 rows and key blocks of 2 pages
    (lengths not multiples of either), GQA groups of 3, 7 and 1: each chunk's output within 1e-5 (of the largest
    value) of float64 causal softmax attention over the float16 keys and values the cache holds (measured ~1.5e-6:
    float32 products and sums, and exp_nonpositive's ulp)."""
    from flashinfer_lite.kv_pages import PAGE_POSITIONS
    monkeypatch.setattr(model_math, "ATTENTION_KEY_BLOCK", 2 * PAGE_POSITIONS)
    rng = np.random.default_rng(H * 1000 + sum(lengths))
    S = sum(lengths)
    cfg = SimpleNamespace(n_layers=1, n_heads=H, n_kv_heads=Hkv, head_dim=hd)
    kv = KVCache(cfg, S, options=KVOptions())
    pos0 = 0
    for T in lengths:
        kv.write(0, pos0, rng.standard_normal((T, Hkv, hd)).astype(np.float32) * 3,
                 rng.standard_normal((T, Hkv, hd)).astype(np.float32))
        q = rng.standard_normal((T, H, hd)).astype(np.float32)
        got = model_math.prompt_attention(q, kv, 0, pos0, None, np.float32(1 / np.sqrt(hd)))
        K, V = (b.view(np.float16).astype(np.float64) for b in kv.rows(0, 0, pos0 + T))
        want = attention64(q.astype(np.float64), K, V, pos0, 0)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        pos0 += T
