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
Dot products with rows of the 32-weight kinds round x to 8-bit blocks first, as llama.cpp's CPU backend does (row_dot8,
set_act8: on by default, 1.5-2x faster than decoding the blocks to float32); the rest is the float32 math on the
dequantized weights: the K-quants' dot products, every axpy (the down rows of bundles), and all of it with set_act8
off. Quantizing weights is storage.blocks.quantize (gguf.quants, llama.cpp's).

Kernels: the row operations row_dot, row_dot8, row_dequant and row_axpy (the FFN over blocks, ffn.quant, is built on
them), quant_matmul_t (x @ W^T for resident matrices: a prompt's rows in tiles, quant_tile) and dequantize (whole
matrix or given rows: the embedding lookup).
QuantMatrix is a resident matrix kept so (linear, below, dispatches on it).
"""
from __future__ import annotations

from dataclasses import dataclass

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from storage.errors import UserError
from flashinfer_lite.kernels.gemv import MATMUL_PARALLEL_MIN_WORK, MATMUL_ROW_KERNEL_MAX_T, matmul_t, matmul_widened
from flashinfer_lite.kernels.rows import HAS_F16C, dot, f16_bits_to_f32, f32_to_f16_bits, prefetch_ahead
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

_F32, _I8, _I16, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
llvm_binding.initialize_native_asmparser()      # _half_at's inline asm (Numba sets up the printer, not the parser)
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
    """The float16 at byte ptr[offset] as float32, by kernels.rows.f16_bits_to_f32 (F16C or portable, as the host).
    With F16C, LLVM converts a float16 alone by loading it with `vpinsrw $0, mem, %xmmA, %xmmB`: the other lanes
    come from whatever register xmmA is, and when that is an accumulator every block waits for the block before it
    (q4_0 and q8_0 in quant_matmul_rows, q4_1's mins: a third fewer bytes per second, bench/quant_kernels.py), and
    asking for
    the other lanes zero does not help (LLVM sees they are unused). So it is inline asm: the register zeroed first
    (vpxor, which waits for nothing), then the load and the conversion."""
    at = builder.gep(ptr, [offset])
    if not HAS_F16C:
        bits = builder.load(builder.bitcast(at, _I16.as_pointer()), align=1)
        return context.compile_internal(builder, lambda h: f16_bits_to_f32(h), types.float32(types.uint16), [bits])
    return builder.asm(ir.FunctionType(_F32, [at.type]), "vpxor $0, $0, $0\n\tvpinsrw $$0, ($1), $0, $0\n\t"
                       "vcvtph2ps $0, $0", "=&x,r", [at], False)


def _half_pair_at(context, builder, ptr, offset):
    """The two float16 at bytes ptr[offset] .. ptr[offset + 3] as float32 (a block's d and m, or d and dmin): one
    32-bit load (vmovss, which zeroes the other lanes) and one conversion with F16C."""
    if not HAS_F16C:
        return _half_at(context, builder, ptr, offset), _half_at(context, builder, ptr, builder.add(offset,
                                                                                           ir.Constant(offset.type, 2)))
    bits = builder.load(builder.bitcast(builder.gep(ptr, [offset]), _I32.as_pointer()), align=1)
    v = builder.insert_element(ir.Constant(ir.VectorType(_I32, 4), [ir.Constant(_I32, 0)] * 4), bits,
                               ir.Constant(_I32, 0))
    f = builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 8)), ir.VectorType(_F32, 8))
    return builder.extract_element(f, ir.Constant(_I32, 0)), builder.extract_element(f, ir.Constant(_I32, 1))


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
        q = _packed_values(builder, kind, ptr, at)
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


def _k_multipliers(builder, kind, ptr, o, d, dmin, slot):
    """Into slot (float32[16]): d * sc of the 8 sub-blocks of the q4_k / q5_k block at byte ptr[o], then -(dmin * m)
    (d, dmin: its float16 fields as float32): _k_scales' fields, all 8 at once, with _decode's float32 products."""
    sm, f8 = _k_scales(builder, kind, ptr, o), ir.VectorType(_F32, 8)
    half = lambda lo: builder.uitofp(builder.shuffle_vector(  # noqa: E731
        sm, sm, ir.Constant(ir.VectorType(_I32, 8), list(range(lo, lo + 8)))), f8)
    dl, ml = builder.fmul(_vec(builder, _F32, d, 8), half(0)), builder.fmul(_vec(builder, _F32, dmin, 8), half(8))
    both = builder.shuffle_vector(dl, builder.fneg(ml), ir.Constant(ir.VectorType(_I32, 16), list(range(16))))
    builder.store(both, builder.bitcast(slot, both.type.as_pointer()), align=4)


def _k_products(context, builder, kind, ptr, o, s, c, slot):
    """<32 x float>: c * w for the weights 32s .. 32s + 31 of the q4_k / q5_k block at byte ptr[o] (slot: its
    _k_multipliers), by lookup. A sub-block's weight w = (d * sc) * q - dmin * m takes one of 16 (q4_k) or 32 (q5_k)
    values, so the sub-block's products c * w are formed once each, with _decode's and _add_run's float32
    operations, into one or two <16 x float> tables that vpermps / vpermi2ps index by q: the same bits, and a run
    costs the permutes and the sum instead of the conversion and three products (the down rows' row_axpy ran at
    0.6x q4_0's bytes per second, bench/quant_kernels.py). The multipliers are read from slot, which _for_runs fills
    for a chunk of blocks first: broadcast from memory they are loads, where from a register each is one more shuffle,
    the unit these runs wait on (in cache, one thread: 0.88x q4_0's bytes per second that way, 1.13x this way)."""
    at = lambda k: builder.add(o, ir.Constant(o.type, k))  # noqa: E731
    v16, i16 = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16)
    dl, nml = (_vec(builder, _F32, builder.load(builder.gep(slot, [ir.Constant(_I32, k)])), 16) for k in (s, 8 + s))
    # (d * sc) * q is exact (at most 11 + 6 + 5 significant bits), so fusing its subtraction rounds as _decode does
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16] * 3), "llvm.fmuladd.v16f32")
    tables = [builder.fmul(_vec(builder, _F32, c, 16), builder.call(
        fma, [dl, ir.Constant(v16, [float(v) for v in range(lo, lo + 16)]), nml]))
        for lo in ((0,) if kind == Q4_K else (0, 16))]
    # the indices, two <16 x i32>: only the bits a permute reads (4 or 5) need be right. q4_k: its bytes widened
    # (straight from memory), shifted for the high nibbles; q5_k: the 5-bit values formed as bytes first
    nibbles = at((16 if kind == Q4_K else 48) + (s >> 1) * 32)
    if kind == Q4_K:
        half = [builder.zext(_load_vec(builder, ptr, _I8, 16, builder.add(nibbles, ir.Constant(o.type, h))), i16)
                for h in (0, 16)]
        half = [builder.lshr(v, _vec(builder, _I32, 4, 16)) for v in half] if s & 1 else half
    else:
        q = builder.or_(_bits(builder, ptr, nibbles, 4 * (s & 1), 0x0F),
                        builder.shl(_bits(builder, ptr, at(16), s, 1), _vec(builder, _I8, 4)))
        half = [builder.zext(builder.shuffle_vector(q, q, ir.Constant(i16, list(range(h, h + 16)))), i16)
                for h in (0, 16)]
    if kind == Q4_K:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, i16]),
                                            "llvm.x86.avx512.permvar.sf.512")
        p = [builder.call(fn, [tables[0], h]) for h in half]
    else:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, i16, v16]),
                                            "llvm.x86.avx512.vpermi2var.ps.512")
        p = [builder.call(fn, [tables[0], h, tables[1]]) for h in half]
    return builder.shuffle_vector(p[0], p[1], ir.Constant(ir.VectorType(_I32, BLOCK), list(range(BLOCK))))


# _for_runs' lookup path: the multipliers of this many blocks are formed first, then their runs (a stack buffer of
# 16 floats a block)
K_CHUNK_BLOCKS = 16


def _for_runs(context, builder, kind, ptr, n_items, body, c=None):
    """body(v, i) for each run i of 32 weights of a row of n_items, in a loop over the row's blocks specialised to
    each kind: v the run decoded (<32 x float>), or with c (float32) the products c * w in strict float32 (q4_k and
    q5_k by _k_products where the host has AVX-512's permutes, K_CHUNK_BLOCKS blocks at a time: first their
    _k_multipliers, then their runs, so that the runs read the multipliers from memory)."""
    cs = None if c is None else _vec(builder, _F32, c)
    lookup = c is not None and HAS_AVX512
    slots = cgutils.alloca_once(builder, _F32, size=16 * K_CHUNK_BLOCKS) if lookup else None
    for k in _emitted(kind, _GEOMETRY):
        per_block, block_bytes = _GEOMETRY[k]
        subs = per_block // BLOCK
        blocks = builder.sdiv(n_items, ir.Constant(n_items.type, per_block))
        at = lambda b: builder.mul(b, ir.Constant(b.type, block_bytes))  # noqa: E731
        with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, k))):
            if lookup and k in (Q4_K, Q5_K):
                n = ir.Constant(blocks.type, K_CHUNK_BLOCKS)
                chunks = builder.sdiv(builder.add(blocks, ir.Constant(blocks.type, K_CHUNK_BLOCKS - 1)), n)
                with cgutils.for_range(builder, chunks) as chunk:
                    b0 = builder.mul(chunk.index, n)
                    m = builder.sub(blocks, b0)
                    m = builder.select(builder.icmp_signed("<", m, n), m, n)
                    slot = lambda j: builder.gep(slots, [builder.mul(j, ir.Constant(j.type, 16))])  # noqa: E731
                    with cgutils.for_range(builder, m) as loop:
                        o = at(builder.add(b0, loop.index))
                        _k_multipliers(builder, k, ptr, o, *_half_pair_at(context, builder, ptr, o), slot(loop.index))
                    with cgutils.for_range(builder, m) as loop:
                        b = builder.add(b0, loop.index)
                        for s in range(subs):
                            i = builder.add(builder.mul(b, ir.Constant(b.type, subs)), ir.Constant(b.type, s))
                            body(_k_products(context, builder, k, ptr, at(b), s, c, slot(loop.index)), i)
                continue
            with cgutils.for_range(builder, blocks) as loop:
                b = loop.index
                o = at(b)
                for s in range(subs):
                    i = builder.add(builder.mul(b, ir.Constant(b.type, subs)), ir.Constant(b.type, s))
                    w = _decode(context, builder, k, ptr, o, s)
                    body(w if c is None else builder.fmul(cs, w), i)


def _accumulate_product(builder, acc, w, x, b):
    """acc (a <32 x float> slot) += w * x[32b : 32b + 32], reassociable: the dot product's step."""
    xs = builder.load(_f32_block(builder, x, b), align=4)
    builder.store(builder.fadd(builder.load(acc), builder.fmul(w, xs, flags=("fast",)), flags=("fast",)), acc)


# The flag of the 8-bit dot products' float operations: Numba's fastmath pass marks every float operation that has no
# flag "fast" (reassociable, contractible), those an intrinsic emits into a fastmath kernel too, so a dot product's
# order would depend on its call site (a decode GEMV's row_dot8k and a prompt tile's rows_dot8k differed in the last
# bits). nsz allows nothing that changes a nonzero sum, and a flagged operation is left alone: one order everywhere.
_KEEP = ("nsz",)


def _horizontal_sum(builder, v, flags=("fast",)):
    """The sum of a vector's lanes by halving (once per row); flags _KEEP keeps exactly this order (row_dot8: the
    same bits whatever LLVM does around it)."""
    n = v.type.count
    while n > 1:
        n //= 2
        half = lambda lo: builder.shuffle_vector(  # noqa: E731
            v, v, ir.Constant(ir.VectorType(_I32, n), list(range(lo, lo + n))))
        v = builder.fadd(half(0), half(n), flags=flags)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _add_run(builder, y, b, p):
    """y[32b : 32b + 32] += p (the products c * w) in strict float32 (no contraction), so every call site rounds
    alike."""
    dst = _f32_block(builder, y, b)
    builder.store(builder.fadd(builder.load(dst, align=4), p), dst, align=4)


def _rows_ok(*arrays_and_dtypes) -> bool:
    """Typing guard of the row intrinsics: 1-D C-contiguous arrays of the given dtypes (else no such function)."""
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dt
               for a, dt in zip(arrays_and_dtypes[::2], arrays_and_dtypes[1::2]))


def _arrays(context, builder, sig, args):
    """The arguments: arrays as Numba's array structures, and an integer typed as a literal (the kind of a kernel made
    for one kind: kernels.neurons.gate_coefficients_for) as that constant, whose loop alone _emitted then emits."""
    return [context.make_array(t)(context, builder, a) if isinstance(t, types.Array) else
            ir.Constant(a.type, t.literal_value) if isinstance(t, types.IntegerLiteral) else a
            for t, a in zip(sig.args, args)]


def _emitted(kind, codes):
    """The kind codes of `codes` whose loops to emit for `kind` (an LLVM value): the one it is when it is a constant
    (none when it is none of them), else all of them, each behind a branch on `kind` taken at run time. A compiler's
    memory grows with the code: kernels that emitted every kind's loops in each call took a first use's compile
    child past a 300 MiB memory cgroup."""
    return [k for k in codes if k == kind.constant] if isinstance(kind, ir.Constant) else list(codes)


@intrinsic(prefer_literal=True)
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


@intrinsic(prefer_literal=True)
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


@intrinsic(prefer_literal=True)
def row_axpy(typingctx, y, c, r, kind):
    """y[:] += c * dequant(r), y float32[cols]; strict float32 (no contraction), so every call site rounds alike."""
    if not _rows_ok(r, types.uint8, y, types.float32):
        return None

    def codegen(context, builder, sig, args):
        y, c, r, kind = _arrays(context, builder, sig, args)
        _for_runs(context, builder, kind, r.data, y.nitems, lambda p, i: _add_run(builder, y, i, p), c)
        return context.get_dummy_value()
    return types.none(y, c, r, kind), codegen


# ---------------------------------------------------------------------------------------------------------------
# 8-bit activations (llama.cpp's dot products, for the 32-weight block kinds). x is rounded once per GEMV into
# blocks of 32 int8 as ggml's x86 CPU backend rounds it (quantize_row_q8_0 / q8_1): the scale max|x| / 127 kept as
# float16, the values rint(x * (127 / max|x|)), ties to even. A weight block's dot product with such a block is then
# an exact integer (8 lanes of 4 products each, one vpdpbusd where the host has AVX512-VNNI, summed), and only the
# float32 operations on each block's integer depend on rounding: their order is fixed here (row_dot8), so the bits do
# not depend on the host's instructions, the thread count or the call site (a prompt's tiles or a decode row).

