"""A GGUF down matrix kept exactly, as columns: the bundles' `<kind>.col` vectors and their resident scale tables.

A GGUF stores down [d, n] with its blocks along n: the scales of row i belong to (row i, block of 32 or 256
neurons) and, in the K-quants, to (row i, sub-block of 16 or 32 neurons). A bundle needs neuron j's column, so the
matrix is cut in two parts that together hold exactly the block's bits:

  column   neuron j's quantized values q[:, j] along d, as the block stored them (unsigned, q8_0's int8 bits), packed
           to the kind's bits (column_bytes) in groups of 64 elements, as the K-quants lay out theirs so that a
           kernel decodes 8, 16 or 32 neighbours with the same shift (SIMD): group G's low nibbles in bytes
           32G + k (element 64G + k low, 64G + 32 + k high), then after all d/2 nibble bytes the high bits (5-bit:
           byte d/2 + 8G + k, bit r: element 64G + 8r + k; 6-bit: byte d/2 + 16G + k, bits 2r, 2r + 1: element
           64G + 16r + k); q8_0 one byte each
  tables   per layer, resident: the blocks' other fields, transposed so row i runs along d (TABLES):
             d   uint16 [n / block weights, d]   every kind's float16 d (K-quants: the super-block's)
             m   uint16 [n / block weights, d]   q4_1, q5_1: float16 m; q4_k, q5_k: float16 dmin
             sc  uint8  [n / sub weights, d]     q4_k, q5_k: 6-bit sub-block scale; q6_k: int8 scale (its bits)
             mn  uint8  [n / 32, d]              q4_k, q5_k: 6-bit sub-block min

Element i of neuron j's column is then gguf.quants' value of (row i, weight j) with the same float32 operations
(b = j // block weights, s = j // sub weights):
  q8_0 d*q   q4_0 d*(q-8)   q5_0 d*(q-16)   q4_1, q5_1 d*q + m   q4_k, q5_k (d*sc)*q - (dmin*mn)   q6_k (d*sc)*(q-32)
On disk (resident.safetensors) the tables hold these raw fields: 20 bytes per 256 weights of a K-quant, about what
the GGUF spends on them, so the FLASHDIR stays the GGUF's size. In DRAM the runtime keeps them nearly as they are
(decode): d and m per block of neurons and row as the float16 bits they are (widened by the kernel with F16C;
float32 on hosts without), sc and mn as the bytes they are, and the kernel forms d*sc and dmin*mn per element (exact:
an 11-bit by 8-bit product, as gguf.quants'). Why not d*sc decoded to float32 per sub-block:
8 bytes per 32 weights of a K-quant (4 per 16 of a q6_k), 11.3 MB per layer of a 7B's down, which the sparse down
pass reads from DRAM for nearly every sub-block at any firing share; it ran at 0.62-0.71 of q4_0's bytes per second
(bench/quant_kernels.py, tables of every neuron). Kept raw they are 3.5 MB a layer (a 7B Q4_K_M's down: ~0.11 GB
over 32 layers against ~0.36 GB), which the budget counts (budget.down_scale_bytes).
The kernels: flashinfer_lite/kernels/blocks.py (col_axpy, col_dequant); tests/test_kdown.py checks both against gguf.quants.
"""
from __future__ import annotations

import numpy as np

from storage.errors import UserError

from .blocks import KIND_SIZES, check_kind

SUFFIX = ".col"
BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "q4_k": 4, "q5_k": 5, "q6_k": 6}
SUB_WEIGHTS = {"q4_k": 32, "q5_k": 32, "q6_k": 16}          # K-quants: neurons per sub-block scale
TABLES = ("d", "m", "sc", "mn")
COLUMN_DTYPES = tuple(k + SUFFIX for k in KIND_SIZES)


def kind_of(dtype: str) -> str | None:
    """The block kind of a column dtype (`q6_k.col` -> q6_k); None for any other dtype."""
    return dtype[:-len(SUFFIX)] if dtype in COLUMN_DTYPES else None


def tables_of(kind: str) -> tuple[str, ...]:
    """The TABLES a kind's columns need."""
    return ("d",) + (("m",) if kind in ("q4_1", "q5_1", "q4_k", "q5_k") else ()) + \
        (("sc",) if kind in SUB_WEIGHTS else ()) + (("mn",) if kind in ("q4_k", "q5_k") else ())


def groups(kind: str) -> tuple[int, int]:
    """(neurons per block, neurons per sub-block scale) of a kind's tables."""
    w = KIND_SIZES[check_kind(kind)][0]
    return w, SUB_WEIGHTS.get(kind, w)


GROUP = 64        # elements of a column group (the kernels' output block, kernels.neurons.OUT_BLOCK, is one)


