"""bench/prompt_pruning.py on a tiny qwen2 GGUF: per depth a row for pruning off and for each ratio, the perplexity of
the continuation per ratio from a pruned prefix (the layers after the first stage hold fewer prompt tokens), and the
markdown table. No timing is asserted."""
from __future__ import annotations

from conftest import DATA, run_bench


def test_rows_hold_every_depth_and_ratio_and_the_continuations_perplexity():
    doc, md = run_bench("prompt_pruning.py", "-m", DATA / "gguf" / "qwen2-q8_0.gguf", "--prompt-tokens", "120",
                        "--depths", "2", "--ppl", "8", "--n-gen", "2", "--ratios", "0.5", timeout=900)
    row = doc["row"]
    assert "error" not in row, row.get("error")
    assert [(d["depth"], d["ratio"]) for d in row["passkey"]] == [(0.25, 0.0), (0.25, 0.5), (0.75, 0.0), (0.75, 0.5)]
    assert all(d["ttft_ms"] >= 0 and isinstance(d["found"], bool) for d in row["passkey"])
    off, half = row["ppl"]
    assert (off["ratio"], half["ratio"]) == (0.0, 0.5) and off["perplexity"] > 1 and half["perplexity"] > 1
    assert off["pruned"] == [0, 0] and half["pruned"] == [0, 60]       # 2 layers: one stage, at layer 1
    assert "| 0.5 |" in md and "passkey found" in md
