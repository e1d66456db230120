"""The KV cache in pages (model.KVCache): per layer, the keys and values of PAGE_POSITIONS positions at a time.

The first `dram_pages` pages of every layer stay in DRAM (the plan's KV share: budget.kv_share); the later ones go to
one file on flash as they fill, and the page being filled stays in DRAM until it is full. Attention reads pages, never
the whole cache: a decode step two passes over the pages it reads (the scores, then the values: the order of every
float32 operation is the same wherever a page lives, so the exact mode's bits do not depend on the budget), a prompt
chunk the layer's positions gathered into one array (model.prompt_attention).

Reads from the file run in a thread of the cache's own, one batch of pages ahead of the batch attention computes on
(two staging buffers in turn), as the FFN's rows stream while the layer before computes: the values' first batch while
the keys' last is scored, and, where the next read is known before it is asked for, the next layer's first batch
(exact decode: the same pages; a prompt: the next block of keys). A read ahead whose pages are written to the file
before it is used, or that is not what comes next, is dropped: the bytes attention reads are the file's.

Quest (Tang et al. 2024): each page keeps the per-channel min and max of its keys (after RoPE); a query's upper bound
on q.k over a page is sum_c max(q_c min_c, q_c max_c), and a decode step reads only the pages with the largest bounds
(`quest_pages`, or `quest_share` of them but at least QUEST_MIN_PAGES), plus the first (the attention sink) and the
latest. Off by default: an approximation.

Cache types (llama.cpp's --cache-type-k/v): f16, or q8_0 (blocks of 32 values along a head's channels: a float16
scale d = amax/127 and 32 int8 q = round(x/d), llama.cpp's quantize_row_q8_0).
"""
from __future__ import annotations

import errno
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from storage.cache import cache_dir
from storage.config import ModelConfig
from storage.errors import UserError
from storage.reader import aligned_empty, open_direct
from .kernels.attention import page_scores, page_values, rotate_rows

# 32 positions a page: the page of a layer's keys is then 64 x Hkv x hd bytes in float16, a multiple of 4 KiB for any
# Hkv x hd >= 64 (every real model), so a page is one O_DIRECT read with no padding; and Quest's bounds stay tight
# (its paper's 16 is twice the metadata: 2 x 4 x Hkv x hd bytes a page, 1/8 of a float16 page's bytes at 32 vs 1/4).
PAGE_POSITIONS = 32
# Pages read from flash per batch (keys or values): the size of each of the two staging buffers, whatever the
# context (one batch in use, the next one in flight).
STAGE_PAGES = 16
FILE_ALIGN = 4096           # O_DIRECT's alignment of offsets, sizes and buffers (the logical block, at most)
CACHE_TYPES = ("f16", "q8_0")
Q8_BLOCK, Q8_BYTES = 32, 34  # values per q8_0 block; its bytes: the float16 scale, then 32 int8
# Quest with a share (--kv-pages P%) reads at least this many pages besides the first and the latest (1,280
# positions): a quarter of a short context is too few where text attends widely. On the real Qwen2.5-0.5B, the
# perplexity of the last 256 tokens of a 2,048-token WikiText-2 passage was above exact by 1.8% with 16 pages (a
# quarter of 64), 2.5% with 24, 1.0% with 32, 0.0% with 40. From 5,120 positions (160 pages) on, a quarter is 40 or
# more: the floor changes nothing there.
QUEST_MIN_PAGES = 40


