"""float16 resident matrices: the Numba GEMV against float64 math, and a Transformer whose matrices are float16
against the same Transformer given the float16-rounded weights back in float32 (the independent oracle: numpy BLAS)."""
import tracemalloc

import numpy as np
import pytest

from storage.checkpoint import open_checkpoint
from flashinfer_lite.kernels.gemv import MATMUL_ROW_KERNEL_MAX_T, WIDEN_BLOCK_BYTES, matmul_t
from flashinfer_lite.model import load_weights
from flashinfer_lite.model import Transformer, half_matrices

from conftest import STORIES
from test_model_oracle import incremental_logits

# A float32 dot of d terms errs by ~sqrt(d) * 6e-8 of sum |x_k w_k|; measured <= 4e-7 here. Rounding the weights to
# float16 moves results by ~1e-3 of that sum, so the tolerance tells a half-precision input from float32 math on it.
REL_TOL = 2e-6


def rounded(w: np.ndarray) -> np.ndarray:
    return w.astype(np.float16).astype(np.float64)


# T <= MATMUL_ROW_KERNEL_MAX_T runs the row kernel (serial, or parallel over row chunks), above it widened blocks +
# BLAS (no parallel choice there); the last shape has a full widened block and a partial one.
@pytest.mark.parametrize("T,parallel", [(1, False), (1, True), (3, False), (3, True),
                                        (MATMUL_ROW_KERNEL_MAX_T + 1, False), (300, False)])
