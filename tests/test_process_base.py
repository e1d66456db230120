"""The process base (issue 43): the parts -v prints add up to the base the plan counts; every kernel a run uses is
loaded before the base is measured (LLVM's pages, dropped then, are not read back in); a generate run imports neither
torch nor gguf's quantizer nor Numba's compile-time registries. The oracle is the kernel's own accounting of the
process (/proc/self/smaps, sys.modules), read in the generate process after its run."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux: /proc/self/smaps")

from child_run import GENERATE_REPORT as RUN   # noqa: E402  (its modules and LLVM's resident bytes)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """{dtype: (the child's report, its stderr)} of generate -v on a tiny llama converted to q8_0 and q4_1 blocks (the
    exact gate: auto's mode for a SiLU model given a budget, calibrated on first use)."""
    from storage.convert import convert
    out = {}
    for dtype in ("q8_0", "q4_1"):
        flash = convert(tiny_model("llama-silu-gqa"), tmp_path_factory.mktemp(dtype) / "flash", dtype=dtype,
                        progress=False)
        r = subprocess.run([sys.executable, "-c", RUN, "generate", "-m", str(flash), "-p", "Once upon a time", "-n",
                            "8", "--temp", "0", "--ignore-chat-template", "-c", "64", "--dram-budget", "2G", "-v"],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        out[dtype] = json.loads(r.stdout.strip().splitlines()[-1]), r.stderr
    return out


@pytest.mark.parametrize("dtype", ["q8_0", "q4_1"])
def test_the_parts_v_prints_sum_to_the_process_base_the_plan_counts(runs, dtype):
    report, err = runs[dtype]
    assert report["rc"] == 0
    head = re.search(r"^process base +([\d.]+) MiB, by part", err, re.M)
    assert head, err
    block = err[head.end():].split("\n")[1:]
    parts = [re.match(r"  (.+?) +([+-][\d.]+)$", line) for line in block]
    parts = [m for m in parts[:next(i for i, m in enumerate(parts) if m is None)]]
    names = [m[1] for m in parts]
    for want in ("interpreter", "numpy", "numba", "tokenizer (512 tokens)", "LLVM library pages dropped"):
        assert want in names, names
    assert any(n.startswith("kernels: ") for n in names), names
    total = float(head[1])
    # each part is rounded to 0.1 MiB on its own
    assert sum(float(m[2]) for m in parts) == pytest.approx(total, abs=0.05 * len(parts) + 0.05)
    planned = re.search(r"^process base +([\d.]+) +[\d.]+%", err, re.M)      # the plan's table
    assert planned and float(planned[1]) == total, err


@pytest.mark.parametrize("dtype", ["q8_0", "q4_1"])
def test_no_kernel_loads_after_the_base_is_measured(runs, dtype):
    """The LLVM library's pages, dropped once the kernels are loaded, stay out through the whole run: loading a
    kernel later would read them back (tens of MiB the plan did not count). What stays is the library's written data
    (relocations, 2 MiB)."""
    report, _ = runs[dtype]
    assert report["llvm_rss"] < 8 << 20, report["llvm_rss"] / 2**20


@pytest.mark.parametrize("dtype", ["q8_0", "q4_1"])
def test_generate_imports_nothing_it_does_not_use(runs, dtype):
    """No torch, sklearn or transformers (training and tests only), no gguf (its quantizer made the warm-up's zero
    blocks), none of the implementations Numba registers for compiling (kernels load from its cache without them)."""
    modules = set(runs[dtype][0]["modules"])
    for name in ("torch", "sklearn", "transformers", "starlette", "uvicorn", "gguf", "numba.np.linalg",
                 "numba.typed.typeddict", "numba.np.random.generator_methods"):
        assert name not in modules, name
