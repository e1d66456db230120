"""The fused decode attention kernel against float64 softmax attention over the visible keys (GQA, sliding window)."""
import math

import numpy as np
import pytest

from flashinfer_lite.kernels import decode_attention


@pytest.mark.parametrize("H,Hkv,S,lo", [(4, 4, 1, 0), (9, 3, 37, 0), (8, 2, 50, 20), (6, 1, 64, 63)])
def test_decode_attention_equals_float64_math(H, Hkv, S, lo):
    rng = np.random.default_rng(H * 100 + S)
    hd, cap = 16, 80
    q = rng.standard_normal((H, hd)).astype(np.float32)
    k = rng.standard_normal((cap, Hkv, hd)).astype(np.float32)
    v = rng.standard_normal((cap, Hkv, hd)).astype(np.float32)
    out = np.empty((H, hd), np.float32)
    decode_attention(q, k, v, lo, S, np.float32(1 / math.sqrt(hd)), out)
    want = np.empty((H, hd))
    for h in range(H):
        kh = h // (H // Hkv)
        s = k[lo:S, kh].astype(np.float64) @ q[h].astype(np.float64) / math.sqrt(hd)
        p = np.exp(s - s.max())
        want[h] = (p / p.sum()) @ v[lo:S, kh].astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
