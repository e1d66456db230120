"""float16 bits <-> float32 inside Numba kernels, and `f32_at`: element i of a weight row (float32, float16 bits or
int8) as float32. Numba has no CPU float16, so float16 weights and the KV cache are read as uint16 and converted here.
Two exact implementations each way: the F16C instruction (vcvtph2ps / vcvtps2ph, ~4x faster in the dot loops) when
the host has it, else portable bit arithmetic. Both are checked over all 65536 inputs in tests/test_kernels.py."""
from __future__ import annotations

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload


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