INT8_KINDS = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)   # x in blocks of 32 (q8_0 / q8_1): codes 0 .. Q5_1 (act_dot)
K_KINDS = (Q4_K, Q5_K, Q6_K)                  # x in blocks of 256 (q8_K): codes Q4_K .. (act_dot)
assert INT8_KINDS == tuple(range(Q5_1 + 1)) and K_KINDS == tuple(range(Q4_K, Q6_K + 1))
SUPER = 256                                   # weights of a K-quant block (and of a q8_K block of x)
LANES = 8                                     # int32 lanes per 32-weight block: 4 products each
GROUP = LANES                                 # blocks whose integer lanes one transpose sums (_row_sums)
CHAINS = 2     # float32 sums a row, even and odd blocks: a decode row waits on half as many adds one after another
# unsigned weight values u = q + offset (q8_0: q + 128; q4_0: the nibble, q = u - 8; q5_0: u - 16): the products are
# u8 x s8 (vpdpbusd's), and offset * (x's lane sums) is taken off in integers
_OFFSET_SHIFT = {Q8_0: 7, Q4_0: 3, Q5_0: 4}


@njit(cache=True, nogil=True)
def quantize_act(x, xq, xd, xs, xl):
    """x float32[n] (n a multiple of 32) -> 8-bit blocks: xq int8[n], xd float32[n // 32] (each block's float16 scale
    as float32), xs float32[n // 32] (q8_1's s: float16 of the unrounded scale times the block's sum of xq) and xl
    int32[n // 4] (the sums of each 4 consecutive xq: the lanes' offset terms)."""
    for b in range(x.shape[0] // BLOCK):
        amax = np.float32(0.0)
        for k in range(BLOCK):
            amax = max(amax, abs(x[b * BLOCK + k]))
        d = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax != np.float32(0.0) else np.float32(0.0)
        total = 0
        for k in range(BLOCK):
            q = np.int32(np.rint(x[b * BLOCK + k] * inv))
            xq[b * BLOCK + k] = q
            total += q
        for k in range(BLOCK // 4):
            i = b * BLOCK + 4 * k
            xl[b * LANES + k] = np.int32(xq[i]) + np.int32(xq[i + 1]) + np.int32(xq[i + 2]) + np.int32(xq[i + 3])
        xd[b] = f16_bits_to_f32(f32_to_f16_bits(d))
        xs[b] = f16_bits_to_f32(f32_to_f16_bits(d * np.float32(total)))


@njit(cache=True, nogil=True)
def quantize_act_k(x, kq, kd, kb):
    """x float32[n] (n a multiple of 256) -> q8_K blocks as ggml's quantize_row_q8_K rounds them: per 256 values the
    scale -127 / (the first value of largest |x|), kq int8[n] = rint(x * scale) (ties to even, at most 127), kd
    float32[n // 256] = 1 / scale, kb int32[n // 16] the sums of each 16 consecutive kq."""
    for b in range(x.shape[0] // SUPER):
        amax, top = np.float32(0.0), np.float32(0.0)
        for k in range(SUPER):
            v = x[b * SUPER + k]
            if abs(v) > amax:
                amax, top = abs(v), v
        if amax == np.float32(0.0):
            kd[b] = 0.0
            kq[b * SUPER:(b + 1) * SUPER] = 0
        else:
            iscale = np.float32(-127.0) / top
            for k in range(SUPER):
                kq[b * SUPER + k] = min(127, np.int32(np.rint(iscale * x[b * SUPER + k])))
            kd[b] = np.float32(1.0) / iscale
        for g in range(SUPER // 16):
            total = 0
            for k in range(16):
                total += np.int32(kq[b * SUPER + g * 16 + k])
            kb[b * SUPER // 16 + g] = total


ACT8 = [True]    # set_act8: 8-bit activations where a kind has them (the default), else float32 x everywhere


def set_act8(on: bool) -> None:
    """Process-wide: dot products with 32-weight block rows round x to 8 bits as llama.cpp does (on, the default and
    faster), or keep it float32 (off: the float32 math on the dequantized weights, exact but for summation order)."""
    ACT8[0] = bool(on)


# x's 8-bit blocks for the kernels, one tuple of 2-D arrays (a row per row of x): quantize_act's (q, d, s, lanes) for
# the 32-weight kinds, then quantize_act_k's (kq, kd, kb) for the K-quants; a part is empty ([T, 0]) where no kind
# needs it, set_act8 is off or x's length is not whole blocks (the kernels then take float32 x).


def _act8_new(T: int, n: int, nk: int) -> tuple:
    return (np.empty((T, n), np.int8), np.empty((T, n // BLOCK), np.float32), np.empty((T, n // BLOCK), np.float32),
            np.empty((T, n // 4), np.int32), np.empty((T, nk), np.int8), np.empty((T, nk // SUPER), np.float32),
            np.empty((T, nk // 16), np.int32))


@njit(cache=True, nogil=True, inline="always")
def act8_row(a, t):
    """Row t of act8_buffers' arrays: the 1-D tuple act8_dot and quantize_act1 take."""
    return a[0][t], a[1][t], a[2][t], a[3][t], a[4][t], a[5][t], a[6][t]


@njit(cache=True, nogil=True, inline="always")
def act8_slice(a, lo, hi):
    """Values lo .. hi of a 1-D tuple (act8_row), lo and hi whole blocks of the kinds it holds."""
    return (a[0][lo:hi], a[1][lo // BLOCK:hi // BLOCK], a[2][lo // BLOCK:hi // BLOCK], a[3][lo // 4:hi // 4],
            a[4][lo:hi], a[5][lo // SUPER:hi // SUPER], a[6][lo // 16:hi // 16])


@njit(cache=True, nogil=True, inline="always")
def quantize_act1(x, a):
    """x float32[n] into the 1-D tuple a (act8_row, act8_slice): the parts it has room for."""
    if a[0].shape[0] != 0:
        quantize_act(x, a[0], a[1], a[2], a[3])
    if a[4].shape[0] != 0:
        quantize_act_k(x, a[4], a[5], a[6])


@njit(cache=True, nogil=True)
def quantize_act_rows(x, a):
    """Each row of x [T, n] into its row of a (act8_buffers; nothing where a is empty)."""
    for t in range(x.shape[0]):
        quantize_act1(x[t], act8_row(a, t))


_NONE: dict[int, tuple] = {}     # T -> the empty arrays of T rows (shared: nothing is ever written into them)


def _codes(kinds) -> set:
    return {KINDS[k].code if isinstance(k, str) else k for k in kinds}


def act8_buffers(T: int, n: int, *kinds: str | int) -> tuple:
    """Room for T rows of n values of x in the 8-bit blocks that `kinds` (names or codes) dot with, for a kernel to
    fill (quantize_act_rows, quantize_act1); empty when set_act8 is off (see above)."""
    codes = _codes(kinds)
    m = n if ACT8[0] and n % BLOCK == 0 and codes & set(INT8_KINDS) else 0
    mk = n if ACT8[0] and n % SUPER == 0 and codes & set(K_KINDS) else 0
    if m or mk:
        return _act8_new(T, m, mk)
    if T not in _NONE:
        _NONE[T] = _act8_new(T, 0, 0)
    return _NONE[T]


def act8_of(x: np.ndarray, *kinds: str | int) -> tuple:
    """x [T, n] float32 (C-contiguous) as the 8-bit blocks `kinds` dot with (act8_buffers, filled)."""
    a = act8_buffers(*x.shape, *kinds)
    if a[0].shape[1] or a[4].shape[1]:
        quantize_act_rows(x, a)
    return a


def act8_rounded(x: np.ndarray, a: tuple, kind: int = Q8_0) -> np.ndarray:
    """x [T, n] as its 8-bit blocks a (act8_of) for `kind` (a code) round it, float32: what a prompt's BLAS products
    multiply by, so they round x as the row kernels do (q4_1 / q5_1: their min term from it, not from the float16 s;
    float rounding apart). x itself where a has no blocks for kind."""
    q, d, size = (a[0], a[1], BLOCK) if kind in INT8_KINDS else (a[4], a[5], SUPER)
    if q.shape[1] == 0:
        return x
    return (q.reshape(x.shape[0], -1, size) * d[:, :, None]).reshape(x.shape)


_HOST = set(llvm_binding.get_host_cpu_features().flatten().split(","))
HAS_VNNI = {"+avx512vnni", "+avx512vl"} <= _HOST
HAS_AVX2 = "+avx2" in _HOST
HAS_GFNI = {"+gfni", "+avx"} <= _HOST        # the 256-bit vgf2p8affineqb
HAS_AVX512 = "+avx512f" in _HOST              # the 512-bit permutes of _k_products


def _lanes_of(builder, u, xv):
    """<8 x i32>: lane l = sum of u[k] * xv[k] over k = 4l .. 4l + 3 (u unsigned, xv signed <32 x i8>): exact. One
    vpdpbusd with AVX512-VNNI; elsewhere the same integers from 32-bit products."""
    v8 = ir.VectorType(_I32, LANES)
    if HAS_VNNI:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]),
                                            "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(fn, [ir.Constant(v8, [ir.Constant(_I32, 0)] * LANES), builder.bitcast(u, v8),
                                 builder.bitcast(xv, v8)])
    w = ir.VectorType(_I32, BLOCK)
    p = builder.mul(builder.zext(u, w), builder.sext(xv, w))
    pick = lambda k: builder.shuffle_vector(p, p, ir.Constant(v8, list(range(k, BLOCK, 4))))  # noqa: E731
    return builder.add(builder.add(pick(0), pick(1)), builder.add(pick(2), pick(3)))


# vgf2p8affineqb's 8x8 bit matrices (output bit i = the parity of the matrix's byte 7 - i and the input byte), one per
# 8 bytes: the low nibble (bits 0-3 kept) for the first 16 bytes, the high nibble moved down for the last 16
_NIBBLE_MAPS = [0, 0, 0, 0, 8, 4, 2, 1] * 2 + [0, 0, 0, 0, 128, 64, 32, 16] * 2


def _unsigned_values(builder, kind, ptr, o):
    """<32 x i8>: the block at byte ptr[o]'s weights as unsigned values u (see _OFFSET_SHIFT)."""
    at = lambda k: builder.add(o, ir.Constant(o.type, k))  # noqa: E731
    if kind == Q8_0:
        return builder.xor(_load_vec(builder, ptr, _I8, BLOCK, at(2)), _vec(builder, _I8, 0x80))
    return _packed_values(builder, kind, ptr, at)


def _packed_values(builder, kind, ptr, at):
    """<32 x i8>: the unsigned 4- or 5-bit values of the q4_0 / q4_1 / q5_0 / q5_1 block whose byte k is at(k):
    elements 0-15 the low nibbles, 16-31 the high ones, plus 16 where the element's bit of qh is set."""
    head = 4 if kind in (Q4_1, Q5_1) else 2                  # the float16 fields
    five = kind in (Q5_0, Q5_1)
    packed = _load_vec(builder, ptr, _I8, 16, at(head + 4 * five))
    if HAS_GFNI:   # the 16 bytes in both halves, then one affine map per half: & 15 (low) and >> 4 (high)
        both = builder.shuffle_vector(packed, packed, ir.Constant(ir.VectorType(_I32, BLOCK), list(range(16)) * 2))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(both.type, [both.type, both.type, _I8]),
                                            "llvm.x86.vgf2p8affineqb.256")
        u = builder.call(fn, [both, ir.Constant(both.type, [_I8c(v) for v in _NIBBLE_MAPS]), _I8c(0)])
    else:
        u = builder.shuffle_vector(builder.and_(packed, _vec(builder, _I8, 15, 16)),
                                   builder.lshr(packed, _vec(builder, _I8, 4, 16)),
                                   ir.Constant(ir.VectorType(_I32, BLOCK), list(range(BLOCK))))
    if five:   # element k's 5th bit: bit k of the u32 qh, read as a mask (AVX512: kmovd, then one masked add)
        qh = builder.load(builder.bitcast(builder.gep(ptr, [at(head)]), _I32.as_pointer()), align=1)
        u = builder.select(builder.bitcast(qh, ir.VectorType(ir.IntType(1), BLOCK)),
                           builder.add(u, _vec(builder, _I8, 16)), u)
    return u


def _group_terms(builder, sums, d):
    """<8 x float>: lane j float(sums[j]) * d[j], block j of a group's term (float32, as for one block alone)."""
    return builder.fmul(builder.sitofp(sums, d.type), d, flags=_KEEP)


def _add_in_order(builder, slots, v, count=LANES):
    """slots[j % len(slots)] += lane j of v, j = 0 .. count - 1 in order (a group of a row's blocks, each into its
    chain: the one-block bits)."""
    accs = [builder.load(slot) for slot in slots]
    for j in range(count):
        h = j % len(slots)
        accs[h] = builder.fadd(accs[h], builder.extract_element(v, ir.Constant(_I32, j)), flags=_KEEP)
    for slot, acc in zip(slots, accs):
        builder.store(acc, slot)


def _halves_of(context, builder, ptr, offsets, pairs):
    """<8 x float> of the float16 at byte ptr[offsets[j]] (8 blocks' d), or with pairs the two <8 x float> of the
    float16 pairs there (d and m): loaded into one vector, one conversion (F16C), no round trip through memory."""
    if not HAS_F16C:
        halves = [_half_pair_at(context, builder, ptr, o) if pairs else (_half_at(context, builder, ptr, o),)
                  for o in offsets]
        out = []
        for h in range(2 if pairs else 1):
            v = ir.Constant(ir.VectorType(_F32, LANES), ir.Undefined)
            for j, p in enumerate(halves):
                v = builder.insert_element(v, p[h], ir.Constant(_I32, j))
            out.append(v)
        return out
    ty = _I32 if pairs else _I16
    v = ir.Constant(ir.VectorType(ty, LANES), ir.Undefined)
    for j, o in enumerate(offsets):
        v = builder.insert_element(v, builder.load(builder.bitcast(builder.gep(ptr, [o]), ty.as_pointer()), align=1),
                                   ir.Constant(_I32, j))
    f = builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), LANES * (1 + pairs))),
                      ir.VectorType(_F32, LANES * (1 + pairs)))
    if not pairs:
        return [f]
    return [builder.shuffle_vector(f, f, ir.Constant(ir.VectorType(_I32, LANES), list(range(h, 2 * LANES, 2))))
            for h in (0, 1)]


def _dot8_rows(context, builder, r, xq, xd, xs, xl, kind, n, rows):
    """The float32 results of row_dot8 of row r with each of `rows` rows of x (row i's values at xq[rows[i] * n],
    its scales at xd[rows[i] * n // 32], ...; n: x's length): each weight block decoded once for all of them, each
    row summed by exactly the operations row_dot8 performs alone, so a row's bits do not depend on how many rows
    share the call. Blocks go GROUP at a time: their integer lanes summed by one transpose (_row_sums: block j's
    integer in lane j), multiplied by their scales lane by lane, then added to the row's sums (CHAINS: even and odd
    blocks) one block after another; the last blocks of a row (fewer than a group) one at a time by the same
    operations."""
    zero = ir.Constant(_F32, 0.0)
    accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(CHAINS)] for _ in rows]   # even, odd blocks
    mins = [[cgutils.alloca_once_value(builder, zero) for _ in range(CHAINS)] for _ in rows]
    result = [cgutils.alloca_once_value(builder, zero) for _ in rows]
    vf = ir.VectorType(_F32, LANES)
    n_blocks = builder.sdiv(n, ir.Constant(n.type, BLOCK))
    c = lambda v: ir.Constant(n_blocks.type, v)  # noqa: E731
    at = [(builder.mul(t, n), builder.mul(t, n_blocks), builder.mul(t, builder.mul(n_blocks, c(LANES))))
          for t in rows]                                                  # each row's start in xq, xd and xs, xl
    fvec = lambda arr, i: builder.load(builder.bitcast(builder.gep(arr, [i]), vf.as_pointer()), align=4)  # noqa

    def lanes_of(k, b, u, i):    # block b's 8 integer lanes with row i of x (less offset * x's lane sums)
        q0, _, l0 = at[i]
        xv = _load_vec(builder, xq.data, _I8, BLOCK, builder.add(q0, builder.mul(b, c(BLOCK))))
        lanes = _lanes_of(builder, u, xv)
        if k in _OFFSET_SHIFT:
            xsum = _load_vec(builder, xl.data, _I32, LANES, builder.add(l0, builder.mul(b, c(LANES))))
            lanes = builder.sub(lanes, builder.shl(xsum, _vec(builder, _I32, _OFFSET_SHIFT[k], LANES)))
        return lanes

    def x_scales(arr, at, m):    # m consecutive float32 of x's (lanes m .. 7 left undefined)
        if m == GROUP:
            return fvec(arr, at)
        v = ir.Constant(vf, ir.Undefined)
        for j in range(m):
            v = builder.insert_element(v, builder.load(builder.gep(arr, [builder.add(at, c(j))])), ir.Constant(_I32, j))
        return v

    def group(k, b0, m=GROUP):   # blocks b0 .. b0 + m - 1 (b0 even; m = GROUP, or half of it for a row's rest)
        blocks = [builder.add(b0, c(j)) for j in range(m)]
        offsets = [builder.mul(b, c(_GEOMETRY[k][1])) for b in blocks]
        us = [_unsigned_values(builder, k, r.data, o) for o in offsets]
        halves = _halves_of(context, builder, r.data, offsets, k in (Q4_1, Q5_1))
        none = [ir.Constant(ir.VectorType(_I32, LANES), [ir.Constant(_I32, 0)] * LANES)] * (GROUP - m)
        for i, (_, d0, _) in enumerate(at):
            sums = _row_sums(builder, [lanes_of(k, b, u, i) for b, u in zip(blocks, us)] + none)
            d = builder.fmul(halves[0], x_scales(xd.data, builder.add(d0, b0), m), flags=_KEEP)
            _add_in_order(builder, accs[i], _group_terms(builder, sums, d), m)
            if k in (Q4_1, Q5_1):
                _add_in_order(builder, mins[i], builder.fmul(halves[1], x_scales(xs.data, builder.add(d0, b0), m),
                                                             flags=_KEEP), m)

    def one(k, b, h):            # block b alone into chain h: its integer, times (wd * x's d), added
        o = builder.mul(b, c(_GEOMETRY[k][1]))
        u = _unsigned_values(builder, k, r.data, o)
        if k in (Q4_1, Q5_1):       # d and m with one load (see _half_at: one at a time, each waited on a sum)
            wd, wm = _half_pair_at(context, builder, r.data, o)
        else:
            wd = _half_at(context, builder, r.data, o)
        for i, (_, d0, _) in enumerate(at):
            d = builder.fmul(wd, builder.load(builder.gep(xd.data, [builder.add(d0, b)])), flags=_KEEP)
            term = builder.fmul(builder.sitofp(_sum_lanes(builder, lanes_of(k, b, u, i)), _F32), d, flags=_KEEP)
            builder.store(builder.fadd(builder.load(accs[i][h]), term, flags=_KEEP), accs[i][h])
            if k in (Q4_1, Q5_1):
                m = builder.fmul(wm, builder.load(builder.gep(xs.data, [builder.add(d0, b)])), flags=_KEEP)
                builder.store(builder.fadd(builder.load(mins[i][h]), m, flags=_KEEP), mins[i][h])

    for k in _emitted(kind, INT8_KINDS):
        with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, k))):
            groups = builder.sdiv(n_blocks, c(GROUP))
            with cgutils.for_range(builder, groups) as loop:
                group(k, builder.mul(loop.index, c(GROUP)))
            done = builder.mul(groups, c(GROUP))        # even: the rest's chains by parity, in pairs
            half = builder.icmp_signed(">=", builder.sub(n_blocks, done), c(GROUP // 2))
            with builder.if_then(half):
                group(k, done, GROUP // 2)
            done = builder.select(half, builder.add(done, c(GROUP // 2)), done)
            with cgutils.for_range(builder, builder.sdiv(builder.sub(n_blocks, done), c(2))) as loop:
                b = builder.add(done, builder.mul(loop.index, c(2)))
                one(k, b, 0)
                one(k, builder.add(b, c(1)), 1)
            with builder.if_then(builder.icmp_signed("==", builder.srem(n_blocks, c(2)), c(1))):
                one(k, builder.sub(n_blocks, c(1)), 0)
            for i in range(len(rows)):
                total = builder.fadd(*(builder.load(a) for a in accs[i]), flags=_KEEP)
                if k in (Q4_1, Q5_1):
                    total = builder.fadd(total, builder.fadd(*(builder.load(m) for m in mins[i]), flags=_KEEP),
                                         flags=_KEEP)
                builder.store(total, result[i])
    return [builder.load(v) for v in result]


@intrinsic(prefer_literal=True)
def row_dot8(typingctx, r, xq, xd, xs, xl, kind):
    """r . x for a quantized row r of a kind in INT8_KINDS and x as 8-bit blocks (quantize_act's xq, xd, xs, xl):
    per block the exact integer dot product (one int32), times (weight scale * x scale), summed block after block in
    two float32 (even and odd blocks, added at the end); q4_1 / q5_1 add min * s per block, summed apart the same
    way, to it last (row_dot8k's order but for the two sums; a prompt's tiles, q_tile_dot, have these bits)."""
    if not _rows_ok(r, types.uint8, xq, types.int8, xd, types.float32, xs, types.float32, xl, types.int32):
        return None

    def codegen(context, builder, sig, args):
        r, xq, xd, xs, xl, kind = _arrays(context, builder, sig, args)
        return _dot8_rows(context, builder, r, xq, xd, xs, xl, kind, xq.nitems, [ir.Constant(xq.nitems.type, 0)])[0]
    return types.float32(r, xq, xd, xs, xl, kind), codegen


# Rows of x per call of rows_dot8: each weight block is decoded once for this many rows of x (a prompt's)
DOT8_ROWS = 8     # twice the 4 it was: a prompt's tiles 1.2-1.4x faster (q4_k, q6_k), 12 or 16 were slower


@intrinsic(prefer_literal=True)
def rows_dot8(typingctx, r, xq, xd, xs, xl, n, t0, out, kind):
    """out[i] = row_dot8 of r with row t0 + i of x, for i < DOT8_ROWS, bit for bit: x's 8-bit blocks as quantize_act
    fills them row after row (xq, xd, xs, xl: act8_buffers' parts of T rows, flattened; n: x's values per row)."""
    if not _rows_ok(r, types.uint8, xq, types.int8, xd, types.float32, xs, types.float32, xl, types.int32, out,
                    types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, xq, xd, xs, xl, n, t0, out, kind = _arrays(context, builder, sig, args)
        n, t0 = (builder.sext(v, _I64) if v.type.width < 64 else v for v in (n, t0))
        rows = [builder.add(t0, ir.Constant(_I64, i)) for i in range(DOT8_ROWS)]
        for i, v in enumerate(_dot8_rows(context, builder, r, xq, xd, xs, xl, kind, n, rows)):
            builder.store(v, builder.gep(out.data, [ir.Constant(_I64, i)]))
        return context.get_dummy_value()
    return types.none(r, xq, xd, xs, xl, n, t0, out, kind), codegen


def _k_values(builder, kind, ptr, o, s):
    """<32 x i8>: sub-block s (weights 32s .. 32s + 31) of the K-quant block at byte ptr[o] as unsigned values (q6_k:
    q + 32)."""
    at = lambda k: builder.add(o, ir.Constant(o.type, k))  # noqa: E731
    if kind in (Q4_K, Q5_K):
        u = _bits(builder, ptr, at((16 if kind == Q4_K else 48) + (s >> 1) * 32), 4 * (s & 1), 0x0F)
        if kind == Q5_K:   # bit s of each qh byte, moved to bit 4
            qh = _load_vec(builder, ptr, _I8, BLOCK, at(16))
            qh = builder.shl(qh, _vec(builder, _I8, 4 - s)) if s <= 4 else builder.lshr(qh, _vec(builder, _I8, s - 4))
            u = builder.or_(u, builder.and_(qh, _vec(builder, _I8, 16)))
        return u
    h, r = s >> 2, s & 3
    lo = _bits(builder, ptr, at(h * 64 + (r & 1) * 32), 4 * (r >> 1), 0x0F)
    hi = _bits(builder, ptr, at(128 + h * 32), 2 * r, 3)
    return builder.or_(lo, builder.shl(hi, _vec(builder, _I8, 4)))


def _k_scales(builder, kind, ptr, o):
    """A K-quant block's scales, decoded once per block as <16 x i16>: q4_k / q5_k the 8 6-bit scales, then the 8
    mins (llama.cpp's get_scale_min_k4, all 8 at once); q6_k its 16 int8 scales, one per 16 weights."""
    at = lambda k: builder.add(o, ir.Constant(o.type, k))  # noqa: E731
    v16 = ir.VectorType(_I16, 16)
    if kind == Q6_K:
        return builder.sext(_load_vec(builder, ptr, _I8, 16, at(192)), v16)
    b = _load_vec(builder, ptr, _I8, 16, at(4))  # lane k: byte 4 + k (lanes 12-15 are the next field's, unused)
    v = lambda x: _vec(builder, _I8, x, 16)  # noqa: E731
    pick = lambda p, q, lanes: builder.shuffle_vector(p, q, ir.Constant(ir.VectorType(_I32, 16), lanes))  # noqa
    # scale s < 4: b[s] & 63; s >= 4: b[s + 4] & 15 | top bits; min s < 4: b[s + 4] & 63; s >= 4: b[s + 4] >> 4 | top
    low = pick(builder.and_(b, v(63)), builder.and_(b, v(15)), [0, 1, 2, 3, 24, 25, 26, 27, 4, 5, 6, 7, 0, 0, 0, 0])
    low = pick(low, builder.lshr(b, v(4)), list(range(12)) + [24, 25, 26, 27])
    # their bits 4-5 for s >= 4: (b[s - 4] >> 2) & 0x30 (scale), (b[s] >> 2) & 0x30 (min)
    top = pick(builder.and_(builder.lshr(b, v(2)), v(0x30)), v(0), [16] * 4 + [0, 1, 2, 3] + [16] * 4 + [4, 5, 6, 7])
    return builder.zext(builder.or_(low, top), v16)


def _scaled_lanes(builder, acc, u, xv, sv):
    """acc + (<8 x i32>: lane l = the sum of u[k] * xv[k], k = 4l .. 4l + 3, times scale sv[2l] = sv[2l + 1]), exact:
    u unsigned <32 x i8> below 64, xv signed <32 x i8> in [-127, 127] (so vpmaddubsw's 16-bit pair sums, at most
    2 * 63 * 127, do not saturate), sv <16 x i16>. vpmaddubsw then vpdpwssd (AVX512-VNNI) or vpmaddwd and an add; on
    other hosts the same integers from _lanes_of."""
    v8, v16 = ir.VectorType(_I32, LANES), ir.VectorType(_I16, 16)
    fn = lambda name, ty, args: builder.call(cgutils.get_or_insert_function(  # noqa: E731
        builder.module, ir.FunctionType(ty, [a.type for a in args]), name), args)
    if not HAS_AVX2:
        s32 = builder.sext(builder.shuffle_vector(sv, sv, ir.Constant(v8, list(range(0, 16, 2)))), v8)
        return builder.add(acc, builder.mul(_lanes_of(builder, u, xv), s32))
    pairs = fn("llvm.x86.avx2.pmadd.ub.sw", v16, [u, xv])
    if HAS_VNNI:
        return fn("llvm.x86.avx512.vpdpwssd.256", v8, [acc, builder.bitcast(pairs, v8), builder.bitcast(sv, v8)])
    return builder.add(acc, fn("llvm.x86.avx2.pmadd.wd", v8, [pairs, sv]))


def _paired_lanes(builder, acc, us, xvs, sv):
    """_scaled_lanes of two sub-blocks at once, the same integers with 3 multiplying instructions where it takes 4:
    acc + (<8 x i32>: lane l = the sum over h of sv[2l + h] times (us[h] . xvs[h] over bytes 4l .. 4l + 3)), exact.
    Each sub-block's 4-byte sums by vpdpbusd; as |u| < 64 and |x| <= 127 they fit 16 bits (4 * 63 * 127 < 2^15), so
    the two go into one lane's halves and one vpdpwssd multiplies them by their scales and adds them (AVX512-VNNI;
    llama.cpp takes vpmaddubsw and vpmaddwd per sub-block, as _scaled_lanes)."""
    v8 = ir.VectorType(_I32, LANES)
    zero = ir.Constant(v8, [ir.Constant(_I32, 0)] * LANES)
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]),
                                         "llvm.x86.avx512.vpdpbusd.256")
    lo, hi = (builder.call(dot, [zero, builder.bitcast(u, v8), builder.bitcast(x, v8)]) for u, x in zip(us, xvs))
    halves = builder.and_(lo, _vec(builder, _I32, 0xFFFF, LANES)), builder.shl(hi, _vec(builder, _I32, 16, LANES))
    pair = builder.or_(*halves)
    madd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]),
                                          "llvm.x86.avx512.vpdpwssd.256")
    return builder.call(madd, [acc, pair, builder.bitcast(sv, v8)])


def _k_low(builder, kind, scales, kb, at, unsummed=False):
    """The integer sum over a K-quant block's 16 groups of 16 weights of x's sum of the group (kb[at + g]) times the
    group's multiplier (_k_scales' lanes): q6_k its scale g, q4_k / q5_k the min of its sub-block g // 2. Exact.
    unsummed (AVX2 hosts): the <8 x i32> whose lanes sum to it."""
    of = [g if kind == Q6_K else 8 + g // 2 for g in range(16)]     # the lane of scales multiplying sum g
    if HAS_AVX2:   # |a sum| <= 16 * 127, so its low 16 bits are it: vpmaddwd of (low, high) halves by (multiplier, 0)
        zero = ir.Constant(scales.type, [ir.Constant(_I16, 0)] * 16)
        lanes = [[v for g in of[8 * h:8 * h + 8] for v in (g, 16)] for h in (0, 1)]   # (multiplier, 0) per sum
        prods = [_madd(builder, _load_vec(builder, kb.data, _I16, 16, builder.add(at, ir.Constant(at.type, 8 * h))),
                       builder.shuffle_vector(scales, zero, ir.Constant(ir.VectorType(_I32, 16), lanes[h])))
                 for h in (0, 1)]    # sums 8h .. 8h + 7
        prods = builder.add(*prods)
        return prods if unsummed else _sum_lanes(builder, prods)
    v32 = ir.VectorType(_I32, 16)
    mult = builder.sext(builder.shuffle_vector(scales, scales, ir.Constant(v32, of)), v32)
    return _sum_lanes(builder, builder.mul(mult, _load_vec(builder, kb.data, _I32, 16, at)))


def _madd(builder, a, b):
    """vpmaddwd: <8 x i32> of a[2l] * b[2l] + a[2l + 1] * b[2l + 1] (a, b <16 x i16>)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VectorType(_I32, LANES), [a.type, b.type]),
                                        "llvm.x86.avx2.pmadd.wd")
    return builder.call(fn, [a, b])


def _sum_lanes(builder, v):
    """The sum of an integer vector's lanes (exact: any order)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v.type.element, [v.type]),
                                        f"llvm.vector.reduce.add.v{v.type.count}i{v.type.element.width}")
    return builder.call(fn, [v])


def _row_sums(builder, vs):
    """<8 x i32>: lane i the sum of the lanes of vs[i] (8 vectors <8 x i32>), by three levels of pairwise shuffles and
    adds: 21 operations where 8 reductions take about 40. Integers: exact in any order."""
    v = lambda *idx: ir.Constant(ir.VectorType(_I32, LANES), list(idx))  # noqa: E731
    levels = [(v(0, 8, 2, 10, 4, 12, 6, 14), v(1, 9, 3, 11, 5, 13, 7, 15)),     # rows' lanes 2k and 2k + 1
              (v(0, 1, 8, 9, 4, 5, 12, 13), v(2, 3, 10, 11, 6, 7, 14, 15)),     # then 4k .. 4k + 3
              (v(0, 1, 2, 3, 8, 9, 10, 11), v(4, 5, 6, 7, 12, 13, 14, 15))]     # then all 8
    for lo, hi in levels:
        vs = [builder.add(builder.shuffle_vector(a, b, lo), builder.shuffle_vector(a, b, hi))
              for a, b in zip(vs[::2], vs[1::2])]
    return vs[0]


def _k_block_terms(builder, k, sums, low, wd, dmin, xd):
    """A K-quant block's (term, mins' term) from its integers (sums: scale * code * x; low: _k_low's), scalars or
    lanes alike: term = float(sums) * (d * x's d); q6_k's mins (d * x's d) * float(32 * low) (its codes carry 32),
    q4_k / q5_k's (dmin * x's d) * float(low)."""
    d = builder.fmul(wd, xd, flags=_KEEP)
    ty = d.type
    term = builder.fmul(builder.sitofp(sums, ty), d, flags=_KEEP)
    if k == Q6_K:
        thirty_two = ir.Constant(low.type, 32) if not isinstance(low.type, ir.VectorType) else \
            _vec(builder, _I32, 32, low.type.count)
        return term, builder.fmul(d, builder.sitofp(builder.mul(low, thirty_two), ty), flags=_KEEP)
    return term, builder.fmul(builder.fmul(dmin, xd, flags=_KEEP), builder.sitofp(low, ty), flags=_KEEP)


def _dot8k_rows(context, builder, r, kq, kd, kb, kind, n, rows):
    """The float32 results of row_dot8k of K-quant row r with each of `rows` rows of x as q8_K blocks (row i's values
    at kq[rows[i] * n], its scales at kd[rows[i] * n // 256], its sums at kb[rows[i] * n // 16]; n: x's length): each
    weight block's scales and sub-blocks decoded once for all of them, each row summed by exactly the operations
    row_dot8k performs alone, so a row's bits do not depend on how many rows share the call (as _dot8_rows)."""
    vf, vi = ir.VectorType(_F32, LANES), ir.VectorType(_I32, LANES)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in rows]
    mins = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in rows]
    # 8 rows (a prompt's tile): each block's per-row scalars (x's scale, d, the mins' integer and term) side by side,
    # lane i row i, by the same float32 operations lane by lane: the same bits, a fifth of a block's operations less
    across = len(rows) == LANES and HAS_AVX2
    # fewer rows (a decode GEMV's one): a block's integer lanes (and the mins') wait in a group of GROUP blocks, summed
    # by one transpose (_row_sums) and scaled lane by lane, then added block after block (as _dot8_rows)
    grouped = not across and HAS_AVX2
    held = [[cgutils.alloca_once(builder, vi, size=GROUP) for _ in range(2)] for _ in rows]   # sums', mins' lanes
    wds, dmins = (cgutils.alloca_once(builder, _F32, size=GROUP) for _ in range(2))
    fvec = lambda arr, i: builder.load(builder.bitcast(builder.gep(arr, [i]), vf.as_pointer()), align=4)  # noqa

    def held_f(arr):    # a group's floats, one load each (one vector load of 8 separate stores would wait on them)
        v = ir.Constant(vf, ir.Undefined)
        for g in range(GROUP):
            v = builder.insert_element(v, builder.load(builder.gep(arr, [c(g)])), ir.Constant(_I32, g))
        return v
    paired = len(rows) > 1 and HAS_VNNI       # a prompt's tiles: _paired_lanes (the decode path's row as it was)
    mins_v = cgutils.alloca_once_value(builder, ir.Constant(vf, [ir.Constant(_F32, 0.0)] * LANES))
    accs_v = cgutils.alloca_once_value(builder, ir.Constant(vf, [ir.Constant(_F32, 0.0)] * LANES))
    n_blocks = builder.sdiv(n, ir.Constant(n.type, SUPER))
    c = lambda v: ir.Constant(n_blocks.type, v)  # noqa: E731
    pick = lambda p, lanes: builder.shuffle_vector(p, p, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))  # noqa
    at = [(builder.mul(t, n), builder.mul(t, n_blocks), builder.mul(t, builder.mul(n_blocks, c(SUPER // 16))))
          for t in rows]                                                  # each row's start in kq, kd and kb
    for k in _emitted(kind, K_KINDS):
        with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, k))):
            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                o = builder.mul(b, c(_GEOMETRY[k][1]))
                scales = _k_scales(builder, k, r.data, o)
                lows = [_k_low(builder, k, scales, kb, builder.add(s0, builder.mul(b, c(SUPER // 16))),
                               across or grouped) for _, _, s0 in at]
                # two chains a row to overlap latency where the rows are few (one alone: row_dot8k); integers, so
                # the same sums either way
                n_chains = 2 if len(rows) < DOT8_ROWS else 1
                chains = [[ir.Constant(vi, [ir.Constant(_I32, 0)] * LANES)] * n_chains for _ in rows]
                # lane l's scale in sub-block s (q6_k: lanes 0-3 its first 16 weights', 4-7 the next 16's)
                scale_of = (lambda s, lane: 2 * s + lane // 4) if k == Q6_K else (lambda s, lane: s)
                for s in range(0, SUPER // BLOCK, 2) if paired else ():
                    us = [_k_values(builder, k, r.data, o, s + h) for h in (0, 1)]
                    sv = pick(scales, [scale_of(s + h, lane) for lane in range(LANES) for h in (0, 1)])
                    for i, (q0, _, _) in enumerate(at):
                        xvs = [_load_vec(builder, kq.data, _I8, BLOCK, builder.add(
                            q0, builder.add(builder.mul(b, c(SUPER)), c(BLOCK * (s + h))))) for h in (0, 1)]
                        chains[i][0] = _paired_lanes(builder, chains[i][0], us, xvs, sv)
                for s in range(SUPER // BLOCK) if not paired else ():
                    u = _k_values(builder, k, r.data, o, s)
                    # q6_k: lanes 0-3 the first 16 weights (scale 2s), 4-7 the next 16 (2s + 1)
                    sv = pick(scales, [2 * s] * 8 + [2 * s + 1] * 8 if k == Q6_K else [s] * 16)
                    for i, (q0, _, _) in enumerate(at):
                        xv = _load_vec(builder, kq.data, _I8, BLOCK,
                                       builder.add(q0, builder.add(builder.mul(b, c(SUPER)), c(BLOCK * s))))
                        chains[i][s % n_chains] = _scaled_lanes(builder, chains[i][s % n_chains], u, xv, sv)
                if k == Q6_K:              # d alone, the block's last 2 bytes
                    wd = _half_at(context, builder, r.data, builder.add(o, c(208)))
                else:
                    wd, dmin = _half_pair_at(context, builder, r.data, o)
                if across:
                    xd = ir.Constant(vf, ir.Undefined)
                    for i, (_, d0, _) in enumerate(at):
                        xd = builder.insert_element(xd, builder.load(builder.gep(kd.data, [builder.add(d0, b)])),
                                                    ir.Constant(_I32, i))
                    d = builder.fmul(_vec(builder, _F32, wd, LANES), xd, flags=_KEEP)
                    if k == Q6_K:
                        low = builder.sitofp(builder.mul(_row_sums(builder, lows), _vec(builder, _I32, 32, LANES)), vf)
                        m = builder.fmul(d, low, flags=_KEEP)
                    else:
                        m = builder.fmul(builder.fmul(_vec(builder, _F32, dmin, LANES), xd, flags=_KEEP),
                                         builder.sitofp(_row_sums(builder, lows), vf), flags=_KEEP)
                    builder.store(builder.fadd(builder.load(mins_v), m, flags=_KEEP), mins_v)
                    sums = _row_sums(builder, [chains[i][0] if n_chains == 1 else builder.add(*chains[i])
                                               for i in range(LANES)])
                    term = builder.fmul(builder.sitofp(sums, vf), d, flags=_KEEP)
                    builder.store(builder.fadd(builder.load(accs_v), term, flags=_KEEP), accs_v)
                elif grouped:
                    j = builder.and_(b, c(GROUP - 1))
                    builder.store(wd, builder.gep(wds, [j]))
                    if k != Q6_K:
                        builder.store(dmin, builder.gep(dmins, [j]))
                    for i in range(len(rows)):
                        lanes = chains[i][0] if n_chains == 1 else builder.add(chains[i][0], chains[i][1])
                        builder.store(lanes, builder.gep(held[i][0], [j]))
                        builder.store(lows[i], builder.gep(held[i][1], [j]))
                    with builder.if_then(builder.icmp_signed("==", j, c(GROUP - 1))):
                        b0 = builder.sub(b, c(GROUP - 1))
                        for i, (_, d0, _) in enumerate(at):
                            sums, low = (_row_sums(builder, [builder.load(builder.gep(held[i][h], [c(g)]))
                                                             for g in range(GROUP)]) for h in (0, 1))
                            xd = fvec(kd.data, builder.add(d0, b0))
                            t, m = _k_block_terms(builder, k, sums, low, held_f(wds),
                                                  None if k == Q6_K else held_f(dmins), xd)
                            _add_in_order(builder, [accs[i]], t)
                            _add_in_order(builder, [mins[i]], m)
                else:
                    for i, (_, d0, _) in enumerate(at):
                        lanes = chains[i][0] if n_chains == 1 else builder.add(chains[i][0], chains[i][1])
                        xd = builder.load(builder.gep(kd.data, [builder.add(d0, b)]))
                        t, m = _k_block_terms(builder, k, _sum_lanes(builder, lanes), lows[i], wd, dmin, xd)
                        builder.store(builder.fadd(builder.load(accs[i]), t, flags=_KEEP), accs[i])
                        builder.store(builder.fadd(builder.load(mins[i]), m, flags=_KEEP), mins[i])
            if grouped:     # the last blocks, fewer than a group: alone, by the same operations
                rest = builder.and_(n_blocks, c(GROUP - 1))
                with cgutils.for_range(builder, rest) as loop:
                    j = loop.index
                    b = builder.add(builder.sub(n_blocks, rest), j)
                    wd = builder.load(builder.gep(wds, [j]))
                    dmin = None if k == Q6_K else builder.load(builder.gep(dmins, [j]))
                    for i, (_, d0, _) in enumerate(at):
                        xd = builder.load(builder.gep(kd.data, [builder.add(d0, b)]))
                        sums, low = (_sum_lanes(builder, builder.load(builder.gep(held[i][h], [j]))) for h in (0, 1))
                        t, m = _k_block_terms(builder, k, sums, low, wd, dmin, xd)
                        builder.store(builder.fadd(builder.load(accs[i]), t, flags=_KEEP), accs[i])
                        builder.store(builder.fadd(builder.load(mins[i]), m, flags=_KEEP), mins[i])
    lane = lambda v, i: builder.extract_element(builder.load(v), ir.Constant(_I32, i))  # noqa: E731
    if across:
        accs, mins = [lane(accs_v, i) for i in range(LANES)], [lane(mins_v, i) for i in range(LANES)]
    else:
        accs, mins = [builder.load(a) for a in accs], [builder.load(m) for m in mins]
    return [builder.fsub(a, m, flags=_KEEP) for a, m in zip(accs, mins)]


@intrinsic(prefer_literal=True)
def row_dot8k(typingctx, r, kq, kd, kb, kind):
    """r . x for a K-quant row r (q4_k, q5_k, q6_k) and x as q8_K blocks (quantize_act_k's kq, kd, kb): per block of
    256 the exact integer sum over its sub-blocks of scale * (the sub-block's products), one int32, times (d * x's
    scale), summed block after block in one float32 (llama.cpp's tiled prompt GEMM's order: k_tile_dot's, so a
    prompt's rows have these bits); the mins (q4_k, q5_k: dmin * m * x's sums) and
    q6_k's offset (32 * scale * x's sums) are integers per block too, scaled and summed apart. The scales are decoded
    once per block (_k_scales) and the mins' integer is one vector product with x's sums (as llama.cpp's
    ggml_vec_dot_q4_K_q8_K)."""
    if not _rows_ok(r, types.uint8, kq, types.int8, kd, types.float32, kb, types.int32):
        return None

    def codegen(context, builder, sig, args):
        r, kq, kd, kb, kind = _arrays(context, builder, sig, args)
        return _dot8k_rows(context, builder, r, kq, kd, kb, kind, kq.nitems, [ir.Constant(kq.nitems.type, 0)])[0]
    return types.float32(r, kq, kd, kb, kind), codegen


@intrinsic(prefer_literal=True)
def rows_dot8k(typingctx, r, kq, kd, kb, n, t0, out, kind):
    """out[i] = row_dot8k of r with row t0 + i of x, for i < DOT8_ROWS, bit for bit (rows_dot8's counterpart: kq, kd,
    kb act8_buffers' q8_K parts of T rows, flattened; n: x's values per row)."""
    if not _rows_ok(r, types.uint8, kq, types.int8, kd, types.float32, kb, types.int32, out, types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, kq, kd, kb, n, t0, out, kind = _arrays(context, builder, sig, args)
        n, t0 = (builder.sext(v, _I64) if v.type.width < 64 else v for v in (n, t0))
        rows = [builder.add(t0, ir.Constant(_I64, i)) for i in range(DOT8_ROWS)]
        for i, v in enumerate(_dot8k_rows(context, builder, r, kq, kd, kb, kind, n, rows)):
            builder.store(v, builder.gep(out.data, [ir.Constant(_I64, i)]))
        return context.get_dummy_value()
    return types.none(r, kq, kd, kb, n, t0, out, kind), codegen


# A prompt's K-quant tiles: TILE_LANES weight rows side by side, weight row i in lane i of <16 x i32> (unpacked once
# per tile, k_unpack), x's 4 bytes broadcast, K_TILE_X rows of x per weight load (llama.cpp's tiled GEMM layout).
# Each 32-weight sub-block's products (q6_k: each 16 weights', one scale each) are summed as integers by vpdpbusd
# first, then scaled once: per block the same exact integer row_dot8k sums, so each (row of x, weight row) gets
# row_dot8k's bits (the float32 operations on it are the same, lane by lane).
TILE_LANES = 16
K_TILE_X = 4
K_TILES = HAS_VNNI and HAS_AVX512      # its instructions (elsewhere quant_tile takes rows_dot8k: the same bits)
# the unpacked tile, per block of 256 weights, int32 words: the codes (8 sub-blocks x 8 runs of 4 bytes x 16 lanes),
# the scales (16 groups x 16 lanes: q4_k / q5_k 8 sub-blocks', q6_k 16 groups'), the pairs of x's group sums'
# multipliers (8 pairs x 16 lanes: two int16 halves); float32: d and dmin (16 lanes each)
_TILE_CODES, _TILE_SCALES, _TILE_MINS = 64 * TILE_LANES, 16 * TILE_LANES, 8 * TILE_LANES


@njit(cache=True, nogil=True)
def k_tile_buffers(d):
    """Zeroed tile buffers for rows of d weights (k_unpack's W, SC, MN, WF)."""
    nb = d // SUPER
    return (np.zeros(nb * _TILE_CODES, np.int32), np.zeros(nb * _TILE_SCALES, np.int32),
            np.zeros(nb * _TILE_MINS, np.int32), np.zeros(nb * 2 * TILE_LANES, np.float32))


def _lane_writer(builder, lane):
    """An unpack's two helpers: c(v), an int64 constant, and put(arr, at, v), arr[at + lane] = v."""
    lane = builder.sext(lane, _I64) if lane.type.width < 64 else lane

    def put(arr, at, v):
        builder.store(v, builder.gep(arr.data, [builder.add(at, lane)]))
    return (lambda v: ir.Constant(_I64, v)), put


@intrinsic(prefer_literal=True)
def k_unpack(typingctx, r, W, SC, MN, WF, lane, kind):
    """Weight row r (a K-quant row) into lane `lane` of the tile buffers (k_tile_buffers: W codes, SC scales, MN the
    multipliers of x's group sums, WF d and dmin): _k_values, _k_scales and the float16 fields, the same numbers
    row_dot8k reads."""
    if not _rows_ok(r, types.uint8, W, types.int32, SC, types.int32, MN, types.int32, WF, types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, W, SC, MN, WF, lane, kind = _arrays(context, builder, sig, args)
        c, put = _lane_writer(builder, lane)
        v8 = ir.VectorType(_I32, LANES)
        for k in _emitted(kind, K_KINDS):
            with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, k))):
                n_blocks = builder.udiv(r.nitems, c(_GEOMETRY[k][1]))
                with cgutils.for_range(builder, n_blocks) as loop:
                    b = loop.index
                    o = builder.mul(b, c(_GEOMETRY[k][1]))
                    for s in range(SUPER // BLOCK):
                        words = builder.bitcast(_k_values(builder, k, r.data, o, s), v8)
                        for i in range(LANES):
                            at = builder.add(builder.mul(b, c(_TILE_CODES)), c((s * LANES + i) * TILE_LANES))
                            put(W, at, builder.extract_element(words, ir.Constant(_I32, i)))
                    scales = _k_scales(builder, k, r.data, o)
                    half = lambda g: builder.extract_element(scales, ir.Constant(_I32, g))  # noqa: E731
                    for g in range(16 if k == Q6_K else 8):
                        v = builder.sext(half(g), _I32) if k == Q6_K else builder.zext(half(g), _I32)
                        put(SC, builder.add(builder.mul(b, c(_TILE_SCALES)), c(g * TILE_LANES)), v)
                    for p in range(8):     # group sums 2p and 2p + 1's multipliers (_k_low's)
                        lo, hi = (half(2 * p), half(2 * p + 1)) if k == Q6_K else (half(8 + p), half(8 + p))
                        v = builder.or_(builder.zext(lo, _I32),
                                        builder.shl(builder.zext(hi, _I32), ir.Constant(_I32, 16)))
                        put(MN, builder.add(builder.mul(b, c(_TILE_MINS)), c(p * TILE_LANES)), v)
                    if k == Q6_K:
                        wd, dmin = _half_at(context, builder, r.data, builder.add(o, c(208))), ir.Constant(_F32, 0.0)
                    else:
                        wd, dmin = _half_pair_at(context, builder, r.data, o)
                    at = builder.mul(b, c(2 * TILE_LANES))
                    put(WF, at, wd)
                    put(WF, builder.add(at, c(TILE_LANES)), dmin)
        return context.get_dummy_value()
    return types.none(r, W, SC, MN, WF, lane, kind), codegen


@intrinsic(prefer_literal=True)
def k_tile_dot(typingctx, W, SC, MN, WF, kq, kd, kb, n, t0, out, kind):
    """out[16i + j] = row_dot8k of the tile's weight row j (k_unpack'd) with row t0 + i of x, i < K_TILE_X, bit for
    bit (kq, kd, kb: act8_buffers' q8_K parts of T rows, flattened; n: x's values per row)."""
    if not _rows_ok(W, types.int32, SC, types.int32, MN, types.int32, WF, types.float32, kq, types.int8,
                    kd, types.float32, kb, types.int32, out, types.float32):
        return None

    def codegen(context, builder, sig, args):
        W, SC, MN, WF, kq, kd, kb, n, t0, out, kind = _arrays(context, builder, sig, args)
        if not K_TILES:      # never called there (quant_tile), and its instructions would not compile
            return context.get_dummy_value()
        n, t0 = (builder.sext(v, _I64) if v.type.width < 64 else v for v in (n, t0))
        vi, vf = ir.VectorType(_I32, TILE_LANES), ir.VectorType(_F32, TILE_LANES)
        zi, zf = _vec(builder, _I32, 0, TILE_LANES), _vec(builder, _F32, 0.0, TILE_LANES)
        c = lambda v: ir.Constant(_I64, v)  # noqa: E731
        fn = lambda name: cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi, [vi] * 3), name)  # noqa
        dpbusd, dpwssd = fn("llvm.x86.avx512.vpdpbusd.512"), fn("llvm.x86.avx512.vpdpwssd.512")
        vload = lambda arr, at, t=vi: builder.load(builder.bitcast(  # noqa: E731
            builder.gep(arr.data, [at]), t.as_pointer()), align=4)
        fload = lambda arr, at: vload(arr, at, vf)  # noqa: E731
        xword = lambda at: builder.load(builder.bitcast(builder.gep(kq.data, [at]), _I32.as_pointer()), align=1)  # noqa
        n_blocks = builder.sdiv(n, c(SUPER))
        rows = [builder.add(t0, c(i)) for i in range(K_TILE_X)]
        accs = [cgutils.alloca_once_value(builder, zf) for _ in rows]
        mins = [cgutils.alloca_once_value(builder, zf) for _ in rows]
        for k in _emitted(kind, K_KINDS):
            run = 4 if k == Q6_K else LANES        # runs of 4 weights under one scale
            with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, k))):
                with cgutils.for_range(builder, n_blocks) as loop:
                    b = loop.index
                    q0 = [builder.add(builder.mul(t, n), builder.mul(b, c(SUPER))) for t in rows]
                    tot = [zi] * K_TILE_X
                    for g in range(SUPER // (4 * run)):
                        part = [zi] * K_TILE_X
                        for i in range(run):
                            w = vload(W, builder.add(builder.mul(b, c(_TILE_CODES)), c((g * run + i) * TILE_LANES)))
                            for x in range(K_TILE_X):
                                xv = _vec(builder, _I32, xword(builder.add(q0[x], c(4 * (g * run + i)))), TILE_LANES)
                                part[x] = builder.call(dpbusd, [part[x], w, xv])
                        sc = vload(SC, builder.add(builder.mul(b, c(_TILE_SCALES)), c(g * TILE_LANES)))
                        tot = [builder.add(t, builder.mul(p, sc)) for t, p in zip(tot, part)]
                    wd = fload(WF, builder.mul(b, c(2 * TILE_LANES)))
                    dmin = fload(WF, builder.add(builder.mul(b, c(2 * TILE_LANES)), c(TILE_LANES)))
                    for x, t in enumerate(rows):
                        xd = _vec(builder, _F32, builder.load(builder.gep(kd.data, [builder.add(
                            builder.mul(t, n_blocks), b)])), TILE_LANES)
                        d = builder.fmul(wd, xd, flags=_KEEP)
                        term = builder.fmul(builder.sitofp(tot[x], vf), d, flags=_KEEP)
                        builder.store(builder.fadd(builder.load(accs[x]), term, flags=_KEEP), accs[x])
                        at = builder.add(builder.mul(t, builder.mul(n_blocks, c(16))), builder.mul(b, c(16)))
                        low = zi
                        for p in range(8):     # x's group sums 2p, 2p + 1 (|sum| <= 16 * 127) as int16 halves
                            s0, s1 = (builder.load(builder.gep(kb.data, [builder.add(at, c(2 * p + h))]))
                                      for h in (0, 1))
                            pair = builder.or_(builder.and_(s0, ir.Constant(_I32, 0xFFFF)),
                                               builder.shl(s1, ir.Constant(_I32, 16)))
                            low = builder.call(dpwssd, [low, vload(MN, builder.add(builder.mul(b, c(_TILE_MINS)),
                                                                                   c(p * TILE_LANES))),
                                                        _vec(builder, _I32, pair, TILE_LANES)])
                        if k == Q6_K:
                            m = builder.fmul(d, builder.sitofp(builder.mul(low, _vec(builder, _I32, 32, TILE_LANES)),
                                                               vf), flags=_KEEP)
                        else:
                            m = builder.fmul(builder.fmul(dmin, xd, flags=_KEEP), builder.sitofp(low, vf), flags=_KEEP)
                        builder.store(builder.fadd(builder.load(mins[x]), m, flags=_KEEP), mins[x])
        for x in range(K_TILE_X):
            res = builder.fsub(builder.load(accs[x]), builder.load(mins[x]), flags=_KEEP)
            builder.store(res, builder.bitcast(builder.gep(out.data, [c(TILE_LANES * x)]), vf.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(W, SC, MN, WF, kq, kd, kb, n, t0, out, kind), codegen


# A prompt's 32-weight tiles (q8_0, q4_0, q4_1, q5_0, q5_1), the K-quant tiles' layout: TILE_LANES weight rows side by
# side, per block 8 words of 4 unsigned values (_unsigned_values) and the float32 d and m, unpacked once per tile
# (q_unpack); x's 4 bytes broadcast, K_TILE_X rows of x per weight load. A block's 8 vpdpbusd give each lane the
# block's exact integer (less offset * x's block sum where the values carry an offset), then row_dot8's float32
# operations lane by lane: each (row of x, weight row) gets row_dot8's bits.
_Q_TILE_CODES = LANES * TILE_LANES    # int32 words per block: 8 runs of 4 values x 16 lanes


@njit(cache=True, nogil=True)
def q_tile_buffers(d):
    """Zeroed tile buffers for rows of d weights of a 32-weight kind (q_unpack's W, WF)."""
    nb = d // BLOCK
    return np.zeros(nb * _Q_TILE_CODES, np.int32), np.zeros(nb * 2 * TILE_LANES, np.float32)


@intrinsic(prefer_literal=True)
def q_unpack(typingctx, r, W, WF, lane, kind):
    """Weight row r (a kind in INT8_KINDS) into lane `lane` of the tile buffers (q_tile_buffers: W the values, WF d
    and m): the numbers row_dot8 reads."""
    if not _rows_ok(r, types.uint8, W, types.int32, WF, types.float32):
        return None

    def codegen(context, builder, sig, args):
        r, W, WF, lane, kind = _arrays(context, builder, sig, args)
        c, put = _lane_writer(builder, lane)
        v8 = ir.VectorType(_I32, LANES)
        for k in _emitted(kind, INT8_KINDS):
            with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, k))):
                with cgutils.for_range(builder, builder.udiv(r.nitems, c(_GEOMETRY[k][1]))) as loop:
                    b = loop.index
                    o = builder.mul(b, c(_GEOMETRY[k][1]))
                    words = builder.bitcast(_unsigned_values(builder, k, r.data, o), v8)
                    for i in range(LANES):
                        put(W, builder.add(builder.mul(b, c(_Q_TILE_CODES)), c(i * TILE_LANES)),
                            builder.extract_element(words, ir.Constant(_I32, i)))
                    if k in (Q4_1, Q5_1):
                        wd, wm = _half_pair_at(context, builder, r.data, o)
                    else:
                        wd, wm = _half_at(context, builder, r.data, o), ir.Constant(_F32, 0.0)
                    at = builder.mul(b, c(2 * TILE_LANES))
                    put(WF, at, wd)
                    put(WF, builder.add(at, c(TILE_LANES)), wm)
        return context.get_dummy_value()
    return types.none(r, W, WF, lane, kind), codegen


@intrinsic(prefer_literal=True)
def q_tile_dot(typingctx, W, WF, xq, xd, xs, xl, n, t0, out, kind):
    """out[16i + j] = row_dot8 of the tile's weight row j (q_unpack'd) with row t0 + i of x, i < K_TILE_X, bit for
    bit (xq, xd, xs, xl: act8_buffers' 32-weight parts of T rows, flattened; n: x's values per row)."""
    if not _rows_ok(W, types.int32, WF, types.float32, xq, types.int8, xd, types.float32, xs, types.float32,
                    xl, types.int32, out, types.float32):
        return None

    def codegen(context, builder, sig, args):
        W, WF, xq, xd, xs, xl, n, t0, out, kind = _arrays(context, builder, sig, args)
        if not K_TILES:      # never called there (quant_tile), and its instructions would not compile
            return context.get_dummy_value()
        n, t0 = (builder.sext(v, _I64) if v.type.width < 64 else v for v in (n, t0))
        vi, vf = ir.VectorType(_I32, TILE_LANES), ir.VectorType(_F32, TILE_LANES)
        zi, zf = _vec(builder, _I32, 0, TILE_LANES), _vec(builder, _F32, 0.0, TILE_LANES)
        c = lambda v: ir.Constant(_I64, v)  # noqa: E731
        dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi, [vi] * 3),
                                                "llvm.x86.avx512.vpdpbusd.512")
        vload = lambda arr, at, t=vi: builder.load(builder.bitcast(  # noqa: E731
            builder.gep(arr.data, [at]), t.as_pointer()), align=4)
        xword = lambda at: builder.load(builder.bitcast(builder.gep(xq.data, [at]), _I32.as_pointer()), align=1)  # noqa
        splat = lambda arr, at: _vec(builder, _F32, builder.load(builder.gep(arr.data, [at])), TILE_LANES)  # noqa
        n_blocks = builder.sdiv(n, c(BLOCK))
        rows = [builder.add(t0, c(i)) for i in range(K_TILE_X)]
        accs = [[cgutils.alloca_once_value(builder, zf) for _ in range(CHAINS)] for _ in rows]   # even, odd blocks
        mins = [[cgutils.alloca_once_value(builder, zf) for _ in range(CHAINS)] for _ in rows]

        def block(k, b, h):         # block b into chain h of each row of x
            q0 = [builder.add(builder.mul(t, n), builder.mul(b, c(BLOCK))) for t in rows]
            tot = [zi] * K_TILE_X
            for i in range(LANES):
                w = vload(W, builder.add(builder.mul(b, c(_Q_TILE_CODES)), c(i * TILE_LANES)))
                for x in range(K_TILE_X):
                    xv = _vec(builder, _I32, xword(builder.add(q0[x], c(4 * i))), TILE_LANES)
                    tot[x] = builder.call(dpbusd, [tot[x], w, xv])
            wd = vload(WF, builder.mul(b, c(2 * TILE_LANES)), vf)
            wm = vload(WF, builder.add(builder.mul(b, c(2 * TILE_LANES)), c(TILE_LANES)), vf)
            for x, t in enumerate(rows):
                at = builder.add(builder.mul(t, n_blocks), b)
                if k in _OFFSET_SHIFT:     # offset * x's block sum (its 8 lane sums), taken off in integers
                    xsum = _sum_lanes(builder, _load_vec(builder, xl.data, _I32, LANES,
                                                         builder.mul(at, c(LANES))))
                    xsum = builder.shl(xsum, ir.Constant(_I32, _OFFSET_SHIFT[k]))
                    tot[x] = builder.sub(tot[x], _vec(builder, _I32, xsum, TILE_LANES))
                d = builder.fmul(wd, splat(xd, at), flags=_KEEP)
                term = builder.fmul(builder.sitofp(tot[x], vf), d, flags=_KEEP)
                builder.store(builder.fadd(builder.load(accs[x][h]), term, flags=_KEEP), accs[x][h])
                if k in (Q4_1, Q5_1):
                    m = builder.fmul(wm, splat(xs, at), flags=_KEEP)
                    builder.store(builder.fadd(builder.load(mins[x][h]), m, flags=_KEEP), mins[x][h])

        for k in _emitted(kind, INT8_KINDS):
            with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, k))):
                with cgutils.for_range(builder, builder.sdiv(n_blocks, c(2))) as loop:
                    block(k, builder.mul(loop.index, c(2)), 0)
                    block(k, builder.add(builder.mul(loop.index, c(2)), c(1)), 1)
                with builder.if_then(builder.icmp_signed("==", builder.srem(n_blocks, c(2)), c(1))):
                    block(k, builder.sub(n_blocks, c(1)), 0)
                for x in range(K_TILE_X):
                    res = builder.fadd(*(builder.load(a) for a in accs[x]), flags=_KEEP)
                    if k in (Q4_1, Q5_1):
                        res = builder.fadd(res, builder.fadd(*(builder.load(m) for m in mins[x]), flags=_KEEP),
                                           flags=_KEEP)
                    builder.store(res, builder.bitcast(builder.gep(out.data, [c(TILE_LANES * x)]),
                                                       vf.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(W, WF, xq, xd, xs, xl, n, t0, out, kind), codegen


@intrinsic(prefer_literal=True)
def act8_dot(typingctx, r, x, a, kind):
    """r . x (float32[n]) by 8-bit blocks a (a 1-D tuple: act8_row, act8_slice) where a holds the blocks kind dots
    with (row_dot8, row_dot8k), else row_dot on x. An intrinsic, not an inlined Numba function: a function's array
    arguments (x and a's 7) each cost an NRT incref and decref per call, as much per row as the dot product of a
    576-weight q4_0 row (bench/quant_kernels.py measures the kernels)."""
    if not (isinstance(a, types.BaseTuple) and len(a) == 7 and isinstance(kind, types.Integer)):
        return None
    dot8, dot8k, dot = (f._defn(typingctx, *args) for f, args in ((row_dot8, (r, *a.types[:4], kind)),
                                                                   (row_dot8k, (r, *a.types[4:], kind)),
                                                                   (row_dot, (r, x, kind))))
    if dot8 is None or dot8k is None or dot is None:
        return None

    def codegen(context, builder, sig, args):
        r, x, a, kind = args
        parts = [builder.extract_value(a, i) for i in range(7)]
        n8, nk = (context.make_array(sig.args[2].types[i])(context, builder, parts[i]).nitems for i in (0, 4))
        c = lambda v: ir.Constant(kind.type, v)  # noqa: E731
        zero = ir.Constant(n8.type, 0)
        out = cgutils.alloca_once(builder, _F32)
        with builder.if_else(builder.and_(builder.icmp_signed("<=", kind, c(Q5_1)),
                                          builder.icmp_signed("!=", n8, zero))) as (blocks32, other):
            with blocks32:
                builder.store(dot8[1](context, builder, dot8[0], [r, *parts[:4], kind]), out)
            with other:
                with builder.if_else(builder.and_(builder.icmp_signed(">=", kind, c(Q4_K)),
                                                  builder.icmp_signed("!=", nk, zero))) as (blocks256, floats):
                    with blocks256:
                        builder.store(dot8k[1](context, builder, dot8k[0], [r, *parts[4:], kind]), out)
                    with floats:
                        builder.store(dot[1](context, builder, dot[0], [r, x, kind]), out)
        return builder.load(out)
    return types.float32(r, x, a, kind), codegen


@njit(cache=True, nogil=True, inline="always")
def act_dot(r, x, a, t, kind):
    """r . x[t] with act8_buffers' a (filled): act8_dot on row t."""
    return act8_dot(r, x[t], act8_row(a, t), kind)


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
def quant_matmul_rows(Q, x, y, lo, hi, kind, a):
    """y[:, lo:hi] = x[T, d] @ dequant(Q[lo:hi])^T; with 8-bit activations a (act8_of) row_dot8's products."""
    T, d = x.shape
    rb = Q.shape[1]
    if T == 1:       # x's row and act8_row's 7 views of its blocks once, not per row
        x0, a0 = x[0], act8_row(a, 0)
        for j in range(lo, hi):
            prefetch_ahead(Q, j, 0, rb)
            y[0, j] = act8_dot(Q[j], x0, a0, kind)
        return
    if a[0].shape[1] != 0 or a[4].shape[1] != 0:  # each block straight into the dot product
        for j in range(lo, hi):
            prefetch_ahead(Q, j, 0, rb)
            for t in range(T):
                y[t, j] = act_dot(Q[j], x, a, t, kind)
        return
    w = np.empty(d, np.float32)  # a few tokens: each row decoded once, then its T dot products run from L1
    for j in range(lo, hi):
        prefetch_ahead(Q, j, 0, rb)
        row_dequant(Q[j], w, kind)
        for t in range(T):
            y[t, j] = dot(w, x[t], d)


@njit(cache=True, fastmath=True, nogil=True)
def quant_matmul_serial(Q, x, y, kind, a):
    """quant_matmul_rows over all rows, x first rounded into a (act8_buffers: empty, or to fill)."""
    quantize_act_rows(x, a)
    quant_matmul_rows(Q, x, y, 0, Q.shape[0], kind, a)


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def quant_matmul_kernel(Q, x, y, chunks, kind, a):
    """quant_matmul_serial's work, its rows split into `chunks` contiguous ranges run in parallel."""
    quantize_act_rows(x, a)
    n = Q.shape[0]
    for c in prange(chunks):
        quant_matmul_rows(Q, x, y, c * n // chunks, (c + 1) * n // chunks, kind, a)


# A prompt's rows (T > 1) with x in 8-bit blocks: a tile of QUANT_TILE_ROWS weight rows against x's rows DOT8_ROWS at a
# time (rows_dot8 / rows_dot8k: each weight block decoded once for them), the tiles in parallel. Every (row of x,
# weight row) gets the bits of row_dot8 / row_dot8k alone (the decode path's), whatever T, the tile or the thread
# count. It replaces widening the blocks to float32 for BLAS: a real 1.5B's prompt is 1.3G multiply-adds a token,
# where BLAS ran at 8-17 G a second a core and these integer products at 45-55 G (q4_k, q6_k; q5_0 30 G), measured
# one thread, alternating, in CPU time.
# The K-quants take k_tiles (llama.cpp's tiled GEMM layout, sub-block sums first: 1.5x the rows_dot8k tiles in a
# prototype, one thread, q4_k), whose order row_dot8k shares (bench/README.md).
QUANT_TILE_ROWS = 16     # weight rows a task: a 1536-column q4_k tile is 14 KB, in L1 while x's rows pass by


@njit(cache=True, nogil=True)
def quant_tile(Q, y, d, j0, j1, kind, a, out):
    """y[:, j0:j1] = x @ dequant(Q[j0:j1])^T for x [T, d] as its 8-bit blocks a (act8_of, filled; blocks for kind):
    DOT8_ROWS rows at a time, then the rest one at a time (row_dot8 / row_dot8k: the same operations per row); the
    tiles of weight rows in lanes (k_tiles, q_tiles) where the host has their instructions (the same bits)."""
    T = y.shape[0]
    full = T - T % DOT8_ROWS
    xq, xd, xs, xl = a[0].reshape(-1), a[1].reshape(-1), a[2].reshape(-1), a[3].reshape(-1)
    kq, kd, kb = a[4].reshape(-1), a[5].reshape(-1), a[6].reshape(-1)
    if K_TILES:
        if kind >= Q4_K:
            k_tiles(Q, y, d, j0, j1, kind, a)
        else:
            q_tiles(Q, y, d, j0, j1, kind, a)
        return
    for t0 in range(0, full, DOT8_ROWS):
        for j in range(j0, j1):
            if kind >= Q4_K:
                rows_dot8k(Q[j], kq, kd, kb, d, t0, out, kind)
            else:
                rows_dot8(Q[j], xq, xd, xs, xl, d, t0, out, kind)
            for i in range(DOT8_ROWS):
                y[t0 + i, j] = out[i]
    for t in range(full, T):
        for j in range(j0, j1):
            y[t, j] = (row_dot8k(Q[j], a[4][t], a[5][t], a[6][t], kind) if kind >= Q4_K else
                       row_dot8(Q[j], a[0][t], a[1][t], a[2][t], a[3][t], kind))


@njit(cache=True, nogil=True)
def k_tiles(Q, y, d, j0, j1, kind, a):
    """quant_tile's work for a K-quant Q: TILE_LANES weight rows at a time unpacked (k_unpack), then K_TILE_X rows of
    x at a time against them (k_tile_dot), the rest one at a time (row_dot8k): the same bits per (row, weight row)."""
    T = y.shape[0]
    full = T - T % K_TILE_X
    kq, kd, kb = a[4].reshape(-1), a[5].reshape(-1), a[6].reshape(-1)
    W, SC, MN, WF = k_tile_buffers(d)
    out = np.empty(K_TILE_X * TILE_LANES, np.float32)
    for l0 in range(j0, j1, TILE_LANES):
        m = min(TILE_LANES, j1 - l0)
        for i in range(m):
            k_unpack(Q[l0 + i], W, SC, MN, WF, i, kind)
        for t0 in range(0, full, K_TILE_X):
            k_tile_dot(W, SC, MN, WF, kq, kd, kb, d, t0, out, kind)
            for x in range(K_TILE_X):
                for i in range(m):
                    y[t0 + x, l0 + i] = out[TILE_LANES * x + i]
        for t in range(full, T):
            for i in range(m):
                y[t, l0 + i] = row_dot8k(Q[l0 + i], a[4][t], a[5][t], a[6][t], kind)


@njit(cache=True, nogil=True)
def q_tiles(Q, y, d, j0, j1, kind, a):
    """quant_tile's work for a 32-weight kind: k_tiles' loops over q_unpack and q_tile_dot (the same bits as
    row_dot8 per (row, weight row))."""
    T = y.shape[0]
    full = T - T % K_TILE_X
    xq, xd, xs, xl = a[0].reshape(-1), a[1].reshape(-1), a[2].reshape(-1), a[3].reshape(-1)
    W, WF = q_tile_buffers(d)
    out = np.empty(K_TILE_X * TILE_LANES, np.float32)
    for l0 in range(j0, j1, TILE_LANES):
        m = min(TILE_LANES, j1 - l0)
        for i in range(m):
            q_unpack(Q[l0 + i], W, WF, i, kind)
        for t0 in range(0, full, K_TILE_X):
            q_tile_dot(W, WF, xq, xd, xs, xl, d, t0, out, kind)
            for x in range(K_TILE_X):
                for i in range(m):
                    y[t0 + x, l0 + i] = out[TILE_LANES * x + i]
        for t in range(full, T):
            for i in range(m):
                y[t, l0 + i] = row_dot8(Q[l0 + i], a[0][t], a[1][t], a[2][t], a[3][t], kind)


@njit(cache=True, nogil=True, parallel=True)
def quant_tiles_kernel(Q, x, y, kind, a, tile):
    """y = x @ dequant(Q)^T by quant_tile over tiles of `tile` weight rows in parallel, x first rounded into a
    (act8_buffers with blocks for kind) a row per task."""
    for t in prange(x.shape[0]):
        quantize_act1(x[t], act8_row(a, t))
    n = Q.shape[0]
    for p in prange((n + tile - 1) // tile):
        quant_tile(Q, y, x.shape[1], p * tile, min(n, (p + 1) * tile), kind, a, np.empty(DOT8_ROWS, np.float32))


@njit(cache=True, nogil=True)
def quant_tiles_serial(Q, x, y, kind, a):
    """quant_tiles_kernel's work on this thread alone (the same bits)."""
    quantize_act_rows(x, a)
    quant_tile(Q, y, x.shape[1], 0, Q.shape[0], kind, a, np.empty(DOT8_ROWS, np.float32))


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
    a = act8_buffers(T, d, kind)
    if T > 1 and a[0 if k.code in INT8_KINDS else 4].shape[1]:       # x in 8-bit blocks: the prompt's tiles
        if numba_threads() > 1 and T * n * d >= parallel_min_work:
            quant_tiles_kernel(q, x, y, k.code, a, QUANT_TILE_ROWS)
        else:
            quant_tiles_serial(q, x, y, k.code, a)
    elif T <= row_kernel_max_t:
        threads = numba_threads()
        if threads > 1 and T * n * d >= parallel_min_work:
            quant_matmul_kernel(q, x, y, threads, k.code, a)
        else:
            quant_matmul_serial(q, x, y, k.code, a)
    else:
        xr = act8_rounded(x, act8_of(x, kind), k.code)
        matmul_widened(xr, n, d, lambda lo, block: dequantize_rows(q, np.arange(lo, lo + block.shape[0]), block,
                                                                   k.code), y)
    return y


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """A resident matrix [rows, cols] kept in a block format: q uint8 [rows, row_bytes(cols, kind)].

    linear multiplies by it (quant_matmul_t); indexing by row ids dequantizes those rows (the embedding
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
# A prompt's SiLU coefficients, 8 at a time: act(g) * u with the bits of kernels.neurons' scalar coefficient, whose
# exp is libm's expf (a call per element: a real 1.5B's 256 rows x 8960 neurons took 37 ms of its layer's time).
# Here expf is glibc's own algorithm (sysdeps/ieee754/flt-32/e_expf.c, the FMA build x86-64 hosts run, its constants
# and fused operations as that build compiles them) in <8 x double>: x N / ln 2 = k + r, 2^(k/N) from a table of
# N = 32 values (vpermi2pd) times 2^(k // N) (its exponent bits), a cubic in r. prompt_silu_ok checks the bits against
# the scalar kernel on a probe of values once per process; where they differ (another libm) the scalar path stays.

_EXPF_INV_LN2_N = float.fromhex("0x1.71547652b82fep+5")     # 32 / ln 2
_EXPF_POLY = tuple(float.fromhex(h) for h in ("0x1.c6af84b912394p-20", "0x1.ebfce50fac4f3p-13", "0x1.62e42ff0c52d6p-6"))
_EXPF_SHIFT = float.fromhex("0x1.8p52")                       # adding it rounds to an integer, ties to even
_EXPF_TABLE = [2.0 ** (i / 32) for i in range(32)]           # glibc's __exp2f_data.tab, its bias taken off


SILU_LANES = 8       # float32 coefficients a step (their exp in <8 x double>: one zmm)


def _splat(ty, v, n=SILU_LANES):
    return ir.Constant(ir.VectorType(ty, n), [ir.Constant(ty, v)] * n)


def _silu_lanes(builder, v, u):
    """<8 x float>: silu(v) * u as kernels.neurons.coefficient computes a SiLU GLU neuron's (no bias): a = v / (1 +
    expf(-v)), 0 for NaN, then a * u where a is not 0 (else a). expf's slow path is not needed: below -104 its value
    is under float32's half step at 1 (so 1 + e is 1, as with glibc's 0), above 100 the product overflows to inf as
    glibc's does, and a NaN v makes a NaN whatever e is."""
    n, F64, I64 = SILU_LANES, ir.DoubleType(), _I64
    vd, vi = ir.VectorType(F64, n), ir.VectorType(I64, n)
    call = lambda name, args: builder.call(cgutils.get_or_insert_function(  # noqa: E731
        builder.module, ir.FunctionType(args[0].type, [a.type for a in args]), name), args)
    fma = lambda a, b, c: call("llvm.fma.v8f64", [a, b, c])  # noqa: E731
    x = builder.fneg(v)
    for op, bound in ((">", -104.0), ("<", 100.0)):
        x = builder.select(builder.fcmp_ordered(op, x, _splat(_F32, bound)), x, _splat(_F32, bound))
    xd, inv, shift = builder.fpext(x, vd), _splat(F64, _EXPF_INV_LN2_N), _splat(F64, _EXPF_SHIFT)
    kd = builder.fsub(fma(inv, xd, shift), shift)
    k = builder.fptosi(kd, vi)
    r = fma(inv, xd, builder.fneg(kd))
    c0, c1, c2 = (_splat(F64, c) for c in _EXPF_POLY)
    y = fma(fma(c0, r, c1), builder.fmul(r, r), fma(r, c2, _splat(F64, 1.0)))
    tab = [ir.Constant(vd, [ir.Constant(F64, t) for t in _EXPF_TABLE[8 * q:8 * q + 8]]) for q in range(4)]
    lo, hi = (call("llvm.x86.avx512.vpermi2var.pd.512", [tab[q], k, tab[q + 1]]) for q in (0, 2))
    t = builder.select(builder.icmp_signed("!=", builder.and_(k, _splat(I64, 16)), _splat(I64, 0)), hi, lo)
    scale = builder.bitcast(builder.shl(builder.add(builder.ashr(k, _splat(I64, 5)), _splat(I64, 1023)),
                                        _splat(I64, 52)), vd)                  # 2^(k // 32), exact
    e = builder.fptrunc(builder.fmul(y, builder.fmul(t, scale)), v.type)
    a = builder.fdiv(v, builder.fadd(_splat(_F32, 1.0), e))
    a = builder.select(builder.fcmp_ordered(">", a, _splat(_F32, -np.inf)), a, _splat(_F32, 0.0))
    return builder.select(builder.fcmp_unordered("!=", a, _splat(_F32, 0.0)), builder.fmul(a, u), a)


@intrinsic(prefer_literal=True)
def silu_run(typingctx, g, u):
    """u[:] = the SiLU GLU coefficients of gate products g and up products u (float32, lengths a multiple of 8),
    _silu_lanes 8 at a time, strict float32 / float64 (no fast-math flags)."""
    if not _rows_ok(g, types.float32, u, types.float32):
        return None

    def codegen(context, builder, sig, args):
        g, u = _arrays(context, builder, sig, args)
        step = ir.Constant(g.nitems.type, SILU_LANES)
        at = lambda arr, i: builder.bitcast(builder.gep(arr.data, [builder.mul(i, step)]),  # noqa: E731
                                            ir.VectorType(_F32, SILU_LANES).as_pointer())
        with cgutils.for_range(builder, builder.udiv(g.nitems, step)) as loop:
            gv, uv = (builder.load(at(a, loop.index), align=4) for a in (g, u))
            builder.store(_silu_lanes(builder, gv, uv), at(u, loop.index), align=4)
        return context.get_dummy_value()
    return types.none(g, u), codegen


@njit(cache=True, nogil=True, parallel=True)
def silu_coefficient_rows(g, u):
    """u[t] = the SiLU GLU coefficients of g[t] and u[t] (float32 [T, n], n a multiple of 8, rows contiguous), the
    rows in parallel."""
    for t in prange(g.shape[0]):
        silu_run(g[t], u[t])


_SILU_OK: list[bool] = []      # prompt_silu_ok's answer, once per process


def prompt_silu_ok(scalar) -> bool:
    """Whether silu_coefficient_rows gives the bits of scalar(g, u) (the same coefficients into u by the kernels.neurons
    path, passed in: neurons imports this module) on a probe of values over every range expf treats apart, and the
    host has the permutes."""
    if not _SILU_OK:
        ok = HAS_AVX512
        if ok:
            rng = np.random.default_rng(0)
            g = np.concatenate([rng.standard_normal(4096) * s for s in (1, 8, 40)] + [
                np.linspace(-110, 110, 4096), [0, -0.0, 88.72, -88.72, 103.5, -103.5, 1e-40, 3e38, -3e38]])
            g = np.resize(g.astype(np.float32), (1, len(g) - len(g) % SILU_LANES))
            u = rng.standard_normal(g.shape).astype(np.float32)
            want, got = u.copy(), u.copy()
            scalar(g, want)
            silu_coefficient_rows(g, got)
            ok = np.array_equal(want.view(np.uint32), got.view(np.uint32))
        _SILU_OK.append(bool(ok))
    return _SILU_OK[0]


# ---------------------------------------------------------------------------------------------------------------
# Columns (storage/columns.py): a GGUF down matrix kept exactly. Neuron j's column holds its raw values along d;
# the scales are the layer's tables, S = (a, m, sc, mn) (storage.columns.decode): a and m float32 rows by block of
# neurons, sc and mn uint8 rows by sub-block (K-quants), one value per row of d. The run over a column is LLVM IR
# as the row operations (64 elements a vector step: as plain Numba loops, LLVM left most kinds scalar, 2-7x slower),
# every weight formed by gguf.quants' float32 operations and y += c * w rounded as row_axpy does (no contraction).


# The columns' a and m tables stay float16 bits where the kernel widens them with one instruction (half the DRAM a
# 7B's q4_0 / q4_1 down reads for them); elsewhere LLVM would widen each lane by a library call
COLUMN_SCALES_F16 = HAS_F16C


def column_tables(tables: dict | None, kind: str | None, d: int, f16: bool = COLUMN_SCALES_F16) -> tuple:
    """The kernels' S = (a, m, sc, mn) of a layer's raw tables (storage.columns.decode; a table the kind has not, or
    no tables: empty)."""
    dec = decode_columns(tables, kind, f16) if tables is not None else {}
    f = np.uint16 if f16 else np.float32
    return tuple(dec[t] if t in dec else np.zeros((0, d), dt) for t, dt in (("a", f), ("m", f), ("sc", np.uint8),
                                                                           ("mn", np.uint8)))


_COL_GROUP = 64      # elements of a column group (storage.columns.GROUP)


def _col_values(builder, kind, ptr, at, i0, half):
    """<64 x i8>: the raw values of elements i0 .. i0 + 63 of the column at byte ptr[at] (storage.columns' layout:
    nibbles, then from byte `half` the high bits), unsigned (q8_0: its int8 bits)."""
    cat = lambda parts: parts[0] if len(parts) == 1 else cat(  # noqa: E731
        [builder.shuffle_vector(parts[i], parts[i + 1], ir.Constant(ir.VectorType(_I32, 2 * parts[i].type.count),
                                                                    list(range(2 * parts[i].type.count))))
         for i in range(0, len(parts), 2)])
    if kind == Q8_0:
        return _load_vec(builder, ptr, _I8, _COL_GROUP, builder.add(at, i0))
    nib = _load_vec(builder, ptr, _I8, 32, builder.add(at, builder.lshr(i0, ir.Constant(i0.type, 1))))
    q = cat([builder.and_(nib, _vec(builder, _I8, 15, 32)), builder.lshr(nib, _vec(builder, _I8, 4, 32))])
    high = lambda sh: builder.add(builder.add(at, half), builder.lshr(i0, ir.Constant(i0.type, sh)))  # noqa: E731
    if kind in (Q5_0, Q5_1, Q5_K):    # bit r of high byte k: element 8r + k, so the 8 bytes into each 8-byte lane
        v8 = ir.VectorType(_I8, _COL_GROUP)
        hb = builder.load(builder.bitcast(builder.gep(ptr, [high(3)]), _I64.as_pointer()), align=1)
        lane_bit = ir.Constant(v8, [ir.Constant(_I8, 1 << (e >> 3)) for e in range(_COL_GROUP)])
        hit = builder.icmp_unsigned("!=", builder.and_(builder.bitcast(_vec(builder, _I64, hb, 8), v8), lane_bit),
                                    ir.Constant(v8, None))
        return builder.or_(q, builder.select(hit, _vec(builder, _I8, 16, _COL_GROUP), ir.Constant(v8, None)))
    if kind == Q6_K:                # bits 2r, 2r + 1 of high byte k: element 16r + k
        hb = _load_vec(builder, ptr, _I8, 16, high(2))
        bits = [builder.and_(builder.lshr(hb, _vec(builder, _I8, 2 * r, 16)), _vec(builder, _I8, 3, 16))
                for r in range(4)]
    else:
        return q
    return builder.or_(q, builder.shl(cat(bits), _vec(builder, _I8, 4, _COL_GROUP)))


def _col_weights(builder, kind, q, a, m):
    """<64 x float>: the weights of raw values q (_col_values) with their rows' a and m (storage.columns.decode):
    gguf.quants' float32 operations, strict (no contraction)."""
    vt = ir.VectorType(_F32, _COL_GROUP)
    if kind == Q8_0:
        return builder.fmul(a, builder.sitofp(q, vt))
    if kind in (Q4_0, Q5_0, Q6_K):
        return builder.fmul(a, builder.sitofp(builder.sub(builder.zext(q, ir.VectorType(_I32, _COL_GROUP)), _vec(
            builder, _I32, {Q4_0: 8, Q5_0: 16, Q6_K: 32}[kind], _COL_GROUP)), vt))
    # a * q is exact (a: float16 d, or d * sc of at most 17 significant bits; q at most 5 bits), so fusing the add
    # rounds as gguf.quants' separate one does
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt] * 3), "llvm.fmuladd.v64f32")
    return builder.call(fma, [a, builder.uitofp(q, vt), m if kind in (Q4_1, Q5_1) else builder.fneg(m)])


