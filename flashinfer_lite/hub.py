"""-m ORG/NAME[:TAG]: a model in the local Hugging Face hub cache, found offline (nothing is downloaded).

The cache is huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub; a repo is models--ORG--NAME/, its files under snapshots/REVISION/ (symlinks to blobs/), the
revision `main` names in refs/main. A snapshot with config.json is an HF model directory; else its .gguf file, the one
whose name holds TAG (Q4_K_M in qwen2.5-0.5b-instruct-q4_k_m.gguf) when it has several.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from storage.errors import UserError

REPO_ID = re.compile(r"([A-Za-z0-9][\w.-]*)/([A-Za-z0-9][\w.-]*)(?::([\w.-]+))?")


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def resolve_model(model):
    """model as load() takes it: a path that exists, or None, as they are; a repo id (ORG/NAME, a GGUF repo's
    ORG/NAME:TAG) the path of its files in the hub cache. A repo id not there is one line: where it looked and the
    command that downloads it."""
    if model is None or Path(model).expanduser().exists():
        return model
    m = REPO_ID.fullmatch(str(model))
    if not m:
        return model                              # a path that does not exist: the loader's "model not found"
    org, name, tag = m.groups()
    repo = f"{org}/{name}"
    where = hub_cache() / f"models--{org}--{name}"
    snapshot = _snapshot(where)
    ggufs = sorted(p for p in snapshot.glob("*.gguf")) if snapshot else []
    if snapshot is None or not ((snapshot / "config.json").is_file() or ggufs):
        pattern = f' --include "*{tag}*.gguf"' if tag else ""
        raise UserError(f"model not found: {model} is neither a path nor in the Hugging Face cache ({where}); "
                        f"download it: huggingface-cli download {repo}{pattern}")
    if tag is None and (snapshot / "config.json").is_file():
        return str(snapshot)
    picked = [p for p in ggufs if tag and tag.lower() in p.name.lower()] if tag else ggufs
    if len(picked) == 1:
        return str(picked[0])
    names = ", ".join(p.name for p in ggufs)
    if not picked:
        raise UserError(f"{repo} in the Hugging Face cache ({snapshot}) has no .gguf file named with {tag!r}: "
                        f"it has {names or 'none'}")
    named = f" named with {tag!r}" if tag else ""
    raise UserError(f"{repo} in the Hugging Face cache holds {len(picked)} GGUF files{named}: "
                    f"{', '.join(p.name for p in picked)}; pick one by its quantization, e.g. -m {repo}:Q4_K_M")


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot refs/main names; without refs/main, the only snapshot (or None)."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = repo_dir / "snapshots" / ref.read_text().strip()
        return snap if snap.is_dir() else None
    snaps = [p for p in (repo_dir / "snapshots").glob("*") if p.is_dir()]
    return snaps[0] if len(snaps) == 1 else None
