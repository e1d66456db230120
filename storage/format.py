"""The on-flash format: FlashLayout (bundle geometry + per-layer regions), the manifest, bundle packing, FlashCheckpoint.

FLASHDIR/
  manifest.json          format name + version, model config, dtype, bundle geometry, per-layer regions, checksums
  resident.safetensors   every non-FFN tensor (+ ffn.down.bias, ffn_norm) in canonical names; matrices float16 in
                         f16/int8 FLASHDIRs (storage.half), float32 in f32 ones; in block-format ones the
                         attention, embedding and lm_head matrices in a block format (uint8 [rows, row_bytes], the
                         kind in the file's metadata: {name: kind}), the rest as in f16
  ffn.bin                per layer a 4096-aligned region of n_neurons bundles, `stride` bytes each
  tokenizer/             tokenizer.json + tokenizer_config.json

A bundle holds everything one neuron needs, so one read fetches it (row-column bundling, LLM in a Flash):
  n_vec vectors of length d back to back (d elements of `dtype` each, or GGUF blocks along d, storage/blocks.py:
  each vector of each layer may have a block format of its own, `layer_dtypes`, as llama.cpp's Q4_K_M mixes them),
  then
  float32 scalars at `scalars_offset` (int8: one symmetric scale per vector; then per-neuron biases), zero padding
  up to `stride` (a multiple of 512, so every run of bundles is an O_DIRECT-aligned read that lands directly in a
  cache row).
See docs/FORMAT.md.
"""
from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from storage.config import ModelConfig
from storage.errors import UserError
from storage.tokenizer import Tokenizer
from storage.untrusted import check_finite, inside, parse_json, read_bytes

from . import blocks, columns
from .checksums import file_checksum, manifest_checksum, new_checksum, region_checksum  # noqa: F401 (the format's)
from .predictor_files import PREDICTOR_DIR, PREDICTOR_MANIFEST, predictor_checksums
from .checkpoint import SafetensorsFile, check_shapes
from .files import write_best_effort
from .experts import MATRICES, ExpertLayout, expert_tensor_name

FORMAT_NAME = "flashinfer-lite-flash"
# The one version written and read. Every manifest names each layer's vector types and the bundles' alignment, and
# the files say where the bundles are (ffn.bin, the split parts, or both; experts whole or split). Older versions are
# refused: a FLASHDIR is rebuilt from its source by `convert` (the cache keys its conversions by this version).
FORMAT_VERSION = 5
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20     # a permutation per layer of a 70B model is ~10 MB of JSON; anything past this is not ours
BUNDLE_ALIGN = 512                # O_DIRECT granularity of offset, length and buffer address
PACKED_ALIGN = 4                  # bundles with down columns are packed: the reader aligns its reads instead
REGION_ALIGN = 4096               # layer regions start on a page
CHECKSUM_ALGO = "blake2b-128-bound"   # a layer's digest covers its index and geometry too (layer_checksum)
VERIFIED_STAMP = ".verified.json" # sizes and mtimes of the files as they were when every checksum last matched

DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "int8": np.dtype("i1")}   # one element per weight
QUANT_DTYPES = tuple(blocks.BLOCK_BYTES)                                           # GGUF blocks along d
BUNDLE_DTYPES = (*DTYPES, *QUANT_DTYPES, *columns.COLUMN_DTYPES)   # columns: the down vector only
NEURON_SCALAR = "neuron.down"     # a down column's neuron id (float32, exact below 2**24): its scale tables' row
GLU_VECTORS = ("gate", "up", "down")
MLP_VECTORS = ("up", "down")
BIAS_NAMES = ("bias.gate", "bias.up")
# The split layout of a GLU FLASHDIR (the exact-gate FFN, ffn.gate): the same neurons, in the same bundle order, cut
# in two files. name: (vectors, row alignment). gate|up rows are kept in DRAM or read as one stream per layer, so they
# need no O_DIRECT padding; a down row is read on its own from flash.
SPLIT_PARTS = {"gate_up": (("gate", "up"), 4), "down": (("down",), BUNDLE_ALIGN)}


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def vector_bytes(d: int, dtype: str) -> int:
    """Bytes of one bundle vector of d weights in `dtype`."""
    if dtype not in BUNDLE_DTYPES:
        raise UserError(f"unknown flash dtype '{dtype}' (choose one of {', '.join(BUNDLE_DTYPES)})")
    if dtype in columns.COLUMN_DTYPES:
        return columns.column_bytes(d, columns.kind_of(dtype))
    return blocks.row_bytes(d, dtype) if dtype in QUANT_DTYPES else d * DTYPES[dtype].itemsize


def vector_dtypes(dtype: str, n_vec: int, down_dtype: str | None) -> tuple[str, ...]:
    """The dtype of each bundle vector: `dtype`, the down vector (the last) in down_dtype if given."""
    return (dtype,) * (n_vec - 1) + (down_dtype or dtype,)


def bundle_geometry(d: int, vector_dtypes: tuple[str, ...], n_scalars: int,
                    align: int = BUNDLE_ALIGN) -> tuple[int, int]:
    """(scalars_offset, stride) of a bundle: one vector of d weights per dtype of `vector_dtypes`, back to back, then
    n_scalars float32 from a 4-aligned offset, then zero padding to a multiple of `align`."""
    scalars_offset = align_up(sum(vector_bytes(d, t) for t in vector_dtypes), 4)
    return scalars_offset, align_up(scalars_offset + 4 * n_scalars, align)


def check_down_dtype(dtype: str, down_dtype: str | None, src: str = "") -> None:
    if down_dtype is not None and (dtype not in QUANT_DTYPES or down_dtype not in QUANT_DTYPES):
        raise UserError(f"{src}a down vector of its own dtype ({down_dtype!r}) needs quantized bundles "
                        f"({', '.join(QUANT_DTYPES)}), not {dtype!r}")


def check_vector_dtypes(dtypes, n_vec: int, src: str = "") -> tuple[str, ...]:
    """A bundle's per-vector dtypes: n_vec known names, one float dtype for all or block formats only (each vector
    may have its own: the kernels take the kind per vector)."""
    dtypes = tuple(dtypes) if isinstance(dtypes, (list, tuple)) else ()
    if len(dtypes) != n_vec or not all(isinstance(t, str) and t in BUNDLE_DTYPES for t in dtypes):
        raise UserError(f"{src}bundle vector dtypes {list(dtypes)} are not {n_vec} of {', '.join(BUNDLE_DTYPES)}")
    if any(t in columns.COLUMN_DTYPES for t in dtypes[:-1]) or \
            (dtypes[-1] in columns.COLUMN_DTYPES and not all(t in QUANT_DTYPES for t in dtypes[:-1])):
        raise UserError(f"{src}bundle vector dtypes {list(dtypes)}: only the down vector may be columns, beside "
                        f"block formats")
    if not (all(t in QUANT_DTYPES for t in dtypes[:-1]) and dtypes[-1] in (*QUANT_DTYPES, *columns.COLUMN_DTYPES)
            or len(set(dtypes)) == 1):
        raise UserError(f"{src}a bundle mixes block formats and float dtypes ({', '.join(dtypes)}): either one "
                        f"float dtype for every vector or block formats ({', '.join(QUANT_DTYPES)}) only")
    return dtypes


def scalar_names(vectors, dtypes, biases) -> tuple[str, ...]:
    """The float32 scalars of a bundle, in order: int8's scale per vector, the biases, a down column's neuron id."""
    scales = tuple(f"scale.{v}" for v in vectors) if dtypes[0] == "int8" else ()
    neuron = (NEURON_SCALAR,) if dtypes[-1] in columns.COLUMN_DTYPES else ()
    return scales + tuple(b for b in BIAS_NAMES if b in biases) + neuron


