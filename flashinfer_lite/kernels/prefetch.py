"""Software prefetch. The hardware prefetcher streams long rows on its own, but not a loop over short ones: a decode
GEMV over SmolLM2's 360-byte q4_1 rows read them from DRAM at 3.1 GB/s, and at 8.8 GB/s when each row asked for
the lines ~2 KiB ahead (7B rows of 2-8 KiB: no gain; bench/README.md, "The OpenMP pool and software prefetch").
A hint: results are unchanged."""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


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

