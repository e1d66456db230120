"""Sparse FFN kernels against the dense FFN math of the contract, computed in float64 from the weight matrices.

Bundles are packed with storage.format.pack_bundles; for f16/int8 the oracle uses the dequantized weights
(storage.format.unpack_bundles), so the comparison isolates the kernel from quantization error.
"""
from __future__ import annotations

import os
import re
import sys
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import numba
import pytest
from numba import njit

from storage.errors import UserError
from flashinfer_lite.kernels.neurons import activations
from flashinfer_lite.ffn.sparse import SparseFFN
from flashinfer_lite.kernels.rows import (HAS_F16C, f16_bits_to_f32_f16c, f16_bits_to_f32_portable, f32_to_f16_bits_f16c,
                                          f32_to_f16_bits_portable)
from storage.format import BundleGeometry, FlashLayout, pack_bundles, unpack_bundles
from storage.reader import aligned_empty

from glu_twin import activation, coefficients

RTOL = 1e-5


@njit
def _map(fn, x, out):
    """out[i] = fn(x[i]) for a jitted scalar fn (the conversions exist only inside Numba)."""
    for i in range(x.size):
        out[i] = fn(x[i])


@pytest.mark.parametrize("impl", ["portable", "f16c"])
def test_f16_conversion_exact_for_every_bit_pattern(impl):
    if impl == "f16c" and not HAS_F16C:
        pytest.skip("host has no F16C")
    h = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(h.size, np.float32)
    _map(f16_bits_to_f32_portable if impl == "portable" else f16_bits_to_f32_f16c, h, out)
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(out), nan)
    # every non-NaN value bit-exact: normals, subnormals (0x0001..0x03ff), +-0, +-inf
    assert np.array_equal(out.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    if impl == "portable":  # the bit arithmetic also keeps NaN payloads
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("impl", ["portable", "f16c"])
def test_f32_to_f16_rounds_like_numpy(impl):
    """The other way (the KV cache's keys and values): round to nearest even, overflow to inf, as numpy."""
    if impl == "f16c" and not HAS_F16C:
        pytest.skip("host has no F16C")
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = np.sort(halves[np.isfinite(halves)].astype(np.float32))
    mid = (finite[:-1] + finite[1:]) / 2        # exact in float32: the ties, where round-to-even decides
    rng = np.random.default_rng(0)
    x = np.concatenate([finite, mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf)),
                        rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        np.float32([65504, 65519.996, 65520, 1e9, np.inf, -np.inf, 2 ** -25, 2 ** -26, -0.0, np.nan])])
    out = np.empty(x.size, np.uint16)
    _map(f32_to_f16_bits_portable if impl == "portable" else f32_to_f16_bits_f16c, x, out)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    assert np.isnan(out[nan].view(np.float16)).all()
    assert np.array_equal(out[~nan], want[~nan].view(np.uint16))


# ---------------------------------------------------------------------------------------------------------------
# Oracle: dense FFN in float64 on the (dequantized) weights.

def make_model(rng, d, n, glu, biased):
    """Source weights in canonical orientation: gate/up [n, d], down [d, n], per-neuron biases [n]."""
    mag = np.exp(rng.uniform(-1, 1, (n, 1))).astype(np.float32) / np.sqrt(d)
    w = {"up": (rng.standard_normal((n, d)) * mag).astype(np.float32),
         "down": (rng.standard_normal((d, n)) * mag.T).astype(np.float32)}
    if glu:
        w["gate"] = (rng.standard_normal((n, d)) * mag).astype(np.float32)
    if biased:
        w["bias.up"] = (rng.standard_normal(n) * 0.3).astype(np.float32)
        if glu:
            w["bias.gate"] = (rng.standard_normal(n) * 0.3).astype(np.float32)
    return w


def pack(w, dtype, glu):
    """-> layout, bundles uint8[n, stride], dequantized weights (same dict shape as w)."""
    vec_names = ("gate", "up", "down") if glu else ("up", "down")
    n, d = w["up"].shape
    biases = tuple(b for b in ("bias.gate", "bias.up") if b in w)
    layout = FlashLayout.create(d, [n], dtype, glu, biases)
    vecs = np.stack([w[v].T if v == "down" else w[v] for v in vec_names], axis=1)  # [n, n_vec, d]
    bias = np.stack([w[b] for b in biases], axis=1) if biases else None
    bundles = pack_bundles(layout, vecs, bias)
    dq_vecs, dq_bias = unpack_bundles(layout, bundles)
    dq = {v: (dq_vecs[:, k].T if v == "down" else dq_vecs[:, k]) for k, v in enumerate(vec_names)}
    dq.update({b: dq_bias[:, j] for j, b in enumerate(biases)})
    return layout, bundles, dq


