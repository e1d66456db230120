"""The Numba kernels that compute on weights in GGUF's block formats (storage/blocks.py: q8_0, q4_0, q4_1, q5_0,
q5_1 and the K-quants q4_k, q5_k, q6_k).

A quantized matrix [rows, cols] is uint8 [rows, row_bytes], each row whole blocks in llama.cpp's byte layout, so
blocks copied verbatim from a GGUF file dequantize bit-exactly (tests/test_quant.py, tests/test_kquant.py check
against gguf.quants). The layouts beyond storage/blocks.py's summary:

  q5_0 / q5_1: q4_0 / q4_1's with a u32 qh after the float16 fields (bit l: element l's 5th bit)
  q4_k  f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) x 8, 128 bytes of nibbles;
        sub-block j (32 weights): (d * sc[j]) * q - dmin * m[j]
  q5_k  q4_k's header, 32 bytes qh (bit j of byte l: sub-block j's element l), 128 bytes of nibbles
  q6_k  128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d: (d * scale[e // 16]) * (q - 32)
  (nibbles: within a 32-weight block, byte k holds element k low and k + 16 high; within each run of 64 weights of a
  K-quant, byte k holds weight k low and weight k + 32 high)
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
from storage.blocks import BLOCK, KIND_SIZES, check_kind, quantize, row_bytes  # noqa: F401 (quantize: re-exported)
from storage.columns import decode as decode_columns


@dataclass(frozen=True)
class QuantKind:
    code: int
    weights: int          # per block
    block_bytes: int


# The one space of kind codes the kernels branch on (once per row, not per element), bundles and resident matrices
KINDS = {name: QuantKind(code, *size) for code, (name, size) in enumerate(KIND_SIZES.items())}
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = (KINDS[k].code for k in
                                                  ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"))


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
# Row operations, written as LLVM IR: each run of 32 weights (a 32-weight block, a K-quant sub-block) becomes one
# <32 x float> vector (load 16 or 32 bytes, split nibbles, add high bits, convert, scale), and the dot product keeps
# a vector accumulator across runs. The same loops in Numba either vectorise across blocks with gathers or reduce
# each block horizontally (2-3x slower, bench/quant_kernels.py). The kind is a runtime argument: each kind's loop
# is emitted once, and one branch per row picks it; a K-quant super-block's 8 sub-blocks are emitted unrolled, so
# their offsets and shifts are constants. No bounds checks: callers pass whole rows (a row of `x`'s or `out`'s
# length in blocks), which the Python entry points and ffn.quant.QuantSparseFFN's geometry guarantee.

_F32, _I8, _I16, _I32 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32)
_GEOMETRY = {k.code: (k.weights, k.block_bytes) for k in KINDS.values()}


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


def _byte(builder, ptr, offset):
    return builder.load(builder.gep(ptr, [offset]))


def _I8c(v):
    return ir.Constant(_I8, v)


def _bits(builder, ptr, at, shift, mask):
    """<32 x i8>: (the 32 bytes at `at` >> shift) & mask."""
    v = _load_vec(builder, ptr, _I8, BLOCK, at)
    if shift:
        v = builder.lshr(v, _vec(builder, _I8, shift))
    return builder.and_(v, _vec(builder, _I8, mask))


def _q4k_scale_min(builder, ptr, at, s):
    """(scale, min) of sub-block s, 6-bit each, from the 12 bytes at block byte 4 (llama.cpp's get_scale_min_k4)."""
    b = lambda k: _byte(builder, ptr, at(4 + k))  # noqa: E731
    if s < 4:
        return builder.and_(b(s), _I8c(63)), builder.and_(b(s + 4), _I8c(63))
    sc = builder.or_(builder.and_(b(s + 4), _I8c(0x0F)), builder.and_(builder.lshr(b(s - 4), _I8c(2)), _I8c(0x30)))
    mn = builder.or_(builder.lshr(b(s + 4), _I8c(4)), builder.and_(builder.lshr(b(s), _I8c(2)), _I8c(0x30)))
    return sc, mn


def _decode(context, builder, kind, ptr, o, s):
    """<32 x float>: weights 32s .. 32s + 31 of the block at byte ptr[o] dequantized with the float32 operations of
    gguf.quants (the same products and sums in the same order, no fused multiply-add: the same bits)."""
    at = lambda k: builder.add(o, ir.Constant(o.type, k))  # noqa: E731
    if kind in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1):
        d = _vec(builder, _F32, _half_at(context, builder, ptr, o))
        if kind == Q8_0:
            return builder.fmul(builder.sitofp(_load_vec(builder, ptr, _I8, BLOCK, at(2)), d.type), d)
        head = 4 if kind in (Q4_1, Q5_1) else 2                  # the float16 fields
        five = kind in (Q5_0, Q5_1)
        packed = _load_vec(builder, ptr, _I8, 16, at(head + 4 * five))
        q = builder.shuffle_vector(builder.and_(packed, _vec(builder, _I8, 15, 16)),  # elements 0..15: low nibbles
                                   builder.lshr(packed, _vec(builder, _I8, 4, 16)),   # 16..31: high nibbles
                                   ir.Constant(ir.VectorType(_I32, BLOCK), list(range(BLOCK))))
        if five:                                                  # element l's 5th bit: bit l of the u32 qh
            qh = builder.load(builder.bitcast(builder.gep(ptr, [at(head)]), _I32.as_pointer()), align=1)
            bit = builder.lshr(_vec(builder, _I32, qh), ir.Constant(ir.VectorType(_I32, BLOCK), list(range(BLOCK))))
            bit = builder.trunc(builder.and_(bit, _vec(builder, _I32, 1)), ir.VectorType(_I8, BLOCK))
            q = builder.or_(q, builder.shl(bit, _vec(builder, _I8, 4)))
        if kind in (Q4_0, Q5_0):
            return builder.fmul(d, builder.sitofp(builder.sub(q, _vec(builder, _I8, 8 if kind == Q4_0 else 16)),
                                                  d.type))
        m = _vec(builder, _F32, _half_at(context, builder, ptr, at(2)))
        return builder.fadd(builder.fmul(d, builder.uitofp(q, d.type)), m)
    vt = ir.VectorType(_F32, BLOCK)
    if kind in (Q4_K, Q5_K):
        sc, mn = _q4k_scale_min(builder, ptr, at, s)
        dl = builder.fmul(_half_at(context, builder, ptr, o), builder.uitofp(sc, _F32))
        ml = builder.fmul(_half_at(context, builder, ptr, at(2)), builder.uitofp(mn, _F32))
        q = _bits(builder, ptr, at((16 if kind == Q4_K else 48) + (s >> 1) * 32), 4 * (s & 1), 0x0F)
        if kind == Q5_K:
            q = builder.or_(q, builder.shl(_bits(builder, ptr, at(16), s, 1), _vec(builder, _I8, 4)))
        return builder.fsub(builder.fmul(_vec(builder, _F32, dl), builder.uitofp(q, vt)), _vec(builder, _F32, ml))
    # Q6_K: half h of 128 weights, quarter r of 32 within it
    h, r = s >> 2, s & 3
    lo = _bits(builder, ptr, at(h * 64 + (r & 1) * 32), 4 * (r >> 1), 0x0F)
    hi = _bits(builder, ptr, at(128 + h * 32), 2 * r, 3)
    q = builder.sub(builder.or_(lo, builder.shl(hi, _vec(builder, _I8, 4))), _vec(builder, _I8, 32))
    d = _half_at(context, builder, ptr, at(208))
    scale = [builder.fmul(d, builder.sitofp(_byte(builder, ptr, at(192 + 2 * s + k)), _F32)) for k in (0, 1)]
    sv = builder.shuffle_vector(_vec(builder, _F32, scale[0], 16), _vec(builder, _F32, scale[1], 16),
                                ir.Constant(ir.VectorType(_I32, BLOCK), list(range(BLOCK))))
    return builder.fmul(sv, builder.sitofp(q, vt))


