"""Bigger than RAM, for real: a model whose files are >1.5x a cgroup memory cap (which also bounds the page cache)
generates under that cap with no OOM kill, and produces the same tokens as the same run uncapped."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CORPUS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from memcap import available  # noqa: E402

CAP_OVER_BUDGET = 160 << 20   # the cap leaves this over the DRAM budget: page cache of non-FFN files, allocator slack


def run(*args, timeout=600, ok=True):
    r = subprocess.run(args, capture_output=True, timeout=timeout)
    if ok:
        assert r.returncode == 0, r.stderr.decode()[-2000:]
    return r


@pytest.fixture(scope="module")
def big_flashdir(tmp_path_factory):
    if available() is not None:
        pytest.skip(f"no memory cgroup here: {available()}")
    root = tmp_path_factory.mktemp("big")
    py, cli = sys.executable, [sys.executable, "-m", "flashinfer_lite"]
    # 12 layers x 16384 neurons x dim 1024 in f16: 1.1 GiB of FFN bundles, ~10% active per token (FATReLU).
    run(py, str(REPO / "tools" / "make_large_model.py"), str(root / "hf"), "--layers", "12", "--dim", "1024",
        "--ffn", "16384", "--heads", "8", "--kv-heads", "2", "--check-tokens", "0")
    run(*cli, "convert", str(root / "hf"), "-o", str(root / "flash"))
    run(*cli, "collect", "-m", str(root / "flash"), "--corpus", str(CORPUS / "tinystories_cased_197KB.txt"),
        "--tokens", "384", "--ctx", "128", "-o", str(root / "acts"))
    run(*cli, "train-predictor", str(root / "acts"), "-o", str(root / "flash"), "--rank", "8", "--max-rank", "8",
        "--steps", "30", "--target-recall", "0.9")
    return root / "flash"


def generate_args(flashdir, budget: str) -> list[str]:
    return [sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(flashdir), "-p", "Once upon a time",
            "-n", "5", "--temp", "0", "--json", "--ffn", "predicted", "--dram-budget", budget, "-c", "256"]


def generate(flashdir, budget: str, cap: int | None, tmp_path):
    args = generate_args(flashdir, budget)
    summary = tmp_path / ("capped.json" if cap else "uncapped.json")
    if cap:
        args = [sys.executable, str(REPO / "tools" / "memcap.py"), "--limit", str(cap), "--drop-caches",
                "--json", str(summary), "--", *args]
    r = run(*args)
    out = json.loads(r.stdout.decode().strip().splitlines()[-1])
    return out, (json.loads(summary.read_text()) if cap else None)


def test_generates_under_a_cap_below_the_model_size_same_tokens_as_uncapped(big_flashdir, tmp_path):
    # The smallest budget this model runs in (from the one-line error; it includes the measured runtime itself).
    err = run(*generate_args(big_flashdir, "1M"), ok=False).stderr.decode()
    minimum_mib = float(re.search(r"below the minimum ([\d.]+) MiB", err).group(1))
    budget_mib = math.ceil(minimum_mib) + 64
    cap = (budget_mib << 20) + CAP_OVER_BUDGET
    files = sum(f.stat().st_size for f in big_flashdir.rglob("*") if f.is_file())
    assert files > 1.5 * cap  # neither DRAM nor the page cache can hold the model: reads must really go to flash
    free, _ = generate(big_flashdir, f"{budget_mib}M", None, tmp_path)
    capped, cg = generate(big_flashdir, f"{budget_mib}M", cap, tmp_path)
    assert cg["oom_kills"] == 0 and cg["exit_code"] == 0
    assert capped["tokens"] == free["tokens"] and len(free["tokens"]) == 5
    assert capped["flash"]["mb_read"] > 0  # decode read bundles from flash under the cap