@pytest.mark.parametrize("n,d", [(37, 131), (300, 77), (WIDEN_BLOCK_BYTES // (4 * 131) + 502, 131)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_matmul_t_equals_float64_math(T, parallel, n, d, dtype):
    rng = np.random.default_rng(T * 1000 + n + d)
    w = rng.standard_normal((n, d), dtype=np.float32)
    w[::7] *= 1e-5                    # rows of float16 subnormals (below 6.1e-5)
    w[3, :5] = [65504.0, -65504.0, 0.0, -0.0, 1e-8]   # the largest finite halves, signed zeros, one flushed to 0
    x = rng.standard_normal((T, d), dtype=np.float32)
    w16 = w.astype(np.float16)
    y = matmul_t(x, w16.astype(dtype), parallel_min_work=0 if parallel else 1 << 62)
    assert y.dtype == np.float32 and y.shape == (T, n)
    want = x.astype(np.float64) @ rounded(w).T
    scale = np.abs(x).astype(np.float64) @ np.abs(rounded(w)).T
    assert np.all(np.abs(y - want) <= REL_TOL * scale)
    # the oracle can tell: float32 math on the unrounded weights falls outside the tolerance
    unrounded = x.astype(np.float64) @ w.astype(np.float64).T
    assert not np.all(np.abs(unrounded - want) <= REL_TOL * scale)


def test_matmul_t_takes_strided_input():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((20, 33), dtype=np.float32).astype(np.float16)
    x = rng.standard_normal((33, 4), dtype=np.float32).T            # [4, 33], Fortran order
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(matmul_t(x, w), want, rtol=1e-5, atol=1e-5)


def test_half_matrices_converts_matrices_only():
    rng = np.random.default_rng(0)
    big = rng.standard_normal((4, 8), dtype=np.float32)
    big[0, 0] = 1e5                                                   # beyond float16: kept float32, still exact
    w = {"layers.0.attn.q.weight": rng.standard_normal((8, 8), dtype=np.float32),
         "layers.0.attn.q.bias": rng.standard_normal(8, dtype=np.float32),
         "layers.0.attn_norm.weight": np.ones(8, np.float32),
         "lm_head.weight": big}
    q = w["layers.0.attn.q.weight"].copy()
    out = half_matrices(w)
    assert out is w
    assert w["layers.0.attn.q.weight"].dtype == np.float16
    np.testing.assert_array_equal(w["layers.0.attn.q.weight"], q.astype(np.float16))
    assert w["layers.0.attn.q.bias"].dtype == np.float32 and w["layers.0.attn_norm.weight"].dtype == np.float32
    assert w["lm_head.weight"] is big


def test_half_matrices_holds_one_tensor_at_a_time():
    # Ten 1 MiB matrices with no other reference: converting them may add at most about one tensor's worth
    # (its half copy and the overflow check's mask), never a second model.
    tensor_bytes = 1 << 20
    tracemalloc.start()  # before the matrices: tracemalloc only sees frees of what it saw allocated
    try:
        w = {f"m{i}": np.ones((256, 1024), np.float32) for i in range(10)}
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        half_matrices(w)
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base <= tensor_bytes
    assert now - base <= -4 * tensor_bytes  # and the float32 copies are gone
    assert all(a.dtype == np.float16 for a in w.values())


def f16_and_oracle(path):
    """(model with float16 matrices, model with the same float16-rounded values in float32, config)."""
    ckpt = open_checkpoint(path)
    w = load_weights(ckpt)
    oracle = {n: a.astype(np.float16).astype(np.float32) if a.ndim == 2 else a for n, a in w.items()}
    half = half_matrices(w)
    assert all(a.dtype == np.float16 for a in half.values() if a.ndim == 2)
    return Transformer(ckpt.config, half), Transformer(ckpt.config, oracle), ckpt.config


@pytest.mark.parametrize("kind", ["llama-bias-untied", "llama-silu-gqa", "opt", "opt-postnorm"])
@pytest.mark.parametrize("prefill", [5, 40])
def test_transformer_with_f16_matrices_matches_rounded_oracle(tiny_model, kind, prefill):
    assert 5 <= MATMUL_ROW_KERNEL_MAX_T < 40  # the prompt runs the row kernel, or widened blocks + BLAS
    ours, oracle, cfg = f16_and_oracle(tiny_model(kind))
    ids = np.random.default_rng(2).integers(3, 512, size=48).tolist()
    got = incremental_logits(ours, ids, prefill)
    want = incremental_logits(oracle, ids, prefill)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_tied_embeddings_share_one_f16_matrix(tiny_model):
    ours, oracle, cfg = f16_and_oracle(tiny_model("opt"))
    assert cfg.tie_embeddings
    assert ours.lm_head is ours.embed and ours.embed.dtype == np.float16
    ids = [5, 17, 300, 2, 99]
    got = ours.forward(ids, ours.new_cache(16), all_logits=True)
    want = oracle.forward(ids, oracle.new_cache(16), all_logits=True)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_stories260k_f16_matrices_match_rounded_oracle():
    ours, oracle, cfg = f16_and_oracle(STORIES)
    assert cfg.tie_embeddings
    ids = np.random.default_rng(3).integers(3, 512, size=60).tolist()
    got = incremental_logits(ours, ids, prefill=30)
    want = incremental_logits(oracle, ids, prefill=30)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_f16_flashdir_loads_its_stored_halves(tiny_model, tmp_path, monkeypatch):
    """A float16 FLASHDIR's resident matrices load as resident.safetensors stores them: equal to the source weights
    rounded to float16 (the oracle), and never widened to float32 on the way (FlashCheckpoint.tensor is not called
    for them)."""
    from storage.convert import convert
    from storage.format import FlashCheckpoint
    from storage.half import half_matrix
    from flashinfer_lite.model import load_tensor

    src = tiny_model("llama-bias-untied")
    flash = FlashCheckpoint(convert(src, tmp_path / "flash", dtype="f16", progress=False))
    source = open_checkpoint(src)
    matrices = [n for n in flash.names() if flash.stored_half(n) is not None]
    assert "lm_head.weight" in matrices and "layers.0.attn.q.weight" in matrices
    widened = flash.tensor
    monkeypatch.setattr(flash, "tensor", lambda n: pytest.fail(f"{n} widened") if n in matrices else widened(n))
    for n in matrices:
        got = load_tensor(flash, n, half_matrix)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, source.tensor(n).astype(np.float16))
    # vectors (norms, biases) stay float32, and without half_matrix a matrix comes widened, as before
    vector = next(n for n in flash.names() if n.endswith("norm.weight"))
    assert load_tensor(flash, vector, half_matrix).dtype == np.float32
    monkeypatch.undo()
    assert load_tensor(flash, "lm_head.weight", None).dtype == np.float32
