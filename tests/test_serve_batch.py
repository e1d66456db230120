"""`flashinfer-lite serve --parallel 4` as a real server on a loopback port, driven by the `openai` client: four
concurrent clients, and one joining while three decode, under a --dram-budget that puts the FFN on flash. The oracle
of each answer is the same model's greedy output alone, in this process (the exact gate's FFN computes one function
of x whatever the budget: the server's budget changes which rows are read, not a bit)."""
import math
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import planner_minimum
from test_serve import prometheus, serving

REAL_05B = Path(os.environ.get("FIL_REAL_GGUFS", Path.home() / ".cache" / "fil-real-ggufs")) / \
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# distinct first tokens: no prompt finds another's prefix in a session's cache, so each is evaluated in one pass as
# the oracle evaluates it (a prompt found in a cache has only its last token evaluated, alone: logits a little other
# than the whole prompt's pass, batched or not). The first four come at once, the last four join three decoding.
PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):", "Water boils at",
           "My favourite book is", "In 1969, the first", "Hello, my name is", "A list of prime numbers:"]
N_TOKENS = 10


def solo_answers(path: Path, ffn: str) -> dict:
    from flashinfer_lite.api import generate
    from flashinfer_lite.runtime import load
    model, tok = load(str(path), None, ffn, 256, say=False)
    return {p: generate(model, tok, p, N_TOKENS, temp=0.0, use_chat_template=False, ignore_eos=True)
            for p in PROMPTS}


def budget_for(path: Path, flags: list[str]) -> tuple[int, str]:
    """(serve's minimum budget with these flags + 24 MiB, the refusal of a budget below it)."""
    def refuse(budget):
        r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "serve", "-m", str(path), *flags,
                            "--dram-budget", budget, "--port", "0"], capture_output=True, timeout=300)
        return r.returncode, r.stderr.decode()
    minimum, err = planner_minimum(refuse)
    return math.ceil(minimum) + 24, err


def four_clients_and_one_joining(path: Path, ffn: str) -> None:
    flags = ["--ffn", ffn, "-c", "256", "--parallel", "4", "--ignore-eos"]   # every answer N_TOKENS long
    budget, refusal = budget_for(path, flags)
    # the refusal counts the 4 contexts, at startup
    assert "4 contexts of 256 positions" in refusal, refusal
    want = solo_answers(path, ffn)
    with serving("-m", str(path), *flags, "--dram-budget", f"{budget}M") as s:
        def ask(prompt: str) -> str:
            return s.client.completions.create(model="m", prompt=prompt, max_tokens=N_TOKENS,
                                               temperature=0).choices[0].text
        before = prometheus(s.call("GET", "/metrics", None, {"Host": "localhost"})[2].decode())
        with ThreadPoolExecutor(4) as pool:
            got = dict(zip(PROMPTS[:4], pool.map(ask, PROMPTS[:4])))
        assert got == {p: want[p] for p in PROMPTS[:4]}
        # one joins mid-batch: three streams are decoding (each has had two pieces) when the fourth arrives
        started = [threading.Event() for _ in range(3)]

        def stream(i: int) -> str:
            pieces = []
            for c in s.client.completions.create(model="m", prompt=PROMPTS[4 + i], max_tokens=N_TOKENS,
                                                 temperature=0, stream=True):
                pieces.append(c.choices[0].text if c.choices else "")
                if len(pieces) == 2:
                    started[i].set()
            return "".join(pieces)
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(stream, i) for i in range(3)]
            assert all(e.wait(300) for e in started)
            late = ask(PROMPTS[7])
            early = [f.result(timeout=300) for f in first]
        assert early == [want[p] for p in PROMPTS[4:7]] and late == want[PROMPTS[7]]
        after = prometheus(s.call("GET", "/metrics", None, {"Host": "localhost"})[2].decode())
        peak = s.peak_rss_bytes()
        log = s.stderr()
    # one log line per request, each with its own tokens, though they were decoded together
    lines = re.findall(r"^POST /v1/completions 200 (\d+)\+(\d+) tokens \d+ ms$", log, re.M)
    assert len(lines) >= 8 and all(int(c) == N_TOKENS for _, c in lines[-8:]), log
    predicted = ("flashinfer_lite_tokens_predicted_total", "")
    assert after[predicted] - before[predicted] == 8 * N_TOKENS
    steps = {k[1]: v for k, v in after.items() if k[0] == "flashinfer_lite_batch_steps_total"}
    assert sum(v for k, v in steps.items() if k != '{sequences="1"}') > 0, steps     # some steps were batched
    read = ("flashinfer_lite_flash_read_bytes_total", "")
    assert after[read] > before[read]               # the FFN's rows came from flash during the answers
    assert after[("flashinfer_lite_requests_processing", "")] == 0
    assert peak <= budget << 20, f"peak RSS {peak / 2**20:.1f} MiB > {budget} MiB"


def test_four_clients_under_parallel_4_get_their_solo_answers(smollm2_gguf):
    four_clients_and_one_joining(smollm2_gguf, "gate")


def test_four_clients_on_the_real_05b(tmp_path):
    if not REAL_05B.exists():
        pytest.skip(f"{REAL_05B.name} absent (shared/models/real_ggufs.sh makes it; FIL_REAL_GGUFS names its folder)")
    four_clients_and_one_joining(REAL_05B, "gate")


def test_parallel_out_of_range_is_one_line_before_the_model_loads():
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "serve", "--parallel", "0", "--port", "0"],
                       capture_output=True, timeout=120)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1 and err == ["error: --parallel 0 is out of range: 1 to 64 sequences"], err
