"""`flashinfer-lite convert MODEL -o FLASHDIR [--dtype auto|q8_0|q4_0|q4_1|q5_0|q5_1|f16|f32|int8] [--force]`: write the
on-flash format.

--dtype auto keeps the source's precision: a GGUF's block formats (checkpoint.GGUF_TYPES), matrix by matrix and layer
by layer as the GGUF mixes them (a Q4_K_M: q4_k or q5_0 gate and up, ...), f16 for an HF checkpoint. With block
formats the bundles' gate and up rows and the resident attention, embedding and lm_head matrices are copied from the
GGUF verbatim where it stores them in a block format already, and quantized (llama.cpp's rounding) otherwise. A
GGUF's down matrix runs its blocks along n, where a bundle needs a column: --dtype auto keeps it exactly as columns
(storage.columns: each bundle its column's values, the blocks' scales resident per layer); an explicit block dtype
requantizes it along d (down_note).

Everything is written into a temp directory next to the output, fsynced, and renamed into place last, so an
interrupted convert never leaves a directory that read_layout would accept.
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from tqdm import tqdm

from storage.errors import UserError, commit
from storage.half import half_matrix

from .checkpoint import open_checkpoint
from .experts import EXPERT_DTYPES, MATRICES, ExpertLayout, expert_tensor_name
from .files import disk_bytes, is_scratch, remove_stale_temp_dirs, temp_path
from . import columns
from .blocks import QUANTIZABLE, fits, quantize, row_bytes
from .format import (DTYPES, MANIFEST, QUANT_DTYPES, PREDICTOR_DIR, FlashLayout, expert_checksum, file_checksum,
                     ffn_tensor_names, pack_bundles, read_layout, scale_table_name, write_manifest,
                     write_verified_stamp)
from .gate_file import GATE_FILE, reorder_gate_file
from .safetensors_out import SafetensorsWriter

PACK_NEURONS = 4096   # neurons packed at a time: bounds the extra memory for wide FFNs
DEFAULT_DTYPE = "auto"
EXPERT_CHUNKS = ("whole", "split")    # storage.experts: whole matrices, or heads then down columns
FFN_LAYOUTS = ("auto", "bundles", "parts")   # a dense model's FFN: ffn.bin's bundles, or the split parts alone
# resident matrices a quantized FLASHDIR keeps in blocks: the ones multiplied (linear) or looked up by row (embeddings)
QUANTIZED_RESIDENT = re.compile(r"embed\.weight|lm_head\.weight|layers\.\d+\.attn\.[qkvo]\.weight")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="Hugging Face model directory or .gguf file")
    parser.add_argument("-o", "--output", required=True, help="flash directory to create")
    parser.add_argument("--dtype", choices=("auto", *DTYPES, *QUANTIZABLE), default=DEFAULT_DTYPE,
                        help="storage type of the FFN bundles and resident matrices (default auto: a GGUF's own block "
                             "formats, K-quants included, or f16; q8_0/q4_0/q4_1/q5_0/q5_1: GGUF blocks; int8: "
                             "symmetric per-vector scale)")
    parser.add_argument("--expert-chunks", choices=EXPERT_CHUNKS, default="whole",
                        help="a mixture of experts' chunks: whole (gate, up, down matrices; default) or split (gate|up "
                             "rows, then down columns along d, so a routed expert can read only its firing neurons' "
                             "columns: --ffn gate; a GGUF's down blocks are requantized along d)")
    parser.add_argument("--ffn-layout", choices=FFN_LAYOUTS, default="auto",
                        help="a dense model's FFN on flash: bundles (ffn.bin: gate, up and down of a neuron in one "
                             "read; --ffn predicted and oracle) or parts (gate|up rows and down rows in two files: "
                             "the exact gate, --ffn gate, reads them, and the other modes assemble bundles from them "
                             "with two reads a neuron). auto (default): parts for SiLU- and GELU-gated models, whose "
                             "FFN runs the exact gate, bundles for the others")
    parser.add_argument("--force", action="store_true", help="replace an existing flash directory")


def run(args) -> int:
    out = convert(args.model, args.output, dtype=args.dtype, force=args.force, expert_chunks=args.expert_chunks,
                  ffn_layout=args.ffn_layout)
    L = read_layout(out)
    if L.experts is not None:
        E = L.experts
        print(f"wrote {out}: {E.n_layers} layers x {E.n_experts} experts of {E.n} neurons, {'/'.join(E.dtypes)}"
              f"{' split' if E.split else ''} chunks of {E.chunk} bytes, ffn.bin {L.ffn_size / 2**20:.1f} MiB")
        return 0
    print(f"wrote {out}: {L.n_layers} layers x {L.n_neurons[0]} neurons, {L.dtype} bundles of {L.stride} bytes"
          + "".join(f", {F.files['ffn']} {F.ffn_size / 2**20:.1f} MiB" for F in L.ffn_files))
    return 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The bundles need the down matrix's blocks along d, and a GGUF's run along n: it is requantized. Into q8_0: its
# rounding is 1/254 of a 32-weight block's largest weight, ~1/16 of a 4-bit step and ~1/4 of a 6-bit one, so the
# source's own rounding stays the error that counts (SmolLM2's Q4_1 down rounded to q4_1 a second time: perplexity
# +8%; into q8_0 +0.35%). The K-quants' 6-bit type (q6_k) would be smaller, but needs d a multiple of 256 and a
# quantizer gguf-py does not have (SmolLM2's d is 576 anyway).
DOWN_REQUANT = "q8_0"


def down_dtype_for(ckpt, dtype: str) -> str | None:
    """The down vector's block format in bundles of `dtype` (None: dtype itself): q8_0 when the source holds the down
    matrix in blocks of fewer bits than 8, so that it is not rounded twice to as few bits."""
    src = ckpt.precision("layers.0.ffn.down.weight")
    low = src in QUANT_DTYPES and src != DOWN_REQUANT
    return DOWN_REQUANT if low and dtype in QUANT_DTYPES and dtype != DOWN_REQUANT else None


def down_note(ckpt, layout: FlashLayout) -> str:
    """One line: what a GGUF's down matrix becomes in the bundles, and why (experts keep their blocks: nothing)."""
    if layout.experts is not None:
        return ""
    src = ckpt.precision("layers.0.ffn.down.weight")
    if not layout.quantized or src not in QUANT_DTYPES:
        return ""
    if layout.down_column(0):
        return (f"the down matrix ({src}, its blocks along the {layout.n_neurons[0]} neurons) is kept exactly: each "
                f"bundle holds its column's {columns.BITS[layout.down_column(0)]}-bit values, the blocks' scales stay "
                f"in DRAM per layer")
    return (f"the down matrix ({src}, its blocks along the {layout.n_neurons[0]} neurons) becomes "
            f"{layout.geometry_of(0).dtype_of('down')} along d={layout.d}: a bundle holds a neuron's down column as "
            f"one row, and 8-bit rounding stays far below the source's own")


