"""FLASHDIR/gate.json: the exact-gate FFN's calibration (ffn.gate), stored with the model.

  {"format": "flashinfer-lite-gate", "version": 2, "n_layers": L, "n_neurons": n, "calibration": {...},
   "sparsity": {"0.4": {"thresholds": [L floats], "freq": [L base64 strings]}, ...}, "manifest_checksum": ...}

thresholds[i]: layer i's |act(gate.x) * up.x| under which a neuron does not count, so that a share `sparsity` of the
calibration tokens' coefficients falls under it; freq[i][b]: the share of those tokens for which bundle b cleared it
(the neuron cache pins the most frequent), stored as n little-endian uint16 of round(share * 65535) in base64: as
decimal text they were 1.46 MB for SmolLM2 (4 sparsities of 30 x 1536 neurons), 1.4% of a Q4_K_M file. Version 1
(decimal lists) is still read. Written by flashinfer_lite.calibrate_gate; checked against its own checksum
and the model's shape when read, as every file of a FLASHDIR.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.errors import UserError
from storage.untrusted import read_json

from .checksums import manifest_checksum
from .files import remove_quietly

GATE_FILE = "gate.json"
GATE_FORMAT = "flashinfer-lite-gate"
GATE_VERSIONS = (1, 2)
FREQ_SCALE = 65535
MAX_GATE_BYTES = 64 << 20
SPARSITIES = (0.3, 0.4, 0.5, 0.6)    # calibrated at once: the runtime picks one (--sparsity), the bench compares them
DEFAULT_SPARSITY = 0.4                # SmolLM2: +1.5% perplexity, 60% of the down rows (bench/exact_gate.py)


@dataclass(frozen=True)
class GateCalibration:
    """One sparsity's thresholds and neuron frequencies (by bundle id), per layer."""
    sparsity: float
    thresholds: tuple[float, ...]
    freq: tuple[np.ndarray, ...]
    calibration: dict


def write_gate_file(flashdir, n_neurons: int, calibration: dict, by_sparsity: dict[float, tuple]) -> None:
    """Write gate.json atomically: by_sparsity {s: (thresholds [L], freq [L][n])}."""
    first = next(iter(by_sparsity.values()))
    m = {"format": GATE_FORMAT, "version": 2, "n_layers": len(first[0]), "n_neurons": n_neurons,
         "calibration": calibration,
         "sparsity": {f"{s:g}": {"thresholds": [float(t) for t in th],
                                 "freq": [_encode_freq(f) for f in fr]}
                      for s, (th, fr) in by_sparsity.items()}}
    m["manifest_checksum"] = manifest_checksum(m)
    path = Path(flashdir) / GATE_FILE
    tmp = path.with_suffix(f".json.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(m, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        remove_quietly(tmp)


def reorder_gate_file(src, dest, orders) -> None:
    """Write src's gate.json into FLASHDIR dest, whose bundles are src's in another order: dest's bundle b of layer
    i is src's bundle orders[i][b]. The thresholds are quantiles of every coefficient, which no order changes; each
    bundle keeps its neuron's frequency."""
    m = _read(src)
    n = m["n_neurons"]
    by_sparsity = {}
    for s, rec in m["sparsity"].items():
        freq = [_decode_freq(f, n) for f in rec["freq"]]
        if len(freq) != len(orders) or any(f is None for f in freq):
            raise UserError(f"{Path(src) / GATE_FILE}: frequencies of sparsity {s} are malformed")
        by_sparsity[float(s)] = (rec["thresholds"], [f[o] for f, o in zip(freq, orders)])
    write_gate_file(dest, n, m["calibration"], by_sparsity)


def gate_sparsities(flashdir) -> list[float]:
    """The sparsities gate.json holds ([] without one)."""
    m = _read(flashdir)
    return [] if m is None else sorted(float(s) for s in m["sparsity"])


def read_gate_file(flashdir, n_layers: int, n_neurons: int, sparsity: float) -> GateCalibration | None:
    """The calibration at `sparsity`, None when the FLASHDIR has no gate.json; a damaged, edited or mismatched file,
    or a sparsity it does not hold, is a UserError."""
    m = _read(flashdir)
    if m is None:
        return None
    path = Path(flashdir) / GATE_FILE
    if m.get("n_layers") != n_layers or m.get("n_neurons") != n_neurons:
        raise UserError(f"{path}: calibrated for {m.get('n_layers')} layers of {m.get('n_neurons')} neurons, not this "
                        f"model's {n_layers} of {n_neurons}; delete it to calibrate again")
    rec = m["sparsity"].get(f"{sparsity:g}")
    if rec is None:
        raise UserError(f"{path}: no thresholds for sparsity {sparsity:g} (it holds "
                        f"{', '.join(sorted(m['sparsity']))})")
    th, fr = (rec.get("thresholds"), rec.get("freq")) if isinstance(rec, dict) else (None, None)
    freq = [_decode_freq(f, n_neurons) for f in fr] if isinstance(fr, list) and len(fr) == n_layers else None
    ok = isinstance(th, list) and len(th) == n_layers and all(isinstance(t, (int, float)) and np.isfinite(t) and t >= 0
                                                              for t in th) \
        and freq is not None and all(f is not None for f in freq)
    if not ok:
        raise UserError(f"{path}: thresholds or frequencies of sparsity {sparsity:g} are malformed; delete it to "
                        f"calibrate again")
    freq = tuple(freq)
    cal = m.get("calibration") if isinstance(m.get("calibration"), dict) else {}
    return GateCalibration(float(sparsity), tuple(float(t) for t in th), freq, cal)


def _encode_freq(f) -> str:
    q = np.rint(np.clip(np.asarray(f, np.float64), 0.0, 1.0) * FREQ_SCALE).astype("<u2")
    return base64.b64encode(q.tobytes()).decode("ascii")


def _decode_freq(f, n_neurons: int) -> np.ndarray | None:
    """One layer's frequencies as float32 [n], from version 2's base64 or version 1's list; None if malformed."""
    if isinstance(f, str):
        try:
            raw = base64.b64decode(f, validate=True)
        except (binascii.Error, ValueError):
            return None
        return np.frombuffer(raw, "<u2").astype(np.float32) / FREQ_SCALE if len(raw) == 2 * n_neurons else None
    if isinstance(f, list) and len(f) == n_neurons and all(isinstance(v, (int, float)) for v in f):
        return np.asarray(f, np.float32)
    return None


def _read(flashdir) -> dict | None:
    path = Path(flashdir) / GATE_FILE
    if not path.is_file():
        return None
    m = read_json(path, "gate calibration", MAX_GATE_BYTES)
    if not isinstance(m, dict) or m.get("format") != GATE_FORMAT or m.get("version") not in GATE_VERSIONS:
        raise UserError(f"{path}: not a {GATE_FORMAT} file of version 1 or 2; delete it to calibrate again")
    if m.get("manifest_checksum") != manifest_checksum(m):
        raise UserError(f"{path}: checksum mismatch: the gate calibration is damaged or edited; delete it to "
                        f"calibrate again")
    if not isinstance(m.get("sparsity"), dict) or not m["sparsity"]:
        raise UserError(f"{path}: lists no sparsity; delete it to calibrate again")
    return m