@dataclass(frozen=True)
class BundleGeometry:
    """Where each part of one bundle sits: the one place these offsets are computed. The writer packs by it, the
    kernels read by it (ffn.sparse.SparseFFN), the budget counts by it; a FLASHDIR builds it once from its manifest
    (FlashLayout.geometry).

      vectors[k] (gate, up, down; or OPT's up, down): d weights of vector_dtypes[k] at byte vector_offsets[k]
      scalars (by name: `scale.<vector>` for int8, then biases): float32 from byte scalars_offset
      zero padding up to stride
    """
    d: int
    vectors: tuple[str, ...]
    vector_dtypes: tuple[str, ...]
    scalars: tuple[str, ...]
    stride: int
    align: int = BUNDLE_ALIGN        # stride is a multiple of it: BUNDLE_ALIGN on flash; 4 for rows kept in DRAM

    @classmethod
    def of(cls, d: int, dtype: str, glu: bool, biases=(), down_dtype: str | None = None,
           stride: int | None = None, dtypes: tuple[str, ...] | None = None) -> "BundleGeometry":
        """The geometry of a bundle of `dtype` (the down vector in down_dtype, if given; or each vector in its own
        block format, `dtypes`) with these biases; stride None: the smallest aligned one."""
        check_down_dtype(dtype, down_dtype)
        vectors = GLU_VECTORS if glu else MLP_VECTORS
        dtypes = vector_dtypes(dtype, len(vectors), down_dtype) if dtypes is None else \
            check_vector_dtypes(dtypes, len(vectors))
        scalars = scalar_names(vectors, dtypes, biases)
        align = PACKED_ALIGN if dtypes[-1] in columns.COLUMN_DTYPES else BUNDLE_ALIGN
        if stride is None:
            stride = bundle_geometry(d, dtypes, len(scalars), align)[1]
        return cls(d, vectors, dtypes, scalars, stride, align)

    def __post_init__(self):
        if self.stride % self.align or self.stride < self.scalars_offset + 4 * len(self.scalars):
            raise UserError(f"bundle stride {self.stride} is not a multiple of {self.align} holding the "
                            f"{self.scalars_offset + 4 * len(self.scalars)} bytes of vectors and scalars")

    @property
    def n_vec(self) -> int:
        return len(self.vectors)

    @property
    def glu(self) -> bool:
        return self.vectors == GLU_VECTORS

    @property
    def dtype(self) -> str:
        return self.vector_dtypes[0]

    @property
    def vector_offsets(self) -> list[int]:
        """Byte offset of each vector in a bundle, then the end of the last."""
        return np.cumsum([0] + [vector_bytes(self.d, t) for t in self.vector_dtypes]).tolist()

    def offset(self, vector: str) -> int:
        """Byte offset of a vector (gate, up, down)."""
        return self.vector_offsets[self.vectors.index(vector)]

    def dtype_of(self, vector: str) -> str:
        """The dtype (block format) of a vector (gate, up, down)."""
        return self.vector_dtypes[self.vectors.index(vector)]

    def vector_bytes(self, vector: str) -> int:
        k = self.vectors.index(vector)
        return vector_bytes(self.d, self.vector_dtypes[k])

    @property
    def scalars_offset(self) -> int:
        return bundle_geometry(self.d, self.vector_dtypes, 0)[0]

    def scalar_slot(self, name: str) -> int:
        """Column of a scalar in a bundle row's float32 view (B.view(np.float32)[:, slot]); -1 when there is none."""
        return self.scalars_offset // 4 + self.scalars.index(name) if name in self.scalars else -1

    def part(self, vectors: tuple[str, ...], align: int = BUNDLE_ALIGN) -> "BundleGeometry":
        """The geometry of a row holding only `vectors` of this bundle (the split layout's parts, SPLIT_PARTS): their
        dtypes back to back, then the scalars that belong to them (`scale.<v>`, `bias.<v>`), padded to `align`."""
        dtypes = tuple(self.vector_dtypes[self.vectors.index(v)] for v in vectors)
        scalars = tuple(s for s in self.scalars if s.split(".")[1] in vectors)
        stride = align_up(bundle_geometry(self.d, dtypes, 0)[0] + 4 * len(scalars), align)
        return BundleGeometry(self.d, tuple(vectors), dtypes, scalars, stride, align)

    def _spans(self, part: "BundleGeometry"):
        """(bytes in a bundle row, the same bytes in a `part` row) for each vector and scalar the part holds."""
        for v in part.vectors:
            yield (slice(self.offset(v), self.offset(v) + self.vector_bytes(v)),
                   slice(part.offset(v), part.offset(v) + part.vector_bytes(v)))
        for s in part.scalars:
            at, to = 4 * self.scalar_slot(s), 4 * part.scalar_slot(s)
            yield slice(at, at + 4), slice(to, to + 4)

    def extract(self, B: np.ndarray, part: "BundleGeometry") -> np.ndarray:
        """Bundles uint8 [n, stride] -> their `part` rows uint8 [n, part.stride]: the bytes copied, nothing recoded."""
        out = np.zeros((B.shape[0], part.stride), np.uint8)
        for b, p in self._spans(part):
            out[:, p] = B[:, b]
        return out

    def assemble(self, rows: list[tuple["BundleGeometry", np.ndarray]], dest: np.ndarray, slots=None) -> None:
        """extract's inverse: each (part, its rows uint8 [n, part.stride]) copied into bundles dest[slots] (uint8
        [., stride]; slots None: dest's first n rows), and the bytes no part holds (padding) zeroed, as in ffn.bin."""
        at = slice(0, rows[0][1].shape[0]) if slots is None else slots
        covered = np.zeros(self.stride, bool)
        for part, R in rows:
            for b, p in self._spans(part):
                dest[at, b] = R[:, p]
                covered[b] = True
        for lo, hi in np.flatnonzero(np.diff(np.r_[0, ~covered, 0])).reshape(-1, 2):
            dest[at, lo:hi] = 0


# ----------------------------------------------------------------------------------------------------------------------
# Layout