def _auto_dtypes(ckpt, layer: int) -> tuple[str, ...]:
    """--dtype auto: each bundle vector's block format in layer `layer` (gate and up as the GGUF stores them, down
    as the GGUF's own blocks cut into columns, else requantized into DOWN_REQUANT), or f16 for every vector when the
    FFN is not in blocks."""
    cfg = ckpt.config
    first = ckpt.precision(f"layers.{layer}.ffn.{'gate' if cfg.glu else 'up'}.weight")
    if first not in QUANT_DTYPES:
        return ("f16",) * (3 if cfg.glu else 2)
    kinds = []
    for v in ("gate", "up") if cfg.glu else ("up",):
        k = ckpt.precision(f"layers.{layer}.ffn.{v}.weight")
        kinds.append(k if k in QUANT_DTYPES and fits(cfg.dim, k) else DOWN_REQUANT)  # a float gate or up: 8 bits
    down = ckpt.block_kind(f"layers.{layer}.ffn.down.weight")
    if down is not None and columns.fits(cfg.dim, cfg.ffn_dim, down):
        return (*kinds, down + columns.SUFFIX)
    return (*kinds, DOWN_REQUANT)


def layout_for(ckpt, dtype: str, orders=None, ffn_layout: str = "auto") -> FlashLayout:
    """The layout of a checkpoint: which biases travel in the bundles, the neuron count of every layer, (dtype
    auto) each layer's vector dtypes that keep the checkpoint's precision, and (ffn_layout, FFN_LAYOUTS) whether
    the bundles live in ffn.bin or in the split parts alone."""
    cfg = ckpt.config
    if ffn_layout not in FFN_LAYOUTS:
        raise UserError(f"--ffn-layout is one of {', '.join(FFN_LAYOUTS)}, not {ffn_layout!r}")
    if ffn_layout == "parts" and not cfg.glu:
        raise UserError(f"--ffn-layout parts is for gated FFNs (gate, up, down); {ckpt.path} has up and down only")
    if cfg.moe:
        return expert_layout_for(ckpt, dtype)
    names = set(ckpt.names())
    down_dtype, per_layer = None, None
    if dtype == "auto":
        per_layer = [_auto_dtypes(ckpt, i) for i in range(cfg.n_layers)]
        dtype = per_layer[0][0]
        if dtype not in QUANT_DTYPES:
            per_layer = None
    if per_layer is None:
        down_dtype = down_dtype_for(ckpt, dtype)
    biases = [b for b, part in (("bias.gate", "gate"), ("bias.up", "up"))
              if (cfg.glu or part == "up") and f"layers.0.ffn.{part}.bias" in names]
    layout = FlashLayout.create(cfg.dim, [cfg.ffn_dim] * cfg.n_layers, dtype, cfg.glu, biases, orders,
                                down_dtype=down_dtype, layer_dtypes=per_layer, config=cfg.to_dict())
    for i in range(cfg.n_layers):
        missing = [n for n in ffn_tensor_names(layout, i) if n not in names]
        if missing:
            raise UserError(f"{ckpt.path}: layer {i} lacks {missing[0]} (layer 0 has it)")
    # The exact gate (ffn.gate) reads the split parts; the other modes assemble bundles from them (no second copy)
    parts = ffn_layout == "parts" or (ffn_layout == "auto" and cfg.exact_gate)
    return layout.in_parts() if parts else layout


