"""The exact down (storage.columns): a GGUF down matrix cut into per-neuron columns + resident scale tables.

Oracles: gguf.quants' dequantization of the source rows (bit for bit), float64 math on those weights for the FFN
kernels (sparse accumulate, dense row, widened prompt, split layout's down rows). The end-to-end FLASHDIR (convert,
manifest, runtime in every mode, every budget) is tests/test_kquant.py's mixed GGUF."""
import numpy as np
import pytest

from flashinfer_lite.kernels import blocks as quant
from storage import columns
from storage.errors import UserError
from test_kquant import gguf_dequant, random_matrix

KINDS = list(columns.BITS)


def source(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] of a GGUF matrix [rows, cols]: gguf's quantizer where it has one, else random blocks."""
    if kind in ("q8_0", "q4_0", "q4_1"):
        from gguf import GGMLQuantizationType, quants
        w = np.random.default_rng(seed).normal(0, 0.02, (rows, cols)).astype(np.float32)
        return np.asarray(quants.quantize(w, GGMLQuantizationType[kind.upper()]))
    return random_matrix(kind, rows, cols, seed)


@pytest.mark.parametrize("kind", KINDS)
def test_columns_are_gguf_bit_for_bit(kind):
    D, n = 128, 512
    raw = source(kind, D, n)
    want = gguf_dequant(raw, kind).reshape(D, n)
    cols, tables = columns.split(raw, kind, n)
    assert cols.shape == (n, columns.column_bytes(D, kind))
    assert sum(t.nbytes for t in tables.values()) == columns.table_bytes(kind, D, n)
    # every source bit is kept: the columns and tables hold no more than the blocks' bytes
    assert cols.nbytes + columns.table_bytes(kind, D, n) <= raw.nbytes + (D * n // 256) * 4
    perm = np.random.default_rng(1).permutation(n)
    got = columns.dequantize_columns(cols[perm], kind, tables, perm)
    assert np.array_equal(got.view(np.uint32), want.T[perm].view(np.uint32))
    code = quant.KINDS[kind].code
    # held in DRAM as stored (a K-quant's d*sc decoded per sub-block to float32 was 3.2x its raw tables, 11 MB a 7B
    # layer); a and m as float32 (hosts without F16C) at most twice
    assert columns.decoded_bytes(kind, D, n, True) == columns.table_bytes(kind, D, n)
    assert columns.decoded_bytes(kind, D, n, False) <= 2 * columns.table_bytes(kind, D, n)
    for f16 in (False, True) if quant.HAS_F16C else (False,):
        S = quant.column_tables(tables, kind, D, f16)
        assert sum(t.nbytes for t in S) == columns.decoded_bytes(kind, D, n, f16)
        out = np.empty(D, np.float32)
        for j in perm[:64]:
            quant.col_dequant(cols, j, 0, out, code, j, S)
            assert np.array_equal(out.view(np.uint32), want[:, j].view(np.uint32)), (j, f16)
        y = np.ones(D - 64, np.float32)
        quant.col_axpy(y, np.float32(0.75), cols, 5, 0, 64, code, 5, S)
        assert np.array_equal(y, np.float32(1) + np.float32(0.75) * want[64:, 5])


@pytest.mark.parametrize("kind", KINDS)
def test_join_gives_back_the_gguf_bytes(kind):
    """columns.join, split's inverse, gives the GGUF matrix back byte for byte (what the resident dense FFN computes
    on, so that a FLASHDIR computes its GGUF's numbers): random bytes too, so every bit of every field is checked,
    scales, mins and high bits included."""
    D, n = 128, 512
    k = quant.KINDS[kind]
    noise = np.random.default_rng(3).integers(0, 256, (D, n // k.weights * k.block_bytes), dtype=np.uint8)
    for raw in (source(kind, D, n), noise):
        cols, tables = columns.split(raw, kind, n)
        back = columns.join(cols, kind, tables)
        assert back.dtype == np.uint8 and back.shape == raw.shape and np.array_equal(back, raw)


def test_pack_unpack_roundtrip():
    q = np.random.default_rng(2).integers(0, 64, (7, 128), dtype=np.uint8)
    for kind, bits in (("q4_0", 4), ("q5_0", 5), ("q6_k", 6)):
        v = q & ((1 << bits) - 1)
        assert np.array_equal(columns.unpack(columns.pack(v, kind), kind, 128), v)


def test_tables_from_a_file_are_checked():
    raw = source("q4_k", 64, 256)
    _, tables = columns.split(raw, "q4_k", 256)
    columns.check_tables(tables, "q4_k", 64, 256)
    bad = dict(tables, sc=tables["sc"][:-1])
    with pytest.raises(UserError, match="down column scales"):
        columns.check_tables(bad, "q4_k", 64, 256)
    with pytest.raises(UserError, match="down column scales"):
        columns.check_tables({k: v for k, v in tables.items() if k != "mn"}, "q4_k", 64, 256)
    with pytest.raises(UserError, match="cannot be cut"):
        columns.split(raw[:, :-1], "q4_k", 256)


def bundles_with_columns(kind, d=64, n=512, seed=3):
    """QuantSparseFFN over bundles [q8_0 gate | q8_0 up | `kind` down columns], neurons permuted as convert does;
    returns (kernel, B, order, float64 gate, up, down [d, n])."""
    from gguf import GGMLQuantizationType, quants
    from flashinfer_lite.ffn.quant import QuantSparseFFN
    from storage.format import FlashLayout, pack_bundles
    rng = np.random.default_rng(seed)
    gu = [np.asarray(quants.quantize(rng.normal(0, 0.3, (n, d)).astype(np.float32), GGMLQuantizationType.Q8_0))
          for _ in range(2)]
    raw = source(kind, d, n, seed)
    cols, tables = columns.split(raw, kind, n)
    order = rng.permutation(n)
    L = FlashLayout.create(d, [n], "q8_0", True, layer_dtypes=[("q8_0", "q8_0", kind + ".col")])
    B = pack_bundles(L, [gu[0][order], gu[1][order], cols[order]], layer=0, neurons=order)
    ffn = QuantSparseFFN.from_layout(L, act="silu", max_active=n, down_scales=tables)
    g64, u64 = (gguf_dequant(m, "q8_0").reshape(n, d).astype(np.float64) for m in gu)
    down64 = gguf_dequant(raw, kind).reshape(d, n).astype(np.float64)
    return ffn, B, order, g64, u64, down64


def float64_ffn(x, g, u, down, neurons):
    a = g[neurons] @ x
    c = a / (1 + np.exp(-a)) * (u[neurons] @ x)
    return down[:, neurons] @ c


@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q5_1"])
def test_column_ffn_is_the_float64_math(kind, float32_activations):
    ffn, B, order, g, u, down = bundles_with_columns(kind)
    d, n = g.shape[1], g.shape[0]
    X = np.random.default_rng(4).normal(size=(3, d)).astype(np.float32)
    rows = np.sort(np.random.default_rng(5).choice(n, 200, replace=False)).astype(np.int32)  # bundle ids
    y = np.empty(d, np.float32)
    ffn(B, rows, X[0], y)
    want = float64_ffn(X[0].astype(np.float64), g, u, down, order[rows])
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # in pieces, into the same Y: the same bits as in one call (the runtime's budget and overlap rely on it)
    coef = np.zeros((1, len(rows)), np.float32)
    ffn.coefficients(B, rows, None, X[:1], coef)
    Y = np.zeros((1, d), np.float32)
    ffn.accumulate(B, rows[:77], np.ascontiguousarray(coef[:, :77]), Y)
    ffn.accumulate(B, rows[77:], np.ascontiguousarray(coef[:, 77:]), Y)
    assert np.array_equal(Y[0], y)
    # the whole layer in RAM: decode rows and a prompt's widened blocks
    layer = ffn.dense_layer(B)
    want = np.stack([float64_ffn(x.astype(np.float64), g, u, down, np.arange(n)) for x in X])
    for T in (1, 3):
        Yd = np.empty((T, d), np.float32)
        ffn.dense(layer, X[:T], Yd)
        np.testing.assert_allclose(Yd, want[:T], rtol=0, atol=1e-4 * np.abs(want).max())


def test_split_down_rows_are_the_bundles_columns():
    """The split layout's down.bin rows hold the same column bytes and neuron id: SplitKernels sums them as
    QuantSparseFFN sums the bundles, to the bit."""
    from flashinfer_lite.ffn.flash import SplitKernels
    from storage.format import FlashLayout, SPLIT_PARTS
    ffn, B, order, g, u, down = bundles_with_columns("q6_k")
    d, n = g.shape[1], g.shape[0]
    L = FlashLayout.create(d, [n], "q8_0", True, layer_dtypes=[("q8_0", "q8_0", "q6_k.col")])
    parts = {name: L.make_part(name) for name in SPLIT_PARTS}
    H, D = (L.geometry.extract(B, parts[p].geometry) for p in ("gate_up", "down"))
    _, tables = columns.split(source("q6_k", d, n, 3), "q6_k", n)
    k = SplitKernels(parts["gate_up"], parts["down"], "silu", None, [tables])
    X = np.random.default_rng(6).normal(size=(1, d)).astype(np.float32)
    coef = np.zeros((1, n), np.float32)
    k.coefficients(H, X, coef, 0.0, 0)
    Y = np.zeros((1, d), np.float32)
    k.accumulate(D, np.arange(n, dtype=np.int32), coef, Y, 0)
    y = np.empty(d, np.float32)
    ffn(B, np.arange(n, dtype=np.int32), X[0], y)
    assert np.array_equal(Y[0], y)
    with pytest.raises(ValueError, match="scale tables"):
        SplitKernels(parts["gate_up"], parts["down"], "silu", None)


@pytest.mark.parametrize("engine", ["io_uring", "threads"])
@pytest.mark.parametrize("gap", [-1, 0, 5])
def test_packed_bundles_read_into_their_rows(uniform_gated, engine, gap):
    """Bundles with down columns are packed (no padding to 512): the reader widens each op to 512-byte boundaries
    and copies every bundle into its row: the rows are the file's bytes, whatever the coalescing (ffn.bin: the same
    GGUF converted with --ffn-layout bundles)."""
    from storage.convert import convert
    from storage.format import BUNDLE_ALIGN, FlashCheckpoint
    from storage.reader import BundleReader, aligned_empty
    bundles = uniform_gated.parent / "bundles"
    if not bundles.exists():
        convert(uniform_gated.parent / "uniform.gguf", bundles, progress=False, ffn_layout="bundles")
    ckpt = FlashCheckpoint(bundles)
    L = ckpt.layout
    assert L.bundled and L.stride % BUNDLE_ALIGN and L.stride % 4 == 0 and L.align == 4
    rng = np.random.default_rng(gap + 10)
    with BundleReader(L, engine=engine, coalesce_gap=gap, max_read_bytes=7 * L.stride) as reader:
        for layer in range(L.n_layers):
            file_rows = ckpt.bundles(layer)
            n = L.n_neurons[layer]
            ids = rng.choice(n, 60, replace=False)
            dest = aligned_empty((80, L.stride), np.uint8)
            slots = rng.choice(80, 60, replace=False)
            st = reader.read(layer, ids, dest, slots)
            assert np.array_equal(dest[slots], file_rows[ids])
            assert st.requested_bytes == 60 * L.stride and st.read_bytes % BUNDLE_ALIGN == 0
            assert st.read_bytes <= 60 * (L.stride + 2 * BUNDLE_ALIGN) + (n * L.stride if gap > 0 else 0)


def test_old_layout_kinds_keep_512_byte_bundles(tiny_model, tmp_path):
    """Only layouts with down columns are packed: the others keep 512-byte bundles."""
    from storage.convert import convert
    from storage.format import read_layout
    L = read_layout(convert(tiny_model("llama-relu"), tmp_path / "flash", dtype="q4_0", progress=False))
    assert L.stride % 512 == 0 and L.align == 512 and not L.columns


@pytest.fixture(scope="module")
def uniform_gated(tiny_model, tmp_path_factory):
    """A uniform GGUF (every layer: gate/up Q8_0, down Q6_K) converted with down columns and the split layout,
    calibrated for the exact gate."""
    import shutil
    from conftest import write_llama_gguf
    from predictors.calibrate_gate import calibrate
    from storage.checkpoint import open_checkpoint
    from storage.convert import convert
    src = open_checkpoint(tiny_model("llama-wide"))
    root = tmp_path_factory.mktemp("kdown-gate")
    types = {"embed.weight": "Q8_0"}
    for i in range(src.config.n_layers):
        types.update({f"layers.{i}.ffn.gate.weight": "Q8_0", f"layers.{i}.ffn.up.weight": "Q8_0",
                      f"layers.{i}.ffn.down.weight": "Q6_K"})
    flash = convert(write_llama_gguf(src, root / "uniform.gguf", types), root / "flash", progress=False)
    calibrate(str(flash), n_tokens=256, progress=False)
    yield flash
    shutil.rmtree(root, ignore_errors=True)


def test_exact_gate_over_down_columns(uniform_gated, monkeypatch, float32_activations):
    """The split layout's down.bin holds the same packed columns: the exact gate from flash equals float64 math on
    the GGUF's own down weights (those of the neurons that cleared the threshold), with the same bits at every
    budget."""
    from conftest import assert_same_bits_at_every_budget
    from test_exact_gate import IDS, float64_gated_model
    from test_quant_e2e import greedy
    from flashinfer_lite.runtime import load_runtime
    from storage.format import read_layout
    from storage.gate_file import DEFAULT_SPARSITY, read_gate_file
    L = read_layout(uniform_gated)
    down = L.parts["down"]
    assert L.uniform and L.down_column(0) == "q6_k" and down.stride % 512 and down.geometry.dtype == "q6_k.col"
    cal = read_gate_file(uniform_gated, L.n_layers, L.n_neurons[0], DEFAULT_SPARSITY)
    probe = load_runtime(uniform_gated, "gate", ctx=64, base_bytes=0)[2].plan
    model, _, rt = load_runtime(uniform_gated, "gate", ctx=64, base_bytes=0, dram_budget=probe.minimum_bytes)
    tokens, got = greedy(model, IDS, 8)
    want_tokens, want = greedy(float64_gated_model(uniform_gated, uniform_gated, cal.thresholds, []), IDS, 8)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()
    assert tokens == want_tokens and rt.stats.read_bytes > 0
    assert_same_bits_at_every_budget(uniform_gated, "gate", IDS, 6, monkeypatch)


@pytest.mark.parametrize("layer", [0, 1])
def test_down_sum_in_sub_block_runs_is_one_column_at_a_time(layer):
    """quant_ffn_accumulate adds a sub-block's fired columns in one pass (col_axpy_run, up to 32 of them, each
    output's sum held across them): every output gets the bits of one col_axpy per fired column in slot order, at any
    task span and thread count, and the float64 sum. The columns are llama.cpp's own Q4_K_M quantizer's (the
    fixture GGUF's down of layer 0 is q4_k, of layer 1 q6_k); the slot order keeps runs of a sub-block long
    (sorted neurons) in one half and breaks them (shuffled) in the other."""
    import numba
    from gguf import GGUFReader

    from conftest import DATA
    from flashinfer_lite.kernels.neurons import quant_ffn_accumulate
    t = next(t for t in GGUFReader(DATA / "gguf" / "qwen2-q4_k_m.gguf").tensors
             if t.name == f"blk.{layer}.ffn_down.weight")
    kind = t.tensor_type.name.lower()
    raw = np.ascontiguousarray(t.data).view(np.uint8)              # [d, row bytes], blocks along n
    d, n = raw.shape[0], int(t.shape[0])
    cols, tables = columns.split(raw, kind, n)
    S, k = quant.column_tables(tables, kind, d), quant.KINDS[kind]
    rng = np.random.default_rng(layer)
    order = np.concatenate([np.arange(n // 2), n // 2 + rng.permutation(n - n // 2)])   # slot -> neuron
    at = cols.shape[1]                                             # the neuron id after the column, as a bundle's
    B = np.zeros((n, at + 4), np.uint8)
    B[:, :at] = cols[order]
    B.view(np.float32)[:, at // 4] = order
    slots = np.arange(n, dtype=np.int32)
    coef = rng.normal(size=(1, n)).astype(np.float32)
    coef[0, rng.random(n) < 0.4] = 0.0                             # 60% fired, as at --sparsity 0.4
    want = np.zeros(d, np.float32)
    for j in np.flatnonzero(coef[0]):
        quant.col_axpy(want, coef[0, j], B, j, 0, 0, k.code, order[j], S)
    down64 = gguf_dequant(raw, kind).reshape(d, n).astype(np.float64)
    np.testing.assert_allclose(want, down64[:, order] @ coef[0].astype(np.float64), rtol=0,
                               atol=1e-5 * np.abs(want).max())
    old = numba.get_num_threads()
    try:
        for threads in (1, 2):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            for span in (64, 128, d):
                Y = np.zeros((1, d), np.float32)
                quant_ffn_accumulate(B, B.view(np.float32), slots, coef, Y, 0, k.code, k.weights, k.block_bytes,
                                     span, at // 4, S)
                assert np.array_equal(Y[0].view(np.uint32), want.view(np.uint32)), (threads, span)
    finally:
        numba.set_num_threads(old)
    # a run of any length is count single columns' bits
    y, one = np.ones(d, np.float32), np.ones(d, np.float32)
    run = np.flatnonzero(order // (16 if kind == "q6_k" else 32) == 3)     # sub-block 3's columns (sorted half)
    quant.col_axpy_run(y, B, run.astype(np.int64), coef[0, run].copy(), len(run), 0, 0, k.code, order[run[0]], S)
    for j in run:
        quant.col_axpy(one, coef[0, j], B, j, 0, 0, k.code, order[j], S)
    assert np.array_equal(y.view(np.uint32), one.view(np.uint32))


def split_kernels_of(kind, d=64, n=512, seed=3):
    """SplitKernels over the split layout of bundles_with_columns' neurons in neuron order (as convert writes them):
    (kernels, gate|up rows H, down rows D, the GGUF's raw down matrix)."""
    from flashinfer_lite.ffn.flash import SplitKernels
    from storage.format import FlashLayout, SPLIT_PARTS
    _, B, order, *_ = bundles_with_columns(kind, d, n, seed)
    L = FlashLayout.create(d, [n], "q8_0", True, layer_dtypes=[("q8_0", "q8_0", kind + ".col")])
    parts = {name: L.make_part(name) for name in SPLIT_PARTS}
    H, D = (L.geometry.extract(B[np.argsort(order)], parts[p].geometry) for p in ("gate_up", "down"))
    raw = source(kind, d, n, seed)
    return SplitKernels(parts["gate_up"], parts["down"], "silu", None, [columns.split(raw, kind, n)[1]]), H, D, raw


def integer_down_sum(raw, kind, coef):
    """The gate's down sum of one row's coefficients coef [n] as numpy computes it from the GGUF's raw matrix, outside
    the runtime: the coefficients rounded to llama.cpp's 8-bit blocks (q8_K per 256 neurons for the K-quants, q8_0
    per 32 for the others: test_act8's oracles), each block's integer sums in int64, then per block in order
    y += f32(I) * (f32(a) * xd) and its min term in float32 (the runtime's order). Returns (that float32 y, the float64
    value of the same rounded coefficients on gguf's weights, and the sum of the terms' magnitudes)."""
    from test_act8 import q8_blocks, q8k_blocks
    d, n = raw.shape[0], len(coef)
    cols, t = columns.split(raw, kind, n)
    w, sw = columns.groups(kind)
    kq, xd = q8k_blocks(coef)[:2] if w == 256 else q8_blocks(coef)[:2]
    q = columns.unpack(cols, kind, d).astype(np.int64)             # [n, d] raw values
    q = q - 256 * (q > 127) if kind == "q8_0" else q - {"q4_0": 8, "q5_0": 16, "q6_k": 32}.get(kind, 0)
    f16 = lambda v: v.view(np.float16).astype(np.float32)  # noqa: E731
    sc = t["sc"].view(np.int8).astype(np.int64) if kind == "q6_k" else t.get("sc", np.ones((n // sw, d), np.int64))
    kq64 = kq.astype(np.int64)
    y = np.zeros(d, np.float32)
    for b in range(n // w):
        if not kq[b * w:(b + 1) * w].any():
            continue
        subs = range(b * w // sw, (b + 1) * w // sw)
        I = sum(sc[s].astype(np.int64) * (kq64[s * sw:(s + 1) * sw] @ q[s * sw:(s + 1) * sw]) for s in subs)
        x = np.float32(xd[b])
        y = y + I.astype(np.float32) * (f16(t["d"][b]) * x)
        if kind in ("q4_1", "q5_1"):
            y = y + np.float32(kq64[b * w:(b + 1) * w].sum()) * (f16(t["m"][b]) * x)
        elif kind in ("q4_k", "q5_k"):
            M = sum(t["mn"][s].astype(np.int64) * kq64[s * sw:(s + 1) * sw].sum() for s in subs)
            y = y - M.astype(np.float32) * (f16(t["m"][b]) * x)
    c = kq64 * np.repeat(xd.astype(np.float64), w)                   # the rounded coefficients
    W = gguf_dequant(raw, kind).reshape(d, n).astype(np.float64)
    return y, W @ c, np.abs(W) @ np.abs(c)


@pytest.mark.parametrize("kind", KINDS)
def test_gate_down_sum_is_integers_on_the_rounded_coefficients(kind):
    """SplitRows' down sum of down columns (begin, pieces, finish): the coefficients rounded to 8 bits per block as
    the dense path rounds them, integer sums per block, three float operations per block and output. Bit for bit
    numpy's integers and float32 steps (integer_down_sum), in one call or in pieces, a row alone or among a prompt's;
    within 2^-20 of the float64 value on gguf's weights of those rounded coefficients (float32 rounds a block's
    term and the sum of about n / 32 terms: (2 blocks + 3) 2^-24 at most here)."""
    k, H, D, raw = split_kernels_of(kind)
    d, n = raw.shape[0], H.shape[0]
    rng = np.random.default_rng(9)
    X = rng.normal(size=(3, d)).astype(np.float32)
    coef = np.zeros((3, n), np.float32)
    k.coefficients(H, X, coef, 0.0, 0)
    coef[rng.random(coef.shape) < 0.4] = 0.0                        # 60% fired, each row its own
    coef[:, 256:288] = 0.0                                           # a block no row needs
    coef[2] = 0.0                                                    # a row with nothing fired
    ids = np.flatnonzero(coef.any(axis=0)).astype(np.int32)

    def run(rows, pieces):
        Y = np.zeros((len(rows), d), np.float32)
        k.begin(np.ascontiguousarray(coef[rows]), 0)
        for p in np.array_split(ids, pieces):
            k.accumulate(D, p, np.ascontiguousarray(coef[rows][:, p]), Y, 0)
        k.finish(Y, 0)
        return Y
    Y = run([0, 1, 2], 1)
    assert not Y[2].any()
    for t in (0, 1):
        want, exact, size = integer_down_sum(raw, kind, coef[t])
        assert np.array_equal(Y[t].view(np.uint32), want.view(np.uint32)), t
        assert np.all(np.abs(Y[t] - exact) <= 2.0 ** -20 * size), np.abs(Y[t] - exact).max()
    for rows, pieces in (([0, 1, 2], 5), ([1], 1), ([1], 7), ([0], 3)):
        assert np.array_equal(run(rows, pieces).view(np.uint32), Y[rows].view(np.uint32)), (rows, pieces)


def test_exact_gate_over_down_columns_in_integers_at_every_budget(uniform_gated, monkeypatch):
    """8-bit activations on (the default): the gate's down sum of columns in integers (SplitRows.begin) gives the
    same bits with no budget and at the minimum (a token's set in pieces through the window), on 1 or 2 threads,
    with the prompt through the cache or streamed; and it is the integer sum, not the float32 one."""
    from conftest import assert_same_bits_at_every_budget
    from test_exact_gate import IDS
    from flashinfer_lite.kernels.blocks import set_act8
    from flashinfer_lite.runtime import load_runtime
    assert_same_bits_at_every_budget(uniform_gated, "gate", IDS, 6, monkeypatch)
    model, _, rt = load_runtime(uniform_gated, "gate", ctx=64, base_bytes=0)
    began = []
    rt.kernels[0].begin = (lambda f: lambda coef: (f(coef), began.append(rt.kernels[0]._ints is not None)))(
        rt.kernels[0].begin)
    model.forward(IDS, model.new_cache(64))
    assert began == [True]


def test_a_permuted_flashdir_gives_the_gate_the_same_logits(uniform_gated):
    """Neurons in another order on flash (co-activation placement, issue 44) change nothing the gate computes: the
    coefficients are rounded by blocks of neurons, not of bundles, and the down sum is integers per block, converted
    in block order. A prompt's and decoded tokens' logits are the identity order's bits (8-bit activations on); the
    calibration is the same model's (its frequencies only choose pinned rows: the whole model is in DRAM here)."""
    import shutil
    from test_exact_gate import IDS
    from test_quant_e2e import greedy
    from flashinfer_lite.runtime import load_runtime
    from storage.checkpoint import open_checkpoint
    from storage.convert import layout_for, write_flashdir
    from storage.format import read_layout
    from storage.gate_file import GATE_FILE
    out = uniform_gated.parent / "permuted"
    if not out.exists():
        ckpt = open_checkpoint(uniform_gated.parent / "uniform.gguf")
        rng = np.random.default_rng(11)
        orders = [rng.permutation(n) for n in read_layout(uniform_gated).n_neurons]
        out.mkdir()
        write_flashdir(ckpt, layout_for(ckpt, "auto", orders), out, progress=False)
        shutil.copy(uniform_gated / GATE_FILE, out / GATE_FILE)
    got = []
    for path in (uniform_gated, out):
        model, _, rt = load_runtime(path, "gate", ctx=64, base_bytes=0)
        got.append(greedy(model, IDS, 6))
    L = read_layout(out)
    assert L.parts["down"].geometry.dtype == "q6_k.col" and not np.array_equal(L.order[0], np.arange(L.n_neurons[0]))
    assert rt.kernels[0].order is not None                          # the permuted layout's path
    assert got[1][0] == got[0][0] and np.array_equal(got[1][1].view(np.uint32), got[0][1].view(np.uint32))


@pytest.fixture(scope="module")
def coact_gated(uniform_gated):
    """uniform_gated's GGUF converted by order-neurons: its neurons placed by the exact gate's co-activation."""
    from predictors.coact import convert_coact
    out = uniform_gated.parent / "coact"
    if not out.exists():
        convert_coact(uniform_gated.parent / "uniform.gguf", out, n_tokens=256, progress=False)
    return out


def test_coact_order_writes_each_neurons_source_bytes_at_its_place(coact_gated):
    """order-neurons' layout: each layer's order is a permutation (not the identity), and bundle b's written bytes
    are the source's neuron order[b], read independently: its gate and up rows the GGUF's blocks as gguf-py reads
    them, its down column gguf-py's dequantized down weights (through the source's own scale tables) and the neuron
    id beside it."""
    from gguf import GGUFReader
    from storage.convert import replaceable
    from storage.format import read_layout
    L = read_layout(coact_gated)
    src = {t.name: np.ascontiguousarray(t.data).view(np.uint8) for t in
           GGUFReader(coact_gated.parent / "uniform.gguf").tensors}
    gu, dn = L.parts["gate_up"], L.parts["down"]
    moved = 0
    for i in range(L.n_layers):
        n, order = L.n_neurons[i], L.order[i]
        assert np.array_equal(np.sort(order), np.arange(n))
        moved += int(np.count_nonzero(order != np.arange(n)))
        G = np.fromfile(gu.ffn_path, np.uint8)[gu.offset[i]:gu.offset[i] + n * gu.stride].reshape(n, gu.stride)
        gate, up = src[f"blk.{i}.ffn_gate.weight"], src[f"blk.{i}.ffn_up.weight"]
        assert np.array_equal(G[:, :gate.shape[1]], gate[order])
        assert np.array_equal(G[:, gate.shape[1]:gate.shape[1] + up.shape[1]], up[order])
        D = np.fromfile(dn.ffn_path, np.uint8)[dn.offset[i]:dn.offset[i] + n * dn.stride].reshape(n, dn.stride)
        raw = src[f"blk.{i}.ffn_down.weight"]
        want = gguf_dequant(raw, "q6_k").reshape(raw.shape[0], n)          # [d, n]
        at = columns.column_bytes(raw.shape[0], "q6_k")
        _, tables = columns.split(raw, "q6_k", n)
        got = columns.dequantize_columns(np.ascontiguousarray(D[:, :at]), "q6_k", tables, order)
        assert np.array_equal(got.view(np.uint32), want.T[order].view(np.uint32))
        assert np.array_equal(D[:, at:at + 4].copy().view(np.float32)[:, 0], order.astype(np.float32))
    assert moved > 0
    assert replaceable(coact_gated)             # --force may replace it, gate.json and all


def test_a_reordered_gate_file_moves_each_frequency_with_its_neuron(tmp_path):
    """reorder_gate_file: every sparsity's thresholds as they were, and bundle b's frequency the source's bundle
    orders[i][b], to the bit of the stored uint16."""
    from storage.gate_file import read_gate_file, reorder_gate_file, write_gate_file
    rng = np.random.default_rng(3)
    src, dest = tmp_path / "a", tmp_path / "b"
    src.mkdir(), dest.mkdir()
    cal = {s: ([float(x) for x in rng.random(2)], [rng.random(37), rng.random(37)]) for s in (0.3, 0.4)}
    write_gate_file(src, 37, {"tokens": 5}, cal)
    orders = [rng.permutation(37), rng.permutation(37)]
    reorder_gate_file(src, dest, orders)
    for s in cal:
        a, b = read_gate_file(src, 2, 37, s), read_gate_file(dest, 2, 37, s)
        assert b.thresholds == a.thresholds and b.calibration == a.calibration
        assert all(np.array_equal(fb, fa[o]) for fa, fb, o in zip(a.freq, b.freq, orders))
        assert not np.array_equal(b.freq[0], a.freq[0])


def test_coact_order_gives_the_gate_the_same_logits_from_flash(uniform_gated, coact_gated):
    """The FLASHDIR order-neurons writes gives the identity order's greedy tokens and logits bit for bit,
    in DRAM and at its minimum budget, which reads its down columns from flash (gate.json's frequencies, moved with
    the neurons, choose the pinned rows there). The identity order runs at the same thresholds: convert calibrated
    them on its own tokens, so the reference is uniform_gated's files with the coact gate.json's frequencies moved
    back."""
    import shutil
    from test_exact_gate import IDS
    from test_quant_e2e import greedy
    from flashinfer_lite.runtime import load_runtime
    from storage.format import read_layout
    from storage.gate_file import GATE_FILE, reorder_gate_file
    ref = uniform_gated.parent / "coact-reference"
    if not ref.exists():
        shutil.copytree(uniform_gated, ref, ignore=shutil.ignore_patterns(GATE_FILE))
        reorder_gate_file(coact_gated, ref, [np.argsort(o) for o in read_layout(coact_gated).order])
    got = []
    for path in (ref, coact_gated):
        model, _, rt = load_runtime(path, "gate", ctx=64, base_bytes=0)
        got.append(greedy(model, IDS, 6))
    assert rt.kernels[0].order is not None
    model, _, low = load_runtime(coact_gated, "gate", dram_budget=rt.plan.minimum_bytes, ctx=64, base_bytes=0)
    got.append(greedy(model, IDS, 6))
    assert low.stats.read_bytes > 0                                 # its down columns came from flash
    for tokens, logits in got[1:]:
        assert tokens == got[0][0] and np.array_equal(logits.view(np.uint32), got[0][1].view(np.uint32))


def test_reads_through_the_gaps_of_a_coact_layout_return_exactly_the_asked_columns(coact_gated):
    """down.bin of the coact layout (packed q6_k columns and their neuron ids), a 60% set read with holes read
    through up to 0, 3 and 40 rows: every asked row is the file's bytes, read independently; no other row of dest is
    touched; a wider gap takes no more reads."""
    from storage.format import read_layout
    from storage.reader import BundleReader, aligned_empty
    dn = read_layout(coact_gated).parts["down"]
    n, stride = dn.n_neurons[1], dn.stride
    raw = np.fromfile(dn.ffn_path, np.uint8)[dn.offset[1]:dn.offset[1] + n * stride].reshape(n, stride)
    rng = np.random.default_rng(5)
    ids = rng.permutation(np.flatnonzero(rng.random(n) < 0.6))
    seen = []
    for gap in (0, 3, 40):
        dest = aligned_empty((ids.size + 4, stride), np.uint8)
        dest[:] = 0xA5
        slots = rng.permutation(dest.shape[0])[:ids.size]
        with BundleReader(dn, coalesce_gap=gap) as r:
            st = r.read(1, ids, dest, slots)
        assert np.array_equal(dest[slots], raw[ids])
        assert (dest[np.setdiff1d(np.arange(dest.shape[0]), slots)] == 0xA5).all()
        assert st.requested_bytes == ids.size * stride
        seen.append((st.n_reads, st.read_bytes))
    # no more reads with a wider gap; bytes at least those asked (packed rows: each read widened to 512 bytes, so
    # many short reads may fetch more than a few long ones)
    assert seen[0][0] >= seen[1][0] >= seen[2][0] and all(b >= ids.size * stride for _, b in seen)
