"""The --dram-budget promise: everything the process keeps counts, so generate's peak RSS stays within the budget.

The oracle for the peak is the kernel's own accounting of the child process (os.wait4's rusage, Linux VmHWM), read
by this test, not the number generate prints. The model has an FFN bigger than what the budget leaves for the neuron
cache, so the budget decides what stays in DRAM and decode has to read from flash.
"""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import flash_model_with_predictors, planner_minimum

PROMPT = "Once upon a time there was a little dog"


@pytest.fixture(scope="module")
def flashdir(tmp_path_factory):
    """2 layers x 8192 neurons x dim 512, f16 bundles (48 MiB of FFN, ~10% active per token), with predictors."""
    return flash_model_with_predictors(tmp_path_factory.mktemp("budget"), 2, 512, 8192, 4, 2)


# Runs argv[2:] and writes [exit code, ru_maxrss] of that child, from os.wait4, to argv[1]. A small process of its
# own because Linux carries a parent's high-water mark into a child across fork/vfork + exec: a direct child of the
# (large) pytest process would show pytest's RSS as its peak.
LAUNCHER = """
import json, os, subprocess, sys
p = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(p.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump([os.waitstatus_to_exitcode(status), usage.ru_maxrss], f)
"""


def generate(flashdir: Path, budget: str, tmp_path: Path) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak RSS bytes of generate as the kernel accounted it)."""
    args = [sys.executable, "-m", "flashinfer_lite", "generate", "-m", str(flashdir), "-p", PROMPT, "-n", "6",
            "--temp", "0", "--json", "--ffn", "predicted", "--dram-budget", budget, "-c", "128"]
    summary = tmp_path / "rusage.json"
    r = subprocess.run([sys.executable, "-c", LAUNCHER, str(summary), *args], capture_output=True, timeout=300)
    rc, maxrss = json.loads(summary.read_text())
    peak = maxrss * (1 if sys.platform == "darwin" else 1024)
    return rc, r.stdout.decode(), r.stderr.decode(), peak


@pytest.mark.skipif(not hasattr(os, "wait4"), reason="needs os.wait4 for the child's peak RSS")
def test_generate_peak_rss_stays_within_the_dram_budget(flashdir, tmp_path):
    # The minimum this process needs, from the one-line error (it includes the measured process base).
    minimum_mib, err = planner_minimum(lambda budget: generate(flashdir, budget, tmp_path)[::2])
    assert len(err.strip().splitlines()) == 1, err
    assert "process base" in err
    budget_mib = math.ceil(minimum_mib) + 16
    budget = budget_mib << 20
    ffn_bytes = (flashdir / "ffn.bin").stat().st_size
    assert ffn_bytes > 2 * (budget - minimum_mib * 2**20)  # the cache cannot hold the FFN: the budget decides

    rc, out, err, peak = generate(flashdir, f"{budget_mib}M", tmp_path)
    assert rc == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert len(r["tokens"]) == 6
    assert r["flash"]["mb_read"] > 0                     # decode fetched neurons from flash
    assert peak <= budget, f"peak RSS {peak / 2**20:.1f} MiB > budget {budget_mib} MiB\n{err}"
    # What generate reports is that same peak (read just before it printed; rounded to 0.1 MiB).
    assert r["dram_budget_mb"] == budget_mib
    assert abs(peak / 2**20 - r["peak_rss_mb"]) < 2.0
    assert "process base" in err and "measured" in err        # the plan's table shows the process base


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_end_line_prints_the_peak_next_to_the_budget():
    import io
    from types import SimpleNamespace

    from flashinfer_lite.generate import Timings
    from storage.reader import FlashStats
    budget = 300 << 20
    ffn = SimpleNamespace(stats=FlashStats.for_layers(2, 8), plan=SimpleNamespace(requested=True, budget_bytes=budget))
    out = io.StringIO()
    Timings().report(out, ffn=ffn)
    line = next(s for s in out.getvalue().splitlines() if "peak RSS" in s)
    hwm = next(int(s.split()[1]) for s in open("/proc/self/status") if s.startswith("VmHWM:")) / 1024
    m = re.search(r"peak RSS = +([\d.]+) MiB \(budget 300\.0 MiB(, EXCEEDED)?\), [\d.]+ MiB now", line)
    assert m, line
    assert abs(float(m.group(1)) - hwm) < 1.0
    assert bool(m.group(2)) == (float(m.group(1)) > 300)   # this pytest process may well be over: it says so
    out = io.StringIO()
    Timings().report(out, ffn=SimpleNamespace(stats=ffn.stats, plan=SimpleNamespace(requested=False)))
    assert "budget" not in next(s for s in out.getvalue().splitlines() if "peak RSS" in s)
