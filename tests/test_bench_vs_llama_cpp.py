"""Smoke test of bench/vs_llama_cpp.py --quick on the default model: the JSON is well-formed, the flash row under the
cap reads from storage, and the bench's llama.cpp tokens are llama.cpp's.

No timing is asserted. The oracle for llama.cpp's tokens is llama.cpp's own greedy sampler chain (Llama.generate with
temp 0) run here on the bench's prompt ids, not the bench's loop (eval, then argmax of the logits row). Skipped where
llama_cpp does not import (it is the optional `bench` extra) or the memory cgroup is unavailable.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))


def _why_not() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # not installed, or its shared library does not load
        return (f"llama_cpp does not import ({type(e).__name__}: {e}); "
                "CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python==0.3.36")
    import memcap
    why = memcap.available()
    return f"memory cgroup unavailable: {why}" if why else None


@pytest.fixture(scope="module")
def quick(request):
    why = _why_not()
    if why:
        pytest.skip(why)
    smollm2_gguf = request.getfixturevalue("smollm2_gguf")     # fetched only when the test can run
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, str(REPO / "bench" / "vs_llama_cpp.py"), "--quick", "-m", str(smollm2_gguf)],
                       cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    return doc, p.stderr, {(r["mode"], r["cap"]): r for r in doc["results"]}


def test_every_row_has_the_fields(quick):
    from bench.vs_llama_cpp import ROW_FIELDS
    doc, err, rows = quick
    for key in ("gguf", "gguf_bytes", "flash", "prompt_ids", "tokens", "llama_baseline_bytes", "flash_minimum_bytes",
                "machine", "results", "command"):
        assert key in doc
    assert set(rows) == {("llama.cpp", "none"), ("flash-dense", "none"), ("flash-auto", "none"),
                         ("flash-predicted", "none"), ("probe", "none"), ("llama.cpp", "min"), ("flash-predicted", "min")}
    assert doc["llama_baseline_bytes"] == rows["llama.cpp", "none"]["memcap"]["peak_bytes"] - doc["gguf_bytes"]
    for r in doc["results"]:
        assert "error" not in r and "below_minimum" not in r, r
        if r["mode"] == "probe":
            assert r["minimum_bytes"] == doc["flash_minimum_bytes"] > 0
            continue
        assert all(k in r for k in ROW_FIELDS), r
        assert len(r["gen_tokens"]) == doc["tokens"] and r["decode_steps"] == doc["tokens"] - 1
        assert r["prompt_tokens"] == len(doc["prompt_ids"])
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["tokens_per_s"] > 0 and r["prompt_ms_per_token"] > 0
        assert r["memcap"]["oom_kills"] == 0 and r["memcap"]["exit_code"] == 0
        assert 0 <= r["agree_prefix"] <= doc["tokens"]
        assert f"| {r['cap']} |" in err and f"| {r['mode']} |" in err
    # a cap the row ran under is a cap the cgroup held it to
    for r in (rows["llama.cpp", "min"], rows["flash-predicted", "min"]):
        assert r["cap_bytes"] == doc["flash_minimum_bytes"] + doc["slack_bytes"]
        assert r["memcap"]["limit_bytes"] == r["cap_bytes"] >= r["memcap"]["peak_bytes"]


def test_flash_row_under_the_cap_reads_from_storage(quick):
    doc, _, rows = quick
    r = rows["flash-predicted", "min"]
    assert r["budget_bytes"] == doc["flash_minimum_bytes"] and r["decode_MB_per_token"] > 0
    # the window holds 256 of each layer's 1536 rows and the quick predictors select every neuron of 29 layers:
    # every token misses most rows of every layer
    assert r["reader_MB_per_token"] > 0.5 * doc["flash_files"]["ffn_bytes"] / 1e6
    assert rows["flash-predicted", "none"]["reader_MB_per_token"] < r["reader_MB_per_token"]


def test_llama_tokens_equal_llama_cpp_greedy_sampler(quick):
    from bench.vs_llama_cpp import llama_model
    doc, _, rows = quick
    llm = llama_model(doc["gguf"], doc["ctx"], doc["threads"])
    want = []
    for tok in llm.generate(doc["prompt_ids"], top_k=1, temp=0.0, reset=True):
        want.append(tok)
        if len(want) == doc["tokens"]:
            break
    for cap in ("none", "min"):
        r = rows["llama.cpp", cap]
        assert r["gen_tokens"] == want, cap
        assert r["same_ids_by_llama_tokenizer"]
        assert r["agree_prefix"] == doc["tokens"]
