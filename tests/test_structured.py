"""Structured output and tools (issue 46, items 1 and 2). The oracles: jsonschema validates every constrained answer;
llguidance's own matcher, fresh, accepts each whole output, and its byte-per-token logit bias (another path than the
bitmask the Constraint reads) gives the set of allowed tokens the masked logits are checked against in float64; the
real `openai` client parses the server's tool calls. Real-model tests (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, assembled
by shared/models/real_ggufs.sh) skip when its file is absent: set FIL_REAL_GGUFS to its folder."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flashinfer_lite.tools import ToolText, call_grammar, parse_tool_calls

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

REPO = Path(__file__).resolve().parents[1]
REAL_05B = Path(os.environ.get("FIL_REAL_GGUFS", Path.home() / ".cache" / "fil-real-ggufs")) / \
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

_OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = {   # name: (question, schema); strings are bounded so that every answer ends within max_tokens
    "nested": ("Give a person's name and address as JSON.", {**_OBJ, "required": ["person"], "properties": {
        "person": {**_OBJ, "required": ["name", "address"], "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {**_OBJ, "required": ["city", "zip"], "properties": {
                "city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}}),
    "enums": ("Pick a color and a shirt size, as JSON.", {**_OBJ, "required": ["color", "size"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}}),
    "arrays": ("List some fruits as JSON.", {**_OBJ, "required": ["fruits"], "properties": {
        "fruits": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 2, "maxItems": 4}}}),
    "bounds": ("Give today's weather in Paris as JSON.", {**_OBJ, "required": ["temperature", "humidity"],
                                                          "properties": {
        "temperature": {"type": "number", "minimum": -40, "maximum": 50},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100}}}),
    "required": ("Describe a film as JSON.", {**_OBJ, "required": ["title", "year", "genre"], "properties": {
        "title": {"type": "string", "maxLength": 40}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genre": {"type": "string", "maxLength": 20}, "rating": {"type": "number", "minimum": 0, "maximum": 10}}}),
}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}]


# ----------------------------------------------------------------------------------------------------------------------
# The parser of tool calls

def args_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_qwen_tool_calls_are_parsed_out_of_the_text():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, ["get_weather"])
    assert content == "Let me check."
    assert args_of(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


@pytest.mark.parametrize("text", ['{"name": "get_weather", "parameters": {"city": "Paris"}}',
                                  ' [{"name": "get_weather", "parameters": {"city": "Paris"}}]\n',
                                  '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'])
def test_llama_and_fenced_json_calls_are_parsed(text):
    content, calls = parse_tool_calls(text, ["get_weather"])
    assert content == "" and args_of(calls) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',        # broken JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',                 # never closed
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',                      # no such tool
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',              # arguments not an object
    '{"name": "get_weather"}', '{"city": "Paris"}', "It is sunny in Paris.", ""])
def test_malformed_calls_leave_a_plain_text_answer(text):
    assert parse_tool_calls(text, ["get_weather"]) == (text, [])


@pytest.mark.parametrize("text", ['Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                  '</tool_call>', '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                                  "No tool needed: it is <b>sunny</b> in <tool Paris.", "<tool_call>\n{broken"])
def test_streamed_pieces_give_what_the_whole_text_gives(text):
    """ToolText fed one character at a time shows the same content and finds the same calls as fed at once, and never
    shows a piece of a call."""
    def run(pieces):
        t = ToolText(["get_weather"])
        shown = "".join(t.push(p) for p in pieces)
        tail, calls = t.finish()
        return shown + tail, args_of(calls)
    whole = run([text])
    assert run(list(text)) == whole
    content, calls = parse_tool_calls(text, ["get_weather"])
    assert whole == ((content if not calls else whole[0]), args_of(calls))
    if calls:
        assert "get_weather" not in whole[0]


# ----------------------------------------------------------------------------------------------------------------------
# The mask

@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf):
    from storage.checkpoint import open_checkpoint
    ck = open_checkpoint(smollm2_gguf)
    return ck.tokenizer(), ck.config.vocab_size


def sample_under(constraint, sampler, vocab: int, rng, steps: int = 300) -> list[int]:
    """Tokens sampled from random logits under the constraint until its grammar is complete; each step's masked
    logits are checked in float64 against llguidance's logit bias (0 or 200 a token) of a second matcher."""
    from flashinfer_lite.constrain import ll_tokenizer
    oracle = llguidance.LLMatcher(ll_tokenizer(constraint.tokenizer, vocab), constraint.grammar, log_level=0)
    history, out = [1, 2, 3], []       # a prompt: the constraint holds only what follows it
    for _ in range(steps):
        logits = rng.normal(0, 4, vocab).astype(np.float32)
        allowed = np.frombuffer(oracle.compute_logit_bias(), np.uint8)[:vocab] > 0
        masked = constraint(history, logits.copy())
        want = np.where(allowed, logits.astype(np.float64), -np.inf)
        assert np.array_equal(masked.astype(np.float64), want)
        tok = sampler(logits, history, [constraint])
        assert allowed[tok], f"sampled token {tok} the grammar does not allow"
        assert oracle.consume_token(tok)
        history, out = history + [tok], out + [tok]
        if constraint.done(history):
            return out
    raise AssertionError(f"the grammar was not complete after {steps} tokens")


