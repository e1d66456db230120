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
                        "--budget-ctx", "256", "--prompt-tokens", "200", "--dram-row", "--ppl", "8", "--kcache", "0.05",
                        "--quest-min-pages", "1", *llama, timeout=900)     # Quest: fewer than a context of 8 pages
    (row,) = doc["rows"]
    ppl = row["ppl"]        # the last 8 of 200 tokens, exact and Quest from one prompt
    assert ppl["scored"] == 8 and ppl["tokens"] == 200 and ppl["exact"] > 1
    assert abs(ppl["quest"] / ppl["exact"] - 1) < 0.1 and abs(ppl["kcache"] / ppl["exact"] - 1) < 0.1
    assert 0 < ppl["kcache_pages_read"] <= ppl["pages"] and ppl["exact_pages_read"] == 0   # exact: prompt chunks
    dram = row["dram"]     # every KV page in DRAM, the weights as the row's budget plans them, the cap raised by
    assert "error" not in dram and dram["dram_pages"] == dram["pages"] == 256 // 32 and dram["ms_per_token"] > 0
    assert dram["planned_dram_pages"] == row["dram_pages"] <= row["pages"]                # the row's pages on flash
    assert dram["cap_bytes"] == row["cap_bytes"] + (row["pages"] - row["dram_pages"]) * row["page_bytes"]
    assert dram["memcap"]["oom_kills"] == 0 and dram["peak_rss_bytes"] <= dram["cap_bytes"]
    if llama:       # the same prompt in the same cgroup: its peak within the cap, its answer read by its vocabulary
        r = row["llama"]
        assert "error" not in r, r
        assert r["prompt_tokens"] == row["depths"][0]["prompt_tokens"] and r["memcap"]["oom_kills"] == 0
        assert r["peak_rss_bytes"] <= row["cap_bytes"] and isinstance(r["found"], bool)
    assert "error" not in row and "below_minimum" not in row, row
    assert row["oom"] == 0 and row["peak_rss_bytes"] <= row["cap_bytes"]
    assert len(row["depths"]) == 2 and row["pages"] == 256 // 32
    deep, shallow = row["depths"][1], row["depths"][0]      # listed order; the deeper one's prompt ran first
    assert deep["prefilled"] == deep["prompt_tokens"] and deep["key"] != shallow["key"]
    # the shallower prompt's head and filler up to its key were the deeper one's: kept in the cache, not run again
    assert shallow["prefilled"] < shallow["prompt_tokens"] * 0.8
    for d in row["depths"]:
        assert 190 <= d["prompt_tokens"] <= 200 and "ids" not in d
        exact, quest = d["exact"], d["quest"]
        assert exact["pages_read"] == exact["pages"] > quest["pages_read"] > 0
        kc = d["kcache"]      # every page's keys, the values of some
        assert kc["pages_read"] == exact["pages_read"] and 2 * 2 <= kc["value_pages_read"] <= kc["pages_read"]
        assert isinstance(exact["found"], bool) and isinstance(quest["answer"], str)
        assert exact["flash_pages_read"] == 0 or exact["read_ahead"] > 0.5    # pages read while the layer before ran
    assert "| 256 |" in md and "llama.cpp peak RSS MiB" in md and "KCache 0.05, -c 256 depth 0.3: found" in md


def test_the_passkey_comes_from_the_depths_value_not_its_place_in_the_list():
    """Runs of one depth each hide different keys (the key used to come from the depth's index in --depths: every
    one-depth run hid the same key), and a depth hides the same key wherever it is listed."""
    sys.path.insert(0, str(DATA.parents[1] / "bench"))
    import harness

    class Digits:       # a tokenizer of one token per character: only the key's place and value matter here
        encode = staticmethod(lambda text: [ord(c) for c in text])
    filler = list(range(1000, 1400))
    keys = {depth: harness.passkey_ids(Digits, filler, 300, depth, 32768)[1] for depth in (0.1, 0.5, 0.9)}
    assert len(set(keys.values())) == 3 and all(10000 <= k < 100000 for k in keys.values())
    assert harness.passkey_ids(Digits, filler, 300, 0.5, 32768)[1] == keys[0.5]
    ids, key = harness.passkey_ids(Digits, filler, 300, 0.5, 32768)
    assert str(key) in "".join(chr(i) for i in ids if i < 1000)