def dense_coefficients(w, x, glu, act, threshold):
    """Per neuron the factor multiplying down_i (float64), the contract's dense math with FATReLU."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    x = x.astype(np.float64)
    pre = w["gate" if glu else "up"] @ x + w.get("bias.gate" if glu else "bias.up", 0.0)
    a = pre / (1 + np.exp(-pre)) if act == "silu" else np.maximum(pre, 0)
    if threshold is not None:
        a = np.where(a > threshold, a, 0.0)
    if not glu:
        return a
    up = w["up"] @ x + w.get("bias.up", 0.0)
    return a * (np.maximum(up, 0) if act == "drelu" else up)


def dense_ffn(w, h):
    return w["down"].astype(np.float64) @ h


def rel_err(y, ref):
    return np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30)


def scatter_rows(rng, bundles, extra):
    """Place the bundles at random rows of a bigger page-aligned matrix; return it and row of each neuron."""
    n = bundles.shape[0]
    M = aligned_empty((n + extra, bundles.shape[1]), np.uint8)
    M[:] = rng.integers(0, 256, M.shape, dtype=np.uint8)  # junk in unused rows must never be read
    rows = rng.permutation(n + extra)[:n]
    M[rows] = bundles
    return M, rows.astype(np.int32)


@pytest.mark.parametrize("act", ["relu", "drelu", "silu", "gelu_tanh"])
@pytest.mark.parametrize("glu", [True, False])
def test_the_glu_rule_is_its_float64_twin(act, glu):
    """kernels.neurons.coefficient (through coefficients_of_products, as the dense FFN and the prompts' BLAS path
    call it) against the float64 twin (tests/glu_twin.py) on products over a wide range, with and without a FATReLU
    threshold: the same neurons fire and each coefficient is within float32 rounding of the twin's."""
    if act == "drelu" and not glu:
        pytest.skip("dReLU is gated")
    rng = np.random.default_rng(zlib.crc32(repr((act, glu)).encode()))
    g = (rng.standard_normal((7, 301)) * np.exp(rng.uniform(-6, 3, (7, 301)))).astype(np.float32)
    u = (rng.standard_normal((7, 301)) * 2).astype(np.float32)
    for threshold in ([-np.inf] if act in ("silu", "gelu_tanh") else [0.0, 0.05]):
        got = activations(act, g if glu else None, u if glu else g, threshold)
        want = coefficients(act, g if glu else None, u if glu else g, threshold)
        first = activation(act, g.astype(np.float64))
        # rounding may decide these: a gate at the threshold, or a tail float32 cannot tell from 0 (SiLU and GELU
        # of a large negative gate underflow or saturate to 0 there)
        scale = np.abs(want).max()
        edge = (np.abs(first - threshold) < 1e-6 * np.maximum(1.0, np.abs(first))) | (np.abs(want) < 1e-6 * scale)
        assert got.dtype == np.float32 and np.array_equal((got != 0)[~edge], (want != 0)[~edge])
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6 * scale)


