"""The Numba kernels that compute on weights in GGUF's block formats (q8_0, q4_0, q4_1: storage/blocks.py).

A quantized matrix [rows, cols] is uint8 [rows, row_bytes], each row cols / 32 blocks in llama.cpp's byte layout, so
blocks copied verbatim from a GGUF file dequantize bit-exactly (tests/test_quant.py checks against gguf.quants).
Compute stays float32: x is never quantized (llama.cpp's int8 dot products would round it), so a kernel's result is
the float32 math on the dequantized weights. Quantizing is storage.blocks.quantize (gguf.quants, llama.cpp's).

Kernels: quant_matmul_t (x @ W^T for resident matrices), dequantize (whole matrix or given rows: the embedding
lookup) and QuantSparseFFN, the SparseFFN of bundles whose gate, up and down vectors are quantized rows along d.
QuantMatrix is a resident matrix kept so (model.linear dispatches on it); sparse_ffn picks the kernel of a layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from flashinfer_lite.errors import UserError
from flashinfer_lite.kernels import (ACT_CODES, ACT_DRELU, MATMUL_PARALLEL_MIN_WORK, MATMUL_ROW_KERNEL_MAX_T,
                                     OUT_BLOCK, WIDEN_BLOCK_BYTES, SparseFFN, _act, _dot, _scalar, f16_bits_to_f32,
                                     matmul_widened, prefetch_ahead, prefetch_row)
from storage.blocks import BLOCK, BLOCK_BYTES, check_kind, quantize, row_bytes  # noqa: F401 (quantize: re-exported)

Q8_0, Q4_0, Q4_1 = 0, 1, 2       # kind codes the kernels branch on (once per row, not per element)
# QuantSparseFFN.dense: up to this many rows, the row kernel per row (the layer's blocks read once per row); more
# (a prompt): widened blocks + BLAS, which read them once for all rows
DENSE_ROW_KERNEL_MAX_T = 2


@dataclass(frozen=True)
class QuantKind:
    code: int
    block_bytes: int


KINDS = {name: QuantKind(code, BLOCK_BYTES[name]) for name, code in (("q8_0", Q8_0), ("q4_0", Q4_0), ("q4_1", Q4_1))}


def quant_kind(kind: str) -> QuantKind:
    return KINDS[check_kind(kind)]


def _check_matrix(q: np.ndarray, kind: str, cols: int) -> QuantKind:
    k = quant_kind(kind)
    rb = row_bytes(cols, kind)
    if q.dtype != np.uint8 or q.ndim != 2 or q.shape[1] != rb or not q.flags.c_contiguous:
        raise UserError(f"a {kind} matrix of {cols} columns must be C-contiguous uint8[rows, {rb}], "
                        f"got {q.dtype}{list(q.shape)}")
    return k


# ---------------------------------------------------------------------------------------------------------------
# Row operations, written as LLVM IR: a block becomes one <32 x float> vector (load 16 or 32 bytes, split nibbles,
# convert, scale), and the dot product keeps a vector accumulator across blocks. The same loops in Numba either
# vectorise across blocks with gathers or reduce each block horizontally (2-3x slower, bench/quant_kernels.py).
# The kind is a runtime argument: each kind's loop is emitted once, and one branch per row picks it.
# No bounds checks: callers pass whole rows (a row of `x`'s or `out`'s length in blocks), which the Python entry
# points and QuantSparseFFN's geometry guarantee.

_F32, _I8, _I16, _I32 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32)
_BLOCK_BYTES = {k.code: k.block_bytes for k in KINDS.values()}


def _vec(builder, ty, value, n=BLOCK):
    """<n x ty> with every lane `value` (a Python number or an IR value)."""
    if not isinstance(value, ir.Value):
        return ir.Constant(ir.VectorType(ty, n), [ir.Constant(ty, value)] * n)
    one = builder.insert_element(ir.Constant(ir.VectorType(ty, n), ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _load_vec(builder, ptr, ty, n, index):
    return builder.load(builder.bitcast(builder.gep(ptr, [index]), ir.VectorType(ty, n).as_pointer()), align=1)


def _f32_block(builder, arr, b):
    """Pointer to float32 elements 32b .. 32b + 31 of an array, as one <32 x float>."""
    p = builder.gep(arr.data, [builder.mul(b, ir.Constant(b.type, BLOCK))])
    return builder.bitcast(p, ir.VectorType(_F32, BLOCK).as_pointer())


def _half_at(context, builder, ptr, offset):
    """The float16 at byte ptr[offset] as float32, by kernels.f16_bits_to_f32 (F16C or portable, as the host)."""
    bits = builder.load(builder.bitcast(builder.gep(ptr, [offset]), _I16.as_pointer()), align=1)
    return context.compile_internal(builder, lambda h: f16_bits_to_f32(h), types.float32(types.uint16), [bits])


def _decode_block(context, builder, kind, ptr, offset):
    """<32 x float>: the block at byte ptr[offset] dequantized with the float32 operations of gguf.quants (the
    same products and sums, so the same bits)."""
    at = lambda k: builder.add(offset, ir.Constant(offset.type, k))  # noqa: E731
    d = _vec(builder, _F32, _half_at(context, builder, ptr, offset))
    if kind == Q8_0:
        return builder.fmul(builder.sitofp(_load_vec(builder, ptr, _I8, BLOCK, at(2)), d.type), d)
    packed = _load_vec(builder, ptr, _I8, 16, at(4 if kind == Q4_1 else 2))
    q = builder.shuffle_vector(builder.and_(packed, _vec(builder, _I8, 15, 16)),  # elements 0..15: low nibbles
                               builder.lshr(packed, _vec(builder, _I8, 4, 16)),   # 16..31: high nibbles
                               ir.Constant(ir.VectorType(_I32, BLOCK), list(range(BLOCK))))
    if kind == Q4_0:
        return builder.fmul(d, builder.sitofp(builder.sub(q, _vec(builder, _I8, 8)), d.type))
    m = _vec(builder, _F32, _half_at(context, builder, ptr, at(2)))
    return builder.fadd(builder.fmul(d, builder.uitofp(q, d.type)), m)


def _for_blocks(context, builder, kind, nb, body):
    """body(k, block, byte_offset) for every block of a row, in a loop specialised to each kind k."""
    for k, bb in _BLOCK_BYTES.items():
        with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, k))):
            with cgutils.for_range(builder, nb) as loop:
                body(k, loop.index, builder.mul(loop.index, ir.Constant(loop.index.type, bb)))


def _rows_ok(*arrays_and_dtypes) -> bool:
    """Typing guard of the row intrinsics: 1-D C-contiguous arrays of the given dtypes (else no such function)."""
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dt
               for a, dt in zip(arrays_and_dtypes[::2], arrays_and_dtypes[1::2]))


def _arrays(context, builder, sig, args):
    return [context.make_array(t)(context, builder, a) if isinstance(t, types.Array) else a
            for t, a in zip(sig.args, args)]


@intrinsic
def _row_dot(typingctx, r, x, kind):
    """dequant(r) . x, for x float32[nb * 32] and r the nb blocks of a quantized row (uint8)."""
    if not _rows_ok(r, types.uint8, x, types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, x, kind = _arrays(context, builder, sig, args)
        nb = builder.sdiv(x.nitems, ir.Constant(x.nitems.type, BLOCK))
        acc = cgutils.alloca_once_value(builder, _vec(builder, _F32, 0.0))

        def body(k, b, offset):
            w = _decode_block(context, builder, k, r.data, offset)
            xs = builder.load(_f32_block(builder, x, b), align=4)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(w, xs, flags=("fast",)), flags=("fast",)),
                          acc)
        _for_blocks(context, builder, kind, nb, body)
        v, n = builder.load(acc), BLOCK
        while n > 1:  # horizontal sum, once per row
            n //= 2
            half = lambda lo: builder.shuffle_vector(  # noqa: E731
                v, v, ir.Constant(ir.VectorType(_I32, n), list(range(lo, lo + n))))
            v = builder.fadd(half(0), half(n), flags=("fast",))
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(r, x, kind), codegen


@intrinsic
def _row_dequant(typingctx, r, out, kind):
    """out[:] = dequant(r), out float32[nb * 32], bit-identical to gguf.quants.dequantize."""
    if not _rows_ok(r, types.uint8, out, types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, out, kind = _arrays(context, builder, sig, args)

        def body(k, b, offset):
            builder.store(_decode_block(context, builder, k, r.data, offset), _f32_block(builder, out, b), align=4)
        _for_blocks(context, builder, kind, builder.sdiv(out.nitems, ir.Constant(out.nitems.type, BLOCK)), body)
        return context.get_dummy_value()
    return types.none(r, out, kind), codegen


@intrinsic
def _row_axpy(typingctx, y, c, r, kind):
    """y[:] += c * dequant(r), y float32[nb * 32]; strict float32 (no contraction), so every call site rounds alike."""
    if not _rows_ok(r, types.uint8, y, types.float32):
        return None

    def codegen(context, builder, sig, args):
        y, c, r, kind = _arrays(context, builder, sig, args)
        cs = _vec(builder, _F32, c)

        def body(k, b, offset):
            w = _decode_block(context, builder, k, r.data, offset)
            dst = _f32_block(builder, y, b)
            builder.store(builder.fadd(builder.load(dst, align=4), builder.fmul(cs, w)), dst, align=4)
        _for_blocks(context, builder, kind, builder.sdiv(y.nitems, ir.Constant(y.nitems.type, BLOCK)), body)
        return context.get_dummy_value()
    return types.none(y, c, r, kind), codegen


# ---------------------------------------------------------------------------------------------------------------
# Dequantize (whole matrices, embedding rows, and the widened blocks of the prefill matmul)


@njit(cache=True, nogil=True)
def dequantize_rows(Q, ids, out, kind):
    """out[i] = dequantized row ids[i] of Q."""
    for i in range(ids.shape[0]):
        _row_dequant(Q[ids[i]], out[i], kind)


def dequantize(q: np.ndarray, kind: str, cols: int, rows: np.ndarray | None = None) -> np.ndarray:
    """uint8 [n, row_bytes] -> float32 [n, cols]; with `rows` (token ids: the embedding lookup) only those rows,
    float32 [len(rows), cols]."""
    k = _check_matrix(q, kind, cols)
    ids = np.arange(q.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= q.shape[0]):
        raise UserError(f"row ids must lie in [0, {q.shape[0]}), got {ids.min()}..{ids.max()}")
    out = np.empty((ids.shape[0], cols), np.float32)
    dequantize_rows(q, ids, out, k.code)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Resident matrices: y = x @ W^T, the counterpart of kernels.matmul_t with the same three paths.


@njit(cache=True, fastmath=True, nogil=True)
def quant_matmul_rows(Q, x, y, lo, hi, kind):
    """y[:, lo:hi] = x[T, d] @ dequant(Q[lo:hi])^T."""
    T, d = x.shape
    rb = Q.shape[1]
    if T == 1:  # decode: decode each block straight into the dot product, nothing written
        for j in range(lo, hi):
            prefetch_ahead(Q, j, 0, rb)
            y[0, j] = _row_dot(Q[j], x[0], kind)
        return
    w = np.empty(d, np.float32)  # a few tokens: each row decoded once, then its T dot products run from L1
    for j in range(lo, hi):
        prefetch_ahead(Q, j, 0, rb)
        _row_dequant(Q[j], w, kind)
        for t in range(T):
            y[t, j] = _dot(w, x[t], d)


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def quant_matmul_kernel(Q, x, y, chunks, kind):
    """quant_matmul_rows over all rows, split into `chunks` contiguous row ranges run in parallel."""
    n = Q.shape[0]
    for c in prange(chunks):
        quant_matmul_rows(Q, x, y, c * n // chunks, (c + 1) * n // chunks, kind)


def quant_matmul_t(x: np.ndarray, q: np.ndarray, kind: str, row_kernel_max_t: int = MATMUL_ROW_KERNEL_MAX_T,
                   parallel_min_work: int = MATMUL_PARALLEL_MIN_WORK) -> np.ndarray:
    """x [T, d] @ W [n, d]^T -> float32 [T, n] for W quantized as uint8 [n, row_bytes(d)]; the thresholds are
    kernels.matmul_t's (the same memory-bound vs compute-bound crossover, the same cost of waking threads)."""
    if x.ndim != 2:
        raise ValueError(f"quant_matmul_t: x must be [T, d], got {x.shape}")
    k = _check_matrix(q, kind, x.shape[1])
    x = np.ascontiguousarray(x, dtype=np.float32)
    (T, d), n = x.shape, q.shape[0]
    y = np.empty((T, n), np.float32)
    if T <= row_kernel_max_t:
        threads = numba.get_num_threads()
        if threads > 1 and T * n * d >= parallel_min_work:
            quant_matmul_kernel(q, x, y, threads, k.code)
        else:
            quant_matmul_rows(q, x, y, 0, n, k.code)
    else:
        matmul_widened(x, n, d, lambda lo, block: dequantize_rows(q, np.arange(lo, lo + block.shape[0]), block,
                                                                  k.code), y)
    return y


