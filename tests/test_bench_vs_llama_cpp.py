"""Smoke test of bench/vs_llama_cpp.py --quick on the default model: the JSON is well-formed, the flash row under the
cap reads from storage, and the bench's llama.cpp tokens are llama.cpp's.

No timing is asserted. The oracle for llama.cpp's tokens is llama.cpp's own greedy sampler chain (Llama.generate with
temp 0) run here on the bench's prompt ids, not the bench's loop (eval, then argmax of the logits row). Skipped where
llama_cpp does not import (it is the optional `bench` extra) or the memory cgroup is unavailable.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import run_bench

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "bench"))    # as when a bench runs as a script: it imports `harness` from there


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
    doc, err = run_bench("vs_llama_cpp.py", "--quick", "-m", smollm2_gguf, timeout=900)
    return doc, err, {(r["mode"], r["cap"]): r for r in doc["results"]}


def test_every_row_has_the_fields(quick):
    from vs_llama_cpp import ROW_FIELDS
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
    from harness import llama_model
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


# ----------------------------------------------------------------------------------------------------------------------
# bench/e2e.py's llama.cpp mode: the tiny generated model as a q4_0 FLASHDIR and as a Q4_0 GGUF; layer-stream is the
# reference (its greedy tokens and active sets). Oracles: llama.cpp's own greedy sampler on the same prompt ids, and
# the reference's tokens for the flash rows (they compute exactly the neurons it found active).

@pytest.fixture(scope="module")
def e2e_llama(tmp_path_factory):
    why = _why_not()
    if why:
        pytest.skip(why)
    work = tmp_path_factory.mktemp("e2e_llama")
    doc, err = run_bench("e2e.py", "--quick", "--quick-dtypes", "q4_0", "--modes", "layer-stream,flash,llama.cpp",
                         "--reference", "layer-stream", "--keep", work)
    return doc, err, {r["mode"]: r for r in doc["results"]}


def test_e2e_llama_row_runs_under_the_flash_rows_cap(e2e_llama):
    doc, err, rows = e2e_llama
    assert {"layer-stream", "flash-oracle-75", "flash-trace-75", "llama.cpp-75"} <= set(rows)
    lr, fr = rows["llama.cpp-75"], rows["flash-oracle-75"]
    assert "error" not in lr, lr
    assert lr["cap_bytes"] == fr["cap_bytes"] == lr["memcap"]["limit_bytes"] >= lr["memcap"]["peak_bytes"]
    assert lr["memcap"]["oom_kills"] == 0 and lr["gguf"].endswith("model.q4_0.gguf")
    assert lr["tokens"] == len(lr["argmax"]) and 0 < lr["p50_ms"] <= lr["p99_ms"] and lr["flash_MB_per_token"] >= 0
    assert lr["floor_ms"] == pytest.approx(lr["floor_flash_ms"] + lr["floor_dram_ms"], abs=0.11)
    sp = {x["mode"]: x for x in doc["speedups"]}
    # rounded to 2 decimals, of P50s rounded to 0.01 ms
    assert sp["flash-oracle-75"]["vs_llama.cpp"] == pytest.approx(lr["p50_ms"] / fr["p50_ms"], rel=0.02, abs=0.006)
    assert "| llama.cpp-75 |" in err


def test_e2e_llama_tokens_equal_llama_cpp_greedy_sampler(e2e_llama):
    from harness import llama_model
    _, _, rows = e2e_llama
    ref, lr = rows["layer-stream"], rows["llama.cpp-75"]
    prompt = ref["ids"][:ref["prompt_len"]]
    llm = llama_model(lr["gguf"], len(prompt) + lr["tokens"] + 2, 2)
    want = []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        want.append(tok)
        if len(want) == lr["tokens"] + 1:
            break
    assert lr["argmax"] == want[1:]          # the first comes from the prompt's pass; the row times the steps after


def test_e2e_flash_rows_on_q4_follow_the_layer_stream_reference(e2e_llama):
    _, _, rows = e2e_llama
    ref = rows["layer-stream"]
    assert ref["cap_bytes"] is None and ref["reader_MB_per_token"] > 0       # uncapped, reads every layer per token
    got = rows["flash-oracle-75"]
    assert got["argmax"] == ref["argmax"][:len(got["argmax"])] and got["argmax_agree_with_dense"] == 1.0


def test_busy_decode_runs_both_engines_beside_a_spinner_and_they_agree(smollm2_gguf):
    """bench/busy_decode.py, one busy round of 4 tokens: both rows measured, the spinner gone after, and
    flashinfer-lite's first 3 greedy tokens are llama.cpp's. The prompt is one whose first 3 tokens llama.cpp picks by
    a clear margin (1.2-2.5 in its logits); on the bench's default prompt its first choice leads by 0.08, which our
    rounding (8-bit x as its, float32 attention) may decide either way."""
    why = _why_not()
    if why:
        pytest.skip(why)
    import psutil
    before = {p.pid for p in psutil.process_iter()}
    doc, err = run_bench("busy_decode.py", "-m", smollm2_gguf, "-p", "The capital of France is", "-n", "4",
                         "--rounds", "1", "--loads", "busy", timeout=900)
    rows = {r["mode"]: r for r in doc["results"]}
    assert set(rows) == {"llama.cpp", "flashinfer-lite"} and all(r["load"] == "busy" for r in rows.values())
    for r in rows.values():
        assert "error" not in r, r
        assert r["decode_steps"] == 3 and 0 < r["p50_ms"] and len(r["loadavg"]) == 3
    assert sum(rows["flashinfer-lite"]["steps_at_threads"].values()) == 3
    assert rows["flashinfer-lite"]["gen_tokens"][:3] == rows["llama.cpp"]["gen_tokens"][:3]
    assert set(doc["summary"]) == {"busy"} and doc["summary"]["busy"]["ms_per_token_ratio"][0] > 0
    spinning = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before
                and "while True: pass" in " ".join(p.info["cmdline"] or [])]
    assert not spinning


def test_a_rows_floor_is_its_compute_or_its_bytes_at_the_rate_measured_in_its_round():
    """add_floors (--floor): per row max(its engine's uncapped P50 in the round, MB per token / the round's sequential
    rate), its read rate, and llama.cpp's P50 at the same cap and round over its own. Worked out by hand."""
    from vs_llama_cpp import add_floors

    def row(mode, cap, p50, mb, rnd=1):
        return {"mode": mode, "cap": cap, "round": rnd, "p50_ms": p50, "decode_MB_per_token": mb}
    results = [{"mode": "sequential", "cap": "none", "round": 1, "seq_MBps": 1000.0},
               row("llama.cpp", "none", 100.0, 0.0), row("flash-auto", "none", 50.0, 0.0),
               row("llama.cpp", "50%", 1000.0, 500.0), row("flash-auto", "50%", 200.0, 300.0),
               row("flash-auto", "75%", 80.0, 20.0), row("flash-auto", "50%", 90.0, 30.0, rnd=2),
               row("llama.cpp", "75%", 120.0, 0.5)]
    add_floors(results, "auto")
    llama, flash, light, other, unbound = results[3], results[4], results[5], results[6], results[7]
    assert llama["floor_ms"] == 500.0 and "x_llama" not in llama          # its bytes: 500 MB at 1 GB/s
    assert flash["floor_ms"] == 300.0 and flash["over_floor"] == round(200 / 300, 2)
    assert flash["read_GBps"] == 1.5 and flash["x_llama"] == 5.0
    # its compute; llama.cpp at 75% read under 1 MB a token: its cap did not hold it (pages charged elsewhere)
    assert light["floor_ms"] == 50.0 and "x_llama" not in light and unbound["unbound"] and "unbound" not in llama
    assert "floor_ms" not in other                                        # round 2 measured no rate
