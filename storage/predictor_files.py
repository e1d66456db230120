"""The predictor files: what `train-predictor` writes into a FLASHDIR and the runtime reads back.

FLASHDIR/predictors/
  manifest.json           format + version, model fingerprint, n_layers/dim/ffn_dim, per layer act_threshold,
                          dense_layers, settings, the other files' checksums, and a checksum of itself
  weights.safetensors     layers.{i}.w_in float16 [r, d], layers.{i}.w_out float16 [n, r], layers.{i}.bias float32 [n]
                          (absent after `train-predictor --thresholds-only`; no weights for the `dense_layers`)
  frequencies.safetensors layers.{i}.freq float32 [n]: how often each neuron is active on the calibration text
                          (profile.safetensors, its older name: still read)
  layer_000.json ...      one card per layer: rank, recall, precision, predicted/true ratio, bytes (for people)

The directory is written whole to a temporary directory and renamed into place, so a reader sees the old set or the
new one, never a mix. What the numbers mean is flashinfer_lite/predictor_set.py's business.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from .checksums import file_checksum, manifest_checksum
from .errors import UserError, commit
from .files import remove_stale_temp_dirs, temp_path
from .untrusted import read_json

PREDICTOR_DIR = "predictors"
PREDICTOR_MANIFEST = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"
FREQ_FILE = "frequencies.safetensors"
OLD_FREQ_FILE = "profile.safetensors"     # its older name: "profile" means the device's only
CARD_FMT = "layer_{:03d}.json"
PRED_FORMAT = "flashinfer-lite-predictors"
PRED_VERSION = 1


def write_predictor_files(flashdir, manifest: dict, weights: dict[str, np.ndarray] | None,
                          freqs: dict[str, np.ndarray], cards: list[dict]) -> Path:
    """Write FLASHDIR/predictors/ atomically; `manifest` gets the format, version, checksums and its own checksum.
    weights None: thresholds only."""
    from safetensors.numpy import save_file
    flashdir = Path(flashdir)
    dest = flashdir / PREDICTOR_DIR
    remove_stale_temp_dirs(flashdir)
    tmp = temp_path(dest, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if weights is not None:
            save_file(weights, str(tmp / WEIGHTS_FILE))           # empty when every layer is dense
        save_file(freqs, str(tmp / FREQ_FILE))
        for c in cards:
            (tmp / CARD_FMT.format(c["layer"])).write_text(json.dumps(c, indent=1))
        manifest = {"format": PRED_FORMAT, "version": PRED_VERSION, **manifest,
                    # verify (and a launch whose verified stamp is stale) checks these: a flipped byte is an error
                    "checksums": {f.name: file_checksum(f) for f in sorted(tmp.iterdir())}}
        manifest["manifest_checksum"] = manifest_checksum(manifest)
        (tmp / PREDICTOR_MANIFEST).write_text(json.dumps(manifest, indent=1))
        old = temp_path(dest, "old")
        with commit():
            if dest.exists():
                os.replace(dest, old)
            os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def read_predictor_manifest(flashdir) -> dict | None:
    """FLASHDIR's predictor manifest with its fields type-checked (no weights read); None without predictors."""
    mpath = Path(flashdir) / PREDICTOR_DIR / PREDICTOR_MANIFEST
    if not mpath.is_file():
        return None
    m = read_json(mpath, "predictor manifest")
    if m.get("format") != PRED_FORMAT:
        raise UserError(f"{mpath} is not a predictor manifest")
    if m.get("version") != PRED_VERSION:
        raise UserError(f"{mpath}: unsupported predictor version {m.get('version')} (expected {PRED_VERSION})")
    L, thresholds, dense = m.get("n_layers"), m.get("act_threshold"), m.get("dense_layers", [])
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)  # noqa: E731
    layer = lambda x: isinstance(x, int) and not isinstance(x, bool) and 0 <= x < L                  # noqa: E731
    if not (isinstance(L, int) and not isinstance(L, bool) and isinstance(thresholds, list) and len(thresholds) == L
            and all(number(t) for t in thresholds) and isinstance(dense, list) and all(layer(i) for i in dense)
            and isinstance(m.get("has_predictors", False), bool)
            and isinstance(m.get("calibration") or {}, dict)):
        raise UserError(f"{mpath}: malformed predictor manifest (n_layers, act_threshold, dense_layers, "
                        f"has_predictors or calibration of the wrong type); re-run train-predictor")
    return m


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    try:
        return load_file(str(path))
    except Exception as e:   # safetensors raises its own types for damaged files
        raise UserError(f"cannot read {path}: {e}") from None


def read_predictor_arrays(flashdir, manifest: dict) -> tuple[dict | None, dict]:
    """(weights or None for thresholds only, frequencies) as stored, by tensor name."""
    root = Path(flashdir) / PREDICTOR_DIR
    weights = _read_safetensors(root / WEIGHTS_FILE) if manifest.get("has_predictors") else None
    freq_file = root / FREQ_FILE if (root / FREQ_FILE).exists() else root / OLD_FREQ_FILE
    return weights, _read_safetensors(freq_file)


def predictor_checksums(flashdir, warn: bool = False) -> dict[str, str]:
    """{file name: checksum} that FLASHDIR/predictors/manifest.json lists ({} without predictors), once the manifest
    matched its own checksum."""
    mpath = Path(flashdir) / PREDICTOR_DIR / PREDICTOR_MANIFEST
    if not mpath.is_file():
        return {}
    m = read_json(mpath, "predictor manifest")
    own = m.get("manifest_checksum")
    if own is None and m.get("checksums") is not None and warn:     # written before it had one
        print(f"flashinfer-lite: {mpath} has no checksum of its own (an older train-predictor); re-run "
              f"train-predictor to have it checked", file=sys.stderr)
    elif own is not None and own != manifest_checksum(m):
        raise UserError(f"{mpath}: checksum mismatch: the predictor manifest is damaged or edited; re-run "
                        f"train-predictor")
    sums = m.get("checksums")
    if sums is None:      # written before predictors had checksums: usable, but nothing to check them against
        if warn:
            print(f"flashinfer-lite: {mpath} lists no checksums (an older train-predictor); re-run train-predictor to "
                  f"have them checked", file=sys.stderr)
        return {}
    if not isinstance(sums, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
        raise UserError(f"{mpath}: malformed checksums: re-run train-predictor")
    return sums