@pytest.mark.parametrize("name", ["enums", "bounds", "arrays"])
def test_every_token_sampled_under_the_mask_is_allowed(smollm2_tokenizer, name):
    from flashinfer_lite.constrain import Constraint, json_schema_grammar, ll_tokenizer
    from flashinfer_lite.generate import Sampler
    tok, vocab = smollm2_tokenizer
    schema = SCHEMAS[name][1]
    rng = np.random.default_rng(0)
    for seed in range(3):
        grammar = json_schema_grammar(schema)
        c = Constraint(tok, grammar, vocab)
        out = sample_under(c, Sampler(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed), vocab, rng)
        again = llguidance.LLMatcher(ll_tokenizer(tok, vocab), grammar, log_level=0)
        assert again.validate_tokens(out) == len(out) and again.consume_tokens(out) and again.is_accepting()
        jsonschema.validate(json.loads(tok.decode(out)), schema)


@pytest.mark.parametrize("text", ['start: "It is " ("sunny" | "raining") " in " CITY "."\nCITY: /[A-Z][a-z]{1,8}/\n',
                                  'root ::= "It is " ("sunny" | "raining") " in " [A-Z] [a-z] [a-z]? [a-z]? "."\n'])
def test_lark_and_gbnf_grammars_hold_greedy_and_sampled_output(smollm2_tokenizer, text):
    """A grammar given as Lark or as GBNF: every output sampled under it is a sentence of it (the regex its rules
    spell), greedy or at temperature 1."""
    import re
    from flashinfer_lite.constrain import Constraint, text_grammar
    from flashinfer_lite.generate import Sampler
    tok, vocab = smollm2_tokenizer
    rng = np.random.default_rng(2)
    for sampler in (Sampler(temp=0), Sampler(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=2)):
        out = sample_under(Constraint(tok, text_grammar(text), vocab), sampler, vocab, rng)
        limit = "{1,8}" if text.startswith("start") else "{1,3}"
        assert re.fullmatch(r"It is (sunny|raining) in [A-Z][a-z]" + limit + r"\.", tok.decode(out)), tok.decode(out)


