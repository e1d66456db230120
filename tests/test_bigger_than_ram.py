"""Bigger than RAM, for real: an HF checkpoint whose files are at least twice a cgroup memory cap (which also bounds
the page cache) goes through every stage that touches weights, each under that one cap: convert, collect,
train-predictor, eval, generate. None is OOM-killed, and generate's greedy tokens equal the same run uncapped."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CORPUS
from storage.files import disk_bytes

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from memcap import available  # noqa: E402

CAP_OVER_BUDGET = 160 << 20   # the cap leaves this over generate's DRAM budget: page cache of non-FFN files, slack
CLI = [sys.executable, "-m", "flashinfer_lite"]


def run(*args, timeout=900, ok=True):
    r = subprocess.run(args, capture_output=True, timeout=timeout)
    if ok:
        assert r.returncode == 0, r.stderr.decode()[-2000:]
    return r


def capped(cap: int, summary: Path, *args, timeout=900):
    """Run args under tools/memcap.py --limit cap (cold page cache); (completed process, memcap summary)."""
    r = run(sys.executable, str(REPO / "tools" / "memcap.py"), "--limit", str(cap), "--drop-caches", "--json",
            str(summary), "--", *args, timeout=timeout, ok=False)
    cg = json.loads(summary.read_text())
    assert cg["oom_kills"] == 0 and r.returncode == 0, (args[3:5], cg, r.stderr.decode()[-2000:])
    return r, cg


def large_checkpoint(tmp_path_factory, name: str, *args: str) -> Path:
    """A new temporary directory whose hf/ holds tools/make_large_model.py's checkpoint for args; skipped where
    there is no memory cgroup to cap it with."""
    if available() is not None:
        pytest.skip(f"no memory cgroup here: {available()}")
    root = tmp_path_factory.mktemp(name)
    run(sys.executable, str(REPO / "tools" / "make_large_model.py"), str(root / "hf"), *args)
    return root


def last_json(r) -> dict:
    """The JSON document on the last line of a command's stdout (generate --json)."""
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """The checkpoint, then each stage under the cap; returns (root, cap, {stage: memcap summary})."""
    # 12 layers x 16384 neurons x dim 1024 in f16: 1.2 GB of FFN weights, ~10% active per token (FATReLU).
    root = large_checkpoint(tmp_path_factory, "big", "--layers", "12", "--dim", "1024", "--ffn", "16384", "--heads",
                            "8", "--kv-heads", "2", "--check-tokens", "0")
    cap = disk_bytes(root / "hf") // 2
    stories = str(CORPUS / "tinystories_cased_197KB.txt")
    peaks = {}
    _, peaks["convert"] = capped(cap, root / "convert.json", *CLI, "convert", str(root / "hf"), "-o",
                                 str(root / "flash"))
    _, peaks["collect"] = capped(cap, root / "collect.json", *CLI, "collect", "-m", str(root / "hf"), "--corpus",
                                 stories, "--tokens", "384", "--ctx", "128", "-o", str(root / "acts"))
    _, peaks["train-predictor"] = capped(cap, root / "train.json", *CLI, "train-predictor", str(root / "acts"), "-o",
                                         str(root / "flash"), "--rank", "8", "--max-rank", "8", "--steps", "10",
                                         "--target-recall", "0.9")
    yield root, cap, peaks
    shutil.rmtree(root, ignore_errors=True)   # 2.6 GB: gone when the module is done, not at the end of the run


def test_every_stage_runs_under_a_cap_of_half_the_checkpoint(pipeline):
    root, cap, peaks = pipeline
    assert disk_bytes(root / "hf") >= 2 * cap and disk_bytes(root / "flash") > 2 * cap
    assert set(peaks) == {"convert", "collect", "train-predictor"}
    for stage, cg in peaks.items():   # the cgroup's peak cannot pass its limit: what counts is that nothing was killed
        assert cg["limit_bytes"] == cap and cg["oom_kills"] == 0 and cg["exit_code"] == 0, stage


def test_eval_under_the_cap_gives_the_uncapped_result(pipeline, tmp_path):
    root, cap, _ = pipeline
    args = [*CLI, "eval", "-m", str(root / "flash"), "--corpus", str(CORPUS / "wikitext2_test.txt"), "--tokens",
            "4", "--ctx", "4", "--ffn", "predicted", "--dram-budget", str(cap - CAP_OVER_BUDGET), "--json"]
    r, cg = capped(cap, tmp_path / "eval.json", *args)
    res = json.loads(r.stdout.decode())
    free = json.loads(run(*args).stdout.decode())
    # the dense reference streams layers and the predicted model reads from flash: neither depends on the cap
    for k in ("tokens", "perplexity", "dense_perplexity", "top1_agreement"):
        assert res[k] == free[k], k
    # one segment of 4 tokens, predicting its last 3 (the predictors here select ~93% of each layer, so every token
    # reads most of the 1.2 GB FFN from flash: few tokens keep this test short)
    assert res["tokens"] == 3


def test_generate_under_the_cap_gives_the_uncapped_tokens_reading_from_flash(pipeline, tmp_path):
    root, cap, _ = pipeline
    args = [*CLI, "generate", "-m", str(root / "flash"), "-p", "Once upon a time", "-n", "5", "--temp", "0",
            "--json", "--ffn", "predicted", "--dram-budget", str(cap - CAP_OVER_BUDGET), "-c", "256"]
    free = last_json(run(*args))
    r, cg = capped(cap, tmp_path / "generate.json", *args)
    out = last_json(r)
    assert out["tokens"] == free["tokens"] and len(free["tokens"]) == 5
    assert out["flash"]["mb_read"] > 0  # decode read bundles from flash under the cap