def column_bytes(d: int, kind: str) -> int:
    if d <= 0 or d % GROUP:
        raise UserError(f"a {kind} column needs d a positive multiple of {GROUP}, got {d}")
    return d * BITS[check_kind(kind)] // 8


def fits(d: int, n: int, kind: str) -> bool:
    """Whether a down matrix [d, n] of `kind` can be kept as columns."""
    return d > 0 and d % GROUP == 0 and n > 0 and n % KIND_SIZES[kind][0] == 0


def table_shapes(kind: str, d: int, n: int) -> dict[str, tuple[tuple[int, int], np.dtype]]:
    """{table: ((rows, d), dtype)} of one layer's tables."""
    w, sw = groups(kind)
    rows = {"d": n // w, "m": n // w, "sc": n // sw, "mn": n // sw}
    return {t: ((rows[t], d), np.dtype(np.uint16 if t in ("d", "m") else np.uint8)) for t in tables_of(kind)}


def table_bytes(kind: str, d: int, n: int) -> int:
    return sum(r * c * dt.itemsize for (r, c), dt in table_shapes(kind, d, n).values())


def decoded_shapes(kind: str, d: int, n: int, f16: bool) -> dict[str, tuple[tuple[int, int], np.dtype]]:
    """{table: ((rows, d), dtype)} of decode's tables: a and m per block of neurons (m where the kind has one),
    float16 bits (f16) or float32, sc and mn uint8 per sub-block (K-quants)."""
    w, sw = groups(kind)
    t, f = tables_of(kind), np.dtype(np.uint16 if f16 else np.float32)
    return {**{k: ((n // w, d), f) for k in ("a", "m") if k == "a" or k in t},
            **{k: ((n // sw, d), np.dtype(np.uint8)) for k in ("sc", "mn") if k in t}}


def decoded_bytes(kind: str, d: int, n: int, f16: bool) -> int:
    return sum(r * c * dt.itemsize for (r, c), dt in decoded_shapes(kind, d, n, f16).values())


def decode(tables: dict, kind: str, f16: bool) -> dict[str, np.ndarray]:
    """A layer's raw tables -> the tables the kernels use: per block b of neurons and row i, a = d and m (q4_1,
    q5_1: added; q4_k, q5_k: dmin, whose product with mn is subtracted), as their float16 bits (f16: the kernel
    widens them, F16C) or float32; per sub-block s, sc and mn as stored (q6_k's sc: int8 bits). The kernels form an
    element from them with gguf.quants' float32 operations (the module docstring's, a K-quant's d*sc and dmin*mn
    too)."""
    f = (lambda t: tables[t]) if f16 else (lambda t: tables[t].view(np.float16).astype(np.float32))
    out = {"a": f("d"), **({"m": f("m")} if "m" in tables else {}),
           **{k: tables[k] for k in ("sc", "mn") if k in tables}}
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def zero_tables(kind: str, d: int, n: int) -> dict[str, np.ndarray]:
    """Tables of the right shapes, all zero (compiling the kernels needs their types, not their values)."""
    return {t: np.zeros(s, dt) for t, (s, dt) in table_shapes(kind, d, n).items()}


def check_tables(tables: dict, kind: str, d: int, n: int, src: str = "") -> dict[str, np.ndarray]:
    """Tables from a file: exactly the names, shapes and dtypes this kind needs (the kernels index them by neuron)."""
    want = table_shapes(kind, d, n)
    if set(tables) != set(want) or any(tables[t].shape != s or tables[t].dtype != dt for t, (s, dt) in want.items()):
        raise UserError(f"{src}the down column scales {sorted(tables)} are not {kind}'s "
                        f"{ {t: list(s) for t, (s, _) in want.items()} }; re-run convert")
    return {t: np.ascontiguousarray(tables[t]) for t in want}


# ---------------------------------------------------------------------------------------------------------------
# Cutting a GGUF matrix's rows into columns + tables


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, :, at:at + 2]).view(np.uint16)[..., 0]


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a 32-weight block -> [..., 32] values (byte k: element k low, k + 16 high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def split(raw: np.ndarray, kind: str, n: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A quantized matrix [d, n] as GGUF stores it (uint8 [d, row_bytes], blocks along n) -> (its columns uint8
    [n, column_bytes(d)], its tables {name: [groups, d]}): the same bits, cut as the module docstring says."""
    W, BB = KIND_SIZES[check_kind(kind)]
    D = raw.shape[0]
    if raw.dtype != np.uint8 or raw.shape != (D, n // W * BB) or not fits(D, n, kind):
        raise UserError(f"a {kind} down matrix [{D}, {n}] cannot be cut into columns (got {raw.dtype}{list(raw.shape)})")
    b = raw.reshape(D, n // W, BB)
    t = {"d": _f16(b, 0)}
    if kind == "q8_0":
        q = b[:, :, 2:]
    elif W == 32:                                                    # q4_0, q4_1, q5_0, q5_1
        head = 4 if kind in ("q4_1", "q5_1") else 2
        if head == 4:
            t["m"] = _f16(b, 2)
        five = kind in ("q5_0", "q5_1")
        q = _nibbles_32(b[:, :, head + 4 * five:])
        if five:
            qh = np.ascontiguousarray(b[:, :, head:head + 4]).view("<u4")
            q = q | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
    elif kind in ("q4_k", "q5_k"):
        t["m"] = _f16(b, 2)
        s = b[:, :, 4:16].astype(np.uint8)
        lo, hi = s[..., 0:4], s[..., 8:12]
        t["sc"] = np.concatenate([lo & 63, (hi & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        t["mn"] = np.concatenate([s[..., 4:8] & 63, (hi >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        base = 16 if kind == "q4_k" else 48
        subs = []
        for j in range(8):
            v = (b[:, :, base + (j >> 1) * 32:base + (j >> 1) * 32 + 32] >> (4 * (j & 1))) & 15
            if kind == "q5_k":
                v = v | (((b[:, :, 16:48] >> j) & 1) << 4)
            subs.append(v)
        q = np.concatenate(subs, axis=-1)
    else:                                                            # q6_k
        t["sc"] = b[:, :, 192:208]
        t["d"] = _f16(b, 208)
        subs = []
        for j in range(8):
            h, r = j >> 2, j & 3
            lo = (b[:, :, h * 64 + (r & 1) * 32:h * 64 + (r & 1) * 32 + 32] >> (4 * (r >> 1))) & 15
            subs.append(lo | (((b[:, :, 128 + h * 32:160 + h * 32] >> (2 * r)) & 3) << 4))
        q = np.concatenate(subs, axis=-1)
    q = np.ascontiguousarray(q.reshape(D, n).T)                      # [n, d]: row j is neuron j's column
    tables = {k: np.ascontiguousarray(v.reshape(D, -1).T) for k, v in t.items()}
    return pack(q, kind), tables


def join(cols: np.ndarray, kind: str, tables: dict) -> np.ndarray:
    """split's inverse: columns uint8 [n, column_bytes(d)] in neuron order and their tables -> the matrix [d, n] as
    GGUF stores it (uint8 [d, row_bytes], blocks along n), byte for byte. The resident dense FFN runs the GGUF's
    own row kernels on it (ffn.resident.ResidentFFN), so a FLASHDIR computes its GGUF's numbers."""
    W, BB = KIND_SIZES[check_kind(kind)]
    D, n = tables["d"].shape[1], cols.shape[0]
    nb = n // W
    q = unpack(cols, kind, D).T.reshape(D, nb, W)                   # row i's values, block by block
    t = {k: np.ascontiguousarray(v.T).reshape(D, nb, -1) for k, v in tables.items()}
    b = np.zeros((D, nb, BB), np.uint8)
    f16 = lambda v: v.reshape(D, nb, 1).astype("<u2").view(np.uint8)  # noqa: E731  (float16 bits -> 2 bytes)
    nib = lambda lo, hi: (lo & 15) | ((hi & 15) << 4)  # noqa: E731
    if kind == "q8_0":
        b[:, :, :2], b[:, :, 2:] = f16(t["d"]), q
    elif W == 32:                                                    # q4_0, q4_1, q5_0, q5_1
        head = 4 if kind in ("q4_1", "q5_1") else 2
        b[:, :, :2] = f16(t["d"])
        if head == 4:
            b[:, :, 2:4] = f16(t["m"])
        five = kind in ("q5_0", "q5_1")
        if five:
            qh = (((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
            b[:, :, head:head + 4] = qh.astype("<u4").reshape(D, nb, 1).view(np.uint8)
        b[:, :, head + 4 * five:] = nib(q[..., :16], q[..., 16:])
    elif kind in ("q4_k", "q5_k"):
        b[:, :, :2], b[:, :, 2:4] = f16(t["d"]), f16(t["m"])
        sc, mn = t["sc"], t["mn"]                                    # [D, nb, 8] each, 6 bits
        b[:, :, 4:8] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
        b[:, :, 8:12] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
        b[:, :, 12:16] = nib(sc[..., 4:], mn[..., 4:])
        base = 16 if kind == "q4_k" else 48
        for p in range(4):                                           # sub-blocks 2p (low nibbles), 2p + 1 (high)
            lo = 64 * p
            b[:, :, base + 32 * p:base + 32 * p + 32] = nib(q[..., lo:lo + 32], q[..., lo + 32:lo + 64])
        if kind == "q5_k":                                           # bit j of byte l: sub-block j's element l
            for j in range(8):
                b[:, :, 16:48] |= ((q[..., 32 * j:32 * j + 32] >> 4) & 1) << j
    else:                                                            # q6_k
        b[:, :, 192:208], b[:, :, 208:210] = t["sc"], f16(t["d"])
        for j in range(8):
            h, r = j >> 2, j & 3
            v = q[..., 32 * j:32 * j + 32]
            b[:, :, h * 64 + (r & 1) * 32:h * 64 + (r & 1) * 32 + 32] |= (v & 15) << (4 * (r >> 1))
            b[:, :, 128 + h * 32:160 + h * 32] |= ((v >> 4) & 3) << (2 * r)
    return b.reshape(D, nb * BB)


def pack(q: np.ndarray, kind: str) -> np.ndarray:
    """Raw values uint8 [n, d] -> columns uint8 [n, column_bytes(d)]."""
    bits = BITS[kind]
    if bits == 8:
        return np.ascontiguousarray(q)
    n, d = q.shape
    g = q.reshape(n, d // GROUP, GROUP)
    low = ((g[..., :32] & 15) | ((g[..., 32:] & 15) << 4)).reshape(n, d // 2)
    if bits == 4:
        return np.ascontiguousarray(low)
    h = g >> 4                                      # [n, groups, 64]: the high bits
    per = 8 if bits == 5 else 16                    # bytes of high bits per group; element r * per + k in byte k
    h = h.reshape(n, d // GROUP, GROUP // per, per)
    high = np.zeros((n, d // GROUP, per), np.uint8)
    for r in range(GROUP // per):
        high |= h[:, :, r] << ((bits - 4) * r)
    return np.ascontiguousarray(np.concatenate([low, high.reshape(n, -1)], axis=1))


def unpack(cols: np.ndarray, kind: str, d: int) -> np.ndarray:
    """Columns uint8 [n, column_bytes(d)] -> raw values uint8 [n, d] (pack's inverse)."""
    bits = BITS[kind]
    if bits == 8:
        return cols[:, :d].copy()
    n = cols.shape[0]
    low = cols[:, :d // 2].reshape(n, d // GROUP, 32)
    q = np.concatenate([low & 15, low >> 4], axis=2)           # [n, groups, 64]
    if bits > 4:
        per, width = (8, 1) if bits == 5 else (16, 2)
        high = cols[:, d // 2:d // 2 + d // GROUP * per].reshape(n, d // GROUP, 1, per)
        r = np.arange(GROUP // per, dtype=np.uint8).reshape(1, 1, -1, 1)
        q |= (((high >> (width * r)) & ((1 << width) - 1)) << 4).reshape(n, d // GROUP, GROUP)
    return np.ascontiguousarray(q.reshape(n, d))


def dequantize_columns(cols: np.ndarray, kind: str, tables: dict, neurons: np.ndarray) -> np.ndarray:
    """Columns uint8 [m, column_bytes(d)] of the neurons `neurons` -> float32 [m, d]: gguf.quants' values, the same
    float32 operations (the module docstring's formulas)."""
    d = tables["d"].shape[1]
    q = unpack(cols, kind, d)
    w, sw = groups(kind)
    neurons = np.asarray(neurons, np.int64)
    f16 = lambda name, rows: tables[name][rows].view(np.float16).astype(np.float32)  # noqa: E731
    dd = f16("d", neurons // w)
    if kind == "q8_0":
        return dd * q.view(np.int8).astype(np.float32)
    if kind in ("q4_0", "q5_0"):
        return dd * (q.astype(np.int8) - np.int8(8 if kind == "q4_0" else 16)).astype(np.float32)
    if kind in ("q4_1", "q5_1"):
        return dd * q.astype(np.float32) + f16("m", neurons // w)
    sc = tables["sc"][neurons // sw]
    if kind == "q6_k":
        return (dd * sc.view(np.int8).astype(np.float32)) * (q.astype(np.int8) - np.int8(32)).astype(np.float32)
    return (dd * sc.astype(np.float32)) * q.astype(np.float32) - \
        (f16("m", neurons // w) * tables["mn"][neurons // sw].astype(np.float32))


def source_matrix(cols: np.ndarray, kind: str, tables: dict, order: np.ndarray) -> np.ndarray:
    """The down matrix float32 [d, n] of a layer's columns in bundle order (order[b]: bundle b's neuron)."""
    out = np.empty((tables["d"].shape[1], len(order)), np.float32)
    out[:, order] = dequantize_columns(cols, kind, tables, order).T
    return out