# ---------------------------------------------------------------------------------------------------------------
# Sparse FFN over quantized bundles. A bundle (one neuron, one row of a uint8 matrix) is its n_vec vectors as
# quantized rows of d weights, back to back ([gate | up | down] or [fc1 | fc2 column], row_bytes(d) bytes each), then
# float32 biases at scalars_offset, zero padding to stride: kernels.py's contract with blocks in place of elements
# (storage.format.bundle_geometry and pack_bundles, as for the other dtypes).


@njit(cache=True, fastmath=True)
def _q_coefficient(wr, fr, x, rb, glu, act, relu_threshold, kind, bg_idx, bu_idx):
    """kernels._coefficient on quantized vectors (rb bytes each): act(gate.x + bg) * (up.x + bu), act(up.x + bu)
    for MLP; 0 when the activation is <= relu_threshold, and then the up row is not read."""
    if glu:
        a = _act(act, _row_dot(wr[:rb], x, kind) + _scalar(fr, bg_idx, 0.0))
        if not a > relu_threshold:
            return np.float32(0.0)
        u = _row_dot(wr[rb:2 * rb], x, kind) + _scalar(fr, bu_idx, 0.0)
        if act == ACT_DRELU and not u > np.float32(0.0):
            return np.float32(0.0)
        return a * u
    a = _act(act, _row_dot(wr[:rb], x, kind) + _scalar(fr, bu_idx, 0.0))
    return a if a > relu_threshold else np.float32(0.0)


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def quant_ffn_coefficients(B, F, slots, js, X, sel, coef, rb, glu, act, relu_threshold, kind, bg_idx, bu_idx,
                           act_threshold):
    """kernels.ffn_coefficients on quantized bundles B (uint8[rows, stride]; F its float32 view)."""
    head = rb * (2 if glu else 1)
    for q in prange(js.shape[0]):
        j = js[q]
        r = slots[j]
        if q + 1 < js.shape[0]:
            prefetch_row(B, slots[js[q + 1]], 0, head)
        for t in range(X.shape[0]):
            c = np.float32(0.0)
            if sel[t, j]:
                c = _q_coefficient(B[r], F[r], X[t], rb, glu, act, relu_threshold, kind, bg_idx, bu_idx)
                if abs(c) <= act_threshold:
                    c = np.float32(0.0)
            coef[t, j] = c