def test_tool_call_grammar_holds_a_call_in_the_template_s_format(smollm2_tokenizer):
    """A Llama-style (no <tool_call> in the template) grammar: random sampling under it gives one call of the named
    function whose parameters validate against its schema."""
    from flashinfer_lite.constrain import Constraint
    from flashinfer_lite.generate import Sampler
    tok, vocab = smollm2_tokenizer
    tools = [WEATHER[0], {"type": "function", "function": {"name": "get_time", "parameters": {
        **_OBJ, "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
    c = Constraint(tok, call_grammar(tok, tools, "get_time"), vocab)
    out = sample_under(c, Sampler(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1), vocab, np.random.default_rng(1))
    content, calls = parse_tool_calls(tok.decode(out), ["get_weather", "get_time"])
    assert content == "" and [n for n, _ in args_of(calls)] == ["get_time"]
    assert args_of(calls)[0][1]["zone"] in ("UTC", "CET")


# ----------------------------------------------------------------------------------------------------------------------
# The CLI

def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "flashinfer_lite", "generate", *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=dict(os.environ, **(env or {})))


def test_generate_json_schema_and_grammar(smollm2_gguf, tmp_path):
    question, schema = SCHEMAS["nested"]
    (tmp_path / "s.json").write_text(json.dumps(schema))
    r = cli("-m", str(smollm2_gguf), "--ffn", "dense", "-p", question, "--json-schema", str(tmp_path / "s.json"),
            "--temp", "0", "-n", "200", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    jsonschema.validate(json.loads(doc["text"]), schema)
    assert doc["timings"]["constrain_ms_per_token"] > 0
    (tmp_path / "g.gbnf").write_text('root ::= "The answer is " ("yes" | "no") "."\n')
    r = cli("-m", str(smollm2_gguf), "--ffn", "dense", "-p", "Is Paris in France?", "--grammar",
            str(tmp_path / "g.gbnf"), "--temp", "0", "-n", "50")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("The answer is yes.", "The answer is no.")
    assert "grammar's mask" in r.stderr


def test_bad_constraints_are_one_line_before_the_model_loads(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bad.gbnf").write_text("root ::= (\n")
    (tmp_path / "ok.json").write_text("{}")
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "llguidance.py").write_text("raise ImportError('no llguidance here')\n")
    for args, env, words in [(["--json-schema", str(tmp_path / "bad.json")], None, "not valid JSON"),
                             (["--grammar", str(tmp_path / "bad.gbnf")], None, "grammar is refused"),
                             (["--json-schema", str(tmp_path / "missing.json")], None, "cannot read"),
                             (["--json-schema", str(tmp_path / "ok.json")], {"PYTHONPATH": str(shadow)},
                              "pip install llguidance")]:
        r = cli("-m", "no-such-model.gguf", "-p", "hi", *args, env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and words in lines[0], r.stderr


def test_grammar_cost_bench_smoke(smollm2_gguf):
    """bench/grammar_cost.py on the default model's vocabulary, llguidance (a core dependency) and outlines-core when
    installed: each row walks the schema's document token by token, every token allowed, or the row is an error."""
    from conftest import run_bench
    libs = ["llguidance"] + (["outlines-core"] if __import__("importlib").util.find_spec("outlines_core") else [])
    doc, err = run_bench("grammar_cost.py", smollm2_gguf, "--rounds", "1", "--libraries", ",".join(libs))
    assert [r["mode"] for r in doc["rows"]] == libs
    for r in doc["rows"]:
        assert "error" not in r, r
        assert r["vocab"] == 49152 and r["document_tokens"] > 20 and r["cpu_ms_per_token"] > 0
    assert "| llguidance |" in err


# ----------------------------------------------------------------------------------------------------------------------
# The server

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from test_serve import serving
    with serving("-m", str(smollm2_gguf), "--ffn", "dense") as s:
        yield s


def fresh(served) -> None:
    """A prompt that shares no prefix with a chat's: the next request evaluates its whole prompt. A prompt evaluated
    after a reused prefix is cut into other batches than when evaluated whole, rounds otherwise, and a near tie of a
    greedy answer can turn on that: answers compared with each other are made after this."""
    served.client.completions.create(model="any", prompt="Tom", max_tokens=1)


def strict(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name][1], "strict": True}}


def check_five_schemas(served):
    for name, (question, schema) in SCHEMAS.items():
        r = served.client.chat.completions.create(model="any", messages=[{"role": "user", "content": question}],
                                                  max_tokens=200, temperature=0, response_format=strict(name))
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert r.choices[0].finish_reason == "stop"
        assert r.model_extra["timings"]["constrain_per_token_ms"] > 0


def test_json_schema_strict_on_the_default_model(smollm2):
    check_five_schemas(smollm2)


def test_a_grammar_complete_at_the_last_token_allowed_is_a_stop(smollm2):
    """The answer that completes its schema at exactly max_tokens ends "stop"; one token fewer is "length"."""
    def ask(n):
        return smollm2.client.chat.completions.create(model="any", max_tokens=n, temperature=0,
                                                      messages=[{"role": "user", "content": SCHEMAS["enums"][0]}],
                                                      response_format=strict("enums")).choices[0]
    n = smollm2.client.chat.completions.create(model="any", max_tokens=100, temperature=0, response_format=strict(
        "enums"), messages=[{"role": "user", "content": SCHEMAS["enums"][0]}]).usage.completion_tokens
    assert ask(n).finish_reason == "stop" and ask(n - 1).finish_reason == "length"


def test_json_object_streamed_equals_whole_and_completions_take_it(smollm2):
    """The 135M model, free to write any object, loops in it (its answer is cut at max_tokens): the whole and the
    streamed answers are the same object's beginning; the 0.5B's whole objects parse (test_json_object_on_...)."""
    msgs = [{"role": "user", "content": "Describe a cat as JSON."}]
    fresh(smollm2)
    whole = smollm2.client.chat.completions.create(model="any", messages=msgs, max_tokens=40, temperature=0,
                                                   response_format={"type": "json_object"})
    assert whole.choices[0].message.content.startswith('{"')
    fresh(smollm2)
    pieces = smollm2.client.chat.completions.create(model="any", messages=msgs, max_tokens=40, temperature=0,
                                                    response_format={"type": "json_object"}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == whole.choices[0].message.content
    r = smollm2.client.completions.create(model="any", prompt="A cat as JSON:", max_tokens=120, temperature=0,
                                         extra_body={"response_format": strict("enums")})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["enums"][1])


def test_bad_response_formats_and_tools_without_template_support_are_400s(smollm2):
    msgs = [{"role": "user", "content": "hi"}]
    for extra, param in [({"response_format": {"type": "xml"}}, "response_format"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
                          "response_format"),
                         ({"tools": WEATHER}, "tools"),    # SmolLM2's ChatML template renders no tools
                         ({"tools": [{"type": "function"}]}, "tools[0]"),
                         ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "x"}}},
                          "tool_choice")]:
        status, doc = smollm2.post("/v1/chat/completions", json.dumps({"messages": msgs, **extra}).encode())
        assert status == 400 and doc["error"]["param"] == param, (extra, doc)
    assert smollm2.client.chat.completions.create(model="any", messages=msgs, max_tokens=2).choices


