"""Numba kernels on llama.cpp's 5-bit and K-quant block formats, read as a GGUF stores them (nothing requantized).

  q5_0   22 bytes / 32 weights: f16 d, u32 qh (bit l: element l's 5th bit), 16 bytes of nibbles   d * (q - 16)
  q5_1   24 bytes / 32 weights: f16 d, f16 m, u32 qh, 16 bytes of nibbles                        d * q + m
  q4_k  144 bytes / 256 weights: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) x 8, 128 bytes of nibbles;
        sub-block j (32 weights): (d * sc[j]) * q - dmin * m[j]
  q5_k  176 bytes / 256: q4_k's header, 32 bytes qh (bit j of byte l: sub-block j's element l), 128 bytes nibbles
  q6_k  210 bytes / 256: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d;
        (d * scale[e // 16]) * (q - 32)
  (nibbles: within each run of 64 weights, byte k holds weight k in its low 4 bits and weight k + 32 in its high
  4 bits for the K-quants; within a 32-weight block, k and k + 16 for q5_0/q5_1)

A matrix [rows, cols] is uint8 [rows, row_bytes], cols a multiple of the block's weights, as quant.py's formats.
Decoding is the float32 arithmetic of gguf.quants in the same order (no fused multiply-add), so `dequantize` equals
gguf's bit for bit (tests/test_kquant.py); the dot product multiplies those weights by x in float32 (x is never
quantized).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types

from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from storage.errors import UserError
from flashinfer_lite.kernels.gemv import MATMUL_PARALLEL_MIN_WORK
from flashinfer_lite.kernels.prefetch import prefetch_ahead
from flashinfer_lite.threads import numba_threads
from flashinfer_lite.quant import (_F32, _I8, _I32, _accumulate_product, _add_product, _arrays, _f32_block,
                                   _half_at, _horizontal_sum, _load_vec, _rows_ok, _vec)

Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = 0, 1, 2, 3, 4     # kind codes the kernels branch on (once per block)
KQUANTS = {"q5_0": (Q5_0, 32, 22), "q5_1": (Q5_1, 32, 24),    # name -> (code, weights per block, bytes per block)
           "q4_k": (Q4_K, 256, 144), "q5_k": (Q5_K, 256, 176), "q6_k": (Q6_K, 256, 210)}
SUB = 32                                           # weights decoded at once: one q5 block, one K-quant sub-block


def kind_of(kind: str) -> tuple[int, int, int]:
    if kind not in KQUANTS:
        raise UserError(f"unknown block format {kind!r} (expected one of {', '.join(KQUANTS)})")
    return KQUANTS[kind]


def row_bytes(cols: int, kind: str) -> int:
    """Bytes of one row of `cols` weights."""
    _, per_block, block_bytes = kind_of(kind)
    if cols <= 0 or cols % per_block:
        raise UserError(f"{kind} rows need a length that is a positive multiple of {per_block}, got {cols}")
    return cols // per_block * block_bytes


# ---------------------------------------------------------------------------------------------------------------
# Row operations in LLVM IR, as quant.py's: 32 weights become one <32 x float> (load 32 bytes, shift and mask
# nibbles and high bits, convert, scale), strict float32 as gguf.quants computes them; the dot product keeps a
# vector accumulator across sub-blocks. The kind is a runtime argument: each kind's loop is emitted once, and one
# branch per row picks it. A K-quant super-block's 8 sub-blocks are emitted unrolled, so their offsets and shifts
# are constants. No bounds checks: callers pass whole rows (the Python entry points check them).


def _byte(builder, ptr, offset):
    return builder.load(builder.gep(ptr, [offset]))


def _const(offset, k):
    return ir.Constant(offset.type, k)


def _I8c(v):
    return ir.Constant(_I8, v)


def _q4k_scale_min(builder, ptr, o, s):
    """(scale, min) of sub-block s, 6-bit each, from the 12 bytes at o + 4 (llama.cpp's get_scale_min_k4)."""
    at = lambda k: _byte(builder, ptr, builder.add(o, _const(o, 4 + k)))  # noqa: E731
    if s < 4:
        return builder.and_(at(s), _I8c(63)), builder.and_(at(s + 4), _I8c(63))
    sc = builder.or_(builder.and_(at(s + 4), _I8c(0x0F)), builder.and_(builder.lshr(at(s - 4), _I8c(2)), _I8c(0x30)))
    mn = builder.or_(builder.lshr(at(s + 4), _I8c(4)), builder.and_(builder.lshr(at(s), _I8c(2)), _I8c(0x30)))
    return sc, mn


def _bits(builder, ptr, at, shift, mask):
    """<32 x i8>: (the 32 bytes at `at` >> shift) & mask."""
    v = _load_vec(builder, ptr, _I8, SUB, at)
    if shift:
        v = builder.lshr(v, _vec(builder, _I8, shift))
    return builder.and_(v, _vec(builder, _I8, mask))


def _decode(context, builder, kind, ptr, o, s):
    """<32 x float>: weights 32s .. 32s + 31 of the block at byte ptr[o], with gguf.quants' float32 operations."""
    at = lambda k: builder.add(o, _const(o, k))  # noqa: E731
    if kind in (Q5_0, Q5_1):
        d = _vec(builder, _F32, _half_at(context, builder, ptr, o))
        hi = 4 if kind == Q5_1 else 2                     # qh, then 16 bytes of nibbles
        packed = _load_vec(builder, ptr, _I8, 16, at(hi + 4))
        nib = builder.shuffle_vector(builder.and_(packed, _vec(builder, _I8, 15, 16)),
                                     builder.lshr(packed, _vec(builder, _I8, 4, 16)),
                                     ir.Constant(ir.VectorType(_I32, SUB), list(range(SUB))))
        qh = builder.load(builder.bitcast(builder.gep(ptr, [at(hi)]), _I32.as_pointer()), align=1)
        bit = builder.lshr(_vec(builder, _I32, qh), ir.Constant(ir.VectorType(_I32, SUB), list(range(SUB))))
        bit = builder.trunc(builder.and_(bit, _vec(builder, _I32, 1)), ir.VectorType(_I8, SUB))
        q = builder.or_(nib, builder.shl(bit, _vec(builder, _I8, 4)))
        if kind == Q5_0:
            return builder.fmul(d, builder.sitofp(builder.sub(q, _vec(builder, _I8, 16)), d.type))
        m = _vec(builder, _F32, _half_at(context, builder, ptr, at(2)))
        return builder.fadd(builder.fmul(d, builder.uitofp(q, d.type)), m)
    if kind in (Q4_K, Q5_K):
        sc, mn = _q4k_scale_min(builder, ptr, o, s)
        dl = builder.fmul(_half_at(context, builder, ptr, o), builder.uitofp(sc, _F32))
        ml = builder.fmul(_half_at(context, builder, ptr, at(2)), builder.uitofp(mn, _F32))
        q = _bits(builder, ptr, at((16 if kind == Q4_K else 48) + (s >> 1) * 32), 4 * (s & 1), 0x0F)
        if kind == Q5_K:
            q = builder.or_(q, builder.shl(_bits(builder, ptr, at(16), s, 1), _vec(builder, _I8, 4)))
        vt = ir.VectorType(_F32, SUB)
        return builder.fsub(builder.fmul(_vec(builder, _F32, dl), builder.uitofp(q, vt)), _vec(builder, _F32, ml))
    # Q6_K: half h of 128 weights, quarter r of 32 within it
    h, r = s >> 2, s & 3
    lo = _bits(builder, ptr, at(h * 64 + (r & 1) * 32), 4 * (r >> 1), 0x0F)
    hi = _bits(builder, ptr, at(128 + h * 32), 2 * r, 3)
    q = builder.sub(builder.or_(lo, builder.shl(hi, _vec(builder, _I8, 4))), _vec(builder, _I8, 32))
    d = _half_at(context, builder, ptr, at(208))
    scale = [builder.fmul(d, builder.sitofp(_byte(builder, ptr, at(192 + 2 * s + k)), _F32)) for k in (0, 1)]
    sv = builder.shuffle_vector(_vec(builder, _F32, scale[0], 16), _vec(builder, _F32, scale[1], 16),
                                ir.Constant(ir.VectorType(_I32, SUB), list(range(SUB))))
    return builder.fmul(sv, builder.sitofp(q, sv.type))


_GEOMETRY = {code: (per_block, block_bytes) for code, per_block, block_bytes in KQUANTS.values()}


def _for_subs(context, builder, kind, ptr, n_items, body):
    """body(w, i) for each run i of 32 weights of a row of n_items (w: the run decoded, <32 x float>), in a loop over
    the row's blocks specialised to each kind."""
    for k, (per_block, block_bytes) in _GEOMETRY.items():
        subs = per_block // SUB
        with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, k))):
            with cgutils.for_range(builder, builder.sdiv(n_items, ir.Constant(n_items.type, per_block))) as loop:
                b = loop.index
                o = builder.mul(b, ir.Constant(b.type, block_bytes))
                for s in range(subs):
                    i = builder.add(builder.mul(b, ir.Constant(b.type, subs)), ir.Constant(b.type, s))
                    body(_decode(context, builder, k, ptr, o, s), i)