CASES = [(glu, act) for glu, act in ((True, "relu"), (True, "drelu"), (True, "silu"), (False, "relu"), (False, "silu"))]


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
@pytest.mark.parametrize("glu,act", CASES)
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("threshold", [None, 0.05])
def test_sparse_equals_dense(dtype, glu, act, biased, threshold):
    rng = np.random.default_rng(zlib.crc32(repr((dtype, glu, act, biased, threshold)).encode()))
    d, n = 96, 257
    w = make_model(rng, d, n, glu, biased)
    layout, bundles, dq = pack(w, dtype, glu)
    M, rows = scatter_rows(rng, bundles, extra=31)
    ffn = SparseFFN.from_layout(layout, act=act, relu_threshold=threshold)
    x = rng.standard_normal(d).astype(np.float32)
    h = dense_coefficients(dq, x, glu, act, threshold)
    y_dense = dense_ffn(dq, h)
    y = np.full(d, np.nan, np.float32)
    coef = np.zeros(n, np.float32)

    # 1. all neurons: the full dense FFN; coef says exactly which neurons fired
    ffn(M, rows, x, y, coef)
    assert rel_err(y, y_dense) < RTOL
    assert np.array_equal(coef != 0, h != 0)
    np.testing.assert_allclose(coef, h, rtol=1e-4, atol=1e-6 * np.abs(h).max())

    if act != "silu" or threshold is not None:
        # 2. the true active set from the dense activations: same result, zero activations contribute nothing
        active = np.flatnonzero(h)
        assert 0 < active.size < n
        ffn(M, rows[active], x, y)
        assert rel_err(y, y_dense) < RTOL
    # 3. any chosen set S (a predictor's guess): the dense math restricted to S
    S = np.sort(rng.choice(n, n // 3, replace=False))
    h_S = np.zeros(n)
    h_S[S] = h[S]
    ffn(M, rows[S], x, y)
    assert rel_err(y, dense_ffn(dq, h_S)) < RTOL


def test_quantized_storage_tracks_source_weights():
    """The f16/int8 paths end to end against the float32 source weights (quantization error only)."""
    rng = np.random.default_rng(1)
    d, n = 128, 200
    w = make_model(rng, d, n, True, False)
    x = rng.standard_normal(d).astype(np.float32)
    y_src = dense_ffn(w, dense_coefficients(w, x, True, "relu", None))
    for dtype, tol in (("f16", 2e-3), ("int8", 5e-2)):
        layout, bundles, _ = pack(w, dtype, True)
        y = np.zeros(d, np.float32)
        SparseFFN.from_layout(layout, act="relu")(bundles, np.arange(n, dtype=np.int32), x, y)
        assert rel_err(y, y_src) < tol, dtype


SETS = (np.array([], np.int64), np.array([3]), np.array([5, 17, 30]), np.arange(40))


@contextmanager
def numba_threads(n):
    old = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_chunking_edge_cases(threads):
    """Fewer active neurons than threads or output blocks, no active neuron, int64 slots: same math."""
    rng = np.random.default_rng(2)
    d, n = 64, 40
    w = make_model(rng, d, n, True, True)
    layout, bundles, dq = pack(w, "f16", True)
    ffn = SparseFFN.from_layout(layout, act="silu")
    x = rng.standard_normal(d).astype(np.float32)
    h = dense_coefficients(dq, x, True, "silu", None)
    y = np.full(d, np.nan, np.float32)
    with numba_threads(threads):
        ys = [ffn(bundles, S.astype(np.int64), x, y).copy() for S in SETS]
    for S, y in zip(SETS, ys):
        h_S = np.zeros(n)
        h_S[S] = h[S]
        ref = dense_ffn(dq, h_S)
        if S.size == 0:
            assert not y.any()
        else:
            assert rel_err(y, ref) < RTOL


def test_bad_configuration_is_a_user_error():
    with pytest.raises(UserError):
        SparseFFN(BundleGeometry.of(16, "bf16", True), "relu")
    with pytest.raises(UserError):
        SparseFFN(BundleGeometry.of(16, "f16", False), "drelu")
    with pytest.raises(UserError):
        SparseFFN(BundleGeometry.of(16, "f16", True), "gelu")
    ffn = SparseFFN(BundleGeometry.of(16, "f16", True), "relu")
    with pytest.raises(UserError):
        ffn(np.zeros((4, 1024), np.uint8), np.arange(2), np.zeros(16, np.float32), np.zeros(16, np.float32))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_magnitude_threshold_skips_small_swiglu_activations(dtype):
    """SwiGLU's calibrated threshold: neurons with |act(gate) * up| <= t count as not fired, inside the kernel."""
    rng = np.random.default_rng(11)
    d, n = 64, 301
    w = make_model(rng, d, n, True, False)
    layout, bundles, dq = pack(w, dtype, True)
    M, rows = scatter_rows(rng, bundles, extra=9)
    ffn = SparseFFN.from_layout(layout, act="silu")
    x = rng.standard_normal(d).astype(np.float32)
    h = dense_coefficients(dq, x, True, "silu", None)
    s = np.sort(np.abs(h))
    t = float(s[n // 2] + s[n // 2 + 1]) / 2   # about half of the neurons fall under it, none sits on it
    h_t = np.where(np.abs(h) > t, h, 0.0)
    y = np.zeros(d, np.float32)
    coef = np.zeros(n, np.float32)
    ffn(M, rows, x, y, coef, act_threshold=t)
    assert rel_err(y, dense_ffn(dq, h_t)) < RTOL
    assert np.array_equal(coef != 0, h_t != 0) and 0.4 < (coef != 0).mean() < 0.6


# ---------------------------------------------------------------------------------------------------------------
# One summation order: the runtime's answer must not depend on how a set is split, where its rows sit, which part was
# computed while reads were in flight, the thread count, or whether prefill streamed the layer (issue 14).

@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
@pytest.mark.parametrize("glu,act", [(True, "silu"), (True, "relu"), (False, "relu")])
def test_same_bits_whatever_the_split_rows_threads_or_batch(dtype, glu, act):
    rng = np.random.default_rng(zlib.crc32(repr((dtype, glu, act)).encode()))
    d, n, T = 200, 300, 5                       # d not a multiple of OUT_BLOCK: the tail block too
    w = make_model(rng, d, n, glu, True)
    layout, bundles, dq = pack(w, dtype, glu)
    ffn = SparseFFN.from_layout(layout, act=act)
    X = rng.standard_normal((T, d)).astype(np.float32)
    sel = (rng.random((T, n)) < 0.4).astype(np.uint8)
    mag = 0.02 if act == "silu" else -1.0

    def whole(t, threads):
        """One call over row t's set, bundles in place (bundle id = row)."""
        S = np.flatnonzero(sel[t]).astype(np.int32)
        with numba_threads(threads):
            return ffn(bundles, S, X[t], np.empty(d, np.float32), act_threshold=mag).copy()

    ref = [whole(t, 2) for t in range(T)]
    for t in range(T):
        assert np.array_equal(whole(t, 1), ref[t])
        # float64 oracle on the selected set
        h = dense_coefficients(dq, X[t], glu, act, None)
        h = np.where(np.abs(h) > mag, h, 0.0) * sel[t]
        assert rel_err(ref[t], dense_ffn(dq, h)) < RTOL
    for t in range(T):
        # the cache path: rows scattered in a bigger matrix, the set in pieces of any size, each piece's
        # coefficients in two halves (rows resident first, then the "newly read" ones), accumulated piece by piece
        M, rows = scatter_rows(rng, bundles, extra=17)
        S = np.flatnonzero(sel[t])
        for piece in (1, 7, 64, len(S)):
            y = np.zeros((1, d), np.float32)
            for lo in range(0, len(S), max(piece, 1)):
                slots = rows[S[lo:lo + piece]].astype(np.int32)
                coef = np.full((1, len(slots)), np.nan, np.float32)
                new = rng.random(len(slots)) < 0.5
                with numba_threads(1):
                    ffn.coefficients(M, slots, np.flatnonzero(~new), X[t:t + 1], coef, act_threshold=mag)
                ffn.coefficients(M, slots, np.flatnonzero(new), X[t:t + 1], coef, act_threshold=mag)
                ffn.accumulate(M, slots, coef, y)
            assert np.array_equal(y[0], ref[t]), (t, piece)
    # prefill streaming: all rows at once over chunks of the layer, unselected neurons masked
    for chunk in (50, n):
        Y = np.zeros((T, d), np.float32)
        for lo in range(0, n, chunk):
            m = min(chunk, n - lo)
            slots = np.arange(m, dtype=np.int32)
            coef = np.empty((T, m), np.float32)
            ffn.coefficients(bundles[lo:lo + m], slots, None, X, coef,
                             sel=np.ascontiguousarray(sel[:, lo:lo + m]), act_threshold=mag)
            ffn.accumulate(bundles[lo:lo + m], slots, coef, Y)
        for t in range(T):
            assert np.array_equal(Y[t], ref[t]), (t, chunk)


# A kernel's Numba cache after a move (drop_stale_kernels): a pair of modules of the test's own, in child processes
STALE_KERNEL = """from numba import njit
from helper import bump


@njit(cache=True)
def run(x):
    return bump(x)
"""
STALE_RUN = """import sys
sys.path.insert(0, sys.argv[1])
import kernel
if sys.argv[2] == "drop":
    from flashinfer_lite.warmup import drop_stale_kernels
    drop_stale_kernels([kernel])
print(kernel.run(1))
"""


def test_a_kernel_cache_is_dropped_when_code_it_inlined_moves(tmp_path):
    """Numba's index keys a cached kernel by its own file: when a kernel it inlined moves to another module (as
    kernels/f16.py was folded into kernels/rows.py) and that file stays as it was, Numba loads the old machine code,
    which names the module that is gone. drop_stale_kernels, given the kernel's module, hashes what it imports and
    drops the cache when that changed: the run compiles the kernel anew, with the moved code."""
    import subprocess
    (tmp_path / "kernel.py").write_text(STALE_KERNEL)
    (tmp_path / "helper.py").write_text("from old import bump  # noqa: F401\n")
    (tmp_path / "old.py").write_text("from numba import njit\n\n\n@njit\ndef bump(x):\n    return x + 1\n")

    def run(mode):
        return subprocess.run([sys.executable, "-c", STALE_RUN, str(tmp_path), mode], capture_output=True, text=True,
                              timeout=300)
    assert run("drop").stdout == "2\n"          # compiled, cached, the sources stamped
    # beside the kernel, or under $NUMBA_CACHE_DIR in a directory named after the kernel's (as CI's suite runs)
    cache = Path(os.environ["NUMBA_CACHE_DIR"]) if os.environ.get("NUMBA_CACHE_DIR") else None
    assert list((tmp_path / "__pycache__").glob("flashinfer-lite-sources-*.stamp")) or \
        cache and list(cache.glob(f"{tmp_path.name}_*/flashinfer-lite-sources-*.stamp"))
    (tmp_path / "old.py").unlink()              # the move: old.py folded into helper.py; kernel.py unchanged
    (tmp_path / "helper.py").write_text("from numba import njit\n\n\n@njit\ndef bump(x):\n    return x + 2\n")
    stale = run("keep")
    assert "ModuleNotFoundError: No module named 'old'" in stale.stderr, stale.stderr[-2000:]   # Numba alone
    assert run("drop").stdout == "3\n"


def test_the_stale_check_hashes_the_sources_only_when_their_sizes_or_mtimes_change(tmp_path, monkeypatch):
    """drop_stale_kernels runs at every import: with its sources as they were (same sizes and mtimes) it reads none of
    their bytes and keeps the cache; once one changes, it hashes them and still drops the cache."""
    import importlib
    from flashinfer_lite.warmup import drop_stale_kernels
    (tmp_path / "kernel_st.py").write_text(STALE_KERNEL.replace("helper", "helper_st"))
    (tmp_path / "helper_st.py").write_text("from numba import njit\n\n\n@njit\ndef bump(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    kernel = importlib.import_module("kernel_st")
    cache = Path(kernel.run._cache.cache_path)
    cache.mkdir(parents=True, exist_ok=True)
    drop_stale_kernels([kernel])                # the sources stamped
    cached = cache / "kernel_st.run-6.py312.nbi"
    cached.write_bytes(b"")                     # a kernel Numba cached since

    def no_read(self):
        raise AssertionError(f"read {self}")
    with monkeypatch.context() as m:
        m.setattr(Path, "read_bytes", no_read)
        assert drop_stale_kernels([kernel]) is False
    assert cached.exists()
    (tmp_path / "helper_st.py").write_text("from numba import njit\n\n\n@njit\ndef bump(x):\n    return x + 20\n")
    assert drop_stale_kernels([kernel]) is True and not cached.exists()


def test_every_kernel_module_is_in_the_stale_check():
    """drop_stale_kernels' default covers every module of the project that defines a cached kernel at import (the
    io_uring watcher's is compiled on demand and inlines nothing of the project), and the storage constants they
    inline (storage/blocks.py: BLOCK)."""
    from flashinfer_lite import warmup
    root = Path(warmup.__file__).parents[1]
    defining = {f for f in [*root.glob("flashinfer_lite/**/*.py"), *root.glob("storage/*.py")]
                if re.search(r"^@.*cache=True", f.read_text(), re.M) and f.name != "_watch.py"}
    modules = [m for n, m in list(sys.modules.items()) if n.split(".")[0] in ("flashinfer_lite", "storage")
               and getattr(m, "__file__", None)]
    dirs, sources = warmup.kernel_sources(modules)
    assert {f for fs in dirs.values() for f in fs} == defining
    assert root / "storage" / "blocks.py" in sources
