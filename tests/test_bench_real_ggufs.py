"""bench/real_ggufs.py on a tiny Q4_K_M GGUF: its minimums are the ones `generate --dram-budget` refuses with, their
split adds up, and the dense and llama.cpp rows hold their own processes' peaks (llama.cpp's skipped, saying so,
without llama-cpp-python)."""
from __future__ import annotations

import re
import subprocess
import sys
from importlib.util import find_spec

import pytest

from conftest import DATA, run_bench

GGUF = DATA / "gguf" / "qwen2-q4_k_m.gguf"
CONTEXTS = (64, 256)


@pytest.fixture(scope="module")
def doc():
    out, err = run_bench("real_ggufs.py", GGUF, "--contexts", ",".join(map(str, CONTEXTS)), timeout=900)
    return out, err


def refusal_mib(ctx: int) -> float:
    """The minimum `generate -m GGUF --dram-budget 1M -c ctx` names (its early refusal, in a process of its own)."""
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(GGUF), "--dram-budget", "1M",
                        "-c", str(ctx), "-p", "hi"], capture_output=True, text=True, timeout=300)
    m = re.search(r"below the minimum ([\d.]+) MiB", r.stderr)
    assert r.returncode == 1 and m, r.stderr
    return float(m.group(1))


def test_minimums_are_the_ones_generate_refuses_with_and_their_split_adds_up(doc):
    (m,), _ = doc[0]["models"], None
    assert m["file_bytes"] == GGUF.stat().st_size
    for ctx in CONTEXTS:
        x = m["minimum"][str(ctx)]
        parts = [x[k] for k in ("base_bytes", "resident_bytes", "kv_bytes", "rest_bytes")]
        assert sum(parts) == x["minimum_bytes"] and min(parts) > 0, x
        # the process base is its own process's RSS: two processes differ by a fraction of a MiB
        assert abs(x["minimum_bytes"] / 2**20 - refusal_mib(ctx)) < 2, (ctx, x)
    small, large = (m["minimum"][str(c)] for c in CONTEXTS)
    # the KV's part is its fixed part (kv_pages.fixed_bytes; its pages can go to flash): it grows by a fraction of
    # what the whole KV cache grows by
    from flashinfer_lite.runtime import model_facts
    cfg = model_facts(str(GGUF))[0]
    whole = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * (CONTEXTS[1] - CONTEXTS[0])   # float16 K and V
    assert 0 < large["kv_bytes"] - small["kv_bytes"] < whole / 4


def test_dense_and_llama_rows_measure_their_own_processes(doc):
    (m,), err = doc[0]["models"], doc[1]
    d = m["dense"]
    assert d["peak_rss_bytes"] > m["file_bytes"] and d["load_s"] > 0 and len(d["loadavg"]) == 3, d
    # the goal's parts: the process base the dense run printed (-v), its KV cache at the default context
    assert 0 < d["base_bytes"] < d["peak_rss_bytes"] and m["dense_kv_bytes"] > 0, (d, m)
    ll = m["llama_cpp"]
    if find_spec("llama_cpp") is None:
        assert "not installed" in ll["skipped"]
    else:
        assert ll["peak_rss_bytes"] > m["file_bytes"] and ll["load_s"] > 0, ll
    assert GGUF.name in err and "| GGUF |" in err