def _for_runs(context, builder, kind, ptr, n_items, body):
    """body(w, i) for each run i of 32 weights of a row of n_items (w: the run decoded, <32 x float>), in a loop over
    the row's blocks specialised to each kind."""
    for k, (per_block, block_bytes) in _GEOMETRY.items():
        subs = per_block // BLOCK
        with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, k))):
            with cgutils.for_range(builder, builder.sdiv(n_items, ir.Constant(n_items.type, per_block))) as loop:
                b = loop.index
                o = builder.mul(b, ir.Constant(b.type, block_bytes))
                for s in range(subs):
                    i = builder.add(builder.mul(b, ir.Constant(b.type, subs)), ir.Constant(b.type, s))
                    body(_decode(context, builder, k, ptr, o, s), i)


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
    """dequant(r) . x, for x float32[cols] and r a quantized row of cols weights (uint8, whole blocks)."""
    if not _rows_ok(r, types.uint8, x, types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, x, kind = _arrays(context, builder, sig, args)
        acc = cgutils.alloca_once_value(builder, _vec(builder, _F32, 0.0))
        _for_runs(context, builder, kind, r.data, x.nitems, lambda w, i: _accumulate_product(builder, acc, w, x, i))
        return _horizontal_sum(builder, builder.load(acc))
    return types.float32(r, x, kind), codegen


@intrinsic
def row_dequant(typingctx, r, out, kind):
    """out[:] = dequant(r), out float32[cols], bit-identical to gguf.quants.dequantize."""
    if not _rows_ok(r, types.uint8, out, types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, out, kind = _arrays(context, builder, sig, args)
        _for_runs(context, builder, kind, r.data, out.nitems,
                  lambda w, i: builder.store(w, _f32_block(builder, out, i), align=4))
        return context.get_dummy_value()
    return types.none(r, out, kind), codegen


@intrinsic
def row_axpy(typingctx, y, c, r, kind):
    """y[:] += c * dequant(r), y float32[cols]; strict float32 (no contraction), so every call site rounds alike."""
    if not _rows_ok(r, types.uint8, y, types.float32):
        return None

    def codegen(context, builder, sig, args):
        y, c, r, kind = _arrays(context, builder, sig, args)
        cs = _vec(builder, _F32, c)
        _for_runs(context, builder, kind, r.data, y.nitems, lambda w, i: _add_product(builder, y, i, cs, w))
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
        k = quant_kind(kind)
        return cls(np.ascontiguousarray(q), kind, q.shape[1] // k.block_bytes * k.weights)

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


# ---------------------------------------------------------------------------------------------------------------
# Columns (storage/columns.py): a GGUF down matrix kept exactly. Neuron j's column holds its raw values along d;
# the scales are the layer's tables decoded to float32, S = (a, m): rows by sub-block of neurons, one value per row
# of d. Plain Numba (no fastmath: every weight is formed by gguf.quants' float32 operations, and y += c * w rounds as
# row_axpy does).


def column_tables(tables: dict | None, kind: str | None, d: int) -> tuple:
    """The kernels' S = (a, m) of a layer's raw tables (storage.columns.decode; none, or no m: empty)."""
    dec = decode_columns(tables, kind) if tables is not None else {}
    return tuple(dec[t] if t in dec else np.zeros((0, d), np.float32) for t in ("a", "m"))


@njit(cache=True, nogil=True, inline="always")
def _col_weight(kind, q, a, m):
    """The weight of raw value q (q8_0: its byte) with its row's a and m (storage.columns.decode): gguf.quants'
    float32 operations. Scalars only: an array argument per element would cost a reference count each."""
    if kind == Q8_0:
        return a * np.float32(q - 256 if q > 127 else q)
    if kind == Q4_0:
        return a * np.float32(q - 8)
    if kind == Q5_0:
        return a * np.float32(q - 16)
    if kind == Q4_1 or kind == Q5_1:
        return a * np.float32(q) + m
    if kind == Q6_K:
        return a * np.float32(q - 32)
    return a * np.float32(q) - m


_U = np.uint64


@njit(cache=True, nogil=True, inline="always")
def _col_loop(y, c, B, r, at, lo, kind, A, M, g, half):
    """col_axpy's loop for one kind (a constant where it is inlined, so the branches fold away), group by group of
    64 elements (storage.columns' layout): runs of 8 (5-bit), 16 (6-bit) or 32 (4-bit) neighbours share their
    shifts, so each run is one SIMD loop over contiguous bytes. Indices are unsigned (a signed index makes Numba
    check for wrap-around on every access, which kept LLVM from vectorising: ~6x slower)."""
    Br, Ar = B[r], A[g]
    Mr = M[g] if M.shape[0] else Ar
    for G in range(y.shape[0] // 64):
        o = _U(64 * G)                       # in y
        i0 = _U(lo) + o                      # in the column
        if kind == Q8_0:
            for k in range(64):
                e = _U(k)
                q = np.int32(Br[_U(at) + i0 + e])
                y[o + e] += c * _col_weight(kind, q, Ar[i0 + e], np.float32(0))
            continue
        per = 8 if (kind == Q5_0 or kind == Q5_1 or kind == Q5_K) else 16 if kind == Q6_K else 32
        nib = _U(at) + (i0 >> _U(1))
        high = _U(at) + _U(half) + (i0 >> _U(3 if per == 8 else 2))
        for s in range(32 // per):
            for k in range(per):
                e = _U(s * per + k)          # element e low nibble, 32 + e high nibble
                b = np.int32(Br[nib + e])
                q0, q1 = b & 15, b >> 4
                if per == 8:
                    hb = np.int32(Br[high + _U(k)])
                    q0 |= ((hb >> s) & 1) << 4
                    q1 |= ((hb >> (4 + s)) & 1) << 4
                elif per == 16:
                    hb = np.int32(Br[high + _U(k)])
                    q0 |= ((hb >> (2 * s)) & 3) << 4
                    q1 |= ((hb >> (2 * s + 4)) & 3) << 4
                e1 = e + _U(32)
                y[o + e] += c * _col_weight(kind, q0, Ar[i0 + e], Mr[i0 + e])
                y[o + e1] += c * _col_weight(kind, q1, Ar[i0 + e1], Mr[i0 + e1])


@njit(cache=True, nogil=True)
def col_axpy(y, c, B, r, at, lo, kind, j, S):
    """y[k] += c * (element lo + k of the column at byte `at` of row r of B, neuron j's), k < len(y) (lo and len(y)
    multiples of 64): strict float32, as row_axpy. One branch per call picks the kind's loop."""
    A, M = S
    g = j // (16 if kind == Q6_K else 32)          # the row of neuron j's sub-block (storage.columns.groups)
    h = A.shape[1] // 2
    # written out per kind: a literal kind is what lets _col_loop's branches fold (a runtime kind ran ~4x slower)
    if kind == Q8_0:
        _col_loop(y, c, B, r, at, lo, Q8_0, A, M, g, h)
    elif kind == Q4_0:
        _col_loop(y, c, B, r, at, lo, Q4_0, A, M, g, h)
    elif kind == Q4_1:
        _col_loop(y, c, B, r, at, lo, Q4_1, A, M, g, h)
    elif kind == Q5_0:
        _col_loop(y, c, B, r, at, lo, Q5_0, A, M, g, h)
    elif kind == Q5_1:
        _col_loop(y, c, B, r, at, lo, Q5_1, A, M, g, h)
    elif kind == Q4_K:
        _col_loop(y, c, B, r, at, lo, Q4_K, A, M, g, h)
    elif kind == Q5_K:
        _col_loop(y, c, B, r, at, lo, Q5_K, A, M, g, h)
    else:
        _col_loop(y, c, B, r, at, lo, Q6_K, A, M, g, h)


@njit(cache=True, nogil=True)
def col_dequant(B, r, at, out, kind, j, S):
    """out[:] = neuron j's column (at byte `at` of row r of B), bit-identical to gguf.quants' dequantization of the
    source rows: col_axpy of 1 onto -0.0 (1 * w is w, and -0.0 + w is w for every w, negative zero included)."""
    out[:] = np.float32(-0.0)
    col_axpy(out, np.float32(1.0), B, r, at, 0, kind, j, S)