def expert_layout_for(ckpt, dtype: str) -> FlashLayout:
    """The layout of a mixture of experts: no bundles, every expert one chunk (storage.experts). dtype auto keeps the
    source's precision: each matrix in a GGUF's own block format where it has one this format stores (its blocks
    copied as they are), else f16 (an HF checkpoint's)."""
    cfg = ckpt.config
    if dtype not in ("auto", *EXPERT_DTYPES):
        raise UserError(f"experts are stored as {', '.join(EXPERT_DTYPES)} (or auto), not {dtype}")
    if dtype == "auto":
        kinds = []
        for m in MATRICES:
            stored = ckpt.quantized(expert_tensor_name(0, 0, m))
            kinds.append(stored[0] if stored is not None else "f16")
        dtypes = tuple(kinds)
    else:
        dtypes = (dtype,) * 3
    main = dtypes[0]
    layout = FlashLayout.create(cfg.dim, [], main, True, config=cfg.to_dict())
    layout.experts = ExpertLayout(cfg.dim, cfg.ffn_dim, cfg.n_experts, cfg.n_layers, dtypes)
    layout.ffn_size = layout.experts.end
    return layout


def _write_experts(f, ckpt, layout: FlashLayout, layer: int) -> list[str]:
    """Write one layer's experts at their offsets, one expert in memory at a time; return their checksums."""
    E, sums = layout.experts, []
    for e in range(E.n_experts):
        mats = {}
        for k, m in enumerate(MATRICES):
            name = expert_tensor_name(layer, e, m)
            stored = ckpt.quantized(name)
            mats[m] = stored[1] if stored is not None and stored[0] == E.dtypes[k] else ckpt.tensor(name)
        chunk = E.pack(mats)
        del mats
        h = expert_checksum(E, layer, e)
        h.update(chunk)
        sums.append(h.hexdigest())
        f.seek(E.chunk_offset(layer, e))
        f.write(chunk)
    ckpt.release()
    return sums


