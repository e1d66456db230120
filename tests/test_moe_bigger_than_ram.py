"""A mixture of experts bigger than RAM (issue 30): a Qwen3-MoE-layout checkpoint whose files are at least twice a
cgroup memory cap (which also bounds the page cache) is converted and generates under that cap, its experts read
from flash through a cache of 2 of its 24 experts per layer; nothing is OOM-killed and the greedy tokens equal the
same run uncapped."""
import shutil

import pytest

from storage.files import disk_bytes
from test_bigger_than_ram import CLI, capped, large_checkpoint, last_json, run

CAP_OVER_BUDGET = 60 << 20    # the cap leaves this over generate's DRAM budget: page cache of the files it reads


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    # 8 layers x 24 experts of 768 neurons at dim 768, f16: 650 MiB of experts, 2 routed per token
    root = large_checkpoint(tmp_path_factory, "bigmoe", "--layers", "8", "--dim", "768", "--ffn", "768", "--heads",
                            "12", "--kv-heads", "4", "--experts", "24", "--experts-used", "2")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_convert_and_generate_under_half_the_checkpoint(moe, tmp_path, monkeypatch):
    # the FLASHDIR is a few KB smaller than the checkpoint (its headers): the cap is half of it
    cap = (disk_bytes(moe / "hf") - (1 << 20)) // 2
    _, cg = capped(cap, tmp_path / "convert.json", *CLI, "convert", str(moe / "hf"), "-o", str(moe / "flash"))
    assert disk_bytes(moe / "hf") >= 2 * cap and disk_bytes(moe / "flash") >= 2 * cap
    args = [*CLI, "generate", "-m", str(moe / "flash"), "-p", "Once upon a time", "-n", "6", "--temp", "0", "--json",
            "-c", "256", "--dram-budget"]
    # a new installation's first run: Numba's cache empty, so the kernels compile (in child processes) under the cap
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    r, cg = capped(cap, tmp_path / "generate.json", *args, str(cap - CAP_OVER_BUDGET))
    out = last_json(r)
    free = last_json(run(*args, "auto"))                    # uncapped, every expert in DRAM: the same tokens
    assert out["tokens"] == free["tokens"] and len(free["tokens"]) == 6
    f = out["flash"]
    assert f["mb_read"] > 0 and f["hit_rate"] < 1          # experts were read from flash, and evicted
    assert out["peak_rss_mb"] <= out["dram_budget_mb"]
