"""The Numba kernels that compute on weights in GGUF's block formats (q8_0, q4_0, q4_1: storage/blocks.py).

A quantized matrix [rows, cols] is uint8 [rows, row_bytes], each row cols / 32 blocks in llama.cpp's byte layout, so
blocks copied verbatim from a GGUF file dequantize bit-exactly (tests/test_quant.py checks against gguf.quants).
Compute stays float32: x is never quantized (llama.cpp's int8 dot products would round it), so a kernel's result is
the float32 math on the dequantized weights. Quantizing is storage.blocks.quantize (gguf.quants, llama.cpp's).

Kernels: the row operations row_dot, row_dequant and row_axpy (the FFN over blocks, ffn.quant, is built on them),
quant_matmul_t (x @ W^T for resident matrices) and dequantize (whole matrix or given rows: the embedding lookup).
QuantMatrix is a resident matrix kept so (model.linear dispatches on it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from storage.errors import UserError
from flashinfer_lite.kernels.f16 import f16_bits_to_f32
from flashinfer_lite.kernels.gemv import MATMUL_PARALLEL_MIN_WORK, MATMUL_ROW_KERNEL_MAX_T, matmul_widened
from flashinfer_lite.kernels.prefetch import prefetch_ahead
from flashinfer_lite.kernels.rows import dot
from flashinfer_lite.threads import numba_threads
from storage.blocks import BLOCK, BLOCK_BYTES, check_kind, quantize, row_bytes  # noqa: F401 (quantize: re-exported)

Q8_0, Q4_0, Q4_1 = 0, 1, 2       # kind codes the kernels branch on (once per row, not per element)


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
# points and ffn.quant.QuantSparseFFN's geometry guarantee.

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
    """The float16 at byte ptr[offset] as float32, by kernels.f16.f16_bits_to_f32 (F16C or portable, as the host)."""
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


def _accumulate_product(builder, acc, w, x, b):
    """acc (a <32 x float> slot) += w * x[32b : 32b + 32], reassociable: the dot product's step."""
    xs = builder.load(_f32_block(builder, x, b), align=4)
    builder.store(builder.fadd(builder.load(acc), builder.fmul(w, xs, flags=("fast",)), flags=("fast",)), acc)


def _horizontal_sum(builder, v):
    """The sum of a <32 x float>'s lanes, by halving (once per row)."""
    n = v.type.count
    while n > 1:
        n //= 2
        half = lambda lo: builder.shuffle_vector(  # noqa: E731
            v, v, ir.Constant(ir.VectorType(_I32, n), list(range(lo, lo + n))))
        v = builder.fadd(half(0), half(n), flags=("fast",))
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _add_product(builder, y, b, cs, w):
    """y[32b : 32b + 32] += cs * w in strict float32 (no contraction), so every call site rounds alike."""
    dst = _f32_block(builder, y, b)
    builder.store(builder.fadd(builder.load(dst, align=4), builder.fmul(cs, w)), dst, align=4)


def _rows_ok(*arrays_and_dtypes) -> bool:
    """Typing guard of the row intrinsics: 1-D C-contiguous arrays of the given dtypes (else no such function)."""
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dt
               for a, dt in zip(arrays_and_dtypes[::2], arrays_and_dtypes[1::2]))


def _arrays(context, builder, sig, args):
    return [context.make_array(t)(context, builder, a) if isinstance(t, types.Array) else a
            for t, a in zip(sig.args, args)]