def _col_scales(builder, code, i0, Ar, Mr, SCr, MNr, f16):
    """(a, m) <64 x float> of elements i0 .. i0 + 63 of the columns' scale rows: Ar and Mr as float32 (widened
    exactly from float16 bits if f16), times a K-quant's sc and mn (exact products, as gguf.quants' float32 ones)."""
    vt = ir.VectorType(_F32, _COL_GROUP)
    if f16:             # float16 bits: widened exactly (vcvtph2ps)
        vh = ir.VectorType(ir.HalfType(), _COL_GROUP)
        a, m = (builder.fpext(builder.bitcast(_load_vec(builder, t.data, _I16, _COL_GROUP, i0), vh), vt)
                for t in (Ar, Mr))
    else:
        a, m = (builder.load(builder.bitcast(builder.gep(t.data, [i0]), vt.as_pointer()), align=4) for t in (Ar, Mr))
    if code in (Q4_K, Q5_K, Q6_K):
        sc = _load_vec(builder, SCr.data, _I8, _COL_GROUP, i0)
        a = builder.fmul(a, builder.sitofp(sc, vt) if code == Q6_K else builder.uitofp(sc, vt))
    if code in (Q4_K, Q5_K):
        m = builder.fmul(m, builder.uitofp(_load_vec(builder, MNr.data, _I8, _COL_GROUP, i0), vt))
    return a, m


