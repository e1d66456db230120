"""Smoke test of bench/e2e.py --quick: the JSON is well-formed and modes that compute the same tokens agree.

No timing is asserted. The oracle for agreement is the dense-ram mode (all weights in DRAM): dense-mmap and
layer-stream run the same kernel on the same bytes, so their argmax tokens must be identical; flash-oracle runs the
sparse kernel on exactly the neurons the dense run found active (FATReLU), so its tokens must match as well.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO / "tools"))


def _cap_unavailable() -> str | None:
    import memcap
    return memcap.available()


@pytest.fixture(scope="module")
def quick_doc():
    if not (SHARED / "models" / "stories260K").exists():
        pytest.skip("../shared/models/stories260K is absent (the quick trace is recorded from it)")
    why = _cap_unavailable()
    if why:
        pytest.skip(f"memory cgroup unavailable: {why}")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, str(REPO / "bench" / "e2e.py"), "--quick"], cwd=REPO, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout), p.stderr


def test_json_is_well_formed(quick_doc):
    doc, _ = quick_doc
    for key in ("model", "model_bytes", "ffn_bytes", "cap_bytes", "machine", "results", "command"):
        assert key in doc
    modes = {r["mode"]: r for r in doc["results"]}
    assert {"dense-ram", "dense-mmap", "layer-stream", "flash-oracle-75", "flash-trace-75"} <= set(modes)
    for r in doc["results"]:
        assert "error" not in r, r
        if "below_minimum" in r:
            continue
        assert r["tokens"] > 0 and len(r["argmax"]) == r["tokens"]
        assert r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] and r["tokens_per_s"] > 0
        assert r["memcap"]["oom_kills"] == 0 and r["memcap"]["exit_code"] == 0
        if r["hit_rate"] is not None:
            assert 0.0 <= r["hit_rate"] <= 1.0


def test_modes_computing_the_same_tokens_agree(quick_doc):
    doc, _ = quick_doc
    modes = {r["mode"]: r for r in doc["results"]}
    ref = modes["dense-ram"]["argmax"]
    for name in ("dense-mmap", "layer-stream", "flash-oracle-75"):
        got = modes[name]["argmax"]
        assert got == ref[:len(got)], name
        assert modes[name]["ids"] == modes["dense-ram"]["ids"][:len(got)]


def test_layer_stream_reads_every_ffn_byte_per_token(quick_doc):
    doc, _ = quick_doc
    r = {r["mode"]: r for r in doc["results"]}["layer-stream"]
    # the quick model's directory is removed after the run; its geometry travels in the JSON
    per_token = doc["config"]["n_layers"] * doc["config"]["ffn_dim"] * doc["stride"]
    assert r["reader_MB_per_token"] == pytest.approx(per_token / 1e6, abs=0.01)


def test_markdown_table_lists_every_mode(quick_doc):
    doc, err = quick_doc
    for r in doc["results"]:
        assert f"| {r['mode']} |" in err