def _layer_vectors(ckpt, layout: FlashLayout, layer: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per vector the [n, d] matrix whose row i goes into bundle of neuron i (or, already in the layout's blocks,
    uint8 [n, vector_bytes]: a GGUF's gate/up rows); per bias the [n] vector."""
    n, d = layout.n_neurons[layer], layout.d
    g = layout.geometry_of(layer)
    mats = []
    for v in layout.vectors:
        if v == "down" and layout.down_column(layer):
            mats.append(_down_columns(ckpt, layout, layer)[0])
            continue
        stored = ckpt.quantized(f"layers.{layer}.ffn.{v}.weight") if layout.quantized and v != "down" else None
        if stored is not None and stored[0] == g.dtype_of(v) and stored[1].shape == (n, g.vector_bytes(v)):
            mats.append(stored[1])                      # rows along d: the bundle's vector as it is
            continue
        w = ckpt.tensor(f"layers.{layer}.ffn.{v}.weight")
        want = (d, n) if v == "down" else (n, d)
        if w.shape != want:
            raise UserError(f"{ckpt.path}: layers.{layer}.ffn.{v}.weight has shape {w.shape}, expected {want}")
        mats.append(w.T if v == "down" else w)          # down: column i of [d, n] is neuron i
    bs = []
    for b in layout.biases:
        t = ckpt.tensor(f"layers.{layer}.ffn.{b.split('.')[1]}.bias")
        if t.shape != (n,):
            raise UserError(f"{ckpt.path}: layers.{layer}.ffn.{b.split('.')[1]}.bias has shape {t.shape}, want ({n},)")
        bs.append(t)
    return mats, bs


def _down_columns(ckpt, layout: FlashLayout, layer: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Layer `layer`'s down matrix cut into (columns uint8 [n, column bytes], scale tables): storage.columns.split."""
    kind = layout.down_column(layer)
    stored = ckpt.quantized(f"layers.{layer}.ffn.down.weight")
    if stored is None or stored[0] != kind:
        raise UserError(f"{ckpt.path}: layers.{layer}.ffn.down.weight is not in {kind} blocks")
    return columns.split(stored[1], kind, layout.n_neurons[layer])


def scale_tables(ckpt, layout: FlashLayout) -> list[tuple[str, tuple, np.dtype, callable]]:
    """(name, shape, dtype, read) of every down column table resident.safetensors holds; read() cuts its layer again
    (cheap beside the write: no layer's tables are held while the bundles are written)."""
    out = []
    for i in range(layout.n_layers):
        kind = layout.down_column(i)
        for t, (shape, dt) in columns.table_shapes(kind, layout.d, layout.n_neurons[i]).items() if kind else ():
            out.append((scale_table_name(i, t), shape, dt,
                        lambda i=i, t=t: _down_columns(ckpt, layout, i)[1][t]))
    return out


def _write_layer(sinks, ckpt, layout: FlashLayout, layer: int) -> list[str]:
    """Read and pack one layer's bundles and write them to each sink (file, F): ffn.bin's bundles when F is the
    layout, else a split part's rows cut from them (F = layout.parts[name]), each at its region's offset. Return each
    region's checksum. A function so that the layer's float32 matrices are freed on return, before the next layer's
    are read."""
    mats, bs = _layer_vectors(ckpt, layout, layer)
    order, g = layout.order[layer], layout.geometry_of(layer)
    sums = [F.layer_checksum(layer) for _, F in sinks]
    for f, F in sinks:
        f.write(b"\0" * (F.offset[layer] - f.tell()))  # pad to the 4096-aligned region start
    for a in range(0, layout.n_neurons[layer], PACK_NEURONS):
        idx = order[a:a + PACK_NEURONS]               # bundle a+j holds original neuron order[a+j]
        vecs = [m[idx] for m in mats]                 # n_vec gathered [c, d] (or [c, vector_bytes]) copies
        bias = np.stack([b[idx] for b in bs], axis=1) if bs else None                   # [c, n_bias]
        packed = pack_bundles(layout, vecs, bias, layer, neurons=idx)
        del vecs                                      # before the next chunk's are allocated
        for (f, F), h in zip(sinks, sums):
            rows = packed if F is layout else g.extract(packed, F.geometry_of(layer))
            h.update(rows)
            f.write(rows)
    return [h.hexdigest() for h in sums]


def write_flashdir(ckpt, layout: FlashLayout, dest: Path, progress: bool = True) -> None:
    """Write ffn.bin (or the split parts, when the layout keeps its bundles in them: layout_for), resident.safetensors,
    tokenizer/ and (last) manifest.json into the empty directory dest. progress: a bar on stderr counting the bytes
    written against flashdir_bytes, with its rate and the time left.

    Memory stays at about one layer whatever the layer count: a layer's FFN is read, packed and written before the
    next is read, and resident tensors are written one at a time as they are read."""
    names = resident_names(ckpt, layout)
    E = layout.experts
    bar = tqdm(total=flashdir_bytes(ckpt, layout, names), desc="convert", unit="B", unit_scale=True,
               unit_divisor=1024, disable=not progress, file=sys.stderr)
    outputs = layout.ffn_files
    with bar, ExitStack() as files:
        sinks = [(files.enter_context(open(dest / F.files["ffn"], "wb")), F) for F in outputs]
        written = 0

        def advance() -> None:      # the FFN files' bytes so far (experts are written at their offsets: tell())
            nonlocal written
            now = sum(f.tell() for f, _ in sinks)
            bar.update(max(now - written, 0))
            written = max(now, written)
        for F in outputs:
            F.checksum = []
        for i in range(layout.n_layers):
            bar.set_postfix_str(f"layer {i}")
            for F, digest in zip(outputs, _write_layer(sinks, ckpt, layout, i)):
                F.checksum.append(digest)
            advance()
        if E is not None:
            f = sinks[0][0]
            E.checksum = []
            for i in range(E.n_layers):
                bar.set_postfix_str(f"layer {i}'s experts")
                E.checksum.append(_write_experts(f, ckpt, layout, i))
                advance()
            f.seek(0, os.SEEK_END)
        for f, F in sinks:
            f.write(b"\0" * (F.ffn_size - f.tell()))
            f.flush()
            os.fsync(f.fileno())
        advance()

        bar.set_postfix_str("resident")
        layout.resident_checksum = write_resident(ckpt, names, dest / layout.files["resident"],
                                                  half=layout.dtype != "f32", quant=resident_quant(layout),
                                                  tables=scale_tables(ckpt, layout), written=bar.update)

        bar.set_postfix_str("tokenizer")
        tok_dir = dest / layout.files["tokenizer"]
        tok_dir.mkdir()
        ckpt.tokenizer().save(tok_dir)
        bar.update(disk_bytes(tok_dir))
        bar.total = bar.n           # the estimate bounds what was written: the bar ends at 100% of it
    write_manifest(layout, dest)
    _fsync_dir(dest)


# tokenizer/ per vocabulary entry, generously: SmolLM2's 49,152 entries take 1.5 MiB (32 bytes each)
TOKENIZER_BYTES_PER_TOKEN = 64


def flashdir_bytes(ckpt, layout: FlashLayout, names: list[str] | None = None) -> int:
    """The bytes write_flashdir will write, from the header alone: the FFN files as the layout sizes them,
    resident.safetensors's tensors as write_resident stores them (a matrix float16 overflows into float32 only
    rarely: then more) and the tokenizer (TOKENIZER_BYTES_PER_TOKEN per vocabulary entry)."""
    names = resident_names(ckpt, layout) if names is None else names
    kinds = resident_kinds(ckpt, names, resident_quant(layout))
    half = layout.dtype != "f32"
    resident = sum(columns.table_bytes(layout.down_column(i), layout.d, layout.n_neurons[i])
                   for i in range(layout.n_layers) if layout.down_column(i))
    for n in names:
        shape = ckpt.shape(n)
        if n in kinds:
            resident += shape[0] * row_bytes(shape[1], kinds[n])
        else:
            resident += int(np.prod(shape)) * (2 if half and len(shape) == 2 else 4)
    return (sum(F.ffn_size for F in layout.ffn_files) + resident
            + TOKENIZER_BYTES_PER_TOKEN * ckpt.config.vocab_size + (64 << 10))     # + headers and manifest


def check_free_space(out: Path, need: int) -> None:
    """Refuse, before anything is written, a conversion of `need` bytes into `out` that its filesystem has no room for
    (the free space of its nearest existing directory): one line naming both, rather than ENOSPC after minutes. An
    --force replacement counts in full: the old directory goes only once the new one is in place."""
    where = next(p for p in (out.parent, *out.parent.parents) if p.is_dir())
    free = shutil.disk_usage(where).free
    if free < need:
        raise UserError(f"need {gigabytes(need)} free in {where} to convert into {out.name}, have {gigabytes(free)}")


# What a conversion writes per second, for the line announcing a first use (storage.cache.first_use_line): the 1.5B
# Qwen Q4_K_M GGUF's 1.1 GB took 20 CPU seconds (2 vCPUs), gguf-py's parse of its 152k-token vocabulary a good part;
# the disk's writes come on top. A busy machine's wall time is longer: the bar's ETA is the measured figure.
CONVERT_BYTES_PER_S = 30e6


def convert_seconds(nbytes: int) -> float:
    """Roughly how long converting into nbytes takes (CONVERT_BYTES_PER_S)."""
    return nbytes / CONVERT_BYTES_PER_S


def gigabytes(n: int) -> str:
    """Bytes as people read disk sizes: GB with one decimal (MB under 0.1 GB, as df -H prints them)."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def resident_quant(layout: FlashLayout) -> str | None:
    """The block format a quantized FLASHDIR quantizes its resident matrices into when the source has none: the
    bundles' first kind, or q8_0 when that one cannot be made here (a K-quant)."""
    if not layout.quantized:
        return None
    return layout.dtype if layout.dtype in QUANTIZABLE else DOWN_REQUANT


def resident_names(ckpt, layout: FlashLayout) -> list[str]:
    """The tensors of ckpt that go to resident.safetensors: all but the bundles' (or the experts' chunks')."""
    bundled = {n for i in range(layout.n_layers) for n in ffn_tensor_names(layout, i)}
    E = layout.experts
    if E is not None:
        bundled |= {expert_tensor_name(i, e, m) for i in range(E.n_layers) for e in range(E.n_experts)
                    for m in MATRICES}
    return [n for n in ckpt.names() if n not in bundled]


def resident_kinds(ckpt, names: list[str], quant: str | None) -> dict[str, str]:
    """{name: block kind} of the resident matrices a FLASHDIR of bundle kind `quant` keeps in blocks: the GGUF's own
    kind where it stores the matrix in one (copied verbatim), else `quant`; none whose rows are not whole blocks."""
    kinds = {}
    for n in names if quant else ():
        if QUANTIZED_RESIDENT.fullmatch(n):
            stored = ckpt.block_kind(n)             # from the header: no tensor read
            if stored is not None:
                kinds[n] = stored
            elif fits(ckpt.shape(n)[1], quant):
                kinds[n] = quant
    return kinds


def write_resident(ckpt, names: list[str], path: Path, half: bool, quant: str | None = None, tables=(),
                   written=lambda nbytes: None) -> str:
    """Write the tensors `names` of ckpt into the safetensors file path, one at a time; return its checksum.

    half (float16 or int8 bundles): matrices float16 by the runtime's rule (storage.half), so the file holds
    what the runtime keeps in DRAM and is half the size; norms and biases float32. Else everything float32.
    quant (a block kind): the matrices of resident_kinds as uint8 [rows, row_bytes], named in the file's metadata.
    tables: the down columns' scale tables (scale_tables), as they are. written(nbytes): after each tensor."""
    store = half_matrix if half else (lambda a: a)
    kinds = resident_kinds(ckpt, names, quant)
    shapes = [(n, ckpt.shape(n)) for n in names]
    shapes = [(n, (s[0], row_bytes(s[1], kinds[n])) if n in kinds else s) for n, s in shapes]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # umask applies: the runtime may be another user
    with open(fd, "wb") as f:
        out = SafetensorsWriter(f, [(n, s) for n, s, _, _ in tables] + shapes, metadata=kinds or None)
        for n, _, _, read in tables:
            t = read()
            out.write(n, t)
            written(t.nbytes)
        for n in names:
            if n in kinds:
                stored = ckpt.quantized(n)
                t = stored[1] if stored is not None else quantize(ckpt.tensor(n), kinds[n])
            else:
                t = store(np.asarray(ckpt.tensor(n), np.float32))
            out.write(n, t)
            written(t.nbytes)
            del t                               # dropped once written
        out.finish()
        f.flush()
        os.fsync(f.fileno())
    return file_checksum(path)


def replaceable(out: Path) -> bool:
    """Whether --force may replace out: a FLASHDIR this program wrote (its manifest read whole: format tag, version,
    every field) holding nothing but what such a directory holds. Never a file, a symlink or a foreign directory,
    whatever it contains: --force must not delete what the user owns."""
    if out.is_symlink() or not out.is_dir():
        return False
    try:
        layout = read_layout(out, check_size=False)
    except UserError:
        return False
    ours = {MANIFEST, PREDICTOR_DIR, GATE_FILE, *layout.files.values()}     # gate.json: calibrated, or order_by's
    return all(p.name in ours or is_scratch(p.name) for p in out.iterdir())


def _check_output(out: Path, force: bool) -> None:
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise UserError(f"{out} already exists (use --force to replace it)")
    if not replaceable(out):
        raise UserError(f"{out} is not a flash directory written by flashinfer-lite convert; --force replaces only "
                        f"those, refusing to replace it")


def _place(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished tmp to out. rename(2) refuses to replace a non-empty directory, so of two writers racing
    for the same out without --force, the later one fails here and says so, and the first's output stays."""
    if force and (out.exists() or out.is_symlink()):
        _check_output(out, force)                 # again: it may have changed during the conversion
        old = temp_path(out, "old")
        with commit():
            os.replace(out, old)
            os.replace(tmp, out)
        shutil.rmtree(old)
        return
    try:
        with commit():
            os.rename(tmp, out)                   # replaces at most an empty directory
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise UserError(f"{out} was created by someone else while this convert ran; left it as it is") from None
        raise


def convert(model, output, dtype: str = DEFAULT_DTYPE, force: bool = False, progress: bool = True,
            expert_chunks: str = "whole", ffn_layout: str = "auto", order_by=None) -> Path:
    """Convert `model` into the FLASHDIR `output`. order_by: a function of a FLASHDIR of the model written in its own
    order (a temp directory beside output) giving each layer's bundle order (position -> bundle id; it may write
    gate.json there): the model is then written again in that order (predictors.coact: co-activation)."""
    out = Path(output).expanduser()
    _check_output(out, force)
    ckpt = open_checkpoint(model)
    if expert_chunks not in EXPERT_CHUNKS:
        raise UserError(f"--expert-chunks is one of {', '.join(EXPERT_CHUNKS)}, not {expert_chunks!r}")
    if expert_chunks == "split" and not ckpt.config.moe:
        raise UserError(f"--expert-chunks split is for mixtures of experts; {model} is a dense model")
    if ffn_layout != "auto" and ckpt.config.moe:
        raise UserError(f"--ffn-layout is for dense models; {model} is a mixture of experts (--expert-chunks)")
    layout = layout_for(ckpt, dtype, ffn_layout=ffn_layout)
    if order_by is not None and (ckpt.config.moe or not ckpt.config.exact_gate or "down" not in layout.parts):
        raise UserError(f"a co-activation order places the neurons of a dense gated model by the exact gate's firing, "
                        f"in the split layout (--ffn-layout auto or parts); {model} with --ffn-layout {ffn_layout} is "
                        f"not one")
    if expert_chunks == "split":
        layout.experts.split = True
        layout.ffn_size = layout.experts.end
    note = down_note(ckpt, layout)
    if note and progress:
        print(f"convert: {note}", file=sys.stderr)
    tmp = temp_path(out, "tmp")
    work = temp_path(out, "calibrate") if order_by else None     # the model in its own order, measured
    try:
        if out.parent.is_dir():
            remove_stale_temp_dirs(out.parent)      # a killed conversion's GBs are free space again
            shutil.rmtree(tmp, ignore_errors=True)
        check_free_space(out, flashdir_bytes(ckpt, layout) * (1 if work is None else 2))
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        try:
            if work is None:
                write_flashdir(ckpt, layout, tmp, progress)
            else:
                _write_in_order(ckpt, layout, work, tmp, order_by, progress, dtype, ffn_layout)
            _place(tmp, out, force)
            _fsync_dir(out.parent)
        except BaseException:   # includes Ctrl-C: no half-written directory survives
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)
    except OSError as e:        # a full disk (ENOSPC), a read-only one (EROFS), no permission: one line
        raise UserError(f"cannot write {e.filename or out}: {e.strerror or e}") from None
    write_verified_stamp(out)                     # every checksum was computed from the bytes just written
    return out


def _write_in_order(ckpt, layout: FlashLayout, work: Path, dest: Path, order_by, progress: bool, dtype: str,
                    ffn_layout: str) -> None:
    """convert's order_by: write the model in its own order into `work`, ask order_by(work) for each layer's order,
    and write the model again into dest in that order; work's gate.json (the exact gate's thresholds, if order_by
    calibrated them) goes with it, its frequencies moved with their bundles (the thresholds and every coefficient are
    the same bits in any order)."""
    work.mkdir()
    write_flashdir(ckpt, layout, work, progress)
    orders = order_by(work)
    ordered = layout_for(ckpt, dtype, [layout.order[i][o] for i, o in enumerate(orders)], ffn_layout)
    write_flashdir(ckpt, ordered, dest, progress)
    if (work / GATE_FILE).exists():
        reorder_gate_file(work, dest, orders)