def _col_groups(builder, y, lo, kind, Ar, Mr, SCr, MNr, f16, add):
    """The column kernels' loop: for each 64 elements of y (one branch per kind), the scales a, m of elements lo + o ..
    of the columns (_col_scales), then y[o:o + 64] = add(code, i0, a, m, y[o:o + 64]) (i0 = lo + o)."""
    lo = builder.sext(lo, _I64) if lo.type.width < 64 else lo
    vp = ir.VectorType(_F32, _COL_GROUP).as_pointer()
    for code in _emitted(kind, _GEOMETRY):
        with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, code))):
            n = builder.udiv(y.nitems, ir.Constant(y.nitems.type, _COL_GROUP))
            with cgutils.for_range(builder, n) as loop:
                o = builder.mul(loop.index, ir.Constant(loop.index.type, _COL_GROUP))
                i0 = builder.add(lo, o)
                a, m = _col_scales(builder, code, i0, Ar, Mr, SCr, MNr, f16)
                dst = builder.bitcast(builder.gep(y.data, [o]), vp)
                builder.store(add(code, i0, a, m, builder.load(dst, align=4)), dst, align=4)


def _col_runs(context, builder, y, terms, at, lo, half, kind, Ar, Mr, SCr, MNr, f16):
    """y[k] += c * (element lo + k of the column at byte `at` of row data) for each (c, data) of terms in turn
    (columns sharing the scale rows Ar, Mr, SCr, MNr; Ar and Mr float16 bits if f16, else float32), 64 elements a
    step: col_run's loop, one per kind. A K-quant's a and m are formed here, d*sc and dmin*mn (exact products, as
    gguf.quants' float32 ones)."""
    at, half = (builder.sext(v, _I64) if v.type.width < 64 else v for v in (at, half))
    cs = [_vec(builder, _F32, c, _COL_GROUP) for c, _ in terms]

    def add(code, i0, a, m, acc):
        for cv, (_, data) in zip(cs, terms):
            w = _col_weights(builder, code, _col_values(builder, code, data, at, i0, half), a, m)
            acc = builder.fadd(acc, builder.fmul(cv, w))
        return acc
    _col_groups(builder, y, lo, kind, Ar, Mr, SCr, MNr, f16, add)


