"""The 5-bit and K-quant kernels against gguf.quants (llama.cpp's reference, ported bit-exactly) and float64 math.

K-quant quantizers are not in gguf-py, so their blocks are random bytes with finite float16 scales: every bit
pattern a quantizer can write decodes the same way, so random blocks exercise every nibble, high bit and scale."""
import json

import numba
import numpy as np
import pytest

from flashinfer_lite.kernels import blocks as quant
from storage.errors import UserError

pytestmark = pytest.mark.usefixtures("float32_activations")   # oracle: float64 on the dequantized weights


@numba.njit
def axpy(y, c, r, kind):
    quant.row_axpy(y, c, r, kind)


KQUANTS = ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
HALVES = {"q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}   # byte offsets of f16 fields


def random_matrix(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    k = quant.KINDS[kind]
    per_block, block_bytes = k.weights, k.block_bytes
    q = rng.integers(0, 256, (rows * cols // per_block, block_bytes), dtype=np.uint8)
    for o in HALVES[kind]:
        q[:, o:o + 2] = rng.normal(0, 0.02, q.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return q.reshape(rows, quant.row_bytes(cols, kind))


def gguf_dequant(q: np.ndarray, kind: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants
    return np.asarray(quants.dequantize(q, GGMLQuantizationType[kind.upper()]), np.float32)


@pytest.mark.parametrize("kind", KQUANTS)
def test_dequantize_is_gguf_bit_for_bit(kind):
    q = random_matrix(kind, 7, 512)
    got = quant.dequantize(q, kind, 512)
    want = gguf_dequant(q, kind).reshape(7, 512)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


@pytest.mark.parametrize("kind", ["q5_0", "q5_1"])
def test_dequantize_quantized_weights(kind):
    """Blocks made by gguf's quantizer (llama.cpp's rounding) decode to within one step of the weights."""
    from gguf import GGMLQuantizationType, quants
    w = np.random.default_rng(1).normal(size=(4, 256)).astype(np.float32)
    q = np.asarray(quants.quantize(w, GGMLQuantizationType[kind.upper()]))
    got = quant.dequantize(q, kind, 256)
    assert np.array_equal(got, gguf_dequant(q, kind).reshape(4, 256))
    step = (np.abs(w).reshape(4, 8, 32).max(-1) / 15).repeat(32, -1)   # one 5-bit step of each block, generously
    assert (np.abs(got - w) <= step.reshape(4, 256)).all()


@pytest.mark.parametrize("kind", KQUANTS)
@pytest.mark.parametrize("T", [1, 3])
def test_matmul_against_float64(kind, T):
    rows, cols = 300, 768
    q = random_matrix(kind, rows, cols, seed=2)
    x = np.random.default_rng(3).normal(size=(T, cols)).astype(np.float32)
    w = gguf_dequant(q, kind).reshape(rows, cols).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    got = quant.quant_matmul_t(x, q, kind)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert (np.abs(got - want) <= 1e-5 * scale + 1e-7).all()


@pytest.mark.parametrize("kind", KQUANTS)
def test_matmul_same_bits_at_every_thread_count(kind):
    q = random_matrix(kind, 512, 1024, seed=4)
    x = np.random.default_rng(5).normal(size=(1, 1024)).astype(np.float32)
    before = numba.get_num_threads()
    try:
        outs = []
        for t in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(t)
            outs.append(quant.quant_matmul_t(x, q, kind))
    finally:
        numba.set_num_threads(before)
    assert all(np.array_equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("kind", KQUANTS)
def test_row_axpy_is_float32_of_the_dequantized_row(kind):
    q = random_matrix(kind, 1, 512, seed=6)
    y = np.random.default_rng(7).normal(size=512).astype(np.float32)
    c = np.float32(0.37)
    want = y + c * gguf_dequant(q, kind).reshape(512)      # float32 numpy: one rounding per product, one per sum
    axpy(y, c, q[0], quant.KINDS[kind].code)
    assert np.array_equal(y, want)


def test_bad_shapes_are_one_line():
    with pytest.raises(UserError, match="multiple of 256"):
        quant.row_bytes(100, "q4_k")
    with pytest.raises(UserError, match="unknown quantized format"):
        quant.row_bytes(256, "iq2_xs")
    with pytest.raises(UserError, match="C-contiguous"):
        quant.quant_matmul_t(np.zeros((1, 256), np.float32), np.zeros((2, 100), np.uint8), "q4_k")


# ---------------------------------------------------------------------------------------------------------------
# A GGUF mixing block formats as llama.cpp's Q4_K_M does, end to end: its dense logits are the float64 math on
# gguf.quants' dequantization of its tensors; its FLASHDIR keeps every block it can verbatim, per matrix and per layer,
# and computes the float64 math on its own weights in every mode, with the same bits at every budget.

# per layer: gate, up, down, attention q/k/v/o (a Q4_K_M's kind of mixture: K-quants, 5-bit and 8-bit blocks)
MIXED = [("Q4_K", "Q5_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q5_0"),
         ("Q5_0", "Q4_K", "Q4_K", "Q5_1", "Q5_K", "Q8_0", "Q6_K")]


@pytest.fixture(scope="module")
def mixed_gguf(tiny_model, tmp_path_factory):
    from conftest import write_llama_gguf
    from storage.checkpoint import open_checkpoint
    src = open_checkpoint(tiny_model("llama-wide"))
    types = {"embed.weight": "Q8_0"}
    for i, kinds in enumerate(MIXED):
        names = ("ffn.gate", "ffn.up", "ffn.down", "attn.q", "attn.k", "attn.v", "attn.o")
        types.update({f"layers.{i}.{n}.weight": k for n, k in zip(names, kinds)})
    return write_llama_gguf(src, tmp_path_factory.mktemp("kgguf") / "mixed.gguf", types)


def test_mixed_gguf_dense_is_the_float64_math(mixed_gguf):
    from test_quant_e2e import float64_model, greedy
    from flashinfer_lite.runtime import load_runtime
    ids = np.random.default_rng(11).integers(3, 512, size=9).tolist()
    want_tokens, want = greedy(float64_model(mixed_gguf), ids, 8)
    model, _, _ = load_runtime(mixed_gguf, "dense")
    assert model.dense_ffn[0].w_down.kind == "q6_k" and model.blocks[1].attn.wo.kind == "q6_k"
    tokens, got = greedy(model, ids, 8)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert tokens == want_tokens


def test_mixed_gguf_flashdir_keeps_its_blocks(mixed_gguf, tmp_path, monkeypatch):
    from gguf import GGUFReader
    from test_quant_e2e import bundles_of, float64_model, greedy
    from flashinfer_lite.runtime import load_runtime
    from conftest import assert_same_bits_at_every_budget
    from storage.convert import convert
    from storage.format import FlashCheckpoint, verify
    out = convert(mixed_gguf, tmp_path / "flash", progress=False)
    L = verify(out, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 5 and not L.uniform and not L.bundled     # SiLU: the split parts alone
    by_name = {t.name: t for t in GGUFReader(str(mixed_gguf)).tensors}
    flash = FlashCheckpoint(out)
    for i, kinds in enumerate(MIXED):
        g = L.geometry_of(i)
        assert g.vector_dtypes == (kinds[0].lower(), kinds[1].lower(), kinds[2].lower() + ".col")  # down: exact
        B = bundles_of(out, i)
        for v in ("gate", "up"):
            at = g.offset(v)
            assert np.array_equal(B[:, at:at + g.vector_bytes(v)], by_name[f"blk.{i}.ffn_{v}.weight"].data), (i, v)
        for m, kind in zip("qkvo", kinds[3:]):
            assert flash.quantized(f"layers.{i}.attn.{m}.weight")[0] == kind.lower()
        src = gguf_dequant(np.asarray(by_name[f"blk.{i}.ffn_down.weight"].data), kinds[2].lower())
        got = flash.tensor(f"layers.{i}.ffn.down.weight")
        assert np.array_equal(got.view(np.uint32), src.reshape(got.shape).view(np.uint32))   # the same bits
    from test_quant_e2e import resident_data_bytes
    from flashinfer_lite.budget import down_scale_bytes, resident_bytes_for
    from flashinfer_lite.kernels.blocks import COLUMN_SCALES_F16
    from storage.columns import decode, table_bytes
    raw = sum(table_bytes(L.down_column(i), L.d, n) for i, n in enumerate(L.n_neurons))
    assert resident_bytes_for(flash.config, half=True, kinds=flash.resident_kinds) + raw == resident_data_bytes(out)
    assert down_scale_bytes(L, COLUMN_SCALES_F16) == sum(t.nbytes for i in range(L.n_layers)       # the budget counts them decoded
                                      for t in decode(flash.down_scales(i), L.down_column(i),
                                                      COLUMN_SCALES_F16).values())
    ids = np.random.default_rng(12).integers(3, 512, size=9).tolist()
    want_tokens, want = greedy(float64_model(out), ids, 8)
    for mode in ("dense", "oracle"):
        model, _, _ = load_runtime(out, mode)
        tokens, got = greedy(model, ids, 8)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
        assert tokens == want_tokens, mode
    assert_same_bits_at_every_budget(out, "oracle", ids, 6, monkeypatch)


def test_mixed_gguf_runs_the_exact_gate(mixed_gguf, tmp_path, monkeypatch, float32_activations):
    """A Q4_K_M-like GGUF (block formats per layer) gets the split layout, each layer's rows in its own geometry (the
    bundles' bytes, cut), and --ffn auto runs the exact gate on it: the float64 math on the FLASHDIR's own weights
    over the neurons that clear the calibrated thresholds, and the same bits at every budget."""
    from test_exact_gate import float64_gated_model
    from test_quant_e2e import bundles_of, greedy
    from flashinfer_lite.runtime import load_runtime
    from conftest import assert_same_bits_at_every_budget
    from predictors.calibrate_gate import calibrate
    from storage.convert import convert
    from storage.format import verify
    from storage.gate_file import DEFAULT_SPARSITY, read_gate_file
    out = convert(mixed_gguf, tmp_path / "flash", progress=False)
    L = verify(out, progress=False)
    gu, dn = L.parts["gate_up"], L.parts["down"]
    assert not L.uniform and gu.geometry_of(0).vector_dtypes != gu.geometry_of(1).vector_dtypes
    for i in range(L.n_layers):
        B = bundles_of(out, i)
        for P in (gu, dn):
            with open(P.ffn_path, "rb") as f:
                f.seek(P.offset[i])
                rows = np.frombuffer(f.read(P.region_bytes(i)), np.uint8).reshape(-1, P.stride)
            for v in P.vectors:
                a, b, n = L.geometry_of(i).offset(v), P.geometry_of(i).offset(v), L.geometry_of(i).vector_bytes(v)
                assert np.array_equal(rows[:, b:b + n], B[:, a:a + n]), (i, v)
    calibrate(str(out), n_tokens=128, progress=False)
    cal = read_gate_file(out, L.n_layers, L.n_neurons[0], DEFAULT_SPARSITY)
    ids = np.random.default_rng(13).integers(3, 512, size=9).tolist()
    want_tokens, want = greedy(float64_gated_model(out, out, cal.thresholds), ids, 8)
    model, _, rt = load_runtime(out, "auto", ctx=64, base_bytes=0)
    assert type(rt.selector).__name__ == "ExactGate"
    tokens, got = greedy(model, ids, 8)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert tokens == want_tokens
    assert_same_bits_at_every_budget(out, "gate", ids, 6, monkeypatch)


def test_uniform_old_kinds_write_the_one_version(tiny_model, tmp_path):
    from storage.convert import convert
    from storage.format import FORMAT_VERSION
    out = convert(tiny_model("llama-relu"), tmp_path / "flash", dtype="q4_0", progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert m["version"] == FORMAT_VERSION and m["layers"][0]["vector_dtypes"] == ["q4_0"] * 3


def test_convert_says_what_the_down_matrix_becomes(mixed_gguf, tmp_path, capsys):
    from storage.convert import convert
    convert(mixed_gguf, tmp_path / "flash")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "down matrix" in ln]
    assert len(lines) == 1 and "(q6_k" in lines[0] and "kept exactly" in lines[0], lines