# ----------------------------------------------------------------------------------------------------------------------
# The real 0.5B

@pytest.fixture(scope="module")
def qwen():
    if not REAL_05B.exists():
        pytest.skip(f"{REAL_05B.name} absent (shared/models/real_ggufs.sh makes it; FIL_REAL_GGUFS names its folder)")
    from test_serve import serving
    with serving("-m", str(REAL_05B), "--ffn", "dense", "-c", "2048", timeout=600) as s:
        yield s


def test_json_schema_strict_on_the_real_0_5b(qwen):
    check_five_schemas(qwen)


def test_json_object_on_the_real_0_5b(qwen):
    r = qwen.client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Describe a cat as "
                                                                    "JSON."}], max_tokens=300, temperature=0,
                                            response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_tools_render_as_transformers_renders_them():
    """Qwen2.5's template with tools, an assistant call (its arguments JSON text from the client) and the tool's
    answer: the prompt our sandbox renders is the one transformers' apply_chat_template renders."""
    if not REAL_05B.exists():
        pytest.skip(f"{REAL_05B.name} absent")
    from transformers import PreTrainedTokenizerFast
    from storage.checkpoint import open_checkpoint
    from flashinfer_lite.serve import message_text
    tok = open_checkpoint(REAL_05B).tokenizer()
    sent = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
    msgs = [message_text(m, i) for i, m in enumerate(sent)]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tok, chat_template=tok.chat_template)
    want = hf.apply_chat_template(msgs, tools=WEATHER, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs, tools=WEATHER) == want
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in want
    assert "<tool_response>\nSunny, 21 C.\n</tool_response>" in want and '"name": "get_weather"' in want


def test_a_weather_tool_call_and_its_answer_on_the_real_0_5b(qwen):
    """The call, whatever tool_choice; the tool's answer sent back gets text, no call. (The 0.5B Coder's final answer
    restates its call and the tool's JSON rather than a sentence; the 1.5B's does no better: the models', since the
    prompt is transformers' own, test_tools_render_as_transformers_renders_them.)"""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    answers = {}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        fresh(qwen)
        r = qwen.client.chat.completions.create(model="any", messages=msgs, tools=WEATHER, tool_choice=choice,
                                                max_tokens=100, temperature=0)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather", (choice, r)
        assert "paris" in json.loads(call.function.arguments)["city"].lower()
        answers[str(choice)] = call
    call = answers["auto"]
    fresh(qwen)
    streamed = qwen.client.chat.completions.create(model="any", messages=msgs, tools=WEATHER, max_tokens=100,
                                                   temperature=0, stream=True)
    deltas = [c.choices[0] for c in streamed if c.choices]
    calls = [t for d in deltas for t in d.delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"] and deltas[-1].finish_reason == "tool_calls"
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)
    assert not "".join(d.delta.content or "" for d in deltas).strip()
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "sky": "sunny",
                                                                              "temperature_c": 21})}]
    final = qwen.client.chat.completions.create(model="any", messages=msgs, tools=WEATHER, max_tokens=80,
                                                temperature=0)
    answer = final.choices[0].message
    assert not answer.tool_calls and answer.content.strip(), final
    assert "21" in answer.content or "sunny" in answer.content.lower(), answer.content
