"""bench/part_times.py (not profile.py: that name shadows the standard library's profile module, which torch imports,
for every script run from bench/) runs from a clone and its parts add up to the total it reports."""
from conftest import STORIES, run_bench


def test_profile_prints_parts_that_sum_to_the_total():
    doc, err = run_bench("part_times.py", "-m", STORIES, "-n", "6", timeout=300)
    assert doc["decode_tokens"] == 5 and doc["prompt_tokens"] > 0
    for key in ("decode_ms_per_token", "prompt_ms_per_token"):
        parts = doc[key]
        assert set(parts) == {"attention", "norms", "ffn", "lm_head", "python", "sampling", "total"}
        assert parts["attention"] > 0 and parts["ffn"] > 0
        assert abs(sum(v for k, v in parts.items() if k != "total") - parts["total"]) < 0.01
    assert "attention" in err