@njit(cache=True, parallel=True, nogil=True)
def quant_ffn_accumulate(B, slots, coef, Y, rb, glu, kind, block_bytes):
    """Y[t] += sum over j = 0, 1, ... of coef[t, j] * down(slots[j]), in that order (zero coefficients skipped);
    the down rows (after the gate/up rows of rb bytes each) are in `kind`, blocks of block_bytes.

    As kernels.ffn_accumulate: one thread per (row, OUT_BLOCK output elements), so each element sums its terms in
    slot order and a set accumulated in pieces gives the bit-identical sum. OUT_BLOCK is a multiple of BLOCK, so a
    task's outputs are whole blocks of the down rows."""
    n = slots.shape[0]
    d = Y.shape[1]
    down = rb * (2 if glu else 1)
    nb = (d + OUT_BLOCK - 1) // OUT_BLOCK
    for q in prange(Y.shape[0] * nb):
        t = q // nb
        lo = (q % nb) * OUT_BLOCK
        hi = min(d, lo + OUT_BLOCK)
        y = Y[t, lo:hi]
        b_lo = down + lo // BLOCK * block_bytes
        b_hi = down + hi // BLOCK * block_bytes
        for j in range(n):
            c = coef[t, j]
            if c != np.float32(0.0):
                _row_axpy(y, c, B[slots[j], b_lo:b_hi], kind)


