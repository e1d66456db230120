"""What the predictor pipeline shares: corpus text, model identity, and the ACTS directory written by `collect`.

ACTS/
  manifest.json            format + version, model identity (config + weight fingerprint), corpus, token counts,
                           shard list, per-layer |a| histograms (counts and mass) and per-neuron nonzero counts
  shard-00000.safetensors  per layer `layers.{i}.x` float32 [r, d] (normed FFN input) and
                           `layers.{i}.a` float16 [r, n] (|activation|), the same r sampled token rows for every layer
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.config import ModelConfig
from storage.errors import UserError
from storage.untrusted import read_json

ACTS_FORMAT = "flashinfer-lite-acts"
ACTS_VERSION = 1
MANIFEST = "manifest.json"

# |a| histogram bins: log2 edges from 2^-40 to 2^24 in 1/16 steps; bin 0 collects |a| == 0 and everything tinier.
HIST_LO, HIST_HI, HIST_STEPS = -40.0, 24.0, 16
HIST_EDGES = 2.0 ** np.arange(HIST_LO, HIST_HI + 1e-9, 1.0 / HIST_STEPS)   # [B+1]
N_BINS = len(HIST_EDGES) + 1                                                # + under- and overflow


def relu_family(cfg) -> bool:
    """Models whose activations are exactly zero for most neurons: the sparsity target is a != 0, threshold 0."""
    return cfg.act in ("relu", "drelu")


# ----------------------------------------------------------------------------------------------------------------------
# Corpus

@dataclass
class CorpusText:
    text: str
    replaced_bytes: int      # undecodable bytes, each shown as U+FFFD
    files: list[str]


_LONE_SURROGATE = re.compile("[\udc80-\udcff]")


def read_corpus(files, max_bytes: int | None = None) -> CorpusText:
    """Concatenated text of the files; invalid UTF-8 is decoded with replacement, counted (one U+FFFD per byte) and
    said in one line on stderr. max_bytes: read no more than that in all, the files' first bytes (what a number of
    tokens can need, Tokenizer.text_cap), so that a huge file or /dev/zero is never held whole."""
    parts, replaced = [], 0
    left = max_bytes
    for f in files:
        if left is not None and left <= 0:
            break
        p = Path(f)
        try:
            with open(p, "rb") as fh:
                data = fh.read(-1 if left is None else left)
        except FileNotFoundError:
            raise UserError(f"corpus file not found: {p}") from None
        except IsADirectoryError:
            raise UserError(f"corpus path is a directory, not a text file: {p}") from None
        except OSError as e:
            raise UserError(f"cannot read corpus file {p}: {e.strerror}") from None
        cut = left is not None and len(data) == left
        if left is not None:
            left -= len(data)
        # surrogateescape maps each undecodable byte to one lone surrogate, so they can be counted exactly; a file
        # cut at max_bytes drops the bytes of a character it cut in two
        text = codecs.getincrementaldecoder("utf-8")("surrogateescape").decode(data, final=not cut)
        text, n = _LONE_SURROGATE.subn("\ufffd", text)
        replaced += n
        parts.append(text)
    text = "\n".join(parts)
    if replaced:
        print(f"warning: {replaced} bytes of the corpus are not valid UTF-8; decoded with replacement (U+FFFD)",
              file=sys.stderr)
    if not text.strip():
        raise UserError(f"empty corpus: {', '.join(str(f) for f in files)} contain no text")
    return CorpusText(text, replaced, [str(f) for f in files])


# ----------------------------------------------------------------------------------------------------------------------
# Model identity: the config plus a fingerprint of weights that every form of the model stores identically

def model_identity(ckpt) -> dict:
    """{"config": ..., "fingerprint": hex} for a Checkpoint or FlashCheckpoint.

    The fingerprint hashes the embedding and the first layer's norms, rounded to float16: a FLASHDIR keeps these
    resident as the source (HF dir or GGUF) had them or rounded to float16, so a model and its FLASHDIR agree, while
    another model (or the same architecture with other weights) does not.
    """
    h = hashlib.blake2b(digest_size=16)
    for name in ("embed.weight", "layers.0.attn_norm.weight", "layers.0.ffn_norm.weight"):
        if name in ckpt:
            h.update(name.encode())
            h.update(np.ascontiguousarray(ckpt.tensor(name), dtype=np.float16).tobytes())
    cfg = ckpt.config.to_dict()
    h.update(json.dumps(cfg, sort_keys=True).encode())
    return {"config": cfg, "fingerprint": h.hexdigest()}


def check_same_model(acts_identity: dict, ckpt, acts_dir, model_path) -> None:
    mine = model_identity(ckpt)
    if mine["fingerprint"] != acts_identity.get("fingerprint"):
        what = "config" if mine["config"] != acts_identity.get("config") else "weights"
        raise UserError(f"activations in {acts_dir} were collected from another model than {model_path} "
                        f"(the {what} differ): re-run `flashinfer-lite collect -m {model_path}`")


# ----------------------------------------------------------------------------------------------------------------------
# Writing shards

_ST_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}


class ShardWriter:
    """A safetensors file laid out before its tensors are computed: the header and the file's size are written
    first, then rows land in place (os.pwrite) as they come, so no shard is ever whole in memory.

    `tensors` maps name -> (dtype, shape); they are stored in that order, so list the wider dtypes first to keep
    every tensor aligned to its item size."""

    def __init__(self, path, tensors: dict[str, tuple[np.dtype, tuple[int, ...]]]):
        self.path = Path(path)
        header, self.where, pos = {}, {}, 0
        for name, (dtype, shape) in tensors.items():
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape)) * dtype.itemsize
            header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            self.where[name] = (dtype, tuple(shape), pos)
            pos += nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)            # the data starts 8-byte aligned, as safetensors writes it
        self.data_start = 8 + len(head)
        with open(self.path, "wb") as f:
            f.write(len(head).to_bytes(8, "little") + head)
            f.truncate(self.data_start + pos)      # sparse until the rows arrive

    def write_rows(self, name: str, row0: int, rows: np.ndarray) -> None:
        """Rows row0.. of tensor `name` (a 2-D tensor of the dtype and width declared)."""
        dtype, shape, pos = self.where[name]
        assert rows.dtype == dtype and rows.shape[1:] == shape[1:] and row0 + len(rows) <= shape[0], name
        buf = memoryview(np.ascontiguousarray(rows)).cast("B")
        offset = self.data_start + pos + row0 * (buf.nbytes // max(1, len(rows)))
        fd = os.open(self.path, os.O_WRONLY)    # opened per write: a long collection has more shards than fds
        try:
            done = 0
            while done < buf.nbytes:
                done += os.pwrite(fd, buf[done:], offset + done)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------------------------------------------------
# Reading ACTS

class Acts:
    """An ACTS directory: its manifest, and per layer the sampled rows (x, |a|) gathered from all shards."""

    def __init__(self, path):
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise UserError(f"{self.path} is not an activations directory (no {MANIFEST}; "
                            f"run `flashinfer-lite collect`)")
        m = read_json(mpath, "activations manifest")
        if m.get("format") != ACTS_FORMAT:
            raise UserError(f"{mpath} is not an activations manifest (format {m.get('format')!r})")
        if m.get("version") != ACTS_VERSION:
            raise UserError(f"{mpath}: unsupported activations version {m.get('version')} (expected {ACTS_VERSION})")
        self.manifest = m
        self.identity = m["identity"]
        self.config = ModelConfig.from_dict(self.identity["config"])
        self.shards = []
        for name in m["shards"]:
            p = (self.path / name).resolve()
            if not p.is_relative_to(self.path.resolve()) or not p.is_file():
                raise UserError(f"{mpath} names a missing or outside shard: {name!r}")
            self.shards.append(p)
        self.hist_count = np.asarray(m["hist_count"], np.float64)    # [L, N_BINS]
        self.hist_mass = np.asarray(m["hist_mass"], np.float64)      # [L, N_BINS]
        self.nonzero = np.asarray(m["nonzero_count"], np.float64)    # [L, n]
        self.tokens = int(m["tokens"])

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """x float32 [R, d], |a| float32 [R, n]: the sampled rows of layer i in corpus order."""
        from safetensors import safe_open
        xs, as_ = [], []
        for p in self.shards:
            try:
                with safe_open(str(p), framework="numpy") as f:
                    xs.append(f.get_tensor(f"layers.{i}.x"))
                    as_.append(f.get_tensor(f"layers.{i}.a"))
            except Exception as e:   # safetensors has its own exception types for damaged files
                raise UserError(f"cannot read activation shard {p}: {e}") from None
        return np.concatenate(xs).astype(np.float32), np.concatenate(as_).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------------
# Thresholds from the histograms

def histogram(absa: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(count, mass) [N_BINS] of |a| values."""
    v = absa.ravel()
    with np.errstate(divide="ignore"):
        # bin k >= 1 covers [edge[k-1], edge[k]); 0: below 2^-40 (incl. 0); N_BINS-1: overflow. Same as
        # searchsorted(HIST_EDGES, v, "right") but a few times faster.
        pos = (np.log2(v, dtype=np.float32) - HIST_LO) * HIST_STEPS
    idx = np.clip(np.floor(pos), -1, N_BINS - 2).astype(np.int64) + 1
    count = np.bincount(idx, minlength=N_BINS).astype(np.float64)
    mass = np.bincount(idx, weights=v.astype(np.float64), minlength=N_BINS)
    return count, mass


def threshold_for(count: np.ndarray, mass: np.ndarray, sparsity: float | None = None,
                  kept_mass: float | None = None) -> float:
    """Magnitude t such that a share `sparsity` of activations has |a| <= t (or such that the activations above t
    carry `kept_mass` of the total |a| mass). Interpolated log-linearly inside the histogram bin."""
    if (sparsity is None) == (kept_mass is None):
        raise ValueError("give exactly one of sparsity, kept_mass")
    if sparsity is not None:
        w, target = count, sparsity
    else:
        w, target = mass, 1.0 - kept_mass    # the dropped share of mass
    total = w.sum()
    if total <= 0 or target <= 0:
        return 0.0
    cum = np.cumsum(w) / total
    b = int(np.searchsorted(cum, min(target, 1.0), side="left"))
    if b == 0:
        return float(HIST_EDGES[0])
    if b >= N_BINS - 1:
        return float(HIST_EDGES[-1])
    lo, hi = HIST_EDGES[b - 1], HIST_EDGES[b]        # bin b covers [edge[b-1], edge[b])
    prev = cum[b - 1]
    frac = 0.0 if cum[b] <= prev else (target - prev) / (cum[b] - prev)
    return float(lo * (hi / lo) ** frac)
