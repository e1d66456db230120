"""The Python API (load, generate, stream_generate) against the CLI's greedy output on the same model."""
import json
import subprocess
import sys

import pytest

from conftest import STORIES
from test_cli import cli


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


@pytest.fixture(scope="module")
def stories_api():
    from flashinfer_lite import load
    return load(STORIES)


@pytest.mark.parametrize("kw,flag", [(dict(temp=-1.0), "--temp"), (dict(temp=0.7, top_p=5.0), "--top-p"),
                                     (dict(temp=0.7, min_p=-3.0), "--min-p"), (dict(temp=float("nan")), "--temp"),
                                     (dict(top_k=-1), "--top-k"), (dict(repeat_penalty=0.0), "--repeat-penalty")])
def test_api_refuses_the_sampling_arguments_the_cli_refuses(stories_api, kw, flag):
    """The API's check is the CLI's (one validator, the Sampler's): the same rule, naming the keyword."""
    from flashinfer_lite import generate
    name, value = next((k, v) for k, v in kw.items() if k.replace("_", "-") == flag[2:])
    with pytest.raises(ValueError) as api:
        generate(*stories_api, "Once", max_tokens=2, **kw)
    assert str(api.value).startswith(f"{name} {value!r} is out of range: ")
    r = cli("generate", "-m", str(STORIES), "-p", "Once", "-n", "2", flag, str(value))
    assert r.returncode == 1 and "Traceback" not in r.stderr.decode()
    assert r.stderr.decode().strip() == f"error: {flag} {value} is out of range: " + str(api.value).split(": ", 1)[1]


@pytest.mark.parametrize("prompt,message", [(b"Once", "prompt is bytes"), (bytearray(b"Once"), "prompt is bytes"),
                                            ([1, 10**9], "prompt token id 1000000000 is not an id"),
                                            ([1, -1], "prompt token id -1 is not an id"),
                                            ([1, "2"], "prompt token id '2' is not an id")])
def test_api_refuses_a_prompt_that_is_neither_text_nor_ids(stories_api, prompt, message):
    from flashinfer_lite import generate
    from storage.errors import UserError
    with pytest.raises(UserError, match=message):
        generate(*stories_api, prompt, max_tokens=2)


def test_api_token_ids_still_generate_as_their_text(stories_api):
    from flashinfer_lite import generate
    model, tok = stories_api
    assert generate(model, tok, tok.encode("Once upon"), max_tokens=8) == generate(model, tok, "Once upon",
                                                                                     max_tokens=8)


def test_load_verbose_false_prints_nothing(capfd):
    from flashinfer_lite import load
    load(STORIES, verbose=False)
    assert capfd.readouterr() == ("", "")
    load(STORIES, verbose=True)          # the decisions, as the commands print them
    assert "ffn: " in capfd.readouterr().err


def test_make_prompt_cache_is_importable_from_the_package():
    from flashinfer_lite import make_prompt_cache
    from flashinfer_lite.api import make_prompt_cache as api_make_prompt_cache
    assert make_prompt_cache is api_make_prompt_cache


def test_a_templated_string_is_not_templated_again(smollm2_gguf):
    """tokenizer.apply_chat_template's text, given as the prompt, is fed as it is (it opens with the template's own
    "<|im_start|>"): the same ids and answer as the messages; a plain string gets the template; use_chat_template
    False feeds it raw."""
    from flashinfer_lite import load, stream_generate
    from flashinfer_lite.api import encode_prompt
    model, tok = load(smollm2_gguf, ffn="dense")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    templated = tok.apply_chat_template(msgs)
    assert encode_prompt(tok, templated)[0] == tok.encode_chat(msgs) == encode_prompt(tok, msgs)[0]
    assert encode_prompt(tok, msgs[0]["content"])[0] == tok.encode_chat(msgs)
    assert encode_prompt(tok, "Paris is", use_chat_template=False)[0] == tok.encode("Paris is")
    a = list(stream_generate(model, tok, templated, max_tokens=8))
    b = list(stream_generate(model, tok, msgs, max_tokens=8))
    assert [s.token for s in a] == [s.token for s in b] and a[0].prompt_tokens == len(tok.encode_chat(msgs))


def test_finish_reason_and_logprobs_on_responses(smollm2_gguf):
    """The last response says why the output ended: "stop" on a response of its own when the model ended it (its
    token the end-of-sequence id, no text), "length" on the max_tokens-th token or the one that filled the context
    (no exception). logprobs=True: each response's [V] log-softmax of the logits its token came from, against
    float64 from a direct forward pass; the greedy token is its argmax."""
    import numpy as np
    from flashinfer_lite import load, stream_generate
    model, tok = load(smollm2_gguf, ffn="dense")
    msgs = [{"role": "user", "content": "Say hi."}]
    steps = list(stream_generate(model, tok, msgs, max_tokens=64, logprobs=True))
    assert steps[-1].finish_reason == "stop" and steps[-1].token in tok.eos_ids and steps[-1].text == ""
    assert all(s.finish_reason is None for s in steps[:-1]) and steps[-1].generation_tokens == len(steps) - 1
    tr = model.transformer
    kv = tr.new_cache(128)
    logits = tr.forward(tok.encode_chat(msgs), kv)
    for s in steps:
        z = logits.astype(np.float64)
        want = z - z.max() - np.log(np.exp(z - z.max()).sum())
        assert s.logprobs.shape == (tok.vocab_size,) and np.abs(s.logprobs - want).max() < 1e-4
        assert s.token == int(np.argmax(s.logprobs))
        logits = tr.forward([s.token], kv)
    cut = list(stream_generate(model, tok, msgs, max_tokens=3))
    assert [s.finish_reason for s in cut] == [None, None, "length"]
    small, tok = load(STORIES, ctx=12)
    ids = tok.encode("Once upon a time")
    full = list(stream_generate(small, tok, ids, max_tokens=100, ignore_eos=True))
    assert len(full) == 12 - len(ids) + 1 and full[-1].finish_reason == "length"
