"""Smoke test of bench/prompt_speed.py on the default model: both engines' rows complete in alternating order, on the
prompt's first --prompt-tokens ids, and flashinfer-lite's greedy tokens after the prompt are llama.cpp's (the bench's
own rows: llama.cpp's eval and argmax is the oracle). No timing is asserted beyond each row having its measurements.
Skipped where llama_cpp does not import (the optional `bench` extra)."""
from __future__ import annotations

import pytest

from conftest import run_bench


def test_prompt_speed_rows_alternate_and_agree(smollm2_gguf):
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:
        pytest.skip(f"llama_cpp does not import ({type(e).__name__}: {e})")
    doc, err = run_bench("prompt_speed.py", "-m", smollm2_gguf, "--prompt-tokens", "40", "--rounds", "2", "-n", "3",
                         timeout=900)
    (case,) = doc["cases"]
    rows = case["rows"]
    assert [(r["round"], r["engine"]) for r in rows] == [(0, "llama.cpp"), (0, "flashinfer-lite"),
                                                         (1, "flashinfer-lite"), (1, "llama.cpp")]
    for r in rows:
        assert "error" not in r, r
        assert r["prompt_tokens"] == 40 and len(r["gen_tokens"]) == 3
        assert r["prompt_ms_per_token"] > 0 and r["prompt_cpu_ms_per_token"] > 0
        assert r["first_token_ms"] >= r["prompt_ms"]
    assert all(r["gen_tokens"] == rows[0]["gen_tokens"] for r in rows)
    assert "| yes |" in err


@pytest.mark.parametrize("fraction", ["0", "1.5"])
def test_a_cap_fraction_outside_0_1_is_one_line(fraction, tmp_path):
    import subprocess
    import sys
    from conftest import DATA
    repo = DATA.parents[1]
    p = subprocess.run([sys.executable, str(repo / "bench" / "prompt_speed.py"), "-m", str(tmp_path / "x.gguf"),
                        "--cap-fraction", fraction], cwd=repo, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--cap-fraction takes a fraction in (0, 1]" in p.stderr.strip().splitlines()[-1]
