"""The building blocks every kernel inlines, over one row of weights: three sections, in the order they build on each
other.

float16: float16 bits <-> float32 inside Numba kernels, and `f32_at`: element i of a weight row (float32, float16 bits
or int8) as float32. Numba has no CPU float16, so float16 weights and the KV cache are read as uint16 and converted
here. Two exact implementations each way: the F16C instruction (vcvtph2ps / vcvtps2ph, ~4x faster in the dot loops)
when the host has it, else portable bit arithmetic. Both are checked over all 65536 inputs in tests/test_kernels.py.

Software prefetch. The hardware prefetcher streams long rows on its own, but not a loop over short ones: a decode
GEMV over SmolLM2's 360-byte q4_1 rows read them from DRAM at 3.1 GB/s, and at 8.8 GB/s when each row asked for
the lines ~2 KiB ahead (7B rows of 2-8 KiB: no gain; bench/README.md, "The OpenMP pool and software prefetch").
A hint: results are unchanged.

Over one vector: `v` is a 1-D typed slice of d elements (float32, float16 bits or int8, read by f32_at). Slices, not
row + offset: with a runtime offset Numba's negative-index wraparound check stays in the loop and blocks
vectorisation."""
from __future__ import annotations

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload


# ----------------------------------------------------------------------------------------------------------------------
# float16

@intrinsic
def _bits_as_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (no conversion)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif v.type.width < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_bits(typingctx, f):
    """Reinterpret a float32 as uint32 bits."""
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(f), codegen


@intrinsic
def _half_bits_fpext(typingctx, h):
    """LLVM `fpext half -> float` of the low 16 bits: one vcvtph2ps per 8-16 values on F16C hardware."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if v.type.width > 16:
            v = builder.trunc(v, ir.IntType(16))
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@njit(cache=True)
def f16_bits_to_f32_portable(h):
    """IEEE half bits (uint16) -> float32 with integer arithmetic only; exact for normals, subnormals, +-0,
    +-inf and NaN (payload kept). Branch-free (both cases computed, then selected) so loops vectorise."""
    # every intermediate is cast back to uint32: Numba widens integer ops to 64 bits, and the casts let LLVM
    # narrow them again (twice the SIMD lanes)
    h32 = np.uint32(h)
    sign = np.uint32((h32 & np.uint32(0x8000)) << np.uint32(16))
    em = np.uint32(h32 & np.uint32(0x7FFF))  # exponent + mantissa
    exp = np.uint32(em & np.uint32(0x7C00))
    shifted = np.uint32(em << np.uint32(13))
    # normal: exponent/mantissa moved into place and rebiased 15 -> 127; inf/NaN: all-ones exponent, payload kept
    normal = np.uint32(shifted + np.uint32(112 << 23))
    special = np.uint32(shifted | np.uint32(0x7F800000))
    bits = special if exp == np.uint32(0x7C00) else normal
    # subnormal (and zero): mantissa * 2^-24 is exact in float32 and never itself subnormal
    sub = np.float32(np.int32(em)) * np.float32(5.9604644775390625e-08)
    mag = sub if exp == np.uint32(0) else _bits_as_f32(bits)
    return _bits_as_f32(np.uint32(_f32_bits(mag) | sign))


@njit(cache=True)
def f16_bits_to_f32_f16c(h):
    """IEEE half bits (uint16) -> float32 by the F16C instruction (exact; signalling NaNs come out quiet)."""
    return _half_bits_fpext(h)


HAS_F16C = "+f16c" in llvm_binding.get_host_cpu_features().flatten().split(",")
f16_bits_to_f32 = f16_bits_to_f32_f16c if HAS_F16C else f16_bits_to_f32_portable


# float32 -> fp16 bits, round to nearest even (numpy's astype(float16)): the KV cache stores keys and values as
# float16, written by the attention kernel. The same two implementations as above; tests/test_kernels.py checks them
# against numpy.


@intrinsic
def _f32_to_half_bits_fptrunc(typingctx, f):
    """LLVM `fptrunc float -> half` as 16 bits: vcvtps2ph on F16C hardware."""
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(f), codegen


@njit(cache=True)
def f32_to_f16_bits_portable(f):
    """float32 -> IEEE half bits with integer arithmetic; overflow gives inf, NaN stays a (quiet) NaN."""
    b = _f32_bits(f)
    sign = np.uint32((b >> np.uint32(16)) & np.uint32(0x8000))
    a = np.uint32(b & np.uint32(0x7FFFFFFF))                   # |f|
    if a > np.uint32(0x7F800000):                               # NaN: quiet, the payload's top bits kept
        h = np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x3FF))
    elif a >= np.uint32(0x477FF000):                            # |f| >= 65520 rounds to inf
        h = np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):                             # |f| < 2^-14: a subnormal half, |f| * 2^24 units
        h = np.uint32(np.rint(_bits_as_f32(a) * np.float32(16777216.0)))   # exact product, then round to even
    else:                                                       # normal: rebias 127 -> 15, round 23 -> 10 bits
        a = np.uint32(a - np.uint32(112 << 23))
        h = np.uint32((a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13))
    return np.uint16(sign | h)


@njit(cache=True)
def f32_to_f16_bits_f16c(f):
    return _f32_to_half_bits_fptrunc(np.float32(f))


f32_to_f16_bits = f32_to_f16_bits_f16c if HAS_F16C else f32_to_f16_bits_portable


# ---------------------------------------------------------------------------------------------------------------


def f32_at(w, i):
    """Element i of a weight view as float32 (f32, f16 bits or int8); resolved per dtype at compile time."""


@overload(f32_at)
def _load_impl(w, i):
    if w.dtype == types.uint16:
        return lambda w, i: f16_bits_to_f32(w[i])
    return lambda w, i: np.float32(w[i])


# ----------------------------------------------------------------------------------------------------------------------
# Software prefetch

PREFETCH_AHEAD = 2048   # bytes: how far ahead of the row being computed a row loop asks for its next lines
CACHE_LINE = 64


def _prefetch_into(locality: int):
    """codegen of an intrinsic (a, byte): ask for the cache line holding byte `byte` of array a's data (llvm.prefetch,
    read, never faults) with `locality` (3: into L1, prefetcht0; 2: into L2, prefetcht1 on x86)."""
    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        data = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, i8p)
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", (), ir.FunctionType(ir.VoidType(),
                                                                                  [i8p, i32, i32, i32]))
        builder.call(fn, [builder.gep(data, [args[1]]), ir.Constant(i32, 0), ir.Constant(i32, locality),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return codegen


@intrinsic
def _prefetch_line(typingctx, a, byte):
    """Ask for the cache line holding byte `byte` of array a's data into L1 (llvm.prefetch: never faults)."""
    if not isinstance(a, types.Array) or not isinstance(byte, types.Integer):
        return None
    return types.none(a, byte), _prefetch_into(3)


