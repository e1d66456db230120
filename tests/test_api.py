"""The Python API (load, generate, stream_generate) against the CLI's greedy output on the same model."""
import json
import subprocess
import sys

from conftest import STORIES


def cli_json(*args):
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", *args, "--temp", "0", "--json"],
                       capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


def test_import_is_light_and_api_is_lazy():
    code = ("import sys, flashinfer_lite; assert 'flashinfer_lite.api' not in sys.modules; "
            "assert 'numba' not in sys.modules; from flashinfer_lite import load, generate, stream_generate; "
            "assert 'flashinfer_lite.api' in sys.modules; "
            "print(generate.__module__, load is sys.modules['flashinfer_lite.api'].load)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True)
    # generate is the API's function, not the command's module; load is the API's (runtime.load, re-exported)
    assert r.returncode == 0 and r.stdout.decode().strip() == "flashinfer_lite.api True", r.stderr.decode()


def test_raw_prompt_generate_equals_cli():
    from flashinfer_lite import generate, load, stream_generate
    want = cli_json("-m", str(STORIES), "-p", "Once upon", "-n", "24")
    model, tokenizer = load(STORIES)
    assert model.ffn is None and not hasattr(model, "runtime")      # every weight in DRAM: no FFN object from flash
    assert generate(model, tokenizer, "Once upon", max_tokens=24, temp=0) == want["text"]
    steps = list(stream_generate(model, tokenizer, "Once upon", max_tokens=24))
    assert [s.token for s in steps] == want["tokens"]
    assert "".join(s.text for s in steps) == want["text"]
    assert steps[-1].generation_tokens == len(want["tokens"]) and steps[-1].prompt_tokens == len(want["prompt_tokens"])
    assert steps[-1].generation_tps > 0 and steps[-1].prompt_tps > 0 and steps[0].token_ms == 0


def test_instruct_model_gets_the_chat_template_as_in_the_cli(smollm2_gguf):
    gguf = smollm2_gguf
    want = cli_json("-m", str(gguf), "-p", "What is the capital of France?", "-n", "16", "--ffn", "dense")
    from flashinfer_lite import load, stream_generate
    model, tokenizer = load(gguf, ffn="dense")
    steps = list(stream_generate(model, tokenizer, "What is the capital of France?", max_tokens=16))
    assert [s.token for s in steps] == want["tokens"]
    assert "".join(s.text for s in steps) == want["text"]