@intrinsic(prefer_literal=True)
def col_run(typingctx, y, c, Br, at, lo, half, kind, Ar, Mr, SCr, MNr):
    """y[k] += c * (element lo + k of the column at byte `at` of Br), k < len(y) (lo and len(y) multiples of 64;
    half: the column's d / 2, where its high bits begin; Ar, Mr, SCr, MNr: the rows of its scale tables, any row of
    their dtype where the kind has none): strict float32, as row_axpy, 64 elements a step. One branch per call picks
    the kind."""
    f = getattr(Ar, "dtype", None)
    if f not in (types.float32, types.uint16) or not _rows_ok(y, types.float32, Br, types.uint8, Ar, f, Mr, f,
                                                              SCr, types.uint8, MNr, types.uint8):
        return None

    def codegen(context, builder, sig, args):
        y, c, Br, at, lo, half, kind, Ar, Mr, SCr, MNr = _arrays(context, builder, sig, args)
        _col_runs(context, builder, y, [(c, Br.data)], at, lo, half, kind, Ar, Mr, SCr, MNr, f == types.uint16)
        return context.get_dummy_value()
    return types.none(y, c, Br, at, lo, half, kind, Ar, Mr, SCr, MNr), codegen


@njit(cache=True, nogil=True, inline="always")
def col_span(kind, d, lo, hi):
    """(c0, c1, h0, h1): the bytes of a column of d elements (storage.columns) that elements lo .. hi (whole groups)
    are in: c0 .. c1 their values (nibbles; q8_0 bytes), h0 .. h1 their high bits (empty without)."""
    if kind == Q8_0:
        return lo, hi, 0, 0
    five = kind == Q5_0 or kind == Q5_1 or kind == Q5_K
    if five or kind == Q6_K:
        sh = 3 if five else 2
        return lo // 2, hi // 2, d // 2 + (lo >> sh), d // 2 + (hi >> sh)
    return lo // 2, hi // 2, 0, 0


