"""The 5-bit and K-quant kernels against gguf.quants (llama.cpp's reference, ported bit-exactly) and float64 math.

K-quant quantizers are not in gguf-py, so their blocks are random bytes with finite float16 scales: every bit
pattern a quantizer can write decodes the same way, so random blocks exercise every nibble, high bit and scale."""
import numba
import numpy as np
import pytest

from flashinfer_lite import kquant
from storage.errors import UserError

@numba.njit
def axpy(y, c, r, kind):
    kquant.row_axpy(y, c, r, kind)


HALVES = {"q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}   # byte offsets of f16 fields


def random_matrix(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    _, per_block, block_bytes = kquant.kind_of(kind)
    q = rng.integers(0, 256, (rows * cols // per_block, block_bytes), dtype=np.uint8)
    for o in HALVES[kind]:
        q[:, o:o + 2] = rng.normal(0, 0.02, q.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return q.reshape(rows, kquant.row_bytes(cols, kind))


def gguf_dequant(q: np.ndarray, kind: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants
    return np.asarray(quants.dequantize(q, GGMLQuantizationType[kind.upper()]), np.float32)


@pytest.mark.parametrize("kind", list(kquant.KQUANTS))
def test_dequantize_is_gguf_bit_for_bit(kind):
    q = random_matrix(kind, 7, 512)
    got = kquant.dequantize(q, kind, 512)
    want = gguf_dequant(q, kind).reshape(7, 512)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


@pytest.mark.parametrize("kind", ["q5_0", "q5_1"])
def test_dequantize_quantized_weights(kind):
    """Blocks made by gguf's quantizer (llama.cpp's rounding) decode to within one step of the weights."""
    from gguf import GGMLQuantizationType, quants
    w = np.random.default_rng(1).normal(size=(4, 256)).astype(np.float32)
    q = np.asarray(quants.quantize(w, GGMLQuantizationType[kind.upper()]))
    got = kquant.dequantize(q, kind, 256)
    assert np.array_equal(got, gguf_dequant(q, kind).reshape(4, 256))
    step = (np.abs(w).reshape(4, 8, 32).max(-1) / 15).repeat(32, -1)   # one 5-bit step of each block, generously
    assert (np.abs(got - w) <= step.reshape(4, 256)).all()


@pytest.mark.parametrize("kind", list(kquant.KQUANTS))
@pytest.mark.parametrize("T", [1, 3])
def test_matmul_against_float64(kind, T):
    rows, cols = 300, 768
    q = random_matrix(kind, rows, cols, seed=2)
    x = np.random.default_rng(3).normal(size=(T, cols)).astype(np.float32)
    w = gguf_dequant(q, kind).reshape(rows, cols).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    got = kquant.matmul_t(x, q, kind)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert (np.abs(got - want) <= 1e-5 * scale + 1e-7).all()


@pytest.mark.parametrize("kind", list(kquant.KQUANTS))
def test_matmul_same_bits_at_every_thread_count(kind):
    q = random_matrix(kind, 512, 1024, seed=4)
    x = np.random.default_rng(5).normal(size=(1, 1024)).astype(np.float32)
    before = numba.get_num_threads()
    try:
        outs = []
        for t in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(t)
            outs.append(kquant.matmul_t(x, q, kind))
    finally:
        numba.set_num_threads(before)
    assert all(np.array_equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("kind", list(kquant.KQUANTS))
def test_row_axpy_is_float32_of_the_dequantized_row(kind):
    q = random_matrix(kind, 1, 512, seed=6)
    y = np.random.default_rng(7).normal(size=512).astype(np.float32)
    c = np.float32(0.37)
    want = y + c * gguf_dequant(q, kind).reshape(512)      # float32 numpy: one rounding per product, one per sum
    axpy(y, c, q[0], kquant.kind_of(kind)[0])
    assert np.array_equal(y, want)


def test_bad_shapes_are_one_line():
    with pytest.raises(UserError, match="multiple of 256"):
        kquant.row_bytes(100, "q4_k")
    with pytest.raises(UserError, match="unknown block format"):
        kquant.row_bytes(256, "iq2_xs")
    with pytest.raises(UserError, match="C-contiguous"):
        kquant.matmul_t(np.zeros((1, 256), np.float32), np.zeros((2, 100), np.uint8), "q4_k")