@dataclass(frozen=True)
class KVOptions:
    """How the KV cache is kept (the CLI's --cache-type-k/v, --kv-pages, --kcache, --kv-dir; the plan's dram_pages)."""
    type_k: str = "f16"
    type_v: str = "f16"
    quest_pages: int = 0            # Quest: pages a decode step reads besides the first and the latest; 0: every page
    quest_share: float = 0.0        # or this share of the pages (when quest_pages is 0), at least quest_min_pages
    quest_min_pages: int = QUEST_MIN_PAGES
    directory: str | None = None    # where the file of pages on flash goes; None: the process's default (kv_directory)
    dram_pages: int | None = None   # per layer, in DRAM (the plan's KV share); None: every page
    kcache: float = 0.0             # KCache: an exact decode step reads every page's keys but only the values of the
                                    # pages where a position's softmax weight reaches this (and the first and latest)
    prompt_pruning: float = 0.0     # LazyLLM (pruning.py): the share of a prompt's tokens its last layers skip; 0: off

    def __post_init__(self):
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in CACHE_TYPES:
                raise UserError(f"--cache-type-{name[-1]} {getattr(self, name)!r}: one of {', '.join(CACHE_TYPES)}")
        if self.quest_pages < 0 or not 0.0 <= self.quest_share <= 1.0 or self.quest_min_pages < 1:
            raise UserError("--kv-pages: a number of pages >= 1 or a share such as 25%")
        if not 0.0 <= self.kcache < 1.0:
            raise UserError(f"--kcache {self.kcache:g}: a softmax weight, at least 0 and below 1 (0: off)")
        if not 0.0 <= self.prompt_pruning < 1.0:
            raise UserError(f"--prompt-pruning {self.prompt_pruning:g}: a share of the prompt's tokens, at least 0 "
                            "and below 1 (0: off)")
        if self.kcache and self.quest:      # KCache reads every page's keys, Quest only some: one or the other
            raise UserError("--kcache with --kv-pages: KCache scores every page's keys, Quest chooses pages; "
                            "give one of them")

    @property
    def quest(self) -> bool:
        return self.quest_pages > 0 or self.quest_share > 0

    @property
    def quest_words(self) -> str:
        """What Quest reads, as said: "N pages" or "P% of the pages", + the first and the latest."""
        what = f"{self.quest_pages} pages" if self.quest_pages else \
            f"{self.quest_share:.0%} of the pages (at least {self.quest_min_pages})"
        return what + " + the first and the latest"

    def pages_read(self, n_pages: int) -> int:
        """Quest's pages read besides the first and the latest, of n_pages: quest_pages, else the share's, at least
        quest_min_pages (all of them in a context that has no more)."""
        return self.quest_pages or max(self.quest_min_pages, int(self.quest_share * n_pages))


def parse_kv_pages(text: str | None) -> dict:
    """--kv-pages: "N" pages or "P%" of the pages a decode step reads (Quest); None or "all": every page (exact)."""
    if text is None or text == "all":
        return {}
    try:
        if text.endswith("%"):
            share = float(text[:-1]) / 100
            if 0 < share <= 1:
                return {"quest_share": share}
        elif int(text) >= 1:
            return {"quest_pages": int(text)}
    except ValueError:
        pass
    raise UserError(f"--kv-pages {text!r}: a number of pages >= 1, a share such as 25%, or all")


def parse_kcache(text: str | None) -> dict:
    """--kcache W: KCache's softmax weight, 0 <= W < 1; None or "off": off (every page's values, exact)."""
    if text is None or text == "off":
        return {}
    try:
        return {"kcache": float(text)}      # its range is KVOptions'
    except ValueError:
        raise UserError(f"--kcache {text!r}: a softmax weight such as 0.001 (at least 0, below 1), or off") from None


def parse_prompt_pruning(text: str | None) -> dict:
    """--prompt-pruning RATIO: the share of a prompt's tokens pruned by its last layers, 0 <= RATIO < 1; None or "off":
    off."""
    if text is None or text == "off":
        return {}
    try:
        ratio = float(text)
    except ValueError:
        ratio = float("nan")
    if not 0.0 <= ratio < 1.0:          # nan too
        raise UserError(f"--prompt-pruning {text!r}: a share of the prompt's tokens such as 0.5 (at least 0, below 1), "
                        "or off")
    return {"prompt_pruning": ratio}


def writable_directory(path: str) -> None:
    """--kv-dir checked when the model loads, not when the first page goes to flash mid-answer."""
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"--kv-dir {path}: not a directory this process can write to")


def kv_directory(options: KVOptions) -> Path:
    """The directory of the file of pages on flash: the user's (runtime: else next to the model's flash files), else
    the cache."""
    return Path(options.directory) if options.directory else cache_dir()


# ----------------------------------------------------------------------------------------------------------------------
# Cache types

def row_bytes(kind: str, values: int) -> int:
    """Bytes of `values` values (one position of a layer: Hkv x hd) stored as `kind`."""
    return values * 2 if kind == "f16" else values // Q8_BLOCK * Q8_BYTES