@njit(cache=True, nogil=True, inline="always")
def col_group(kind, j):
    """The sub-block of neurons that neuron j is in (storage.columns.groups): its row of the sc and mn tables, and
    what the neurons that col_axpy_run adds in one pass share."""
    return j // (16 if kind == Q6_K else 32)


@njit(cache=True, nogil=True, inline="always")
def col_block(kind, j):
    """The block of neurons that neuron j is in: its row of the a and m tables."""
    return j // (256 if kind == Q4_K or kind == Q5_K or kind == Q6_K else 32)


@njit(cache=True, nogil=True, inline="always")
def _col_rows(S, kind, j, B, r):
    """Neuron j's rows of the scale tables S (the a row for one the kind has not: never read, only typed)."""
    A, M, SC, MN = S
    b, g = col_block(kind, j), col_group(kind, j)
    return A[b], M[b] if M.shape[0] else A[b], SC[g] if SC.shape[0] else B[r], MN[g] if MN.shape[0] else B[r]


@njit(cache=True, nogil=True)
def col_axpy(y, c, B, r, at, lo, kind, j, S):
    """y[k] += c * (element lo + k of the column at byte `at` of row r of B, neuron j's), k < len(y) (lo and len(y)
    multiples of 64): strict float32, as row_axpy (col_run)."""
    a, m, sc, mn = _col_rows(S, kind, j, B, r)
    col_run(y, c, B[r], at, lo, S[0].shape[1] // 2, kind, a, m, sc, mn)


def _col_loop(context, builder, y, B, stride, rows, cs, count, at, lo, half, kind, Ar, Mr, SCr, MNr, f16):
    """_col_runs with its terms in a loop instead of unrolled: y[k] += cs[i] * (element lo + k of the column at byte
    `at` of row rows[i] of B) for i = 0 .. count - 1 in turn, each 64 elements' sums held in registers across the
    terms, their scales formed once for all of them. Per element the same operations in the same order as
    _col_runs (the same bits), for any count."""
    at, half, count = (builder.sext(v, _I64) if v.type.width < 64 else v for v in (at, half, count))
    acc_at = cgutils.alloca_once(builder, ir.VectorType(_F32, _COL_GROUP))   # a register: the terms' running sums

    def add(code, i0, a, m, acc):
        builder.store(acc, acc_at)
        with cgutils.for_range(builder, count) as term:
            i = term.index
            data = builder.gep(B.data, [builder.mul(builder.load(builder.gep(rows.data, [i])), stride)])
            cv = _vec(builder, _F32, builder.load(builder.gep(cs.data, [i])), _COL_GROUP)
            w = _col_weights(builder, code, _col_values(builder, code, data, at, i0, half), a, m)
            builder.store(builder.fadd(builder.load(acc_at), builder.fmul(cv, w)), acc_at)
        return builder.load(acc_at)
    _col_groups(builder, y, lo, kind, Ar, Mr, SCr, MNr, f16, add)


@intrinsic(prefer_literal=True)
def col_loop(typingctx, y, B, rows, cs, count, at, lo, half, kind, Ar, Mr, SCr, MNr):
    """count col_run calls in one pass (columns sharing their scale rows): each element adds its count terms in
    order, the same bits, its scales and sum loaded once for all of them."""
    f = getattr(Ar, "dtype", None)
    if not (f in (types.float32, types.uint16) and _rows_ok(y, types.float32, rows, types.int64, cs, types.float32,
                                                            Ar, f, Mr, f, SCr, types.uint8, MNr, types.uint8)
            and isinstance(B, types.Array) and B.ndim == 2 and B.layout == "C" and B.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        y, B, rows, cs, count, at, lo, half, kind, Ar, Mr, SCr, MNr = _arrays(context, builder, sig, args)
        _col_loop(context, builder, y, B, builder.extract_value(B.strides, 0), rows, cs, count, at, lo, half, kind,
                  Ar, Mr, SCr, MNr, f == types.uint16)
        return context.get_dummy_value()
    return types.none(y, B, rows, cs, count, at, lo, half, kind, Ar, Mr, SCr, MNr), codegen


# The exact gate's down sum in integers (kernels.neurons.gate_down_ints): a sub-block's fired columns times their
# 8-bit coefficients, exact in int32 (|a value| <= 128 after its offset, |a coefficient| <= 127: each product fits 16
# bits, a K-quant block's sum, its sub-blocks' scales applied, 31), 64 elements a vector step


def _col_int_term(builder, code, B, stride, rows, ks, i, at, i0, half):
    """<64 x i32>: ks[i] times the integer values i0 .. i0 + 63 of column rows[i] (offset off), as 16-bit products
    (exact: |value| <= 128, |k| <= 127)."""
    v16, v32 = ir.VectorType(_I16, _COL_GROUP), ir.VectorType(_I32, _COL_GROUP)
    data = builder.gep(B.data, [builder.mul(builder.load(builder.gep(rows.data, [i])), stride)])
    q = _col_values(builder, code, data, at, i0, half)
    v = builder.sext(q, v16) if code == Q8_0 else builder.zext(q, v16)
    off = _COL_OFFSETS.get(code, 0)
    if off:
        v = builder.sub(v, _vec(builder, _I16, off, _COL_GROUP))
    c = builder.trunc(builder.load(builder.gep(ks.data, [i])), _I16)
    return builder.sext(builder.mul(v, _vec(builder, _I16, c, _COL_GROUP)), v32)


_COL_OFFSETS = {Q4_0: 8, Q5_0: 16, Q6_K: 32}     # the values' offsets (q8_0: signed, offset 128 when made unsigned)
# Four columns' values interleaved, byte 4e + c = column c's element e: a <256 x i8> from two <128 x i8> halves
_QUAD = [(c // 2) * 128 + (c % 2) * 64 + e for e in range(_COL_GROUP) for c in range(4)]


def _col_int_loop(builder, I, B, stride, rows, ks, count, at, lo, half, kind, SCr):
    """I[k] += sc[lo + k] * sum over i < count of ks[i] * (integer value lo + k of the column at byte `at` of row
    rows[i] of B), k < len(I): the values as storage.columns holds them, offset off (q8_0 its int8 values, q4_0
    q - 8, q5_0 q - 16, q6_k q - 32; the others q: their min is the block's term), sc the K-quants' sub-block scales
    SCr (q6_k: int8 bits), 1 for the others. With AVX512-VNNI four columns at a time: their unsigned values
    interleaved, one vpdpbusd per 16 outputs by the four coefficients, the offsets taken off as offset * (their sum);
    elsewhere (and the last count % 4) one column at a time in 16-bit products. Integers: the same sums."""
    at, half, count, lo = (builder.sext(v, _I64) if v.type.width < 64 else v for v in (at, half, count, lo))
    v32, v16i = ir.VectorType(_I32, _COL_GROUP), ir.VectorType(_I32, 16)
    acc_at = cgutils.alloca_once(builder, v32)
    vp = v32.as_pointer()
    quads = builder.udiv(count, ir.Constant(count.type, 4)) if HAS_VNNI and HAS_AVX512 else ir.Constant(_I64, 0)
    c4 = lambda q, c: builder.add(builder.mul(q, ir.Constant(_I64, 4)), ir.Constant(_I64, c))  # noqa: E731
    dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16i, [v16i] * 3),
                                            "llvm.x86.avx512.vpdpbusd.512")
    for code in _emitted(kind, _GEOMETRY):
        off = 128 if code == Q8_0 else _COL_OFFSETS.get(code, 0)
        with builder.if_then(builder.icmp_signed("==", kind, ir.Constant(kind.type, code))):
            n = builder.udiv(I.nitems, ir.Constant(I.nitems.type, _COL_GROUP))
            with cgutils.for_range(builder, n) as loop:
                o = builder.mul(loop.index, ir.Constant(loop.index.type, _COL_GROUP))
                i0 = builder.add(lo, o)
                builder.store(ir.Constant(v32, None), acc_at)
                with cgutils.for_range(builder, quads) as quad:
                    us, word, total = [], ir.Constant(_I32, 0), ir.Constant(_I32, 0)
                    for c in range(4):
                        i = c4(quad.index, c)
                        data = builder.gep(B.data, [builder.mul(builder.load(builder.gep(rows.data, [i])), stride)])
                        u = _col_values(builder, code, data, at, i0, half)
                        us.append(builder.xor(u, _vec(builder, _I8, 0x80, _COL_GROUP)) if code == Q8_0 else u)
                        kc = builder.load(builder.gep(ks.data, [i]))
                        total = builder.add(total, kc)
                        word = builder.or_(word, builder.shl(builder.and_(kc, ir.Constant(_I32, 255)),
                                                             ir.Constant(_I32, 8 * c)))
                    cat = lambda a, b: builder.shuffle_vector(a, b, ir.Constant(  # noqa: E731
                        ir.VectorType(_I32, 2 * a.type.count), list(range(2 * a.type.count))))
                    z = builder.shuffle_vector(cat(us[0], us[1]), cat(us[2], us[3]),
                                               ir.Constant(ir.VectorType(_I32, 4 * _COL_GROUP), _QUAD))
                    kv = _vec(builder, _I32, word, 16)
                    parts = []
                    for m in range(4):
                        zm = builder.shuffle_vector(z, z, ir.Constant(ir.VectorType(_I32, _COL_GROUP),
                                                                      list(range(64 * m, 64 * m + 64))))
                        parts.append(builder.call(dpbusd, [ir.Constant(v16i, None), builder.bitcast(zm, v16i), kv]))
                    prod = cat(cat(parts[0], parts[1]), cat(parts[2], parts[3]))
                    if off:
                        prod = builder.sub(prod, _vec(builder, _I32, builder.mul(total, ir.Constant(_I32, off)),
                                                      _COL_GROUP))
                    builder.store(builder.add(builder.load(acc_at), prod), acc_at)
                rest = builder.sub(count, builder.mul(quads, ir.Constant(_I64, 4)))
                with cgutils.for_range(builder, rest) as term:
                    i = builder.add(builder.mul(quads, ir.Constant(_I64, 4)), term.index)
                    prod = _col_int_term(builder, code, B, stride, rows, ks, i, at, i0, half)
                    builder.store(builder.add(builder.load(acc_at), prod), acc_at)
                acc = builder.load(acc_at)
                if code in (Q4_K, Q5_K, Q6_K):
                    sc = _load_vec(builder, SCr.data, _I8, _COL_GROUP, i0)
                    acc = builder.mul(acc, builder.sext(sc, v32) if code == Q6_K else builder.zext(sc, v32))
                dst = builder.bitcast(builder.gep(I.data, [o]), vp)
                builder.store(builder.add(builder.load(dst, align=4), acc), dst, align=4)


@intrinsic(prefer_literal=True)
def col_int_run(typingctx, I, B, rows, ks, count, at, lo, half, kind, SCr):
    """I[k] += sc[lo + k] * sum over i < count of ks[i] * (integer value lo + k of column rows[i] of B, at byte
    `at`), k < len(I) (lo and len(I) multiples of 64; half: the columns' d / 2; SCr: the sub-block's row of the sc
    table, any uint8 row where the kind has none): the columns of one sub-block, in integers (_col_int_loop)."""
    if not (_rows_ok(I, types.int32, rows, types.int64, ks, types.int32, SCr, types.uint8)
            and isinstance(B, types.Array) and B.ndim == 2 and B.layout == "C" and B.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        I, B, rows, ks, count, at, lo, half, kind, SCr = _arrays(context, builder, sig, args)
        _col_int_loop(builder, I, B, builder.extract_value(B.strides, 0), rows, ks, count, at, lo, half, kind, SCr)
        return context.get_dummy_value()
    return types.none(I, B, rows, ks, count, at, lo, half, kind, SCr), codegen


@njit(cache=True, nogil=True, inline="always")
def col_axpy_run(y, B, rows, cs, count, at, lo, kind, j, S):
    """col_axpy of (cs[i], row rows[i] of B) for i < count in turn, whose neurons share neuron j's sub-block
    (col_group), any count: col_loop, the same bits. Inlined: no call (and no reference counts) per run."""
    a, m, sc, mn = _col_rows(S, kind, j, B, rows[0])
    col_loop(y, B, rows, cs, count, at, lo, S[0].shape[1] // 2, kind, a, m, sc, mn)


@njit(cache=True, nogil=True)
def col_dequant(B, r, at, out, kind, j, S):
    """out[:] = neuron j's column (at byte `at` of row r of B), bit-identical to gguf.quants' dequantization of the
    source rows: col_axpy of 1 onto -0.0 (1 * w is w, and -0.0 + w is w for every w, negative zero included)."""
    out[:] = np.float32(-0.0)
    col_axpy(out, np.float32(1.0), B, r, at, 0, kind, j, S)


def linear(x: np.ndarray, w: np.ndarray | QuantMatrix, b: np.ndarray | None = None) -> np.ndarray:
    # x [T, in] @ w [out, in]^T -> [T, out]. Resident matrices of a FLASHDIR: float16 (model.half_matrices) or in a
    # block format (QuantMatrix), each with its Numba kernel; float32 through BLAS; a matrix that computes its own
    # product (QuantMatrix; a head streamed from flash, flash_matrix.FlashMatrix) by its matmul_t.
    if not isinstance(w, np.ndarray):
        y = w.matmul_t(x)
    else:
        y = matmul_t(x, w) if w.dtype == np.float16 else x @ w.T
    return y if b is None else y + b
