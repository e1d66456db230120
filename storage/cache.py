"""The user cache: converted models, the default model's GGUF, the device profile; and, in the last section,
finding a model in Hugging Face's hub cache (-m ORG/NAME[:TAG]).

  CACHE/                       $FLASHINFER_LITE_CACHE, else $XDG_CACHE_HOME/flashinfer-lite, else ~/.cache/...
    models/                    the default model's GGUF (fetched on first use)
    flash/NAME-KEY/            a FLASHDIR converted on first use from a model file or directory
    flash/index.json           NAME-KEY -> the source path it was converted from (for `flashinfer-lite cache`)
    source-digests.json        per source file: size, mtime, inode -> content digest (so nothing is hashed twice)
    device-profile.json        flash-bench's result (storage/profile.py)

KEY is a digest of the source's content (file names relative to it, and bytes), never of its path or times, followed
by the dtype convert's default gives it: moving the cache or the model, or touching a file, finds the same
conversion; changing a byte, or convert's default for it, makes a new one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from storage.errors import UserError, child_exit_code, run_child

from .checkpoint import open_checkpoint
from .convert import (DEFAULT_DTYPE, check_free_space, convert, convert_seconds, flashdir_bytes, gigabytes,
                      layout_for)
from .files import (disk_bytes, exclusive, is_stale, remove_stale_temp_dirs, remove_temp, temp_entries,
                    write_best_effort)
from .checksums import file_checksum, new_checksum
from .format import FORMAT_VERSION, MANIFEST, is_flashdir

FLASH = "flash"
INDEX = "index.json"
DIGESTS = "source-digests.json"


def cache_dir() -> Path:
    """$FLASHINFER_LITE_CACHE, else $XDG_CACHE_HOME/flashinfer-lite, else ~/.cache/flashinfer-lite."""
    env = os.environ.get("FLASHINFER_LITE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "flashinfer-lite"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}             # a lost or damaged index only costs a re-hash, never a wrong answer


def _write(path: Path, data: dict) -> None:
    """Best effort: a read-only cache re-hashes a source at every run, and finds its conversion by that digest."""
    write_best_effort(path, json.dumps(data, indent=1))


def source_key(path: Path, known_only: bool = False) -> str | None:
    """Digest of a model file's or directory's content; file digests are remembered by (size, mtime, inode).
    known_only: None rather than read a file whose digest is not remembered (and nothing written)."""
    path = Path(path).resolve()
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    memo_path = cache_dir() / DIGESTS
    memo, changed = _read(memo_path), False
    h = new_checksum()
    for f in files:
        st = f.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        seen = memo.get(str(f))
        if not (isinstance(seen, dict) and seen.get("stat") == stamp):
            if known_only:
                return None
            seen = memo[str(f)] = {"stat": stamp, "digest": file_checksum(f)}
            changed = True
        name = f.relative_to(path).as_posix() if path.is_dir() else ""
        h.update(f"{name}\0{seen['digest']}\n".encode())
    if changed:
        _write(memo_path, memo)
    return h.hexdigest()[:16]


def cached_conversion(p: Path, known_only: bool = False) -> Path | None:
    """Where the cached conversion of model file/directory p is (or will be made): an existing one of this format
    version is reused as it is.
    known_only: None when finding it would read the model (its digest is not remembered)."""
    flash = cache_dir() / FLASH
    if known_only and source_key(p, known_only=True) is None:
        return None
    # The dtype convert's default gives this source is part of the key: a conversion made under an older default
    # (first uses before q4_1 made float16 ones) is not reused, and `flashinfer-lite cache` lists it for removal.
    # "-split": GLU conversions made before the split layout (ffn.gate's gate|up and down files) are not reused;
    # "-parts": nor, for the exact gate's models, those that also hold ffn.bin (the FFN twice on disk); "-vN": nor
    # those of another format version (read_layout refuses them).
    layout = layout_for(open_checkpoint(p), DEFAULT_DTYPE)
    key = (f"{source_key(p)}-{layout.dtype}{'-parts' if not layout.bundled else '-split' if layout.glu else ''}"
           f"-v{FORMAT_VERSION}")
    # the name's stem is for people; the key alone finds a conversion (a renamed model is the same model)
    return next((d for d in sorted(flash.glob(f"*-{key}")) if is_flashdir(d)), flash / f"{p.stem}-{key}")


def flashdir_for(path, progress: bool, then=None) -> str:
    """A FLASHDIR for any model path: itself, or a conversion cached under the user cache dir (made on first use,
    announced by first_use_line; then: what the run does after it, for that line)."""
    if is_flashdir(path):
        return str(path)
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise UserError(f"model not found: {p}")
    flash = cache_dir() / FLASH
    dest = cached_conversion(p)
    if not is_flashdir(dest):
        flash.mkdir(parents=True, exist_ok=True)
        with exclusive(dest, "the first-use conversion"):
            if not is_flashdir(dest):                       # a concurrent first use may have made it meanwhile
                remove_stale_temp_dirs(flash)
                print(first_use_line(p, dest, then), file=sys.stderr)
                convert_in_child(p, dest, progress)
    index = _read(flash / INDEX)
    if index.get(dest.name, {}).get("source") != str(p):
        index[dest.name] = {"source": str(p)}
        _write(flash / INDEX, index)
    return str(dest)


def first_use_line(src: Path, dest: Path, then=None) -> str:
    """The line before a first use's conversion: what it writes where, what follows, and roughly how long it all takes
    (convert_seconds; then(config, layout) -> (", then ...", seconds): what the run does next), so that minutes of work
    are announced, not only shown by a progress bar once under way. A cache without room for it is refused first
    (convert.check_free_space), with nothing announced."""
    ckpt = open_checkpoint(src)
    layout = layout_for(ckpt, DEFAULT_DTYPE)
    need = flashdir_bytes(ckpt, layout)
    check_free_space(dest, need)
    after, more = then(ckpt.config, layout) if then is not None else ("", 0.0)
    return (f"converting {src.name} into the flash layout at {dest} ({gigabytes(need)}, first use){after}: "
            f"{roughly(convert_seconds(need) + more)}")


def roughly(seconds: float) -> str:
    """A duration as an announcement gives it: under a minute, else whole minutes."""
    if seconds < 60:
        return "under a minute"
    m = round(seconds / 60)
    return f"about {m} minute{'s' * (m != 1)}"


def convert_in_child(src: Path, dest: Path, progress: bool) -> None:
    """convert(src, dest) with convert's default dtype (the source's precision), in a child process: the source's
    pages and the layer in transit are its memory, not this process's, whose --dram-budget counts its own peak (a
    first use in-process peaked 70 MiB above a 320 MiB budget)."""
    run_child([sys.executable, "-m", "storage.cache", str(src), str(dest), *([] if progress else ["--quiet"])])


def entries() -> list[dict]:
    """What the cache holds: [{name, kind, bytes, source}], converted models first, then the temp directories of
    conversions (.NAME.tmp-PID): kind "leftover" when their process is gone (killed: a SIGKILL or the OOM killer
    skips every cleanup; GBs for a 7B), "writing" while it runs (pid: its process)."""
    root = cache_dir()
    index = _read(root / FLASH / INDEX)
    out, temps = [], temp_entries(root / FLASH)
    for d in sorted((root / FLASH).glob("*")) if (root / FLASH).is_dir() else []:
        if d.is_dir() and (d / MANIFEST).is_file() and d not in dict(temps):   # a killed one may hold its manifest
            src = index.get(d.name, {}).get("source")
            out.append({"name": d.name, "kind": "flashdir", "bytes": disk_bytes(d), "path": str(d),
                        "source": src, "source_exists": bool(src and Path(src).exists())})
    for p, pid in temps:
        out.append({"name": p.name, "kind": "leftover" if is_stale(pid) else "writing", "bytes": disk_bytes(p),
                    "path": str(p), "source": None, "source_exists": None, "pid": pid})
    for f in sorted((root / "models").glob("*")) if (root / "models").is_dir() else []:
        if f.is_file() and not f.name.startswith("."):
            out.append({"name": f.name, "kind": "model", "bytes": disk_bytes(f), "path": str(f), "source": None,
                        "source_exists": None})
    return out


def remove(name: str) -> int:
    """Remove one cached entry by name; returns the bytes freed. Never a conversion in progress (kind "writing")."""
    for e in entries():
        if e["name"] == name:
            p = Path(e["path"])
            if e["kind"] == "writing":
                raise UserError(f"{name} is being written by process {e['pid']} (a conversion in progress): not "
                                f"removed")
            if e["kind"] == "leftover":
                remove_temp(p)
                return e["bytes"]
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            index = _read(cache_dir() / FLASH / INDEX)
            if index.pop(name, None) is not None:
                _write(cache_dir() / FLASH / INDEX, index)
            return e["bytes"]
    raise UserError(f"nothing named {name!r} in the cache {cache_dir()} (see `flashinfer-lite cache`)")


def main(argv: list[str] | None = None) -> int:
    """`python -m storage.cache SOURCE FLASHDIR [--quiet]`: the first-use conversion, run by convert_in_child."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or argv[2:] not in ([], ["--quiet"]):
        print("usage: python -m storage.cache SOURCE FLASHDIR [--quiet]", file=sys.stderr)
        return 2
    return child_exit_code(lambda: convert(argv[0], argv[1], force=False, progress=argv[2:] != ["--quiet"]))



# ----------------------------------------------------------------------------------------------------------------------
# -m ORG/NAME[:TAG]: a model in the local Hugging Face hub cache, found offline (nothing is downloaded).
#
# The cache is huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
# ~/.cache/huggingface/hub; a repo is models--ORG--NAME/, its files under snapshots/REVISION/ (symlinks to blobs/), the
# revision `main` names in refs/main. A snapshot with config.json is an HF model directory; else its .gguf file, the one
# whose name holds TAG (Q4_K_M in qwen2.5-0.5b-instruct-q4_k_m.gguf) when it has several.

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


if __name__ == "__main__":
    sys.exit(main())
