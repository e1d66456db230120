"""Reading untrusted model files: JSON with a size bound, and paths that must stay inside their directory.
Every reader of a model file (checkpoint, format, tokenizer, predictors) goes through it."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError

MAX_JSON_BYTES = 50 * 1024 * 1024


def read_json(path: Path, what: str) -> dict:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise UserError(f"{what} is too large ({path.stat().st_size} bytes): {path}")
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"missing {what}: {path}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what} is not valid JSON: {path}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} is not a JSON object: {path}")
    return data


def inside(root: Path, name, what: str) -> Path:
    """root/name, refusing names that escape root (absolute paths, '..', symlinks out) or name root itself."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UserError(f"{what}: invalid path {name!r}")
    base = root.resolve()
    p = (base / name).resolve()
    if Path(name).is_absolute() or p == base or base not in p.parents:
        raise UserError(f"{what} names a path outside the directory {root}: {name!r}")
    return p
