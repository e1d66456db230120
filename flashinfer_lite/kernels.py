"""Sparse FFN kernels (Numba) over a bundle matrix: only the active neurons' rows are touched.

A bundle matrix B is uint8[rows, stride]; row r holds one neuron (contract layout):
  GLU: [gate_i | up_i | down_i], MLP (OPT): [up_i (fc1 row) | down_i (fc2 column)], each d values of the
  storage dtype, then float32 scalars at `scalars_offset` (int8 scales per vector, then bias_gate, bias_up).

  GLU: y = sum_j act(gate_j.x + bg_j) * (up_j.x + bu_j) * down_j     (dReLU: relu(gate) * relu(up))
  MLP: y = sum_j act(up_j.x + bu_j) * down_j
The per-output down bias is not in the bundles: the caller adds it. FATReLU: an activation act(.) <= relu_threshold
counts as zero, and then the neuron's remaining vectors are not read at all (for ReLU the default threshold 0
is exactly ReLU; for SiLU the default is -inf, i.e. none).

One summation order, whatever the thread count, the cache rows, the budget or the prefill strategy: the
coefficients are per neuron (each computed whole by one thread, so order-free), and the down accumulation adds
the neurons' contributions to each output element in the order the caller lists them (sorted neuron ids), one
thread per fixed block of OUT_BLOCK output elements. A caller may split a set into pieces and accumulate them one
after the other into the same y: the sum is bit-identical to one call over the whole set (the runtime relies on
this: budget, overlap, pieces and prefill streaming all give the same output, tests/test_kernels.py).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import llvmlite.binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from flashinfer_lite.errors import UserError

ACT_RELU, ACT_SILU, ACT_DRELU = 0, 1, 2
ACT_CODES = {"relu": ACT_RELU, "silu": ACT_SILU, "drelu": ACT_DRELU}
STORAGE_VIEWS = {"f32": np.float32, "f16": np.uint16, "int8": np.int8}  # dtype name -> view of B the kernel reads


# ---------------------------------------------------------------------------------------------------------------
# fp16 bits -> float32. Numba has no CPU float16, so f16 weights are read as uint16 and converted here.
# Two exact implementations: the F16C instruction (vcvtph2ps, ~4x faster in the dot loops) when the host has it,
# else portable bit arithmetic. Both are checked over all 65536 inputs in tests/test_kernels.py.


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
# Software prefetch. The hardware prefetcher streams long rows on its own, but not a loop over short ones: a decode
# GEMV over SmolLM2's 360-byte q4_1 rows read them from DRAM at 3.1 GB/s, and at 8.8 GB/s when each row asked for
# the lines ~2 KiB ahead (7B rows of 2-8 KiB: no gain; bench/README.md, "The OpenMP pool and software prefetch").
# A hint: results are unchanged.

PREFETCH_AHEAD = 2048   # bytes: how far ahead of the row being computed a row loop asks for its next lines
CACHE_LINE = 64


@intrinsic
def _prefetch_line(typingctx, a, byte):
    """Ask for the cache line holding byte `byte` of array a's data (llvm.prefetch, read, into L1: never faults)."""
    if not isinstance(a, types.Array) or not isinstance(byte, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        data = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, i8p)
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", (), ir.FunctionType(ir.VoidType(),
                                                                                  [i8p, i32, i32, i32]))
        builder.call(fn, [builder.gep(data, [args[1]]), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.none(a, byte), codegen


@njit(cache=True, inline="always")
def prefetch_row(M, r, lo, hi):
    """Ask for bytes lo .. hi of row r of M (2-D), if there is such a row and the piece is shorter than
    PREFETCH_AHEAD (the hardware streams a longer one once it has begun): a row at an address the hardware cannot
    guess (the neuron cache's slots), asked for while the one before it is computed."""
    if 0 <= r < M.shape[0] and hi - lo < PREFETCH_AHEAD:
        start = r * M.strides[0]
        for b in range(start + lo, start + hi, CACHE_LINE):
            _prefetch_line(M, b)


@njit(cache=True, inline="always")
def prefetch_ahead(M, j, lo, hi):
    """A loop reads bytes lo .. hi of rows j = 0, 1, ... of M (2-D) in order: at row j, ask for the same bytes of
    the row PREFETCH_AHEAD bytes later (prefetch_row: nothing for longer pieces)."""
    if hi > lo:
        prefetch_row(M, j + 1 + (PREFETCH_AHEAD - 1) // (hi - lo), lo, hi)


def _load(w, i):
    """Element i of a weight view as float32 (f32, f16 bits or int8); resolved per dtype at compile time."""


@overload(_load)
def _load_impl(w, i):
    if w.dtype == types.uint16:
        return lambda w, i: f16_bits_to_f32(w[i])
    return lambda w, i: np.float32(w[i])


# ---------------------------------------------------------------------------------------------------------------
# Building blocks over one vector: `v` is a 1-D typed slice of d elements. (Slices, not row + offset: with a
# runtime offset Numba's negative-index wraparound check stays in the loop and blocks vectorisation.)


@njit(cache=True, fastmath=True)
def _dot(v, x, d):
    acc = np.float32(0.0)
    for k in range(d):
        acc += _load(v, k) * x[k]
    return acc


@njit(cache=True, fastmath=True)
def _axpy(out, a, v, d):
    for k in range(d):
        out[k] += a * _load(v, k)


@njit(cache=True)
def _scalar(f, idx, default):
    """float32 scalar of a row (scale or bias) or `default` when the layout has none (idx < 0)."""
    return f[idx] if idx >= 0 else np.float32(default)


@njit(cache=True, fastmath=True)
def _act(code, v):
    if code == ACT_SILU:
        return v / (np.float32(1.0) + math.exp(-v))
    return v if v > np.float32(0.0) else np.float32(0.0)  # relu and drelu


@njit(cache=True, fastmath=True)
def _coefficient(wr, fr, x, d, glu, act, relu_threshold, scale0, bg_idx, bu_idx):
    """act(gate.x + bg) * (up.x + bu) for GLU, act(up.x + bu) for MLP; 0 when the activation is <= relu_threshold."""
    if glu:
        g = _dot(wr[:d], x, d) * _scalar(fr, scale0, 1.0) + _scalar(fr, bg_idx, 0.0)
        a = _act(act, g)
        if not a > relu_threshold:  # also true for NaN-free silu when relu_threshold is -inf -> never
            return np.float32(0.0)
        u = _dot(wr[d:2 * d], x, d) * _scalar(fr, scale0 + 1 if scale0 >= 0 else -1, 1.0) + _scalar(fr, bu_idx, 0.0)
        if act == ACT_DRELU and not u > np.float32(0.0):
            return np.float32(0.0)
        return a * u
    u = _dot(wr[:d], x, d) * _scalar(fr, scale0, 1.0) + _scalar(fr, bu_idx, 0.0)
    a = _act(act, u)
    if not a > relu_threshold:
        return np.float32(0.0)
    return a


# ---------------------------------------------------------------------------------------------------------------
# Kernels


# Output elements per task of the down accumulation: a constant (not the thread count), so that every element is
# summed by the same loop code in the same order whatever -t is.
OUT_BLOCK = 64


# nogil: flash reads run in Python threads while these compute the rows already resident.
@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def ffn_coefficients(W, F, slots, js, X, sel, coef, d, glu, act, relu_threshold, scale0, bg_idx, bu_idx,
                     act_threshold):
    """coef[t, j] = coefficient of neuron row slots[j] on X[t] if sel[t, j] else 0, for every j in js.

    W: typed view of the bundle matrix [rows, stride // itemsize]; F: its float32 view [rows, stride // 4];
    slots: int32[n] rows; js: int64 positions into slots to compute now (the rest of coef is left alone);
    X: float32[T, d]; sel: uint8[T, >=n]; coef: float32[T, >=n]. act_threshold: coefficients with |c| <= it count as
    zero (SwiGLU's calibrated act_threshold; -1: none). scale0: float index of the first int8 scale or -1;
    bg_idx / bu_idx: float index of the gate / up bias or -1.
    """
    for q in prange(js.shape[0]):
        j = js[q]
        r = slots[j]
        wr = W[r]
        fr = F[r]
        for t in range(X.shape[0]):
            c = np.float32(0.0)
            if sel[t, j]:
                c = _coefficient(wr, fr, X[t], d, glu, act, relu_threshold, scale0, bg_idx, bu_idx)
                if abs(c) <= act_threshold:
                    c = np.float32(0.0)
            coef[t, j] = c


# No fastmath: nothing here needs reassociation to vectorise, and without it no FMA contraction can make one call
# site round differently from another.
@njit(cache=True, parallel=True, nogil=True)
def ffn_accumulate(W, F, slots, coef, Y, d, glu, scale0):
    """Y[t] += sum over j = 0, 1, ... of coef[t, j] * down(slots[j]), in that order (zero coefficients skipped).

    Parallel over (row, block of OUT_BLOCK output elements): each output element is summed by one thread."""
    n = slots.shape[0]
    down = 2 * d if glu else d
    scale_down = (scale0 + (2 if glu else 1)) if scale0 >= 0 else -1
    nb = (d + OUT_BLOCK - 1) // OUT_BLOCK
    for q in prange(Y.shape[0] * nb):
        t = q // nb
        lo = (q % nb) * OUT_BLOCK
        hi = min(d, lo + OUT_BLOCK)
        y = Y[t, lo:hi]
        m = hi - lo
        # the fired neurons in order, then four per pass: four rows' loads in flight at once (rows sit at random
        # addresses); each output element still adds them one after the other (no fastmath: no reassociation)
        fired = np.empty(n, np.int64)
        nf = 0
        for j in range(n):
            if coef[t, j] != np.float32(0.0):
                fired[nf] = j
                nf += 1
        q4 = nf - nf % 4
        for i in range(0, q4, 4):
            j0, j1, j2, j3 = fired[i], fired[i + 1], fired[i + 2], fired[i + 3]
            c0 = coef[t, j0] * _scalar(F[slots[j0]], scale_down, 1.0)
            c1 = coef[t, j1] * _scalar(F[slots[j1]], scale_down, 1.0)
            c2 = coef[t, j2] * _scalar(F[slots[j2]], scale_down, 1.0)
            c3 = coef[t, j3] * _scalar(F[slots[j3]], scale_down, 1.0)
            v0 = W[slots[j0], down + lo:down + hi]
            v1 = W[slots[j1], down + lo:down + hi]
            v2 = W[slots[j2], down + lo:down + hi]
            v3 = W[slots[j3], down + lo:down + hi]
            for k in range(m):
                y[k] = (((y[k] + c0 * _load(v0, k)) + c1 * _load(v1, k)) + c2 * _load(v2, k)) + c3 * _load(v3, k)
        for i in range(q4, nf):
            j = fired[i]
            c = coef[t, j] * _scalar(F[slots[j]], scale_down, 1.0)
            v = W[slots[j], down + lo:down + hi]
            for k in range(m):
                y[k] += c * _load(v, k)


# ---------------------------------------------------------------------------------------------------------------
# Python entry point: geometry bound once, scratch allocated once, no allocation per call.


class SparseFFN:
    """The sparse FFN of one model geometry. Create once; call per layer per token.

    ffn = SparseFFN(d=4096, dtype="f16", glu=True, act="relu", stride=24576, scalars_offset=24576)
    ffn(B, slots, x, y)   # y[:] = sum over slots of the neuron outputs (down bias not included)

    In two steps, for a caller that overlaps reads with compute or computes a set in pieces:
    ffn.coefficients(B, slots, js, X, coef)   # coef[:, js] for rows slots[js] (js: any subset, any time)
    ffn.accumulate(B, slots, coef, Y)         # Y += the neurons' outputs, in the order of slots

    Subclasses for other bundle encodings (quant.QuantSparseFFN) replace DTYPES, views and the two kernel calls.
    """
    DTYPES = STORAGE_VIEWS

    def __init__(self, d: int, dtype: str, glu: bool, act: str, stride: int, scalars_offset: int,
                 bias_gate_index: int | None = None, bias_up_index: int | None = None,
                 relu_threshold: float | None = None, max_active: int = 0):
        if dtype not in self.DTYPES:
            raise UserError(f"unsupported FFN storage dtype {dtype!r} (expected one of {sorted(self.DTYPES)})")
        if act not in ACT_CODES:
            raise UserError(f"unsupported FFN activation {act!r} (expected one of {sorted(ACT_CODES)})")
        if act == "drelu" and not glu:
            raise UserError("dReLU needs a gated (GLU) FFN")
        if scalars_offset % 4 or stride % 4:
            raise UserError("bundle stride and scalars_offset must be multiples of 4")
        n_vec = 3 if glu else 2
        self.d, self.dtype, self.glu, self.act, self.stride = d, dtype, glu, act, stride
        self.scalars_offset = scalars_offset
        self.n_vec = n_vec
        self.act_code = ACT_CODES[act]
        if relu_threshold is None:
            relu_threshold = -np.inf if act == "silu" else 0.0
        self.relu_threshold = np.float32(relu_threshold)
        s0 = scalars_offset // 4
        self.scale0 = s0 if dtype == "int8" else -1
        # scalar indices in the layout are relative to the scalars block
        self.bg_idx = s0 + bias_gate_index if bias_gate_index is not None else -1
        self.bu_idx = s0 + bias_up_index if bias_up_index is not None else -1
        self.coef = np.zeros(max(max_active, 1), np.float32)  # per-call activation coefficients
        self._ones = np.ones(max(max_active, 1), np.uint8)     # "every listed neuron is selected"
        self._positions = np.arange(max(max_active, 1), dtype=np.int64)

    @classmethod
    def from_layout(cls, layout, act: str | None = None, relu_threshold: float | None = None, **kw) -> "SparseFFN":
        """Bind to a storage.format.FlashLayout; act and relu_threshold (FATReLU) default to the model config's."""
        scalars = layout.scalars
        act = act or layout.config["act"]
        if relu_threshold is None and act != "silu":
            relu_threshold = layout.config.get("relu_threshold")
        return cls(d=layout.d, dtype=layout.dtype, glu=layout.n_vec == 3, act=act,
                   stride=layout.stride, scalars_offset=layout.scalars_offset,
                   bias_gate_index=scalars.index("bias.gate") if "bias.gate" in scalars else None,
                   bias_up_index=scalars.index("bias.up") if "bias.up" in scalars else None,
                   relu_threshold=relu_threshold, **kw)

    def views(self, B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(typed weight view, float32 scalar view) of a bundle matrix uint8[rows, stride]."""
        if B.dtype != np.uint8 or B.ndim != 2 or B.shape[1] != self.stride:
            raise UserError(f"bundle matrix must be uint8[rows, {self.stride}], got {B.dtype}{list(B.shape)}")
        return B.view(STORAGE_VIEWS[self.dtype]), B.view(np.float32)

    def _grow(self, n: int) -> None:
        """Scratch grows once to the largest set seen, then is reused."""
        if self.coef.shape[0] < n:
            self.coef = np.zeros(n, np.float32)
            self._ones = np.ones(n, np.uint8)
            self._positions = np.arange(n, dtype=np.int64)

    def coefficients(self, B: np.ndarray, slots: np.ndarray, js: np.ndarray | None, X: np.ndarray, coef: np.ndarray,
                     sel: np.ndarray | None = None, act_threshold: float = -1.0) -> None:
        """coef[t, j] (float32[T, >= len(slots)]) = coefficient of bundle row slots[j] on X[t] (float32[T, d]) for
        j in js (int64; None: all), 0 where sel[t, j] (uint8[T, >= len(slots)]; None: all selected) is 0 or the
        neuron did not fire (ReLU / FATReLU, or |coefficient| <= act_threshold as SwiGLU thresholds calibrate)."""
        W, F = self.views(B)
        n = len(slots)
        self._grow(n)
        if js is None:
            js = self._positions[:n]
        if sel is None:
            if X.shape[0] != 1:
                raise ValueError("sel is required for more than one row")
            sel = self._ones[None, :n]
        self._coefficients(W, F, slots, js, X, sel, coef, np.float32(act_threshold))

    def _coefficients(self, W, F, slots, js, X, sel, coef, act_threshold) -> None:
        ffn_coefficients(W, F, slots, js, X, sel, coef, self.d, self.glu, self.act_code, self.relu_threshold,
                         self.scale0, self.bg_idx, self.bu_idx, act_threshold)

    def accumulate(self, B: np.ndarray, slots: np.ndarray, coef: np.ndarray, Y: np.ndarray) -> None:
        """Y[t] += sum of coef[t, j] * down(slots[j]) over j in order (Y float32[T, d])."""
        W, F = self.views(B)
        self._accumulate(W, F, slots, coef, Y)

    def _accumulate(self, W, F, slots, coef, Y) -> None:
        ffn_accumulate(W, F, slots, coef, Y, self.d, self.glu, self.scale0)

    def __call__(self, B: np.ndarray, slots: np.ndarray, x: np.ndarray, y: np.ndarray,
                 coef: np.ndarray | None = None, act_threshold: float = -1.0) -> np.ndarray:
        """y[:] = sparse FFN of x over bundle rows `slots`; coef (float32[>= len(slots)]), if given, receives each
        neuron's coefficient, so `coef != 0` is the set that actually fired (after ReLU / FATReLU, and after the
        act_threshold: a neuron with |coefficient| <= act_threshold is skipped, as SwiGLU thresholds calibrate)."""
        n = len(slots)
        self._grow(n)
        c = (self.coef if coef is None else coef)[None, :n]
        y[:] = 0.0
        self.coefficients(B, slots, None, x[None, :], c, act_threshold=act_threshold)
        self.accumulate(B, slots, c, y[None, :])
        return y


# ---------------------------------------------------------------------------------------------------------------
# Resident matrices (attention q/k/v/o, embeddings, lm_head): y = x @ W^T with W float16 (viewed as uint16 bits)
# or float32. Decode (T = 1) is a GEMV bound by how fast W streams from DRAM: float16 halves those bytes, and a
# Numba kernel runs on the sparse FFN's thread pool instead of OpenBLAS threads that compete with it. Prefill (large
# T) is compute bound, where OpenBLAS's register-blocked sgemm is ~7x this row kernel at T = 128, so there W is
# widened to float32 one cache-sized row block at a time and given to numpy matmul. bench/resident_gemv.py measures
# both sides.

MATMUL_ROW_KERNEL_MAX_T = 12      # T up to this: row kernel; above: widened blocks + BLAS (crossover measured 12-16)
# A parallel call pays for waking the other threads (the OpenMP pool: microseconds on an idle machine, far more on an
# overloaded one): from this much work (T * n * d) it pays. At 1 << 18 SmolLM2's 576 x 576 and 960 x 576 attention
# GEMVs run parallel: attention 3.2 -> 2.2 ms/token in RAM (bench/part_times.py, 2 threads, quiet); at 1 << 21 (the
# workqueue pool's threshold) they ran serial.
MATMUL_PARALLEL_MIN_WORK = 1 << 18
WIDEN_BLOCK_BYTES = 1 << 20       # float32 bytes per widened block: stays in L2 while BLAS reads it


@njit(cache=True, fastmath=True, nogil=True)
def matmul_t_rows(W, x, y, lo, hi):
    """y[:, lo:hi] = x[T, d] @ W[lo:hi]^T; W float32 or float16 bits (uint16) [n, d], x and y float32.

    Row by row: each row of W is read from DRAM once and stays in L1 for the T dot products."""
    d = W.shape[1]
    for j in range(lo, hi):
        prefetch_ahead(W, j, 0, d * W.itemsize)
        w = W[j]
        for t in range(x.shape[0]):
            y[t, j] = _dot(w, x[t], d)


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def matmul_t_kernel(W, x, y, chunks):
    """matmul_t_rows over all rows, split into `chunks` contiguous row ranges run in parallel."""
    n = W.shape[0]
    for c in prange(chunks):
        matmul_t_rows(W, x, y, c * n // chunks, (c + 1) * n // chunks)


# Serial on purpose: it alternates with multi-threaded BLAS calls, and a Numba parallel region between them makes
# each pool wait for the other's spinning threads (measured ~10x slower on 2 loaded cores).
@njit(cache=True, fastmath=True, nogil=True)
def widen_rows(W, lo, out):
    """out[m, d] = rows lo .. lo + m of W as float32."""
    for r in range(out.shape[0]):
        w = W[lo + r]
        o = out[r]
        for k in range(out.shape[1]):
            o[k] = _load(w, k)


def matmul_t(x: np.ndarray, w: np.ndarray, row_kernel_max_t: int = MATMUL_ROW_KERNEL_MAX_T,
             parallel_min_work: int = MATMUL_PARALLEL_MIN_WORK) -> np.ndarray:
    """x [T, d] @ w [n, d]^T -> float32 [T, n] for a float16 or float32 matrix w."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul_t: x {x.shape} does not match w {w.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, (n, d) = x.shape[0], w.shape
    W = w.view(np.uint16) if w.dtype == np.float16 else w
    y = np.empty((T, n), np.float32)
    if T <= row_kernel_max_t:
        threads = numba.get_num_threads()
        if threads > 1 and T * n * d >= parallel_min_work:
            matmul_t_kernel(W, x, y, threads)
        else:
            matmul_t_rows(W, x, y, 0, n)
    elif w.dtype == np.float32:
        np.matmul(x, w.T, out=y)
    else:
        matmul_widened(x, n, d, lambda lo, block: widen_rows(W, lo, block), y)
    return y


def matmul_widened(x: np.ndarray, n: int, d: int, widen, y: np.ndarray) -> None:
    """y[T, n] = x @ W^T for a compact W [n, d] that `widen(lo, block)` writes to float32 rows lo.. of `block`, one
    L2-sized block at a time, each then multiplied by BLAS (the prefill path of matmul_t and quant.quant_matmul_t)."""
    buf = np.empty((max(1, min(n, WIDEN_BLOCK_BYTES // (4 * d))), d), np.float32)
    for lo in range(0, n, buf.shape[0]):
        block = buf[: min(buf.shape[0], n - lo)]
        widen(lo, block)
        np.matmul(x, block.T, out=y[:, lo: lo + block.shape[0]])


# ---------------------------------------------------------------------------------------------------------------
# Decode step kernels: attention over the float16 KV cache and the fused residual add + RMSNorm. At T = 1 each numpy
# op costs ~1-3 us of dispatch on vectors of 64-576 elements, ~25 of them per layer; one Numba call replaces them.


@njit(cache=True, fastmath=True, nogil=True)
def _rope_inplace(x, cos, sin, half):
    """x [2 * half] rotated in place: the half-split pairing of model.apply_rope."""
    for i in range(half):
        a, b = x[i], x[i + half]
        x[i] = a * cos[i] - b * sin[i]
        x[i + half] = b * cos[i] + a * sin[i]


@njit(cache=True, fastmath=True, nogil=True)
def attention_rows(q, k, v, cos, sin, K, V, pos0, window, out):
    """Causal GQA attention of T new rows at positions pos0.., appending their keys and values to a layer's cache.

    q [T, H, hd], k and v [T, Hkv, hd] float32 (q and k are rotated in place); cos, sin [T, hd/2] float32 (shape
    [T, 0]: no RoPE); K, V [capacity, Hkv, hd] float16 bits (uint16), rows pos0 .. pos0+T-1 written here; window:
    Mistral's sliding window (0: none); out [T, H, hd] float32. Query head h reads KV head h // (H / Hkv)."""
    T, H, hd = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    half = cos.shape[1]
    scale = np.float32(1.0 / math.sqrt(hd))
    for t in range(T):
        for h in range(H if half else 0):
            _rope_inplace(q[t, h], cos[t], sin[t], half)
        for c in range(Hkv):
            if half:
                _rope_inplace(k[t, c], cos[t], sin[t], half)
            Kr, Vr = K[pos0 + t, c], V[pos0 + t, c]
            for i in range(hd):
                Kr[i] = f32_to_f16_bits(k[t, c, i])
                Vr[i] = f32_to_f16_bits(v[t, c, i])
    scores = np.empty(pos0 + T, np.float32)
    for t in range(T):
        pos = pos0 + t
        lo = max(0, pos - window + 1) if window > 0 else 0     # keys j with pos - window < j <= pos
        for h in range(H):
            c = h // group
            qh = q[t, h]
            m = -np.inf
            for j in range(lo, pos + 1):
                s = _dot(K[j, c], qh, hd) * scale
                scores[j] = s
                m = max(m, s)
            o = out[t, h]
            o[:] = 0.0
            total = np.float32(0.0)
            for j in range(lo, pos + 1):
                p = np.float32(math.exp(scores[j] - m))
                total += p
                _axpy(o, p, V[j, c], hd)
            inv = np.float32(1.0) / total
            for i in range(hd):
                o[i] *= inv


@njit(cache=True, fastmath=True, nogil=True)
def _rms_norm_row(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w over one row [d]."""
    d = x.shape[0]
    ss = np.float32(0.0)
    for i in range(d):
        ss += x[i] * x[i]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
    for i in range(d):
        out[i] = x[i] * r * w[i]


@njit(cache=True, fastmath=True, nogil=True)
def rms_norm_rows(x, w, eps, out):
    """out[t] = RMSNorm(x[t]) * w; x, out float32 [T, d], w float32 [d]."""
    for t in range(x.shape[0]):
        _rms_norm_row(x[t], w, eps, out[t])


@njit(cache=True, fastmath=True, nogil=True)
def add_rms_norm_rows(x, delta, w, eps, out):
    """x[t] += delta[t] (the residual add, in place), then out[t] = RMSNorm(x[t]) * w: one pass over x."""
    for t in range(x.shape[0]):
        xt, dt = x[t], delta[t]
        for i in range(xt.shape[0]):
            xt[i] += dt[i]
        _rms_norm_row(xt, w, eps, out[t])