@intrinsic
def row_dot(typingctx, r, x, kind):
    """dequant(r) . x, for x float32[cols] and r a row's blocks (uint8)."""
    if not _rows_ok(r, types.uint8, x, types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, x, kind = _arrays(context, builder, sig, args)
        acc = cgutils.alloca_once_value(builder, _vec(builder, _F32, 0.0))

        def body(w, i):
            _accumulate_product(builder, acc, w, x, i)
        _for_subs(context, builder, kind, r.data, x.nitems, body)
        return _horizontal_sum(builder, builder.load(acc))
    return types.float32(r, x, kind), codegen


@intrinsic
def row_dequant(typingctx, r, out, kind):
    """out[:] = dequant(r), bit-identical to gguf.quants.dequantize."""
    if not _rows_ok(r, types.uint8, out, types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, out, kind = _arrays(context, builder, sig, args)
        _for_subs(context, builder, kind, r.data, out.nitems,
                  lambda w, i: builder.store(w, _f32_block(builder, out, i), align=4))
        return context.get_dummy_value()
    return types.none(r, out, kind), codegen


@intrinsic
def row_axpy(typingctx, y, c, r, kind):
    """y[:] += c * dequant(r); strict float32 (no contraction), so every call site rounds alike."""
    if not _rows_ok(r, types.uint8, y, types.float32):
        return None

    def codegen(context, builder, sig, args):
        y, c, r, kind = _arrays(context, builder, sig, args)
        cs = _vec(builder, _F32, c)

        def body(w, i):
            _add_product(builder, y, i, cs, w)
        _for_subs(context, builder, kind, r.data, y.nitems, body)
        return context.get_dummy_value()
    return types.none(y, c, r, kind), codegen


# ---------------------------------------------------------------------------------------------------------------
# Whole matrices


@njit(cache=True)
def dequantize_rows(Q, ids, out, kind):
    for i in range(ids.shape[0]):
        row_dequant(Q[ids[i]], out[i], kind)


def _check(q: np.ndarray, kind: str, cols: int) -> int:
    rb = row_bytes(cols, kind)
    if q.dtype != np.uint8 or q.ndim != 2 or q.shape[1] != rb or not q.flags.c_contiguous:
        raise UserError(f"a {kind} matrix of {cols} columns must be C-contiguous uint8[rows, {rb}], "
                        f"got {q.dtype}{list(q.shape)}")
    return kind_of(kind)[0]


def dequantize(q: np.ndarray, kind: str, cols: int) -> np.ndarray:
    """uint8 [n, row_bytes] -> float32 [n, cols]."""
    code = _check(q, kind, cols)
    out = np.empty((q.shape[0], cols), np.float32)
    dequantize_rows(q, np.arange(q.shape[0]), out, code)
    return out


@njit(cache=True)
def matmul_rows(Q, x, y, lo, hi, kind):
    """y[:, lo:hi] = x[T, d] @ dequant(Q[lo:hi])^T."""
    rb = Q.shape[1]
    for j in range(lo, hi):
        prefetch_ahead(Q, j, 0, rb)
        for t in range(x.shape[0]):
            y[t, j] = row_dot(Q[j], x[t], kind)


@njit(cache=True, parallel=True)
def matmul_kernel(Q, x, y, chunks, kind):
    n = Q.shape[0]
    for c in prange(chunks):
        matmul_rows(Q, x, y, c * n // chunks, (c + 1) * n // chunks, kind)


def matmul_t(x: np.ndarray, q: np.ndarray, kind: str) -> np.ndarray:
    """x [T, d] @ W [n, d]^T -> float32 [T, n]; row chunks in parallel from MATMUL_PARALLEL_MIN_WORK (each output
    is one row's dot product, so the thread count does not change a bit)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    code = _check(q, kind, x.shape[1])
    (T, d), n = x.shape, q.shape[0]
    y = np.empty((T, n), np.float32)
    threads = numba_threads()
    if threads > 1 and T * n * d >= MATMUL_PARALLEL_MIN_WORK:
        matmul_kernel(q, x, y, threads, code)
    else:
        matmul_rows(q, x, y, 0, n, code)
    return y