@dataclass
class FlashLayout:
    """Bundle geometry and where each layer's bundles live in ffn.bin.

    Per layer i: offset[i] (byte offset of bundle 0), n_neurons[i], order[i] (int64 [n]: bundle index -> original
    neuron id), checksum[i] (hex digest of the region's n_neurons*stride bytes). Each layer's bundles may keep its
    vectors in block formats of their own (layer_dtypes, as a GGUF's Q4_K_M mixes them): geometry_of(layer); one
    stride for all layers (the largest), so the reader, the cache and the budget see one row size.
    """
    d: int
    dtype: str                       # a BUNDLE_DTYPES name; with layer_dtypes, layer 0's first vector's
    vectors: tuple[str, ...]         # ("gate", "up", "down") for GLU, ("up", "down") for OPT-style MLPs
    biases: tuple[str, ...]          # subset of BIAS_NAMES, stored as float32 scalars after the scales
    stride: int
    offset: list[int]
    n_neurons: list[int]
    order: list[np.ndarray]
    checksum: list[str] = field(default_factory=list)
    ffn_size: int = 0
    config: dict = field(default_factory=dict)
    files: dict = field(default_factory=lambda: {"ffn": "ffn.bin", "resident": "resident.safetensors",
                                                 "tokenizer": "tokenizer"})
    resident_checksum: str = ""
    flashdir: Path | None = None     # set when read from disk
    down_dtype: str | None = None    # quantized layouts: the down vector's block format, when not `dtype`
    checksum_algo: str = CHECKSUM_ALGO
    experts: ExpertLayout | None = None   # a mixture of experts: ffn.bin holds expert chunks, not bundles (no layers)
    layer_dtypes: list[tuple[str, ...]] | None = None   # per layer each vector's block format (None: dtype, down_dtype)
    align: int = BUNDLE_ALIGN        # stride's alignment (a split part's gate|up rows: 4)
    parts: dict = field(default_factory=dict)   # the split layout: SPLIT_PARTS name -> its FlashLayout (own file)

    # -- geometry --------------------------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.offset)

    @property
    def n_vec(self) -> int:
        return len(self.vectors)

    @property
    def glu(self) -> bool:
        return self.vectors == GLU_VECTORS

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANT_DTYPES

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int | None:
        """Bytes per weight; None for the block formats."""
        return None if self.quantized else self.np_dtype.itemsize

    def dtypes_of(self, layer: int) -> tuple[str, ...]:
        """The dtype of each vector of layer `layer`'s bundles."""
        return self.layer_dtypes[layer] if self.layer_dtypes else vector_dtypes(self.dtype, self.n_vec, self.down_dtype)

    @cached_property
    def geometries(self) -> list[BundleGeometry]:
        """Per layer its bundles' geometry, built once (one object per distinct geometry)."""
        seen: dict[tuple, BundleGeometry] = {}
        return [seen.setdefault(t, BundleGeometry(self.d, self.vectors, t, self.scalars, self.stride, self.align))
                for t in map(self.dtypes_of, range(self.n_layers))]

    def geometry_of(self, layer: int) -> BundleGeometry:
        return self.geometries[layer]

    @property
    def columns(self) -> bool:
        """Some layer's down vectors are columns (storage.columns): its scale tables live in resident.safetensors."""
        return any(self.dtypes_of(i)[-1] in columns.COLUMN_DTYPES for i in range(self.n_layers)) or \
            (not self.n_layers and self.dtype in columns.COLUMN_DTYPES)

    def down_column(self, layer: int) -> str | None:
        """The block kind of layer `layer`'s down columns; None when its down vectors are rows along d."""
        return columns.kind_of(self.dtypes_of(layer)[-1])

    @property
    def uniform(self) -> bool:
        """Every layer's bundles have one geometry (no per-layer block formats)."""
        return self.layer_dtypes is None or len(set(self.layer_dtypes)) == 1

    @cached_property
    def geometry(self) -> BundleGeometry:
        """The bundles' geometry when every layer has the same (else geometry_of(layer): asking for one geometry of
        a mixed layout is a bug, not a guess at layer 0's)."""
        if not self.uniform:
            raise ValueError("this layout's layers have bundle geometries of their own: use geometry_of(layer)")
        return BundleGeometry(self.d, self.vectors, self.dtypes_of(0), self.scalars, self.stride, self.align)

    @property
    def vector_dtypes(self) -> tuple[str, ...]:
        return self.geometry.vector_dtypes

    @property
    def vector_offsets(self) -> list[int]:
        return self.geometry.vector_offsets

    @property
    def vector_bytes(self) -> int:
        """Bytes of a vector in `dtype` (every vector but a down vector in down_dtype)."""
        return vector_bytes(self.d, self.dtype)

    @property
    def scalars_offset(self) -> int:
        return self.geometry.scalars_offset

    @property
    def scalars(self) -> tuple[str, ...]:
        """Names of the float32 scalars at scalars_offset, in order: `scale.<vector>` (int8 only), then biases, then
        (down columns) the neuron id."""
        last = columns.COLUMN_DTYPES[0] if self.columns else self.dtype
        return scalar_names(self.vectors, (self.dtype, last), self.biases)

    def scalar_index(self, name: str) -> int:
        """j such that the scalar sits at B.view(np.float32)[:, scalars_offset // 4 + j]."""
        return self.scalars.index(name)

    @cached_property
    def bundle_of(self) -> list[np.ndarray]:
        """Per layer int64 [n]: original neuron id -> bundle id (the inverse of `order`)."""
        return [np.argsort(o).astype(np.int64) for o in self.order]

    def region_bytes(self, layer: int) -> int:
        return self.n_neurons[layer] * self.stride

    def layer_checksum(self, layer: int):
        """A digest to feed layer `layer`'s region into. It starts from the layer's index and geometry, so a region
        moved to another layer with its checksum, or a manifest whose n_neurons, offset or dtype was changed, does not
        match."""
        h = new_checksum()
        bound = {"layer": layer, "offset": self.offset[layer], "n_neurons": self.n_neurons[layer],
                 "stride": self.stride, "d": self.d, "dtype": self.dtype, "down_dtype": self.down_dtype,
                 "vectors": list(self.vectors), "biases": list(self.biases),
                 "vector_dtypes": list(self.dtypes_of(layer))}
        h.update(json.dumps(bound, sort_keys=True).encode())
        return h

    @property
    def bundled(self) -> bool:
        """ffn.bin holds the bundles; False: only the split parts hold them (a GLU model whose FFN runs the exact gate: storage.reader.PartsReader assembles bundles from the parts for the other modes)."""
        return "ffn" in self.files

    @property
    def ffn_path(self) -> Path:
        return self.flashdir / self.files["ffn"]

    @property
    def ffn_files(self) -> list["FlashLayout"]:
        """The layouts of every file of the FFN: ffn.bin's (this one) when there is one, then the split parts'."""
        return [self] * self.bundled + list(self.parts.values())

    @property
    def device_path(self) -> Path:
        """A file of this layout's FFN (its device's profile sets the readers and streams): ffn.bin, else down.bin."""
        return self.ffn_path if self.bundled else self.parts["down"].ffn_path

    @classmethod
    def create(cls, d: int, n_neurons: list[int], dtype: str, glu: bool, biases=(), orders=None,
               down_dtype: str | None = None, layer_dtypes=None, **kw) -> "FlashLayout":
        """Compute stride and region offsets for a model; checksums are filled in by the writer. layer_dtypes: per
        layer each vector's block format (dtype and down_dtype are then derived from them)."""
        if layer_dtypes is not None:
            layer_dtypes = [check_vector_dtypes(t, len(GLU_VECTORS if glu else MLP_VECTORS)) for t in layer_dtypes]
            first = layer_dtypes[0]
            dtype, down_dtype = first[0], None
            if len(set(layer_dtypes)) == 1 and len(set(first[:-1])) == 1 and first[-1] in BUNDLE_DTYPES[:-len(
                    columns.COLUMN_DTYPES)]:      # as dtype + down_dtype can say it (columns: only per layer)
                down_dtype, layer_dtypes = (first[-1] if first[-1] != dtype else None), None
        gs = [BundleGeometry.of(d, dtype, glu, biases, down_dtype, dtypes=t) for t in set(layer_dtypes or [None])]
        g = gs[0]
        stride, vectors, biases = max(x.stride for x in gs), g.vectors, tuple(b for b in BIAS_NAMES if b in biases)
        offsets, pos = [], 0
        for n in n_neurons:
            pos = align_up(pos, REGION_ALIGN)
            offsets.append(pos)
            pos += n * stride
        orders = [np.arange(n, dtype=np.int64) for n in n_neurons] if orders is None else \
            [np.asarray(o, dtype=np.int64) for o in orders]
        return cls(d=d, dtype=dtype, vectors=vectors, biases=biases, stride=stride, offset=offsets,
                   n_neurons=list(n_neurons), order=orders, ffn_size=align_up(pos, REGION_ALIGN),
                   down_dtype=down_dtype, layer_dtypes=layer_dtypes, align=min(x.align for x in gs), **kw)

    def make_part(self, name: str) -> "FlashLayout":
        """The layout of one split part (SPLIT_PARTS) of these bundles: its rows (BundleGeometry.part) in the same
        bundle order, each layer a REGION_ALIGN-aligned region of its own file; checksums filled in by the writer."""
        vectors, align = SPLIT_PARTS[name]
        align = min(align, self.align)          # packed bundles (down columns): packed down rows too
        gs = [g.part(vectors, align) for g in self.geometries]       # per layer (Q4_K_M mixes block formats)
        stride = max(g.stride for g in gs)      # one row size for the reader, the cache and the budget, as ffn.bin
        offsets, pos = [], 0
        for n in self.n_neurons:
            pos = align_up(pos, REGION_ALIGN)
            offsets.append(pos)
            pos += n * stride
        return FlashLayout(d=self.d, dtype=gs[0].dtype, vectors=gs[0].vectors,
                           biases=tuple(b for b in self.biases if b.split(".")[1] in vectors), stride=stride,
                           offset=offsets, n_neurons=list(self.n_neurons), order=self.order,
                           ffn_size=align_up(pos, REGION_ALIGN), config=self.config, files={"ffn": f"{name}.bin"},
                           flashdir=self.flashdir, checksum_algo=self.checksum_algo, align=align,
                           layer_dtypes=None if self.uniform else [g.vector_dtypes for g in gs])

    def in_parts(self) -> "FlashLayout":
        """This layout with its bundles in the split parts alone (no ffn.bin): how convert writes a
        GLU model whose FFN runs the exact gate. The bundle geometry stays (the readers assemble bundles from the
        parts); offsets and ffn_size say where ffn.bin would hold them, from which the parts' regions derive."""
        parts = {name: self.make_part(name) for name in SPLIT_PARTS}
        files = {k: v for k, v in self.files.items() if k != "ffn"} | {n: P.files["ffn"] for n, P in parts.items()}
        return replace(self, files=files, parts=parts, checksum=[])

    # -- manifest ----------------------------------------------------------------------------------------------------
    def to_manifest(self) -> dict:
        layers = []
        for i in range(self.n_layers):
            o = self.order[i]
            identity = bool(np.array_equal(o, np.arange(len(o))))
            layers.append({"offset": self.offset[i], "n_neurons": self.n_neurons[i],
                           "order": "identity" if identity else [int(x) for x in o]})
            if self.bundled:        # else the parts' checksums cover the bytes (`split`)
                layers[-1]["checksum"] = self.checksum[i]
            layers[-1]["vector_dtypes"] = list(self.dtypes_of(i))
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "config": self.config, "dtype": self.dtype,
                "bundle": {"d": self.d, "vectors": list(self.vectors), "itemsize": self.itemsize,
                           "vector_bytes": self.vector_bytes, "down_dtype": self.down_dtype,
                           "align": self.align,
                           "stride": self.stride, "scalars_offset": (self.geometry_of(0) if self.layer_dtypes else self.geometry).scalars_offset,
                           "scalars": list(self.scalars)},
                "files": dict(self.files), "ffn_size": self.ffn_size, "checksum_algo": self.checksum_algo,
                "resident_checksum": self.resident_checksum, "layers": layers,
                **({"experts": self.experts.to_manifest()} if self.experts is not None else {}),
                **({"split": {name: {"stride": P.stride, "ffn_size": P.ffn_size, "offsets": P.offset,
                                     "checksums": P.checksum} for name, P in self.parts.items()}} if self.parts else {})}