@intrinsic
def _prefetch_line_l2(typingctx, a, byte):
    """_prefetch_line into L2 only."""
    if not isinstance(a, types.Array) or not isinstance(byte, types.Integer):
        return None
    return types.none(a, byte), _prefetch_into(2)


@njit(cache=True, inline="always")
def prefetch_piece(M, r, lo, hi):
    """Ask for bytes lo .. hi of row r of M (2-D), if there is such a row, whatever their length: a piece at an
    address the hardware cannot guess (the neuron cache's slots), asked for while the one before it is computed."""
    if 0 <= r < M.shape[0]:
        start = r * M.strides[0]
        for b in range(start + lo, start + hi, CACHE_LINE):
            _prefetch_line(M, b)


@njit(cache=True, inline="always")
def prefetch_row(M, r, lo, hi):
    """prefetch_piece where the piece is shorter than PREFETCH_AHEAD: the hardware streams a longer one on its own once
    the loop has begun reading it."""
    if hi - lo < PREFETCH_AHEAD:
        prefetch_piece(M, r, lo, hi)


@njit(cache=True, inline="always")
def prefetch_row_l2(M, r, lo, hi):
    """prefetch_row into L2 only, for a loop that asks for a run of rows before one pass over all of them, whose
    sums and scales stay in L1 meanwhile: the exact gate's down columns (kernels.neurons.quant_ffn_accumulate), a run
    of up to 32 columns of 1.1 KB asked into L1, left their pass waiting on memory (the real 1.5B's down sum on one
    thread took 1.5x the time it takes with this, the same bits)."""
    if hi - lo < PREFETCH_AHEAD and 0 <= r < M.shape[0]:
        start = r * M.strides[0]
        for b in range(start + lo, start + hi, CACHE_LINE):
            _prefetch_line_l2(M, b)


@njit(cache=True, inline="always")
def rows_ahead(piece_bytes):
    """How many rows ahead of the one being computed a loop over pieces of piece_bytes (> 0) asks for: the first
    whose piece starts at least PREFETCH_AHEAD bytes of reading later."""
    return 1 + (PREFETCH_AHEAD - 1) // piece_bytes


@njit(cache=True, inline="always")
def prefetch_ahead(M, j, lo, hi):
    """A loop reads bytes lo .. hi of rows j = 0, 1, ... of M (2-D) in order: at row j, ask for the same bytes of
    the row PREFETCH_AHEAD bytes later (prefetch_row: nothing for longer pieces)."""
    if hi > lo:
        prefetch_row(M, j + rows_ahead(hi - lo), lo, hi)


# ----------------------------------------------------------------------------------------------------------------------
# Over one vector

@njit(cache=True, fastmath=True)
def dot(v, x, d):
    acc = np.float32(0.0)
    for k in range(d):
        acc += f32_at(v, k) * x[k]
    return acc


@njit(cache=True, fastmath=True)
def axpy(out, a, v, d):
    for k in range(d):
        out[k] += a * f32_at(v, k)


@njit(cache=True)
def scalar(f, idx, default):
    """float32 scalar of a row (scale or bias) or `default` when the layout has none (idx < 0)."""
    return f[idx] if idx >= 0 else np.float32(default)

