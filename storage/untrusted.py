"""Reading untrusted model files: regular files only, bounded by the bytes actually read; JSON with a size and a
nesting bound; paths that must stay inside their directory; weights that must be finite.
Every reader of a model file (checkpoint, format, tokenizer, predictors) goes through it."""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import numpy as np

from .errors import UserError

MAX_JSON_BYTES = 50 * 1024 * 1024


def read_bytes(path: Path, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. Never blocks on a FIFO (opened non-blocking, then
    refused), never reads a device such as /dev/zero (refused), and stops at limit + 1 bytes whatever stat says:
    a file that grows while read, or a special file reporting size 0, is bounded too."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UserError(f"missing {what}: {path}") from None
    except OSError as e:
        raise UserError(f"cannot open {what} {path}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{what} is not a regular file: {path}")
        chunks, got = [], 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    if got > limit:
        raise UserError(f"{what} is too large (more than the {limit} bytes allowed): {path}")
    return b"".join(chunks)


def parse_json(data: bytes | str, what: str, path) -> object:
    """json.loads with every failure one line: bad UTF-8, bad JSON, and nesting too deep for the parser (a
    RecursionError on a header of 100,000 '[')."""
    try:
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what} is not valid JSON: {path}: {e}") from None
    except RecursionError:
        raise UserError(f"{what} is nested too deeply: {path}") from None


def read_json(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> dict:
    data = parse_json(read_bytes(path, what, limit), what, path)
    if not isinstance(data, dict):
        raise UserError(f"{what} is not a JSON object: {path}")
    return data


def inside(root: Path, name, what: str, blobs: Path | None = None) -> Path:
    """root/name, refusing names that escape root (absolute paths, '..', symlinks out) or name root itself.
    blobs: a directory that root's symlinks may also point into (a Hugging Face hub cache's, hub_blobs)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UserError(f"{what}: invalid path {name!r}")
    base = root.resolve()
    p = (base / name).resolve()
    in_blobs = blobs is not None and ".." not in Path(name).parts and p.parent == blobs.resolve()
    if Path(name).is_absolute() or p == base or (base not in p.parents and not in_blobs):
        raise UserError(f"{what} names a path outside the directory {root}: {name!r}")
    return p


def hub_blobs(root: Path) -> Path | None:
    """REPO/blobs when root is a Hugging Face hub cache snapshot, REPO/snapshots/REV (`huggingface-cli download`
    leaves every file of it a symlink to ../../blobs/HASH: the normal layout, not an escape); else None."""
    root = Path(root).absolute()
    blobs = root.parent.parent / "blobs"
    return blobs if root.parent.name == "snapshots" and blobs.is_dir() else None


def check_finite(a: np.ndarray, what: str) -> np.ndarray:
    """a, unless a float array holding NaN or inf (a corrupt download: GGUF files carry no checksums), refused in one
    line naming `what` (the tensor) and where. One float64 sum, buffered, no array as large as a: the sum of finite
    float16 or float32 values cannot overflow float64, and any NaN or inf makes it non-finite."""
    if a.dtype.kind == "f" and a.size and not math.isfinite(a.sum(dtype=np.float64)):
        at = np.unravel_index(int(np.argmin(np.isfinite(a))), a.shape)
        raise UserError(f"{what} holds {a[at]} at {list(map(int, at))}: the file is damaged")
    return a
