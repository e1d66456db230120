"""bench/long_context.py on a tiny qwen2 GGUF: a row per context under its memory cgroup, exact and Quest decoding
from the same prompt, exact reading every page of the context and Quest fewer; the unbudgeted row with every page in
DRAM, and llama.cpp's row where llama-cpp-python imports. No timing is asserted."""
from __future__ import annotations

import sys

import pytest

from conftest import DATA, run_bench

GGUF = DATA / "gguf" / "qwen2-q8_0.gguf"     # not real_ggufs' fixture: a run records its loading peak


def test_rows_hold_exact_and_quest_from_one_prompt_within_the_cap():
    sys.path.insert(0, str(DATA.parents[1] / "tools"))
    import memcap
    why = memcap.available()
    if why:
        pytest.skip(f"memory cgroup unavailable: {why}")
    try:
        import llama_cpp  # noqa: F401  (the optional `bench` extra)
        llama = ["--llama"]
    except ImportError:
        llama = []
    doc, md = run_bench("long_context.py", "-m", GGUF, "--contexts", "256", "--depths", "0.3,0.8", "-n", "4",
                        "--budget-ctx", "256", "--prompt-tokens", "200", "--dram-row", "--ppl", "8", *llama,
                        timeout=900)
    (row,) = doc["rows"]
    ppl = row["ppl"]        # the last 8 of 200 tokens, exact and Quest from one prompt
    assert ppl["scored"] == 8 and ppl["tokens"] == 200 and ppl["exact"] > 1
    assert abs(ppl["quest"] / ppl["exact"] - 1) < 0.1
    dram = row["dram"]
    assert "error" not in dram and dram["dram_pages"] == dram["pages"] == 256 // 32 and dram["ms_per_token"] > 0
    if llama:       # the same prompt in the same cgroup: its peak within the cap, its answer read by its vocabulary
        r = row["llama"]
        assert "error" not in r, r
        assert r["prompt_tokens"] == row["depths"][0]["prompt_tokens"] and r["memcap"]["oom_kills"] == 0
        assert r["peak_rss_bytes"] <= row["cap_bytes"] and isinstance(r["found"], bool)
    assert "error" not in row and "below_minimum" not in row, row
    assert row["oom"] == 0 and row["peak_rss_bytes"] <= row["cap_bytes"]
    assert len(row["depths"]) == 2 and row["pages"] == 256 // 32
    for d in row["depths"]:
        assert 190 <= d["prompt_tokens"] <= 200 and "ids" not in d
        exact, quest = d["exact"], d["quest"]
        assert exact["pages_read"] == exact["pages"] > quest["pages_read"] > 0
        assert isinstance(exact["found"], bool) and isinstance(quest["answer"], str)
        assert exact["flash_pages_read"] == 0 or exact["read_ahead"] > 0.5    # pages read while the layer before ran
    assert "| 256 |" in md and "llama.cpp peak RSS MiB" in md