def write_manifest(layout: FlashLayout, flashdir: Path) -> None:
    """Write manifest.json atomically (temp file + fsync + rename)."""
    path = Path(flashdir) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    m = layout.to_manifest()
    m["manifest_checksum"] = manifest_checksum(m)
    with open(tmp, "w") as f:
        json.dump(m, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _int(x, what: str, src: Path, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        raise UserError(f"{src}: manifest field {what} must be an integer >= {lo}, got {x!r}")
    return x


def read_layout(flashdir, check_size: bool = True) -> FlashLayout:
    """Parse and validate FLASHDIR/manifest.json; with check_size also that ffn.bin has the recorded size.

    Everything in the manifest is checked before use: it comes from disk and may be damaged or hostile.
    """
    flashdir = Path(flashdir)
    src = flashdir / MANIFEST
    if not flashdir.is_dir():
        raise UserError(f"{flashdir}: not a directory (expected a flash directory written by `flashinfer-lite convert`)")
    if not (src.exists() or src.is_symlink()):
        raise UserError(f"{flashdir}: no {MANIFEST} (not a converted flash directory, or the convert did not finish)")
    m = parse_json(read_bytes(src, "manifest", MAX_MANIFEST_BYTES), "manifest", src)
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise UserError(f"{src}: not a {FORMAT_NAME} manifest")
    if m.get("version") != FORMAT_VERSION:
        raise UserError(f"{src}: format version {m.get('version')!r} is not supported (this build reads version "
                        f"{FORMAT_VERSION}); re-convert it from its source with `flashinfer-lite convert`")
    if m.get("manifest_checksum") != manifest_checksum(m):
        raise UserError(f"{src}: checksum mismatch: the manifest is damaged or edited; re-run convert")
    try:
        b, layers, files, cfg = m["bundle"], m["layers"], m["files"], m["config"]
        dtype, ffn_size = m["dtype"], m["ffn_size"]
    except KeyError as e:
        raise UserError(f"{src}: manifest lacks field {e}")
    if not (isinstance(b, dict) and isinstance(layers, list) and isinstance(files, dict) and isinstance(cfg, dict)):
        raise UserError(f"{src}: manifest fields have the wrong types")
    if dtype not in BUNDLE_DTYPES:
        raise UserError(f"{src}: unknown dtype {dtype!r} (this build reads {', '.join(BUNDLE_DTYPES)})")
    if m.get("checksum_algo") != CHECKSUM_ALGO:
        raise UserError(f"{src}: unknown checksum algorithm {m.get('checksum_algo')!r}")
    for key in ("resident", "tokenizer", *(() if m.get("split") is not None else ("ffn",))):
        if key not in files:
            raise UserError(f"{src}: manifest names no {key} file")
        inside(flashdir, files[key], f"{src}: {key} file")
    vectors = tuple(b.get("vectors") or ())
    if vectors not in (GLU_VECTORS, MLP_VECTORS):
        raise UserError(f"{src}: bundle vectors {list(vectors)} are neither {list(GLU_VECTORS)} nor {list(MLP_VECTORS)}")
    scalars = tuple(b.get("scalars") or ())
    n_scales = len(vectors) if dtype == "int8" else 0
    biases = tuple(x for x in scalars[n_scales:] if x != NEURON_SCALAR)
    down_dtype = b.get("down_dtype")
    check_down_dtype(dtype, down_dtype, f"{src}: ")
    if not set(biases) <= set(BIAS_NAMES) or len(set(biases)) != len(biases):
        raise UserError(f"{src}: unknown bundle scalars {list(scalars)}")
    layout = FlashLayout(d=_int(b.get("d"), "bundle.d", src, 1), dtype=dtype, vectors=vectors,
                         biases=tuple(x for x in BIAS_NAMES if x in biases),
                         stride=_int(b.get("stride"), "bundle.stride", src, 4),
                         offset=[], n_neurons=[], order=[], ffn_size=_int(ffn_size, "ffn_size", src),
                         config=cfg, files=dict(files), resident_checksum=str(m.get("resident_checksum", "")),
                         flashdir=flashdir, down_dtype=down_dtype, checksum_algo=m["checksum_algo"])
    layout.align = b.get("align")
    if layout.align not in (PACKED_ALIGN, BUNDLE_ALIGN) or layout.stride % layout.align:
        raise UserError(f"{src}: bundle stride {layout.stride} is not a multiple of {layout.align} holding the payload")
    end, per_layer = 0, []
    for i, L in enumerate(layers):
        if not isinstance(L, dict):
            raise UserError(f"{src}: layer {i} entry is not an object")
        off = _int(L.get("offset"), f"layers[{i}].offset", src)
        n = _int(L.get("n_neurons"), f"layers[{i}].n_neurons", src, 1)
        if off % REGION_ALIGN or off < end:
            raise UserError(f"{src}: layer {i} region at offset {off} is unaligned or overlaps the previous layer")
        end = off + n * layout.stride
        if end > layout.ffn_size:
            raise UserError(f"{src}: layer {i} region ends at byte {end}, past ffn_size {layout.ffn_size}")
        o = L.get("order")
        if o == "identity":
            order = np.arange(n, dtype=np.int64)
        else:
            if not isinstance(o, list) or len(o) != n or not all(isinstance(x, int) for x in o):
                raise UserError(f"{src}: layer {i} neuron order is not a list of {n} integers")
            order = np.asarray(o, dtype=np.int64)
            if not np.array_equal(np.sort(order), np.arange(n)):
                raise UserError(f"{src}: layer {i} neuron order is not a permutation of 0..{n - 1}")
        ck = L.get("checksum")
        if "ffn" in files and (not isinstance(ck, str) or len(ck) != 32):
            raise UserError(f"{src}: layer {i} has no valid checksum")
        per_layer.append(check_vector_dtypes(L.get("vector_dtypes"), len(vectors), f"{src}: layer {i}: "))
        layout.offset.append(off)
        layout.n_neurons.append(n)
        layout.order.append(order)
        if "ffn" in files:
            layout.checksum.append(ck)
    if m.get("experts") is not None:
        layout.experts = ExpertLayout.from_manifest(m["experts"], src)
        E = layout.experts
        if layers or E.offset < end or E.end > layout.ffn_size:
            raise UserError(f"{src}: the experts' chunks (bytes {E.offset}..{E.end}) overlap bundle regions or pass "
                            f"ffn_size {layout.ffn_size}")
        if (cfg.get("n_layers"), cfg.get("dim"), cfg.get("ffn_dim"), cfg.get("n_experts")) != \
                (E.n_layers, E.d, E.n, E.n_experts):
            raise UserError(f"{src}: config disagrees with the experts' geometry in the manifest")
    elif not layers:
        raise UserError(f"{src}: manifest lists no layers")
    if per_layer:
        if per_layer[0][0] != dtype or per_layer[0][-1] != (down_dtype or per_layer[0][-1]):
            raise UserError(f"{src}: dtype {dtype!r} and down_dtype {down_dtype!r} are not layer 0's "
                            f"{list(per_layer[0])}")
        if set(per_layer) != {vector_dtypes(dtype, len(vectors), down_dtype)}:   # as FlashLayout.create keeps them
            layout.layer_dtypes = per_layer
    # The geometry the readers and kernels will rely on must be exactly what this build would compute (a d that is
    # not whole blocks of a quantized dtype is a UserError of its own).
    first = layout.geometry_of(0) if layout.layer_dtypes else layout.geometry     # a mixture of experts has no layers
    if layout.scalars != scalars or b.get("scalars_offset") != first.scalars_offset \
            or b.get("itemsize") != layout.itemsize \
            or b.get("vector_bytes") != layout.vector_bytes:
        raise UserError(f"{src}: bundle scalars/offsets do not match dtype {dtype} and vectors {list(vectors)}")
    if any(layout.stride < g.scalars_offset + 4 * len(scalars) for g in layout.geometries or [first]):
        raise UserError(f"{src}: bundle stride {layout.stride} is not a multiple of {layout.align} holding the payload")
    if (layout.experts is None and cfg.get("n_layers") not in (None, len(layers))) or cfg.get("dim") not in (None, layout.d):
        raise UserError(f"{src}: config (n_layers={cfg.get('n_layers')}, dim={cfg.get('dim')}) disagrees with the "
                        f"{len(layers)} layers of width {layout.d} in the manifest")
    if layout.experts is None and cfg.get("n_experts"):
        raise UserError(f"{src}: config has {cfg['n_experts']!r} experts, the manifest none")
    if any(n != cfg.get("ffn_dim", n) for n in layout.n_neurons):     # the kernels index [ffn_dim] arrays by neuron
        i = next(i for i, n in enumerate(layout.n_neurons) if n != cfg.get("ffn_dim"))
        raise UserError(f"{src}: layer {i} has {layout.n_neurons[i]} neurons but the config's ffn_dim is "
                        f"{cfg.get('ffn_dim')!r}")
    if m.get("split") is not None:
        _read_split(layout, m["split"], src)
    if check_size:
        for L in layout.ffn_files:
            _check_file_size(L.ffn_path, L.ffn_size)
    return layout


def _check_file_size(ffn: Path, size: int) -> None:
    try:
        actual = ffn.stat().st_size
    except FileNotFoundError:
        raise UserError(f"{ffn}: FFN file is missing")
    if actual != size:
        raise UserError(f"{ffn}: size is {actual} bytes but the manifest says {size} "
                        f"({'truncated' if actual < size else 'extra bytes'}); re-run convert")


def _read_split(layout: FlashLayout, split, src: Path) -> None:
    """layout.parts from the manifest's `split` section: each part's geometry and regions must be exactly what this
    build computes from the bundles' (FlashLayout.make_part); only the checksums are the part's own."""
    if not layout.glu or not isinstance(split, dict) or set(split) != set(SPLIT_PARTS):
        raise UserError(f"{src}: manifest field split must name the parts {sorted(SPLIT_PARTS)} of GLU bundles")
    for name in SPLIT_PARTS:
        part, rec = layout.make_part(name), split[name]
        sums = rec.get("checksums") if isinstance(rec, dict) else None
        if not isinstance(rec, dict) or rec.get("stride") != part.stride or rec.get("ffn_size") != part.ffn_size \
                or rec.get("offsets") != part.offset or not isinstance(sums, list) or len(sums) != part.n_layers \
                or not all(isinstance(c, str) and len(c) == 32 for c in sums):
            raise UserError(f"{src}: split part {name!r} does not match the bundles' geometry; re-run convert")
        if layout.files.get(name) != part.files["ffn"]:
            raise UserError(f"{src}: manifest names no {name} file {part.files['ffn']!r}")
        part.checksum = list(sums)
        layout.parts[name] = part


# ----------------------------------------------------------------------------------------------------------------------
# Bundles

def pack_bundles(layout: FlashLayout, vecs, biases: np.ndarray | None = None, layer: int = 0,
                 neurons: np.ndarray | None = None) -> np.ndarray:
    """vecs float32 [n, n_vec, d] (or a list of n_vec matrices [n, d]), biases float32 [n, len(layout.biases)] ->
    layer `layer`'s bundles uint8 [n, stride]. A quantized layout also takes any vector already in its blocks, uint8
    [n, vector bytes] (convert copies a GGUF's gate and up rows so, verbatim; down columns come only so, with
    `neurons`, the original neuron id of each bundle)."""
    vecs = [vecs[:, k] for k in range(vecs.shape[1])] if isinstance(vecs, np.ndarray) else list(vecs)
    n = vecs[0].shape[0]
    assert len(vecs) == layout.n_vec and all(v.shape[0] == n for v in vecs), [v.shape for v in vecs]
    out = np.zeros((n, layout.stride), np.uint8)
    g = layout.geometry_of(layer)
    at, kinds = g.vector_offsets, g.vector_dtypes
    scalars = []
    for k, v in enumerate(vecs):
        dest = out[:, at[k]:at[k + 1]]
        if v.dtype == np.uint8 and layout.quantized:      # already stored: blocks along d
            assert v.shape == dest.shape, v.shape
            dest[:] = v
            continue
        assert v.shape == (n, layout.d) and kinds[k] not in columns.COLUMN_DTYPES, (v.shape, kinds[k])
        if layout.quantized:
            dest[:] = blocks.quantize(np.ascontiguousarray(v, dtype=np.float32), kinds[k])
        elif layout.dtype == "int8":
            # Symmetric per-vector scale: q = round(v / s), s = max|v| / 127, so |v - q*s| <= s/2.
            scale = np.abs(v).max(axis=1).astype(np.float32) / np.float32(127.0)           # [n]
            safe = np.where(scale > 0, scale, np.float32(1.0))
            dest[:] = np.clip(np.rint(v / safe[:, None]), -127, 127).astype(np.int8).view(np.uint8)
            scalars.append(scale[:, None])
        else:
            with np.errstate(over="ignore"):   # reported below as one clear error
                packed = v.astype(layout.np_dtype)
            if not np.isfinite(packed).all():
                raise UserError(f"weights do not fit in {layout.dtype} (non-finite values after conversion)")
            dest[:] = packed.view(np.uint8)
    if layout.biases:
        assert biases is not None and biases.shape == (n, len(layout.biases)), None if biases is None else biases.shape
        scalars.append(biases.astype(np.float32))
    if NEURON_SCALAR in layout.scalars:
        assert neurons is not None and neurons.shape == (n,), None if neurons is None else neurons.shape
        scalars.append(neurons.astype(np.float32)[:, None])
    if scalars:
        s = np.ascontiguousarray(np.concatenate(scalars, axis=1), dtype="<f4")
        so = g.scalars_offset
        out[:, so:so + s.shape[1] * 4] = s.view(np.uint8)
    return out


def unpack_bundles(layout: FlashLayout, bundles: np.ndarray, layer: int = 0,
                   down_scales: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Layer `layer`'s bundles uint8 [n, stride] -> (vecs float32 [n, n_vec, d], biases float32
    [n, len(layout.biases)]); quantized vectors dequantized (bit-exact with the runtime's kernels); down columns
    with the layer's scale tables (FlashCheckpoint.down_scales)."""
    n = bundles.shape[0]
    assert bundles.dtype == np.uint8 and bundles.shape[1] == layout.stride
    g = layout.geometry_of(layer)
    at, so = g.vector_offsets, g.scalars_offset
    s = np.ascontiguousarray(bundles[:, so:so + 4 * len(layout.scalars)]).view("<f4").astype(np.float32)
    if layout.quantized:
        neurons = s[:, layout.scalars.index(NEURON_SCALAR)].astype(np.int64) if layout.columns else None
        vecs = np.stack([columns.dequantize_columns(bundles[:, at[k]:at[k + 1]], columns.kind_of(kind), down_scales,
                                                    neurons) if kind in columns.COLUMN_DTYPES else
                         blocks.dequantize(bundles[:, at[k]:at[k + 1]], kind)
                         for k, kind in enumerate(g.vector_dtypes)], axis=1)
        return vecs, s[:, :len(layout.biases)]
    raw = np.ascontiguousarray(bundles[:, :at[-1]])
    vecs = raw.view(layout.np_dtype).reshape(n, layout.n_vec, layout.d).astype(np.float32)
    if layout.dtype == "int8":
        vecs *= s[:, :layout.n_vec, None]
        s = s[:, layout.n_vec:]
    return vecs, s


def bundle_tensors(layout: FlashLayout, layer: int, vecs: np.ndarray, biases: np.ndarray) -> dict[str, np.ndarray]:
    """Canonical FFN tensors of unpacked bundles (vecs [m, n_vec, d], biases [m, n_bias]), rows in bundle order:
    gate/up weight [m, d], down weight [d, m], gate/up biases [m]."""
    out = {}
    for k, v in enumerate(layout.vectors):
        w = vecs[:, k, :]                                          # [m, d]
        out[f"layers.{layer}.ffn.{v}.weight"] = np.ascontiguousarray(w.T if v == "down" else w)
    for j, b in enumerate(layout.biases):
        out[f"layers.{layer}.ffn.{b.split('.')[1]}.bias"] = np.ascontiguousarray(biases[:, j])
    return out


def scale_table_name(layer: int, table: str) -> str:
    """The resident.safetensors name of one of layer `layer`'s down column tables (storage.columns.TABLES)."""
    return f"layers.{layer}.ffn.down.scales.{table}"


def ffn_tensor_names(layout: FlashLayout, layer: int) -> list[str]:
    """Canonical names of the tensors that live in this layer's bundles."""
    names = [f"layers.{layer}.ffn.{v}.weight" for v in layout.vectors]
    names += [f"layers.{layer}.ffn.{b.split('.')[1]}.bias" for b in layout.biases]
    return names


# ----------------------------------------------------------------------------------------------------------------------
# Verification (the checksum primitives: storage/checksums.py)

def expert_checksum(E: ExpertLayout, layer: int, expert: int):
    """A digest to feed expert (layer, expert)'s chunk into, bound to its place and geometry: a chunk moved to another
    expert with its checksum, or a manifest whose geometry was edited, does not match."""
    h = new_checksum()
    h.update(json.dumps({"layer": layer, "expert": expert, **E.geometry()}, sort_keys=True).encode())
    return h


def expert_ids(layout: FlashLayout) -> list[tuple[int, int]]:
    """(layer, expert) of every expert chunk of a FLASHDIR, in file order (none without experts)."""
    E = layout.experts
    return [] if E is None else [(i, e) for i in range(E.n_layers) for e in range(E.n_experts)]


def expert_chunks(layout: FlashLayout) -> FlashLayout:
    """The experts of a FLASHDIR as storage.reader.BundleReader reads rows: "layer" l's rows are its experts, each a
    row of `chunk` bytes (a multiple of 4096), so reader.submit(l, expert ids, slots, slot ids) reads whole experts
    straight into cache slots, one large O_DIRECT request each."""
    E = layout.experts
    return FlashLayout(d=E.d, dtype=layout.dtype, vectors=GLU_VECTORS, biases=(), stride=E.chunk,
                       offset=[E.chunk_offset(i, 0) for i in range(E.n_layers)], n_neurons=[E.n_experts] * E.n_layers,
                       order=[np.arange(E.n_experts)] * E.n_layers, ffn_size=layout.ffn_size, config=layout.config,
                       files=layout.files, flashdir=layout.flashdir)


def expert_parts(layout: FlashLayout) -> dict[str, FlashLayout]:
    """Split expert chunks as the split layout's parts (SPLIT_PARTS), so the dense exact gate's reader and kernels
    (storage.reader.BundleReader, ffn.flash.SplitKernels) work on them unchanged: region l * n_experts + e is expert e
    of layer l, its rows its neurons' gate|up rows ("gate_up") or down columns ("down"); and "heads", the gate|up
    rows of a region as one row."""
    E = layout.experts
    regions = [(i, e) for i in range(E.n_layers) for e in range(E.n_experts)]
    # "heads": the same gate|up rows as one row per region, 512-aligned, so a miss reads them in one O_DIRECT
    # request straight into its slot (packed rows would go through the reader's staging buffer)
    out = {"heads": FlashLayout(d=E.d, dtype=E.dtypes[0], vectors=GLU_VECTORS, biases=(), stride=E.columns_at,
                                offset=[E.chunk_offset(i, e) for i, e in regions], n_neurons=[1] * len(regions),
                                order=[np.arange(1)] * len(regions), ffn_size=layout.ffn_size, config=layout.config,
                                files=layout.files, flashdir=layout.flashdir)}
    for name, (vectors, _) in SPLIT_PARTS.items():
        at, stride = (0, E.head_stride) if name == "gate_up" else (E.columns_at, E.column_stride)
        dtypes = tuple(E.dtypes[MATRICES.index(v)] for v in vectors)
        out[name] = FlashLayout(d=E.d, dtype=dtypes[0], vectors=vectors, biases=(), stride=stride,
                                offset=[E.chunk_offset(i, e) + at for i, e in regions], n_neurons=[E.n] * len(regions),
                                order=[np.arange(E.n)] * len(regions), ffn_size=layout.ffn_size, config=layout.config,
                                files=layout.files, flashdir=layout.flashdir, layer_dtypes=[dtypes] * len(regions),
                                align=PACKED_ALIGN)
    return out


def is_flashdir(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).exists()


def verify(flashdir, progress: bool = True) -> FlashLayout:
    """Check the manifest, the file sizes and every checksum, the predictors' included; raise UserError naming the
    first bad layer or file. Then stamp the directory as verified (see verify_at_load).

    Reads the whole directory once: call it from `flashinfer-lite verify` or when the stamp is stale.
    """
    from tqdm import tqdm
    layout = read_layout(flashdir)
    regions = layout.ffn_files
    total = sum(L.region_bytes(i) for L in regions for i in range(L.n_layers)) + \
        (layout.experts.end - layout.experts.offset if layout.experts is not None else 0)
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress, leave=False) as bar:
        for L in regions:
            with open(L.ffn_path, "rb") as f:
                for i in range(L.n_layers):
                    got = region_checksum(f, L.offset[i], L.region_bytes(i), progress=bar, h=L.layer_checksum(i))
                    if got != L.checksum[i]:
                        raise UserError(f"{L.ffn_path}: checksum mismatch in layer {i} (bytes {L.offset[i]}.."
                                        f"{L.offset[i] + L.region_bytes(i)}): the file is damaged; re-run convert")
        E = layout.experts
        if E is not None:
            with open(layout.ffn_path, "rb") as f:
                for i, e in expert_ids(layout):
                    if region_checksum(f, E.chunk_offset(i, e), E.chunk, progress=bar, h=expert_checksum(E, i, e)) \
                            != E.checksum[i][e]:
                        raise UserError(f"{layout.ffn_path}: checksum mismatch in layer {i}'s expert {e}: the file "
                                        f"is damaged; re-run convert")
    res = layout.flashdir / layout.files["resident"]
    if not res.is_file():
        raise UserError(f"{res}: resident weights file is missing")
    if file_checksum(res) != layout.resident_checksum:
        raise UserError(f"{res}: checksum mismatch in the resident weights: the file is damaged; re-run convert")
    for name, digest in predictor_checksums(layout.flashdir, warn=True).items():
        p = inside(layout.flashdir / PREDICTOR_DIR, name, "predictor file")
        if not p.is_file():
            raise UserError(f"{p}: predictor file is missing; re-run train-predictor")
        if file_checksum(p) != digest:
            raise UserError(f"{p}: checksum mismatch: the predictor file is damaged; re-run train-predictor")
    FlashCheckpoint(layout.flashdir)              # config and every tensor's shape, from the headers
    write_verified_stamp(layout.flashdir)
    return layout


def _stamped_files(flashdir: Path) -> dict[str, list[int]]:
    """{relative path: [size, mtime_ns, inode]} of every file whose checksum verify checks."""
    names = [MANIFEST, *read_layout(flashdir, check_size=False).files.values()]
    pm = flashdir / PREDICTOR_DIR / PREDICTOR_MANIFEST
    if pm.is_file():
        names += [f"{PREDICTOR_DIR}/{PREDICTOR_MANIFEST}"] + [f"{PREDICTOR_DIR}/{n}" for n in predictor_checksums(flashdir)]
    out = {}
    for n in names:
        try:
            st = (flashdir / n).stat()
        except OSError:
            continue
        out[n] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def write_verified_stamp(flashdir) -> None:
    """Record that FLASHDIR's files, as they are now, matched their checksums. Best effort: a read-only FLASHDIR is
    simply verified in full at every load."""
    flashdir = Path(flashdir)
    write_best_effort(flashdir / VERIFIED_STAMP, json.dumps({"files": _stamped_files(flashdir)}))


def verify_at_load(flashdir, progress: bool = False) -> FlashLayout:
    """What a launch checks: the manifest and file sizes always; every checksum only when a file changed (size, mtime
    or inode) since it was last verified, so a launch does not read the whole model (a 4 GB model: seconds)."""
    flashdir = Path(flashdir)
    layout = read_layout(flashdir)                                # manifest and sizes
    try:
        stamp = parse_json(read_bytes(flashdir / VERIFIED_STAMP, "stamp", 64 << 10), "stamp", flashdir).get("files")
    except (UserError, AttributeError):
        stamp = None
    if stamp and stamp == _stamped_files(flashdir):
        return layout
    return verify(flashdir, progress=progress)


# ----------------------------------------------------------------------------------------------------------------------
# FlashCheckpoint: a converted directory seen through the same API as storage.checkpoint.Checkpoint

class FlashCheckpoint:
    """Read a FLASHDIR as a checkpoint: `.config`, `.names()`, `.tensor(name)` (float32, canonical names, FFN
    matrices reassembled in original neuron order, blocks dequantized), `.quantized(name)` (a resident matrix in its
    block format, as stored), `.tokenizer()`.

    Loads a layer region whole and checks its checksum while it is in memory, so it never returns damaged weights.
    This is the load/convert path; the runtime reads bundles with storage.reader.BundleReader.
    """

    def __init__(self, flashdir):
        self.layout = read_layout(flashdir)
        self.flashdir = self.path = self.layout.flashdir
        self.config = ModelConfig.from_dict(self.layout.config)
        self._resident_path = self.flashdir / self.layout.files["resident"]
        self._resident = self._open_resident()
        tables = {scale_table_name(i, t) for i in range(self.layout.n_layers) for t in columns.TABLES}
        self._resident_names = [n for n in self._resident.entries if n not in tables]   # tables: down_scales
        self.resident_kinds = self._resident_kinds()
        for i in range(self.layout.n_layers):      # checked once here; read again when a kernel decodes them
            self.down_scales(i)
        self._ffn_names = {}
        for i in range(self.layout.n_layers):
            for name in ffn_tensor_names(self.layout, i):
                self._ffn_names[name] = i
        self._expert_names = {expert_tensor_name(i, e, m): (i, e, k) for i, e in expert_ids(self.layout)
                              for k, m in enumerate(MATRICES)}
        self._cached_expert: tuple[tuple[int, int], np.ndarray] | None = None
        self._cached_layer: tuple[int, dict] | None = None
        self._cached_blocks: tuple[int, dict] | None = None     # ffn_blocks' layer
        check_shapes(self.config, self.shapes(), self._resident_path)

    def shapes(self) -> dict[str, tuple]:
        """{name: shape tensor(name) has}, from the resident file's header and the layout, nothing read."""
        out = {}
        for name in self._resident_names:
            shape, kind = self._resident.entries[name][2], self.resident_kinds.get(name)
            out[name] = shape if kind is None else (shape[0], blocks.row_cols(shape[1], kind))
        L = self.layout
        for name, i in self._ffn_names.items():
            n = L.n_neurons[i]
            out[name] = (L.d, n) if name.endswith("down.weight") else (n, L.d) if name.endswith("weight") else (n,)
        for name, (_, _, k) in self._expert_names.items():
            out[name] = L.experts.shape(MATRICES[k])
        return out

    def down_scales(self, layer: int) -> dict[str, np.ndarray] | None:
        """Layer `layer`'s down column scale tables {name: raw array} (storage.columns) from resident.safetensors,
        checked against the layout (the kernels index them by neuron); None when its down vectors are rows. Read
        on each call, not kept: the kernels keep them decoded."""
        kind = self.layout.down_column(layer)
        if kind is None:
            return None
        found = {t: self._resident.read(scale_table_name(layer, t), raw=True) for t in columns.TABLES
                 if scale_table_name(layer, t) in self._resident.entries}
        return columns.check_tables(found, kind, self.layout.d, self.layout.n_neurons[layer],
                                    f"{self._resident_path}: layer {layer}: ")

    def down_scales_all(self) -> list | None:
        """Every layer's down_scales, None when no layer's down vectors are columns."""
        return [self.down_scales(i) for i in range(self.layout.n_layers)] if self.layout.columns else None

    def _open_resident(self) -> SafetensorsFile:
        # pread into a buffer the array then owns: a float32 tensor is read with no second copy and no mapping
        try:
            return SafetensorsFile(self._resident_path)
        except UserError as e:
            raise UserError(f"cannot read resident weights: {e}") from None

    def _resident_kinds(self) -> dict[str, str]:
        """{name: block kind} of the resident matrices stored quantized (the file's metadata), checked against the
        tensors: the file comes from disk."""
        kinds = self._resident.metadata
        for name, kind in kinds.items():
            e = self._resident.entries.get(name)
            if not isinstance(kind, str) or kind not in blocks.BLOCK_BYTES or e is None or e[1] != np.uint8 \
                    or len(e[2]) != 2 or e[2][1] % blocks.BLOCK_BYTES[kind]:
                raise UserError(f"{self._resident_path}: resident tensor {name!r} is not a {kind!r} matrix; "
                                f"re-run convert")
        return dict(kinds)

    def quantized(self, name: str) -> tuple[str, np.ndarray] | None:
        """(kind, uint8 [rows, row_bytes]) of a resident matrix stored in a block format; else None."""
        if name in self._expert_names:
            kind, a = self._expert_matrix(name)
            return (kind, a) if kind in blocks.BLOCK_BYTES else None
        kind = self.resident_kinds.get(name)
        if kind is None:
            return None
        return kind, blocks.check_finite_blocks(self._resident.read(name, raw=True), kind, self._where(name))

    def ffn_blocks(self, name: str) -> tuple[str, np.ndarray] | None:
        """(kind, uint8 [rows, row_bytes]) of an FFN matrix of a layer whose down vectors are columns (a GGUF's
        down blocks, kept exactly), in the GGUF's orientation and original neuron order: gate and up rows as the
        bundles hold them (the GGUF's own where it stores them in a kind bundles hold: convert --dtype auto), down
        joined from its columns and the layer's scale tables (storage.columns.join); else None. A dense run on these
        computes its GGUF's numbers, bit for bit (ffn.resident.ResidentFFN, eval's dense reference)."""
        i = self._ffn_names.get(name)
        if i is None or not name.endswith(".weight") or self.layout.down_column(i) is None:
            return None
        if self._cached_blocks is None or self._cached_blocks[0] != i:
            L, g = self.layout, self.layout.geometry_of(i)
            B = self.bundles(i)
            if not np.array_equal(L.order[i], np.arange(L.n_neurons[i])):
                B = B[np.argsort(L.order[i])]                           # bundle order -> neuron order
            vec = lambda v: np.ascontiguousarray(B[:, g.offset(v):g.offset(v) + g.vector_bytes(v)])  # noqa: E731
            kind = L.down_column(i)
            mats = {v: (g.dtype_of(v), vec(v)) for v in g.vectors if v != "down"}
            mats["down"] = (kind, columns.join(vec("down"), kind, self.down_scales(i)))
            self._cached_blocks = (i, mats)
        return self._cached_blocks[1][name.split(".")[-2]]

    def stored_half(self, name: str) -> np.ndarray | None:
        """A resident matrix that resident.safetensors stores as float16, as stored (float16 [rows, cols]); else None.
        The runtime keeps such a matrix in float16 (half.half_matrix): read so, it is not widened to float32 and
        rounded back (a 7B float16 FLASHDIR: 4 GiB of resident matrices)."""
        if name in self._expert_names:
            kind, a = self._expert_matrix(name)
            return a if kind == "f16" else None
        e = self._resident.entries.get(name)
        if e is None or e[0] or e[1] != np.float16 or len(e[2]) != 2:
            return None
        return check_finite(self._resident.read(name, raw=True), self._where(name))

    def rows_layout(self, name: str) -> tuple[FlashLayout, str]:
        """A resident matrix read from flash rather than held (the token embeddings, a streamed head): (a layout of
        one region, the matrix where resident.safetensors stores it, each row a bundle of its row's bytes, for
        storage.reader; the rows' type as stored: a block format, "f16" or "f32"). Nothing is read. The region
        starts wherever the file has it: the reader widens its reads to 512-byte boundaries."""
        e = self._resident.entries.get(name)
        kind = self.resident_kinds.get(name) or {np.dtype("<f2"): "f16", np.dtype("<f4"): "f32"}.get(
            e[1] if e is not None and not e[0] else None)
        if kind is None or len(e[2]) != 2:
            raise UserError(f"{self._where(name)} is not a matrix of blocks, float16 or float32; re-run convert")
        rows, stride = e[2][0], e[2][1] * e[1].itemsize
        cols = blocks.row_cols(stride, kind) if kind in blocks.BLOCK_BYTES else e[2][1]
        return FlashLayout(d=cols, dtype=kind, vectors=(), biases=(), stride=stride, offset=[e[3]], n_neurons=[rows],
                           order=[np.arange(rows, dtype=np.int64)], files={"ffn": self.layout.files["resident"]},
                           flashdir=self.flashdir, align=PACKED_ALIGN), kind

    def names(self) -> list[str]:
        return self._resident_names + list(self._ffn_names) + list(self._expert_names)

    def __contains__(self, name: str) -> bool:
        return name in self._ffn_names or name in self._resident_names or name in self._expert_names

    def tensor(self, name: str) -> np.ndarray:
        if name in self._expert_names:
            kind, a = self._expert_matrix(name)
            return blocks.dequantize(a, kind) if kind in blocks.BLOCK_BYTES else a.astype(np.float32)
        if name in self._ffn_names:
            return self._layer_tensors(self._ffn_names[name])[name]
        if name not in self._resident.entries:
            raise UserError(f"{self.flashdir}: no tensor named {name!r}")
        stored = self.quantized(name)
        return check_finite(self._resident.read(name), self._where(name)) if stored is None else \
            blocks.dequantize(stored[1], stored[0])

    def _where(self, name: str) -> str:
        return f"{self._resident_path}: tensor {name}"

    def _layer_tensors(self, layer: int) -> dict[str, np.ndarray]:
        if self._cached_layer is not None and self._cached_layer[0] == layer:
            return self._cached_layer[1]
        L, n = self.layout, self.layout.n_neurons[layer]
        vecs, biases = unpack_bundles(L, self.bundles(layer), layer, self.down_scales(layer))
        # Bundle b holds original neuron order[b]: scatter back to original rows.
        inv = np.empty(n, np.int64)
        inv[L.order[layer]] = np.arange(n)
        vecs, biases = vecs[inv], biases[inv]
        out = bundle_tensors(L, layer, vecs, biases)
        self._cached_layer = (layer, out)
        return out

    def _expert_matrix(self, name: str) -> tuple[str, np.ndarray]:
        """(dtype, matrix as stored) of an expert's tensor: its chunk read whole, checksum checked, and kept until
        another expert's is asked for (its three matrices are read one after the other)."""
        i, e, k = self._expert_names[name]
        if self._cached_expert is None or self._cached_expert[0] != (i, e):
            E = self.layout.experts
            buf = np.empty(E.chunk, np.uint8)
            with open(self.layout.ffn_path, "rb") as f:
                got = os.preadv(f.fileno(), [buf], E.chunk_offset(i, e))
            h = expert_checksum(E, i, e)
            h.update(buf)
            if got != E.chunk or h.hexdigest() != E.checksum[i][e]:
                raise UserError(f"{self.layout.ffn_path}: checksum mismatch in layer {i}'s expert {e}: the file is "
                                f"damaged; re-run convert")
            self._cached_expert = ((i, e), buf)
        kind, a = self.layout.experts.matrices(self._cached_expert[1])[k]
        return kind, a.copy()     # its own memory: the chunk buffer is replaced by the next expert's

    def bundle_chunks(self, layer: int, rows: int):
        """Yield (first bundle, bundles uint8 [m, stride]) of layer `layer`, `rows` at a time in bundle order, as
        ffn.bin holds them (a layout without ffn.bin: assembled from the split parts). Each region's checksum is
        checked over the bytes read, after the last chunk: a caller that keeps what it computed only once the loop ends
        never uses damaged weights."""
        L = self.layout
        n = L.n_neurons[layer]
        g = L.geometry_of(layer)
        files = [(F, F.geometry_of(layer)) for F in ([L] if L.bundled else L.parts.values())]
        sums = [F.layer_checksum(layer) for F, _ in files]
        with ExitStack() as stack:
            fds = [stack.enter_context(open(F.ffn_path, "rb")).fileno() for F, _ in files]
            for b0 in range(0, n, rows):
                m = min(rows, n - b0)
                got = []
                for (F, part), fd, h in zip(files, fds, sums):
                    buf = np.empty((m, F.stride), np.uint8)
                    if os.preadv(fd, [buf], F.offset[layer] + b0 * F.stride) != buf.nbytes:
                        self._region_error(F, layer)
                    h.update(buf)
                    got.append((part, buf))
                if L.bundled:
                    yield b0, got[0][1]
                    continue
                B = np.zeros((m, L.stride), np.uint8)
                g.assemble(got, B)
                yield b0, B
        for (F, _), h in zip(files, sums):
            if h.hexdigest() != F.checksum[layer]:
                self._region_error(F, layer)

    def bundles(self, layer: int) -> np.ndarray:
        """A layer's bundles uint8 [n_neurons, stride] in bundle order, checksum checked (bundle_chunks; the resident
        dense FFN computes on them as they are)."""
        (_, B), = self.bundle_chunks(layer, self.layout.n_neurons[layer])
        return B

    def vector_norms(self, layer: int, vector: str = "down", chunk_bytes: int = 64 << 20) -> np.ndarray:
        """||v_i|| float32 [n] of one FFN vector of every neuron (e.g. the down column), in original neuron order.

        Read in chunks of bundles, so memory stays at one chunk whatever the layer's size; the regions' checksums are
        checked over the same bytes."""
        L, k = self.layout, self.layout.vectors.index(vector)
        norms = np.empty(L.n_neurons[layer], np.float32)
        for b0, B in self.bundle_chunks(layer, max(1, chunk_bytes // L.stride)):
            vecs, _ = unpack_bundles(L, B, layer, self.down_scales(layer))
            norms[L.order[layer][b0:b0 + B.shape[0]]] = np.linalg.norm(vecs[:, k, :], axis=1)
        return norms

    @staticmethod
    def _region_error(F: FlashLayout, layer: int):
        """Never hand out damaged weights: a region read short, or whose checksum is not the manifest's."""
        raise UserError(f"{F.ffn_path}: checksum mismatch in layer {layer}: the file is damaged; re-run convert")

    def release(self) -> None:
        """Drop the cached FFN layer (layer-streaming: the next layer's bundles load without it)."""
        self._cached_layer = self._cached_expert = self._cached_blocks = None

    def tokenizer(self):
        return Tokenizer.from_dir(self.flashdir / self.layout.files["tokenizer"], self.config)