# ---------------------------------------------------------------------------------------------------------------
# Dense FFN over a whole layer (every neuron): the in-RAM path, where there is nothing to predict or look up. The
# layer's bundles are split once into two contiguous matrices (DenseLayer): [gate | up | biases] rows and down rows,
# without the bundles' 512-byte padding, so each pass streams only what it reads (the bundle layout made the
# coefficients ~30% slower than the same rows back to back, single thread). Decode (a row or two) is one Numba call
# per row; a prompt widens the rows to float32 one L2-sized block of neurons at a time and hands the three products
# to BLAS.


@dataclass(frozen=True, eq=False)
class DenseLayer:
    """One layer's FFN for QuantSparseFFN.dense: head uint8 [n, head_bytes] (gate and up rows, or up for MLP, then
    the float32 biases at bg_idx / bu_idx of its float32 view, -1: none) and down uint8 [n, row_bytes(d)]."""
    head: np.ndarray
    down: np.ndarray
    bg_idx: int
    bu_idx: int

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + self.down.nbytes


# The neuron ranges of a dense decode step: a constant, not the thread count, so -t does not change the bits. Each
# range is one task, coefficients then its partial down sum (rows front to back): one parallel region per layer, as
# each region pays for waking the pool (flashinfer_lite/__init__.py).
DOWN_PARTIALS = 4


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def quant_dense_ffn_row(H, Hf, D, x, y, coef, partial, rb, glu, act, relu_threshold, kind, bg_idx, bu_idx, down_kind):
    """y[:] = sum over neurons j of coef[j] * dequant(D[j]), coef[j] = the coefficient of head row H[j] (Hf: its
    float32 view) on x: partial[p] sums the p-th of len(partial) neuron ranges in order, then they add up in order."""
    n, P = H.shape[0], partial.shape[0]
    for p in prange(P):
        acc = partial[p]
        acc[:] = 0.0
        for j in range(p * n // P, (p + 1) * n // P):
            prefetch_ahead(H, j, 0, H.shape[1])
            prefetch_ahead(D, j, 0, D.shape[1])
            c = _q_coefficient(H[j], Hf[j], x, rb, glu, act, relu_threshold, kind, bg_idx, bu_idx)
            coef[j] = c
            if c != np.float32(0.0):
                _row_axpy(acc, c, D[j], down_kind)
    y[:] = partial[0]
    for p in range(1, P):
        y += partial[p]


@njit(cache=True, nogil=True)
def dequantize_dense_layer(H, Hf, D, lo, G, U, Dw, bias_g, bias_u, rb, glu, kind, bg_idx, bu_idx, down_kind):
    """Neurons lo .. lo + len(Dw) widened to float32 rows: gate G (GLU only), up U, down Dw; their gate and up
    biases (0 where there are none)."""
    for r in range(Dw.shape[0]):
        row = H[lo + r]
        if glu:
            _row_dequant(row[:rb], G[r], kind)
            _row_dequant(row[rb:2 * rb], U[r], kind)
        else:
            _row_dequant(row[:rb], U[r], kind)
        _row_dequant(D[lo + r], Dw[r], down_kind)
        bias_g[r] = _scalar(Hf[lo + r], bg_idx, 0.0)
        bias_u[r] = _scalar(Hf[lo + r], bu_idx, 0.0)


@njit(cache=True, fastmath=True, nogil=True)
def ffn_coefficients_from_products(g, u, bias_g, bias_u, glu, act, relu_threshold):
    """u[t, j] = the coefficient of neuron j from its products g = X G^T, u = X U^T (in place): _q_coefficient's
    math on precomputed dot products."""
    for t in range(u.shape[0]):
        for j in range(u.shape[1]):
            if glu:
                a = _act(act, g[t, j] + bias_g[j])
                uj = u[t, j] + bias_u[j]
                if not a > relu_threshold or (act == ACT_DRELU and not uj > np.float32(0.0)):
                    u[t, j] = 0.0
                else:
                    u[t, j] = a * uj
            else:
                a = _act(act, u[t, j] + bias_u[j])
                u[t, j] = a if a > relu_threshold else np.float32(0.0)


class QuantSparseFFN(SparseFFN):
    """SparseFFN over quantized bundles (storage.format.pack_bundles); dtype is a kind of KINDS (down_dtype, if given,
    the down vector's), the rest as SparseFFN:

    so, stride = bundle_geometry(4096, ("q4_0", "q4_0", "q8_0"), n_scalars=0)
    ffn = QuantSparseFFN(d=4096, dtype="q4_0", glu=True, act="relu", stride=stride, scalars_offset=so,
                         down_dtype="q8_0")
    ffn(B, slots, x, y)  |  ffn.coefficients(B, slots, js, X, coef)  +  ffn.accumulate(B, slots, coef, Y)
    """
    DTYPES = KINDS

    def __init__(self, d: int, dtype: str, *args, down_dtype: str | None = None, **kw):
        super().__init__(d, dtype, *args, **kw)
        self.kind, self.down_kind = KINDS[dtype], quant_kind(down_dtype or dtype)
        self.down_kind_name = down_dtype or dtype
        self._widened = None     # dense(): float32 blocks of a prompt's widened bundles, allocated on first use
        self._partial = np.empty((DOWN_PARTIALS, d), np.float32)  # dense(): the down pass's partial sums
        self.row_bytes = row_bytes(d, dtype)
        payload = (self.n_vec - 1) * self.row_bytes + row_bytes(d, down_dtype or dtype)
        # the row kernels read whole rows unchecked: the geometry must hold them
        if not payload <= self.scalars_offset <= self.stride:
            raise UserError(f"quantized bundle: {payload} bytes of vectors, then scalars at {self.scalars_offset}, "
                            f"do not fit a stride of {self.stride}")

    def views(self, B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if B.dtype != np.uint8 or B.ndim != 2 or B.shape[1] != self.stride:
            raise UserError(f"bundle matrix must be uint8[rows, {self.stride}], got {B.dtype}{list(B.shape)}")
        return B, B.view(np.float32)

    def _rows_of_d(self, X: np.ndarray) -> None:
        if X.ndim != 2 or X.shape[1] != self.d or X.dtype != np.float32 or not X.flags.c_contiguous:
            raise UserError(f"expected C-contiguous float32[T, {self.d}], got {X.dtype}{list(X.shape)}")

    def _coefficients(self, W, F, slots, js, X, sel, coef, act_threshold) -> None:
        self._rows_of_d(X)
        quant_ffn_coefficients(W, F, slots, js, X, sel, coef, self.row_bytes, self.glu, self.act_code,
                               self.relu_threshold, self.kind.code, self.bg_idx, self.bu_idx, act_threshold)

    def _accumulate(self, W, F, slots, coef, Y) -> None:
        self._rows_of_d(Y)
        quant_ffn_accumulate(W, slots, coef, Y, self.row_bytes, self.glu, self.down_kind.code,
                             self.down_kind.block_bytes)

    def _dense_geometry(self) -> tuple[int, int, int, int]:
        """(bytes of the gate and up rows (MLP: up), offset of the biases in a head row, how many float32 scalars
        it keeps (the biases the kernels read), bytes of a down row) of dense_layer's matrices."""
        vec_bytes = (self.n_vec - 1) * self.row_bytes
        last = max(self.bg_idx, self.bu_idx)
        n_scalars = 1 + last - self.scalars_offset // 4 if last >= 0 else 0
        return vec_bytes, -(-vec_bytes // 4) * 4, n_scalars, row_bytes(self.d, self.down_kind_name)

    @property
    def dense_row_bytes(self) -> int:
        """DRAM per neuron of dense_layer (what the budget counts for a resident FFN)."""
        _, at, n_scalars, down_bytes = self._dense_geometry()
        return at + 4 * n_scalars + down_bytes

    def dense_layer(self, B: np.ndarray) -> DenseLayer:
        """A whole layer's bundles uint8 [n, stride] as the two contiguous matrices of dense() (copies: B can go)."""
        self.views(B)
        vec_bytes, at, n_scalars, down_bytes = self._dense_geometry()
        head = np.zeros((B.shape[0], at + 4 * n_scalars), np.uint8)
        head[:, :vec_bytes] = B[:, :vec_bytes]
        head[:, at:] = B[:, self.scalars_offset:self.scalars_offset + 4 * n_scalars]
        down = np.ascontiguousarray(B[:, vec_bytes:vec_bytes + down_bytes])
        moved = lambda idx: idx - self.scalars_offset // 4 + at // 4 if idx >= 0 else -1  # noqa: E731
        return DenseLayer(head, down, moved(self.bg_idx), moved(self.bu_idx))

    def dense(self, layer: DenseLayer, X: np.ndarray, Y: np.ndarray) -> None:
        """Y[:] = the FFN of every neuron of `layer` (dense_layer) on X [T, d] (down bias not included)."""
        H, D, Hf = layer.head, layer.down, layer.head.view(np.float32)
        self._rows_of_d(X)
        self._rows_of_d(Y)
        n, T = H.shape[0], X.shape[0]
        if T <= DENSE_ROW_KERNEL_MAX_T:
            self._grow(n)
            for t in range(T):
                quant_dense_ffn_row(H, Hf, D, X[t], Y[t], self.coef, self._partial, self.row_bytes, self.glu,
                                    self.act_code, self.relu_threshold, self.kind.code, layer.bg_idx, layer.bu_idx,
                                    self.down_kind.code)
            return
        d = self.d
        block = max(1, min(n, WIDEN_BLOCK_BYTES // (4 * d)))
        if self._widened is None or self._widened[0].shape[0] != block:
            self._widened = (np.empty((block, d), np.float32), np.empty((block, d), np.float32),
                             np.empty((block, d), np.float32), np.empty(block, np.float32), np.empty(block, np.float32))
        G, U, Dw, bg, bu = self._widened
        Y[:] = 0.0
        for lo in range(0, n, block):
            m = min(block, n - lo)
            dequantize_dense_layer(H, Hf, D, lo, G[:m], U[:m], Dw[:m], bg[:m], bu[:m], self.row_bytes, self.glu,
                                   self.kind.code, layer.bg_idx, layer.bu_idx, self.down_kind.code)
            a = X @ U[:m].T                                            # [T, m], then the coefficients in place
            ffn_coefficients_from_products(X @ G[:m].T if self.glu else a, a, bg[:m], bu[:m], self.glu,
                                           self.act_code, self.relu_threshold)
            Y += a @ Dw[:m]


def sparse_ffn(layout, **kw) -> SparseFFN:
    """The sparse FFN kernel of a FlashLayout's bundles (SparseFFN.from_layout's arguments)."""
    if layout.dtype in KINDS:
        return QuantSparseFFN.from_layout(layout, down_dtype=layout.down_dtype, **kw)
    return SparseFFN.from_layout(layout, **kw)


# ---------------------------------------------------------------------------------------------------------------
# A dense FFN whose matrices are QuantMatrix in the checkpoint's orientation (a GGUF's: gate and up [n, d], down
# [d, n] in blocks along n): at decode one Numba call, both passes parallel, instead of three serial GEMVs and the
# activation's numpy ops in between.


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def quant_ffn_row(Wg, Wu, Wd, x, a, y, partial, glu, act, relu_threshold, kind_g, kind_u, kind_d, down_block_bytes):
    """y = Wd @ a with a[j] = act(Wg[j].x) * (Wu[j].x) (GLU; MLP: act(Wu[j].x)), activations <= relu_threshold
    count as 0 (dReLU: also up <= 0), as model.ffn_activation. One task per range of whole blocks of neurons (as
    quant_dense_ffn_row: len(partial) of them, one parallel region): its activations, then its share of every down
    row's dot product into partial[p]; the partials add up in order."""
    n, P = Wu.shape[0], partial.shape[0]
    nb = n // BLOCK
    for p in prange(P):
        lo, hi = p * nb // P * BLOCK, (p + 1) * nb // P * BLOCK
        for j in range(lo, hi):
            prefetch_ahead(Wu, j, 0, Wu.shape[1])
            v = np.float32(0.0)
            if glu:
                prefetch_ahead(Wg, j, 0, Wg.shape[1])
                g = _act(act, _row_dot(Wg[j], x, kind_g))
                if g > relu_threshold:
                    u = _row_dot(Wu[j], x, kind_u)
                    if act != ACT_DRELU or u > np.float32(0.0):
                        v = g * u
            else:
                g = _act(act, _row_dot(Wu[j], x, kind_u))
                if g > relu_threshold:
                    v = g
            a[j] = v
        acc = partial[p]
        b_lo, b_hi = lo // BLOCK * down_block_bytes, hi // BLOCK * down_block_bytes
        for i in range(Wd.shape[0]):
            prefetch_ahead(Wd, i, b_lo, b_hi)
            acc[i] = _row_dot(Wd[i, b_lo:b_hi], a[lo:hi], kind_d) if hi > lo else np.float32(0.0)
    y[:] = partial[0]
    for p in range(1, P):
        y += partial[p]


def quant_ffn(x: np.ndarray, gate: "QuantMatrix | None", up: "QuantMatrix", down: "QuantMatrix", act: str,
              relu_threshold: float) -> np.ndarray:
    """The FFN of the rows of x [T, d] over QuantMatrix weights without gate/up biases (down's bias not included):
    quant_ffn_row per row. act: a kernels.ACT_CODES name; relu_threshold: FATReLU's (ignored for SiLU)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, n = x.shape[0], up.shape[0]
    y = np.empty((T, down.shape[0]), np.float32)
    a = np.empty(n, np.float32)
    partial = np.empty((DOWN_PARTIALS, down.shape[0]), np.float32)
    g = gate if gate is not None else up
    t = np.float32(-np.inf if act == "silu" else relu_threshold)
    kd = quant_kind(down.kind)
    for r in range(T):
        quant_ffn_row(g.q, up.q, down.q, x[r], a, y[r], partial, gate is not None, ACT_CODES[act], t,
                      quant_kind(g.kind).code, quant_kind(up.kind).code, kd.code, kd.block_bytes)
    return y


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """A resident matrix [rows, cols] kept in a block format: q uint8 [rows, row_bytes(cols, kind)].

    model.linear multiplies by it (quant_matmul_t); indexing by row ids dequantizes those rows (the embedding
    lookup), so `embed[tokens]` reads as for an array."""
    q: np.ndarray
    kind: str
    cols: int

    def __post_init__(self):
        _check_matrix(self.q, self.kind, self.cols)

    @classmethod
    def of(cls, stored: tuple[str, np.ndarray]) -> "QuantMatrix":
        """From a checkpoint's quantized(name): (kind, uint8 [rows, row_bytes])."""
        kind, q = stored
        return cls(np.ascontiguousarray(q), kind, q.shape[1] // quant_kind(kind).block_bytes * BLOCK)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.cols

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    def __getitem__(self, rows) -> np.ndarray:
        return dequantize(self.q, self.kind, self.cols, rows=rows)

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        return quant_matmul_t(x, self.q, self.kind)