def check_type(kind: str, head_dim: int) -> None:
    if kind == "q8_0" and head_dim % Q8_BLOCK:
        raise UserError(f"q8_0 KV needs a head dimension that is a multiple of {Q8_BLOCK} (this model's: {head_dim})")


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] (n a multiple of 32) -> uint8 [..., n / 32 x 34]: llama.cpp's quantize_row_q8_0 (as
    gguf-py's numpy port computes it: the reciprocal of the float32 scale, rounding half away from zero)."""
    b = np.asarray(x, np.float32).reshape(-1, Q8_BLOCK)
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    v = b * inv
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK * Q8_BYTES)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """uint8 q8_0 blocks (34 bytes each, any shape) -> float32 [blocks x 32]: d x q."""
    b = raw.reshape(-1, Q8_BYTES)
    d = np.ascontiguousarray(b[:, :2]).view(np.float16).astype(np.float32)
    return (d * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


def encode(kind: str, x: np.ndarray) -> np.ndarray:
    """Rows [t, Hkv, hd] float32 -> their bytes [t, row_bytes] as stored."""
    t = x.shape[0]
    if kind == "f16":
        return np.ascontiguousarray(x, np.float32).astype(np.float16).view(np.uint8).reshape(t, -1)
    return quantize_q8_0(np.ascontiguousarray(x, np.float32).reshape(t, -1))


def readable(kind: str, raw: np.ndarray, shape: tuple) -> np.ndarray:
    """Stored bytes [..., row_bytes x rows] -> what the kernels read, `shape`: float16 bits (a view where raw is
    contiguous) or float32 (q8_0, dequantized)."""
    if kind == "f16":
        return np.ascontiguousarray(raw).view(np.uint16).reshape(shape)
    return dequantize_q8_0(raw).reshape(shape)


# ----------------------------------------------------------------------------------------------------------------------
# Sizes (budget.kv_share)

def page_bytes(cfg: ModelConfig, kind: str) -> int:
    return PAGE_POSITIONS * row_bytes(kind, cfg.n_kv_heads * cfg.head_dim)


def slot_bytes(cfg: ModelConfig, kind: str) -> int:
    """A page's room in the file and in the staging buffers: its bytes rounded up to FILE_ALIGN."""
    return -(-page_bytes(cfg, kind) // FILE_ALIGN) * FILE_ALIGN


def n_pages(capacity: int) -> int:
    return -(-capacity // PAGE_POSITIONS)


def dram_page_bytes(cfg: ModelConfig, options: KVOptions, n_layers: int | None = None) -> int:
    """One page per layer of keys and values, in DRAM."""
    return (cfg.n_layers if n_layers is None else n_layers) * sum(page_bytes(cfg, k)
                                                                  for k in (options.type_k, options.type_v))


def fixed_bytes(cfg: ModelConfig, capacity: int, options: KVOptions) -> int:
    """What a cache keeps besides its pages in DRAM: each layer's page being filled, the staging of pages read from
    flash (and their dequantized copy), a decode step's scores [2, H, capacity], the pages' flags and ids, and
    with Quest the pages' key bounds (min and max, float32) and a step's bounds [H, pages, hd] x 2."""
    L, P, n = cfg.n_layers, n_pages(capacity), cfg.n_kv_heads * cfg.head_dim
    kinds = (options.type_k, options.type_v)
    tails = L * sum(slot_bytes(cfg, k) for k in kinds)
    staging = 2 * STAGE_PAGES * max(slot_bytes(cfg, k) for k in kinds) + \
        sum(STAGE_PAGES * PAGE_POSITIONS * n * 4 for k in kinds if k == "q8_0")
    scores = 2 * cfg.n_heads * capacity * 4 + L * P * 2 + P * (cfg.n_kv_heads + 8)
    quest = (L * P * (2 * n * 4 + 8) + 3 * cfg.n_heads * P * cfg.head_dim * 4) if options.quest else 0
    return tails + staging + scores + quest


def all_bytes(cfg: ModelConfig, capacity: int, options: KVOptions) -> int:
    """The whole cache in DRAM: every page, and fixed_bytes."""
    return n_pages(capacity) * dram_page_bytes(cfg, options) + fixed_bytes(cfg, capacity, options)


# ----------------------------------------------------------------------------------------------------------------------
# The file of pages on flash

class PageFile:
    """One file, pages at fixed offsets ([keys | values][layer][page], a slot each: consecutive pages of a layer are one
    read). Unlinked as soon as it is open, so it goes when the process does, at exit, on error or when killed.
    O_DIRECT where the filesystem accepts it (the page cache would hold a second copy of what the budget put on
    flash); else buffered (tmpfs), which `direct` says."""

    def __init__(self, directory: Path, slots: tuple[int, int], n_layers: int, pages: int):
        self.slots, self.n_layers, self.pages = slots, n_layers, pages
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="kv-pages-", suffix=".bin", dir=directory)
        except OSError as e:
            raise UserError(f"--kv-dir {directory}: cannot create the KV pages' file ({e.strerror})") from None
        os.close(fd)
        self.path = path
        try:
            self.fd, self.direct = open_direct(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0), FILE_ALIGN)
        finally:
            os.unlink(path)

    def offset(self, which: int, layer: int, page: int) -> int:
        base = 0 if which == 0 else self.n_layers * self.pages * self.slots[0]
        return base + (layer * self.pages + page) * self.slots[which]

    def write(self, which: int, layer: int, page: int, buf: np.ndarray) -> None:
        n = os.pwrite(self.fd, memoryview(buf), self.offset(which, layer, page))
        if n != buf.nbytes:
            raise OSError(errno.EIO, f"short write of a KV page ({n} of {buf.nbytes} bytes)")

    def read(self, which: int, layer: int, pages: np.ndarray, into: np.ndarray) -> None:
        """Pages (ascending) of a layer into into[0..], one read per run of consecutive pages."""
        i = 0
        while i < len(pages):
            j = i + 1
            while j < len(pages) and pages[j] == pages[j - 1] + 1:
                j += 1
            dest = into[i:j]
            n = os.preadv(self.fd, [memoryview(dest).cast("B")], self.offset(which, layer, int(pages[i])))
            if n != dest.nbytes:
                raise OSError(errno.EIO, f"short read of KV pages ({n} of {dest.nbytes} bytes)")
            i = j

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ----------------------------------------------------------------------------------------------------------------------
# The cache

@dataclass
class PageStats:
    """Decode steps and the pages their attention read (summed over layers), of which from flash; and the reads of
    flash pages (keys and values each) that were in flight before attention asked for them."""
    steps: int = 0
    pages_read: int = 0
    flash_pages_read: int = 0
    pages_held: int = 0         # pages of the context at each step, summed (what exact attention would read)
    flash_reads: int = 0        # page reads from the file (a page's keys and its values: two)
    flash_reads_ahead: int = 0  # of which submitted before their batch was asked for
    value_pages_read: int = 0   # pages whose values a step read (KCache: fewer than pages_read, their keys)

    def per_token(self) -> dict:
        s = max(self.steps, 1)
        return {"pages_read": self.pages_read / s, "flash_pages_read": self.flash_pages_read / s,
                "value_pages_read": self.value_pages_read / s,
                "pages": self.pages_held / s, "read_ahead": self.flash_reads_ahead / max(self.flash_reads, 1)}


class PageRead:
    """Pages (ascending, one batch) of a layer's keys (w = 0) or values being read from the file into a staging
    buffer by the cache's reading thread."""

    def __init__(self, w: int, layer: int, pages: np.ndarray, buf: np.ndarray, future: Future):
        self.w, self.layer, self.pages, self.buf, self.future = w, layer, pages, buf, future

    def is_(self, w: int, layer: int, pages: np.ndarray) -> bool:
        return self.w == w and self.layer == layer and np.array_equal(self.pages, pages)

    def wait(self) -> np.ndarray:
        self.future.result()            # the read's OSError, if it failed
        return self.buf

    def drop(self) -> None:
        """Wait for a read nobody will use (its buffer is about to be reused); its error is the next read's to find."""
        try:
            self.future.result()
        except OSError:
            pass


class KVCache:
    """Keys and values of a context of `capacity` positions, in pages per layer (module docstring). k and v are
    stored as options.type_k and type_v; float16 is llama.cpp's default KV type too (a key or value beyond its range,
    65504, would become inf)."""

    def __init__(self, cfg: ModelConfig, capacity: int, n_layers: int | None = None,
                 options: KVOptions | None = None):
        # n_layers: the model's by default; 1 when layers run one at a time (predictors/layerwise.py)
        self.cfg, self.capacity, self.file = cfg, capacity, None
        self.reads = None       # the reading thread (ThreadPoolExecutor), on the first read; set first: close() asks
        self.options = o = KVOptions() if options is None else options
        L = self.n_layers = cfg.n_layers if n_layers is None else n_layers
        self.Hkv, self.hd = cfg.n_kv_heads, cfg.head_dim
        self.kinds = (o.type_k, o.type_v)
        for k in self.kinds:
            check_type(k, self.hd)
        self.pages = n_pages(capacity)
        self.dram_pages = self.pages if o.dram_pages is None else min(self.pages, max(0, o.dram_pages))
        per_page = dram_page_bytes(cfg, o, L)
        fixed, ram = fixed_bytes(cfg, capacity, o), psutil.virtual_memory().total
        need = self.dram_pages * per_page + fixed
        if need > ram:       # -c 300000 on a model claiming 10M positions: refused before allocating
            flash = " or a --dram-budget (the pages beyond it go to flash)" if fixed < ram // 2 else ""
            raise UserError(f"a context of {capacity} positions needs {need / 2**30:.1f} GiB of KV cache, more than "
                            f"this machine's {ram / 2**30:.1f} GiB of memory: give a smaller -c{flash}")
        self.page_bytes = tuple(page_bytes(cfg, k) for k in self.kinds)
        self.slot_bytes = tuple(slot_bytes(cfg, k) for k in self.kinds)
        try:            # zeros: pages not yet written take no DRAM (calloc's untouched pages)
            self.pool = tuple(np.zeros((L, self.dram_pages, b), np.uint8) for b in self.page_bytes)
            self.scores = np.empty((2, cfg.n_heads, capacity), np.float32)
        except MemoryError:
            raise UserError(f"cannot allocate the KV cache of a {capacity}-position context "
                            f"({need / 2**30:.1f} GiB): give a smaller -c or a --dram-budget") from None
        self.tail = tuple(aligned_empty((L, s), np.uint8, FILE_ALIGN) for s in self.slot_bytes) \
            if self.dram_pages < self.pages else None
        for t in self.tail or ():
            t[:] = 0               # rows not yet written are read as zeros (q8_0: no NaN from stale bytes), never used
        self.tail_page = np.full(L, -1, np.int64)            # the page each layer's tail holds
        self.flushed = np.zeros((L, self.pages), bool)       # pages written to the file
        self.staging = None         # two buffers, in turn (page_values)
        self.turn = 0
        self.ahead: PageRead | None = None      # the read in flight beyond the batch in use
        self.every_page = np.ones((self.pages, self.Hkv), np.uint8)          # exact attention's `chosen`
        self.page_ids = np.arange(self.pages, dtype=np.int64)
        if o.quest:
            self.kmin = np.empty((L, self.pages, self.Hkv, self.hd), np.float32)
            self.kmax = np.empty((L, self.pages, self.Hkv, self.hd), np.float32)
            self.bound_rows = np.zeros((L, self.pages), np.int64)     # rows of the page kmin/kmax cover
        self.stats = PageStats()
        self.length = 0  # positions filled
        # prompt pruning (pruning.py): per layer, the positions of pruned prompts it holds no keys and values of; a
        # position after them is at slot position - pruned[layer] of the layer. pruned_end: the last pruned prompt's end
        self.pruned = np.zeros(L, np.int64)
        self.pruned_end = 0

    def reusable(self, length: int) -> int:
        """How many of the first `length` positions a reset can keep: none inside a pruned prompt (its layers' slots
        no longer say which positions they hold), else all."""
        return 0 if length < self.pruned_end else length

    def reset(self, length: int = 0) -> None:
        """Keep the first `length` positions (a later write reloads a partial page from the file if it must); a
        length inside a pruned prompt is refused (reusable says what can be kept)."""
        if length < self.pruned_end:
            if length:
                raise ValueError(f"KVCache.reset({length}): inside a pruned prompt (ends at {self.pruned_end})")
            self.pruned[:], self.pruned_end = 0, 0
        self.length = length

    def close(self) -> None:
        if self.reads is not None:
            self.reads.shutdown(wait=True)
            self.reads, self.ahead = None, None
        if self.file is not None:
            self.file.close()

    def __del__(self):
        self.close()

    @property
    def on_flash(self) -> int:
        """Pages (all layers) in the file."""
        return int(self.flushed.sum())

    def describe(self) -> str:
        o = self.options
        io = "O_DIRECT" if self.file is None or self.file.direct else "buffered: the filesystem refuses O_DIRECT"
        where = "" if self.dram_pages == self.pages else \
            f", the rest on flash ({io}, a file in {kv_directory(o)}, deleted at exit)"
        read = f"Quest: {o.quest_words}" if o.quest else "every page"
        return (f"kv cache {o.type_k}/{o.type_v} in pages of {PAGE_POSITIONS} positions: {self.dram_pages} of "
                f"{self.pages} per layer in DRAM{where}; a decode step reads {read}")

    # ---- writing

    def write(self, layer: int, pos0: int, k: np.ndarray, v: np.ndarray) -> None:
        """Rows k, v [t, Hkv, hd] (float32, keys rotated) at positions pos0.. of a layer."""
        P, t = PAGE_POSITIONS, k.shape[0]
        if t == 0:
            return
        raws = [encode(kind, x) for kind, x in zip(self.kinds, (k, v))]
        if self.options.quest:
            self._bound(layer, pos0, self._as_read(0, raws[0], t))
        at = pos0
        while at < pos0 + t:
            p, r = divmod(at, P)
            n = min(P - r, pos0 + t - at)
            for w in (0, 1):
                rb = row_bytes(self.kinds[w], self.Hkv * self.hd)
                self._page_for_write(w, layer, p, r)[r * rb:(r + n) * rb] = raws[w][at - pos0:at - pos0 + n].reshape(-1)
            if p >= self.dram_pages and r + n == P:     # full: to the file
                self._flush(layer, p)
            at += n

    def _as_read(self, w: int, raw: np.ndarray, t: int) -> np.ndarray:
        """The values attention will read of stored rows raw [t, row_bytes], float32 [t, Hkv, hd]."""
        x = readable(self.kinds[w], raw, (t, self.Hkv, self.hd))
        return x.view(np.float16).astype(np.float32) if x.dtype == np.uint16 else x

    def _bound(self, layer: int, pos0: int, keys: np.ndarray) -> None:
        """Quest's per-page min and max of the keys as attention reads them (rounded as stored)."""
        P = PAGE_POSITIONS
        at = pos0
        while at < pos0 + len(keys):
            p, r = divmod(at, P)
            n = min(P - r, pos0 + len(keys) - at)
            rows = keys[at - pos0:at - pos0 + n]
            lo, hi = rows.min(axis=0), rows.max(axis=0)
            if r > 0 and self.bound_rows[layer, p] != r:      # after a reset: the bounds of the rows kept
                store, slots, _ = next(self.page_values(layer, 0, np.array([p])))
                kept = store[slots[0], :r]
                kept = kept.view(np.float16).astype(np.float32) if kept.dtype == np.uint16 else kept
                self.kmin[layer, p], self.kmax[layer, p] = kept.min(axis=0), kept.max(axis=0)
            if r > 0:
                lo, hi = np.minimum(lo, self.kmin[layer, p]), np.maximum(hi, self.kmax[layer, p])
            self.kmin[layer, p], self.kmax[layer, p] = lo, hi
            self.bound_rows[layer, p] = r + n
            at += n

    def _page_for_write(self, w: int, layer: int, p: int, r: int) -> np.ndarray:
        """The bytes of page p (keys w = 0, values 1) to write rows r.. into: in the pool, else the layer's tail."""
        if p < self.dram_pages:
            return self.pool[w][layer, p]
        if self.tail_page[layer] != p:
            if r > 0 and self.flushed[layer, p]:      # a context cut inside a page (reset) and grown again
                for x in (0, 1):
                    self.file.read(x, layer, np.array([p]), self.tail[x][layer:layer + 1])
            self.tail_page[layer] = p
        return self.tail[w][layer, :self.page_bytes[w]]

    def _flush(self, layer: int, p: int) -> None:
        if self.file is None:
            self.file = PageFile(kv_directory(self.options), self.slot_bytes, self.n_layers, self.pages)
        if self.ahead is not None and self.ahead.layer == layer and p in self.ahead.pages:
            self.ahead.drop()           # it read the page as it was (a context cut and grown again)
            self.ahead = None
        for w in (0, 1):
            self.file.write(w, layer, p, self.tail[w][layer])
        self.flushed[layer, p] = True
        self.tail_page[layer] = -1

    # ---- reading

    def flash_pages(self, layer: int, pages: np.ndarray) -> np.ndarray:
        """Of pages (ascending) of a layer, those read from the file: past the DRAM share and not the one being
        filled."""
        return pages[(pages >= self.dram_pages) & (pages != self.tail_page[layer])]

    def _read(self, w: int, layer: int, pages: np.ndarray) -> PageRead:
        """Start reading a batch of pages into the staging buffer the batch before it does not use."""
        if self.staging is None:
            self.staging = tuple(aligned_empty((STAGE_PAGES * max(self.slot_bytes),), np.uint8, FILE_ALIGN)
                                 for _ in range(2))
            self.reads = ThreadPoolExecutor(1, thread_name_prefix="kv-pages")
        self.turn ^= 1
        s = self.slot_bytes[w]
        buf = self.staging[self.turn][:STAGE_PAGES * s].reshape(STAGE_PAGES, s)
        return PageRead(w, layer, pages, buf, self.reads.submit(self.file.read, w, layer, pages, buf[:len(pages)]))

    def _take(self, w: int, layer: int, pages: np.ndarray) -> PageRead:
        """The read of this batch: the one in flight if it is this batch, else one started now."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            if ahead.is_(w, layer, pages):
                self.stats.flash_reads_ahead += len(pages)
                return ahead
            ahead.drop()
        return self._read(w, layer, pages)

    def read_ahead(self, w: int, layer: int, pages: np.ndarray) -> None:
        """Start reading the first batch of the pages a later page_values(layer, w, pages) will read from the file
        (the pages there now, written in full), unless a read is in flight already."""
        if self.ahead is not None or self.file is None or not 0 <= layer < self.n_layers:
            return
        flash = self.flash_pages(layer, pages)
        flash = flash[self.flushed[layer, flash]][:STAGE_PAGES]
        if len(flash):
            self.ahead = self._read(w, layer, flash)

    def page_values(self, layer: int, w: int, pages: np.ndarray, then: tuple | None = None):
        """Pages (ascending) of a layer's keys (w = 0) or values, as the kernels read them: yields (store, slots,
        pages) in ascending page order, store [n, P, Hkv, hd] (float16 bits or float32) holding page pages[i] at
        slots[i]; pages from flash in batches of STAGE_PAGES, each read while the one before is in use. then:
        (w, layer, pages) of the page_values that will come next, whose first batch is read while the last one here
        is in use."""
        shape = (PAGE_POSITIONS, self.Hkv, self.hd)
        kind, pb = self.kinds[w], self.page_bytes[w]
        flash = self.flash_pages(layer, pages)
        batches = [flash[i:i + STAGE_PAGES] for i in range(0, len(flash), STAGE_PAGES)]
        read = self._take(w, layer, batches[0]) if batches else None      # in flight while the DRAM pages are used
        if not batches and then is not None:
            self.read_ahead(*then)
        dram = pages[pages < self.dram_pages]
        if len(dram):
            if kind == "f16":
                yield readable(kind, self.pool[w][layer], (-1, *shape)), dram, dram
            else:
                for i in range(0, len(dram), STAGE_PAGES):
                    some = dram[i:i + STAGE_PAGES]
                    yield readable(kind, self.pool[w][layer][some], (-1, *shape)), np.arange(len(some)), some
        for i, some in enumerate(batches):
            if i + 1 < len(batches):
                self.ahead = self._read(w, layer, batches[i + 1])
            elif then is not None:
                self.read_ahead(*then)
            buf = read.wait()
            self.stats.flash_reads += len(some)
            yield readable(kind, buf[:len(some), :pb], (-1, *shape)), np.arange(len(some)), some
            if i + 1 < len(batches):
                read = self._take(w, layer, batches[i + 1])
        tail = pages[(pages >= self.dram_pages) & (pages == self.tail_page[layer])]
        if len(tail):
            yield readable(kind, self.tail[w][layer:layer + 1, :pb], (-1, *shape)), np.zeros(1, np.int64), tail

    def rows(self, layer: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """A layer's keys and values of positions start..stop-1 [stop - start, Hkv, hd] (float16 bits or float32;
        start a page's first position), for a prompt's attention: a view of the pool when they all are there."""
        P = PAGE_POSITIONS
        first, last = start // P, -(-stop // P)
        # read ahead: the block of keys a prompt's attention reads next, of this layer, else of the next layer
        after = np.arange(last, min(2 * last - first, self.pages))
        after = (0, layer, after) if self.flushed[layer, after].any() else (0, layer + 1, np.arange(last - first))
        out = []
        for w in (0, 1):
            if last <= self.dram_pages and self.kinds[w] == "f16":
                out.append(readable("f16", self.pool[w][layer], (-1, self.Hkv, self.hd))[start:stop])
                continue
            rows = None
            then = (1, layer, np.arange(first, last)) if w == 0 else after
            for store, slots, pages in self.page_values(layer, w, np.arange(first, last), then):
                if rows is None:
                    rows = np.empty(((last - first) * P, self.Hkv, self.hd), store.dtype)
                for s, p in zip(slots, pages):
                    rows[(p - first) * P:(p - first + 1) * P] = store[s]
            out.append(rows[:stop - start])
        return out[0], out[1]

    # ---- decode attention

    def select(self, layer: int, q: np.ndarray, last: int) -> np.ndarray:
        """Quest: which pages 0..last each KV head reads [last + 1, Hkv] (uint8) for a query q [H, hd] (rotated): the
        first, the latest, and pages_read pages more. A page holds every KV head's keys and values, so one read serves
        them all: the pages are taken by rank, round robin over the KV heads (each head's ranking by its bound, the
        largest over its group of queries; ties to the earlier page), until pages_read distinct pages are in, and every
        head attends over all of them."""
        n = last + 1
        chosen = np.zeros((n, self.Hkv), np.uint8)
        keep = self.options.pages_read(n)               # a share: of the pages the context has now
        if n <= keep + 2:
            chosen[:] = 1
            return chosen
        H = q.shape[0]
        b = quest_bounds(q.reshape(self.Hkv, H // self.Hkv, self.hd), self.kmin[layer, :n], self.kmax[layer, :n])
        b = b.max(axis=1)                                                     # [Hkv, n]: the group's largest
        ranked = np.stack([np.argsort(-b[c, 1:last], kind="stable") for c in range(self.Hkv)], axis=1).ravel() + 1
        _, at = np.unique(ranked, return_index=True)                          # each page at its best rank, first head
        chosen[ranked[np.sort(at)[:keep]]] = 1
        chosen[0] = chosen[last] = 1
        return chosen

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, cos: np.ndarray, sin: np.ndarray,
               pos0: int, sliding_window: int, scale: np.float32, out: np.ndarray) -> None:
        """A decode step's attention (T new rows at positions pos0..): rotates q and k in place, writes k and v, and
        leaves in out [T, H, hd] the causal attention over the pages read."""
        T, H, hd = q.shape
        rotate_rows(q, k, cos, sin)
        self.write(layer, pos0, k, v)
        hi = np.arange(pos0, pos0 + T, dtype=np.int64)
        lo = np.maximum(hi - sliding_window + 1, 0) if sliding_window > 0 else np.zeros(T, np.int64)
        P = PAGE_POSITIONS
        first, last = int(lo.min()) // P, (pos0 + T - 1) // P
        then = None
        if self.options.quest and T == 1 and not sliding_window:
            chosen = self.select(layer, q[0], last)
            pages = np.flatnonzero(chosen[first:].any(axis=1)) + first
        else:
            chosen, pages = self.every_page, self.page_ids[first:last + 1]
            if T == 1 and not self.options.quest:   # the next layer reads the same pages (the next step's: one more)
                then = (0, layer + 1, pages) if layer + 1 < self.n_layers else \
                    (0, 0, self.page_ids[first:(pos0 + T) // P + 1])
        kcache = self.options.kcache > 0 and T == 1 and not sliding_window and not self.options.quest
        m = np.full((T, H), -np.inf, np.float32)
        scores = self.scores[:T] if T <= len(self.scores) else np.empty((T, H, self.capacity), np.float32)
        for store, slots, some in self.page_values(layer, 0, pages, None if kcache else (1, layer, pages)):
            page_scores(q, store, slots, some, P, lo, hi, chosen, scale, scores, m)
        values = self.heavy_pages(pages, scores[0], m[0], pos0 + 1) if kcache else pages
        out[:] = 0.0
        total = np.zeros((T, H), np.float32)
        for store, slots, some in self.page_values(layer, 1, values, then):
            page_values(scores, m, store, slots, some, P, lo, hi, chosen, out, total)
        out *= (np.float32(1.0) / total)[:, :, None]
        if T == 1:
            self.stats.pages_read += len(pages)
            self.stats.value_pages_read += len(values)
            self.stats.flash_pages_read += int(np.count_nonzero((pages >= self.dram_pages)
                                                                & (pages != self.tail_page[layer])))
            self.stats.pages_held += last + 1 - first
            self.stats.steps += layer == self.n_layers - 1


    def heavy_pages(self, pages: np.ndarray, scores: np.ndarray, m: np.ndarray, n: int) -> np.ndarray:
        """KCache: of a step's pages (0.. the latest, the context's n positions), those holding a position whose
        softmax weight reaches options.kcache for some head (scores [H, capacity] and their largest m [H], as the
        keys' pass left them), and the first and the latest. Attention then sums the values of these alone, its
        weights normalized over them: it moves by at most twice the weight left out times the largest value."""
        w = np.exp(scores[:, :n] - m[:, None])
        w /= w.sum(axis=1, keepdims=True)
        peak = np.zeros(len(pages) * PAGE_POSITIONS, np.float32)
        peak[:n] = w.max(axis=0)
        heavy = peak.reshape(len(pages), PAGE_POSITIONS).max(axis=1) >= self.options.kcache
        heavy[0] = heavy[-1] = True
        return pages[heavy]


def quest_bounds(q: np.ndarray, kmin: np.ndarray, kmax: np.ndarray) -> np.ndarray:
    """Quest's upper bounds on q.k over each page: q [Hkv, g, hd], kmin and kmax [n, Hkv, hd] -> [Hkv, g, n], the sum
    over channels of max(q_c kmin_c, q_c kmax_c). Computed in q's dtype."""
    lo = q[:, :, None, :] * kmin.transpose(1, 0, 2)[:, None, :, :]
    hi = q[:, :, None, :] * kmax.transpose(1, 0, 2)[:, None, :, :]
    return np.maximum(lo, hi).sum(axis=-1)
