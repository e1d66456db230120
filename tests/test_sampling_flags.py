"""llama.cpp's sampling and prompt flags: min-p and repeat penalty against numpy reference math on fixed logits,
stop strings, stdin prompts, -f with -p, eval --json."""
import json
import os
import subprocess
import sys

import numpy as np

from conftest import CORPUS, STORIES
from flashinfer_lite.generate import Sampler, StopStrings


def cli(*args, stdin=None):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "flashinfer_lite", *args], capture_output=True, env=env,
                          input=stdin, timeout=300)


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def test_min_p_keeps_tokens_within_min_p_of_the_top_probability():
    logits = np.log(np.array([0.40, 0.30, 0.15, 0.10, 0.03, 0.019, 0.001])).astype(np.float32)
    for min_p in (0.05, 0.3, 0.5):
        p = softmax(logits.astype(np.float64))
        allowed = set(np.flatnonzero(p >= min_p * p.max()))
        s = Sampler(temp=1.0, top_k=0, top_p=1.0, min_p=min_p, seed=0)
        draws = np.array([s(logits) for _ in range(6000)])
        assert set(draws) == allowed
        want = p * np.isin(np.arange(len(p)), list(allowed))
        counts = np.bincount(draws, minlength=len(p)) / len(draws)
        np.testing.assert_allclose(counts, want / want.sum(), atol=0.02)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits_of_the_last_n():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=50).astype(np.float32)
    history = [3, 7, 7, 11, 20, 3, 41, 2]
    s = Sampler(temp=0, repeat_penalty=1.3, repeat_last_n=5)
    want = logits.astype(np.float64).copy()
    for t in set(history[-5:]):            # 20, 3, 41, 2, 11
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    np.testing.assert_allclose(s.penalize(logits, history), want, rtol=1e-6)
    assert s(logits, history) == int(np.argmax(want))
    # a penalty large enough moves greedy off the repeated top token
    top = int(np.argmax(logits))
    assert Sampler(temp=0, repeat_penalty=100.0)(logits, [top]) != top
    assert Sampler(temp=0, repeat_penalty=100.0, repeat_last_n=0)(logits, [top]) == top


def test_stop_strings_cut_before_the_first_match_and_never_show_a_part():
    s = StopStrings(["</end>", "\n\n"])
    shown = "".join(s.push(p) for p in ["Hello <", "/en", "d> more"])
    assert shown == "Hello " and s.stopped and s.text == "Hello "
    s = StopStrings(["STOP"])
    shown = "".join(s.push(p) for p in ["a S", "T", "ring"]) + s.flush()
    assert shown == "a STring" and not s.stopped


def test_reverse_prompt_stops_generation_at_the_stop_string():
    full = json.loads(cli("generate", "-m", str(STORIES), "-p", "Once upon", "-n", "40", "--temp", "0",
                          "--json").stdout)
    stop = full["text"][10:14]
    r = cli("generate", "-m", str(STORIES), "-p", "Once upon", "-n", "40", "--temp", "0", "-r", stop, "--json")
    out = json.loads(r.stdout)
    assert out["text"] == full["text"][: full["text"].index(stop)]
    assert len(out["tokens"]) < len(full["tokens"])
    r = cli("generate", "-m", str(STORIES), "-p", "Once upon", "-n", "40", "--temp", "0", "-r", stop)
    assert r.stdout.decode() == "Once upon" + out["text"] + "\n"


def test_prompt_from_stdin_equals_the_argument(tmp_path):
    want = json.loads(cli("generate", "-m", str(STORIES), "-p", "Once upon", "-n", "8", "--temp", "0",
                          "--json").stdout)["tokens"]
    for flag in ("-p", "-f"):
        r = cli("generate", "-m", str(STORIES), flag, "-", "-n", "8", "--temp", "0", "--json", stdin=b"Once upon")
        assert json.loads(r.stdout)["tokens"] == want, r.stderr.decode()
    r = cli("generate", "-m", str(STORIES), "-p", "-", "-n", "8", stdin=b"Once \xff")
    assert r.returncode == 1 and "stdin is not valid UTF-8" in r.stderr.decode()


def test_file_and_prompt_together_is_an_error(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("Once")
    r = cli("generate", "-m", str(STORIES), "-p", "Once", "-f", str(f), "-n", "4")
    assert r.returncode == 1 and r.stderr.decode().strip() == "error: pass the prompt with -p or -f, not both"


def test_eval_json_prints_only_json_on_stdout():
    corpus = sorted(CORPUS.glob("*.txt"))[0]
    r = cli("eval", "-m", str(STORIES), "--corpus", str(corpus), "--ffn", "dense", "--tokens", "40", "--ctx", "32",
            "--json")
    assert r.returncode == 0, r.stderr.decode()
    res = json.loads(r.stdout)                      # the whole of stdout is one JSON object
    assert res["ffn"] == "dense" and res["tokens"] > 0 and res["perplexity"] == res["dense_perplexity"]
    assert f"{res['perplexity']:.2f}" in r.stderr.decode()   # the table went to stderr