@intrinsic
def row_dot(typingctx, r, x, kind):
    """dequant(r) . x, for x float32[nb * 32] and r the nb blocks of a quantized row (uint8)."""
    if not _rows_ok(r, types.uint8, x, types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, x, kind = _arrays(context, builder, sig, args)
        nb = builder.sdiv(x.nitems, ir.Constant(x.nitems.type, BLOCK))
        acc = cgutils.alloca_once_value(builder, _vec(builder, _F32, 0.0))

        def body(k, b, offset):
            w = _decode_block(context, builder, k, r.data, offset)
            _accumulate_product(builder, acc, w, x, b)
        _for_blocks(context, builder, kind, nb, body)
        return _horizontal_sum(builder, builder.load(acc))
    return types.float32(r, x, kind), codegen


@intrinsic
def row_dequant(typingctx, r, out, kind):
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
def row_axpy(typingctx, y, c, r, kind):
    """y[:] += c * dequant(r), y float32[nb * 32]; strict float32 (no contraction), so every call site rounds alike."""
    if not _rows_ok(r, types.uint8, y, types.float32):
        return None

    def codegen(context, builder, sig, args):
        y, c, r, kind = _arrays(context, builder, sig, args)
        cs = _vec(builder, _F32, c)

        def body(k, b, offset):
            w = _decode_block(context, builder, k, r.data, offset)
            _add_product(builder, y, b, cs, w)
        _for_blocks(context, builder, kind, builder.sdiv(y.nitems, ir.Constant(y.nitems.type, BLOCK)), body)
        return context.get_dummy_value()
    return types.none(y, c, r, kind), codegen


# ---------------------------------------------------------------------------------------------------------------
# Dequantize (whole matrices, embedding rows, and the widened blocks of the prefill matmul)


@njit(cache=True, nogil=True)
def dequantize_rows(Q, ids, out, kind):
    """out[i] = dequantized row ids[i] of Q."""
    for i in range(ids.shape[0]):
        row_dequant(Q[ids[i]], out[i], kind)


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
# Resident matrices: y = x @ W^T, the counterpart of kernels.gemv.matmul_t with the same three paths.


@njit(cache=True, fastmath=True, nogil=True)
def quant_matmul_rows(Q, x, y, lo, hi, kind):
    """y[:, lo:hi] = x[T, d] @ dequant(Q[lo:hi])^T."""
    T, d = x.shape
    rb = Q.shape[1]
    if T == 1:  # decode: decode each block straight into the dot product, nothing written
        for j in range(lo, hi):
            prefetch_ahead(Q, j, 0, rb)
            y[0, j] = row_dot(Q[j], x[0], kind)
        return
    w = np.empty(d, np.float32)  # a few tokens: each row decoded once, then its T dot products run from L1
    for j in range(lo, hi):
        prefetch_ahead(Q, j, 0, rb)
        row_dequant(Q[j], w, kind)
        for t in range(T):
            y[t, j] = dot(w, x[t], d)


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def quant_matmul_kernel(Q, x, y, chunks, kind):
    """quant_matmul_rows over all rows, split into `chunks` contiguous row ranges run in parallel."""
    n = Q.shape[0]
    for c in prange(chunks):
        quant_matmul_rows(Q, x, y, c * n // chunks, (c + 1) * n // chunks, kind)


def quant_matmul_t(x: np.ndarray, q: np.ndarray, kind: str, row_kernel_max_t: int = MATMUL_ROW_KERNEL_MAX_T,
                   parallel_min_work: int = MATMUL_PARALLEL_MIN_WORK) -> np.ndarray:
    """x [T, d] @ W [n, d]^T -> float32 [T, n] for W quantized as uint8 [n, row_bytes(d)]; the thresholds are
    kernels.gemv.matmul_t's (the same memory-bound vs compute-bound crossover, the same cost of waking threads)."""
    if x.ndim != 2:
        raise ValueError(f"quant_matmul_t: x must be [T, d], got {x.shape}")
    k = _check_matrix(q, kind, x.shape[1])
    x = np.ascontiguousarray(x, dtype=np.float32)
    (T, d), n = x.shape, q.shape[0]
    y = np.empty((T, n), np.float32)
    if T <= row_kernel_max_t:
        threads = numba_threads()
        if threads > 1 and T * n * d >= parallel_min_work:
            quant_matmul_kernel(q, x, y, threads, k.code)
        else:
            quant_matmul_rows(q, x, y, 0, n, k.code)
    else:
        matmul_widened(x, n, d, lambda lo, block: dequantize_rows(q, np.arange(lo, lo + block.shape[0]), block,
                                                                  k.code), y)
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
