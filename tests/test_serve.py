"""`flashinfer-lite serve` as a real server on a loopback port, driven by the `openai` client package. The oracle for
every answer is `flashinfer-lite generate --temp 0 --json` with the same model and flags; for the budget, the kernel's
high-water mark of the server process (VmHWM in /proc/PID/status), not what the server says."""
import http.client
import json
import math
import random
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import STORIES, planner_minimum, stories_with_chat_template

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

REPO = Path(__file__).resolve().parents[1]
# The stories server runs the flash path under a budget: its FFN read through the neuron cache (--ffn oracle), so
# --dram-budget applies; --ignore-eos makes every answer max_tokens long, so a stopped generation is visible.
STORIES_FLAGS = ["-m", str(STORIES), "--ffn", "oracle", "-c", "256", "--ignore-eos"]


class Served:
    def __init__(self, proc, port, log):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: bytes, headers=None) -> tuple[int, dict]:
        """(status, JSON body) of a raw POST: the requests a client library would refuse to send."""
        req = urllib.request.Request(self.url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def call(self, method: str, path: str, body: bytes | None = None, headers=None) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one request sent with exactly these headers (Host and Origin included)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def raw_status(self, request: bytes) -> int:
        """The status code of an answer to bytes sent as they are (the first line of the response)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
            sock.sendall(request)
            head = sock.recv(4096).split(b"\r\n", 1)[0]
        return int(head.split()[1])

    def peak_rss_bytes(self) -> int:
        """VmHWM: the kernel's high-water mark of this process's RSS (its own memory map, made at exec)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")


@contextmanager
def serving(*flags, env=None, timeout=240):
    """A `flashinfer-lite serve` child on a loopback port the system picks (--port 0; the startup line names it), up
    (answering /health) when entered, stopped (Ctrl-C, then killed) on exit."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "flashinfer_lite", "serve", *flags, "--host", "127.0.0.1",
                             "--port", "0"], stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, **(env or {})), cwd=REPO)
    served = None
    try:
        deadline = time.time() + timeout
        while True:
            log.seek(0)
            text = log.read().decode(errors="replace")
            assert proc.poll() is None, f"serve exited {proc.returncode}:\n{text}"
            assert time.time() < deadline, f"serve did not start in {timeout} s:\n{text}"
            port = re.search(r"^serving .* on http://127\.0\.0\.1:(\d+)/v1 ", text, re.M)
            if port:
                break
            time.sleep(0.3)
        served = Served(proc, int(port.group(1)), log)
        assert served.health()["status"] == "ok"
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def generate_json(flags, prompt: str, n: int, env=None, template: bool = False) -> dict:
    """The oracle: `flashinfer-lite generate --temp 0 --json`."""
    args = [sys.executable, "-m", "flashinfer_lite", "generate", *flags, "-p", prompt, "-n", str(n), "--temp", "0",
            "--json"] + ([] if template else ["--ignore-chat-template"])
    r = subprocess.run(args, capture_output=True, timeout=300, env=dict(os.environ, **(env or {})), cwd=REPO)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    """Its own cache for the FLASHDIR that --ffn oracle converts stories260K into."""
    return {"FLASHINFER_LITE_CACHE": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
def budget_mib(cache_env) -> int:
    """serve's own minimum budget (the planner's, its measured runtime included) + 16 MiB: little
    room, so the load test's peak RSS is held to a budget that bites."""
    def refuse(budget):
        r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "serve", *STORIES_FLAGS, "--dram-budget", budget,
                            "--port", "0"], capture_output=True, timeout=300, env=dict(os.environ, **cache_env))
        return r.returncode, r.stderr.decode()
    return math.ceil(planner_minimum(refuse)[0]) + 16


@pytest.fixture(scope="module")
def flags(budget_mib):
    return STORIES_FLAGS + ["--dram-budget", f"{budget_mib}M"]


@pytest.fixture(scope="module")
def stories(flags, cache_env):
    with serving(*flags, env=cache_env) as s:
        yield s


@pytest.fixture(scope="module")
def stories_chat(tmp_path_factory):
    """stories260K with a chat template, served dense."""
    d = stories_with_chat_template(tmp_path_factory.mktemp("chat") / "stories-chat")
    with serving("-m", str(d)) as s:
        s.model_dir = d
        yield s


def test_greedy_completions_equal_generate_and_extend_the_cache(stories, flags, cache_env):
    first, second = "Once upon a time", "Once upon a time there was a big dog"   # the second extends the first
    for prompt, n in ((first, 24), (second, 20)):
        want = generate_json(flags, prompt, n, env=cache_env)
        r = stories.client.completions.create(model="stories260K", prompt=prompt, max_tokens=n, temperature=0)
        assert r.choices[0].text == want["text"]
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want["prompt_tokens"]), n)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        timings = r.model_extra["timings"]
        assert timings["predicted_n"] == n and timings["prompt_n"] + timings["cache_n"] == r.usage.prompt_tokens
        assert timings["first_token_ms"] >= timings["prompt_ms"] > 0
    assert timings["cache_n"] >= len(want["prompt_tokens"]) - 6   # the second reused the first's prompt from the KV


def test_streamed_pieces_join_to_the_whole_text(stories):
    kw = dict(model="any", prompt="The little cat", max_tokens=30, temperature=0)
    whole = stories.client.completions.create(**kw)
    pieces = [c.choices[0].text for c in stories.client.completions.create(**kw, stream=True)]
    assert len(pieces) > 10 and "".join(pieces) == whole.choices[0].text


def test_stop_strings_cut_the_text_before_them(stories):
    kw = dict(model="any", prompt="Once upon a time", max_tokens=40, temperature=0)
    full = stories.client.completions.create(**kw).choices[0].text
    stop = full[full.index("little") + 2:][:5]          # a stop string that starts inside a word, mid-token
    want = full[:full.index(stop)]
    r = stories.client.completions.create(**kw, stop=["never appears", stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    streamed = stories.client.completions.create(**kw, stop=stop, stream=True)
    chunks = [c.choices[0] for c in streamed]
    assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == "stop"


def test_bad_requests_get_openai_errors_and_the_server_carries_on(stories):
    cases = {
        b"{not json": (400, None),
        b'"a string"': (400, None),
        json.dumps({"prompt": 5}).encode(): (400, "prompt"),
        json.dumps({"prompt": "hi", "max_tokens": "ten"}).encode(): (400, "max_tokens"),
        json.dumps({"prompt": "hi", "max_tokens": 0}).encode(): (400, "max_tokens"),
        json.dumps({"prompt": "hi", "temperature": True}).encode(): (400, "temperature"),
        b'{"prompt": "hi", "temperature": NaN}': (400, "temperature"),
        json.dumps({"prompt": "hi", "top_p": 2}).encode(): (400, "top_p"),
        json.dumps({"prompt": "hi", "stop": [1]}).encode(): (400, "stop"),
        json.dumps({"prompt": "hi", "stream": "yes"}).encode(): (400, "stream"),
        json.dumps({"prompt": "word " * 400}).encode(): (400, "prompt"),          # over the 256-token context
        b'{"prompt": "\\ud800"}': (400, "prompt"),                                   # a lone surrogate: not UTF-8
        b'{"prompt": "caf\xe9"}': (400, None),                                       # a Latin-1 byte in the body
        b"[" * 30000 + b"]" * 30000: (400, None),                                    # nesting deep enough to recurse
    }
    for body, (status, param) in cases.items():
        got, doc = stories.post("/v1/completions", body)
        assert got == status, (body[:60], doc)
        assert doc["error"]["message"] and doc["error"]["param"] == param, doc
    # A body over the limit is refused from its Content-Length, before it is read. Sent by hand: the server answers
    # and closes without reading the rest, so a client still writing a real 3 MiB body would see a reset instead.
    for declared in (3 << 20, 1 << 30):
        assert stories.raw_status(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                                  b"\r\nContent-Length: %d\r\n\r\n{\"prompt\": \"xxxx" % declared) == 413
    assert stories.post("/v1/chat/completions", json.dumps({"messages": []}).encode())[0] == 400
    # stories260K has no chat template: a chat request is the client's mistake, not a crash
    status, doc = stories.post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 400 and "chat template" in doc["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:   # what an openai client sees
        stories.client.completions.create(model="any", prompt="hi " * 300, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        stories.client.embeddings.create(model="any", input="hi")
    assert stories.health()["status"] == "ok"
    assert stories.client.completions.create(model="any", prompt="Once", max_tokens=3).usage.completion_tokens == 3


def test_models_lists_the_one_model(stories):
    ids = [m.id for m in stories.client.models.list()]
    assert ids == ["stories260K"]


def test_sampling_is_checked_by_the_cli_s_rules(stories, flags, cache_env):
    """The server checks sampling as the CLI and the API do (the Sampler's one validator): its rule, as a 400 naming
    the request's field; and "temperature": 1e-310, which the sampler turned into NaN (a 500), samples greedily."""
    status, doc = stories.post("/v1/completions", json.dumps({"prompt": "Once", "min_p": -3}).encode())
    assert (status, doc["error"]["param"]) == (400, "min_p"), doc
    assert doc["error"]["message"] == "'min_p' must be a number between 0 and 1 (0 = off), got -3"
    want = generate_json(flags, "Once upon a time", 8, env=cache_env)
    status, doc = stories.post("/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 8,
                                                              "temperature": 1e-310}).encode())
    assert status == 200 and doc["choices"][0]["text"] == want["text"], doc


def test_a_client_gone_mid_stream_stops_its_generation(stories):
    before = stories.health()["tokens_predicted_total"]
    stream = stories.client.completions.create(model="any", prompt="Once upon a time", max_tokens=240,
                                                temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    time.sleep(1.0)
    generated = stories.health()["tokens_predicted_total"] - before
    assert 3 <= generated < 240   # stopped well before its max_tokens (--ignore-eos: it would have run to 240)
    assert stories.client.completions.create(model="any", prompt="Once", max_tokens=5).usage.completion_tokens == 5


def test_chat_completions_use_the_template_and_reuse_the_conversation(stories_chat):
    client = stories_chat.client
    msgs = [{"role": "user", "content": "Once upon a time"}]
    want = generate_json(["-m", str(stories_chat.model_dir)], "Once upon a time", 20, template=True)
    r = client.chat.completions.create(model="any", messages=msgs, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want["text"] and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(want["prompt_tokens"])
    assert r.usage.completion_tokens == len(want["tokens"])
    assert r.choices[0].finish_reason == ("length" if len(want["tokens"]) == 20 else "stop")
    streamed = list(client.chat.completions.create(model="any", messages=msgs, max_tokens=20, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want["text"]
    assert streamed[-1].usage.completion_tokens == len(want["tokens"])
    # the next turn: its prompt extends the conversation the KV cache holds, and gives what a fresh cache gives
    msgs += [{"role": "assistant", "content": want["text"]}, {"role": "user", "content": "The dog ran"}]
    again = client.chat.completions.create(model="any", messages=msgs, max_tokens=20, temperature=0)
    assert again.model_extra["timings"]["cache_n"] >= len(want["prompt_tokens"])   # the whole first turn's prompt
    client.completions.create(model="any", prompt="Tom", max_tokens=2)                 # the cache now holds "Tom"
    fresh = client.chat.completions.create(model="any", messages=msgs, max_tokens=20, temperature=0)
    assert fresh.model_extra["timings"]["cache_n"] <= 1
    assert fresh.choices[0].message.content == again.choices[0].message.content


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    with serving("-m", str(smollm2_gguf), "--ffn", "dense") as s:
        yield s


def test_default_model_chat_equals_generate(smollm2, smollm2_gguf):
    question = "What is the capital of France?"
    want = generate_json(["-m", str(smollm2_gguf), "--ffn", "dense"], question, 16, template=True)
    r = smollm2.client.chat.completions.create(model="any", messages=[{"role": "user", "content": question}],
                                               max_tokens=16, temperature=0)
    assert r.choices[0].message.content == want["text"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want["prompt_tokens"]), len(want["tokens"]))


def test_an_empty_prompt_is_the_clients_mistake(smollm2):
    """The default model adds no BOS: an empty prompt has no token to evaluate. A 400 for it, streamed or not, before
    a stream starts (not a 500, nor a 200 whose only event is the error)."""
    for stream in (False, True):
        status, doc = smollm2.post("/v1/completions", json.dumps({"prompt": "", "max_tokens": 2,
                                                                   "stream": stream}).encode())
        assert status == 400 and doc["error"]["param"] == "prompt", doc
    assert smollm2.client.completions.create(model="any", prompt="Paris is", max_tokens=2).usage.completion_tokens


def test_load_8_clients_40_requests(stories, flags, budget_mib, cache_env):
    """8 concurrent clients, 40 requests: streamed, whole, and streams dropped after two pieces. Every finished
    answer is generate's, none is lost, /health answers throughout, peak RSS stays within --dram-budget."""
    prompts = ["Once upon a time", "Once upon a time there was a big dog", "The little cat"]
    n = 16
    want = {p: generate_json(flags, p, n, env=cache_env)["text"] for p in prompts}

    def one(i: int):
        prompt, kind = prompts[i % len(prompts)], ("stream", "whole", "drop", "whole")[i % 4]
        kw = dict(model="any", prompt=prompt, max_tokens=n, temperature=0)
        if kind == "whole":
            return kind, prompt, stories.client.completions.create(**kw).choices[0].text
        stream = stories.client.completions.create(**kw, stream=True)
        pieces = []
        for c in stream:
            pieces.append(c.choices[0].text)
            if kind == "drop" and len(pieces) == 2:
                stream.close()
                break
        return kind, prompt, "".join(pieces)

    healthy = []
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(40)]
        while not all(f.done() for f in futures):
            healthy.append(stories.health()["status"] == "ok")
            time.sleep(0.2)
        results = [f.result(timeout=300) for f in futures]   # none lost: each came back, none raised
    assert len(results) == 40 and healthy and all(healthy)
    for kind, prompt, text in results:
        if kind == "drop":
            assert want[prompt].startswith(text) and text
        else:
            assert text == want[prompt], (kind, prompt)
    assert stories.health()["status"] == "ok"
    peak = stories.peak_rss_bytes()
    assert peak <= budget_mib << 20, f"peak RSS {peak / 2**20:.1f} MiB > {budget_mib} MiB\n{stories.stderr()}"
    print(f"peak RSS {peak / 2**20:.1f} MiB, budget {budget_mib} MiB")


def test_a_taken_port_is_one_line_before_the_model_loads():
    import socket
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "serve", "-m", str(STORIES), "--port", str(port)],
                           capture_output=True, timeout=120, cwd=REPO)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1 and len(err) == 1 and err[0].startswith(f"error: cannot listen on 127.0.0.1:{port}"), err


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=8),
       stops=st.lists(st.text("abc", max_size=4), max_size=3))
def test_stop_strings_against_str_find(text, cuts, stops):
    """Any text in any pieces: what StopStrings lets through, flushed, is the text before the stop string that ends
    first (of two ending together, the longer one)."""
    from storage.tokenizer import StopStrings
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    cut = StopStrings(stops)
    shown = ""
    for a, b in zip(bounds, bounds[1:]):
        shown += cut.push(text[a:b])
        if cut.stopped:
            break
    shown += cut.flush()
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
    assert shown == (text[:min(hits)[1]] if hits else text)
    assert cut.stopped == bool(hits) or len(bounds) == 1


def test_refused_prompts_stay_within_the_budget(stories, budget_mib):
    """4 concurrent 2 MB prompts (over a 256-token context) are refused from their Content-Length, before their bytes
    are held or tokenized; one just under the body limit, from its size, before it is tokenized. Peak RSS (VmHWM)
    stays within --dram-budget, and every answer is a 4xx."""
    random.seed(0)
    words = "the cat sat on a mat and then ran away".split()
    text = " ".join(random.choice(words) for _ in range(500000))[:2_000_000]

    def send(body: bytes) -> tuple[int, dict]:
        c = http.client.HTTPConnection("127.0.0.1", stories.port, timeout=300)
        try:
            c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, json.loads(r.read())
        finally:
            c.close()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, [json.dumps({"prompt": text, "max_tokens": 2}).encode()] * 4))
    peak = stories.peak_rss_bytes()
    assert peak <= budget_mib << 20, f"peak RSS {peak / 2**20:.1f} MiB > {budget_mib} MiB"
    assert all(status == 413 for status, _ in answers), answers
    limit = int(re.search(r"over (\d+) bytes", answers[0][1]["error"]["message"]).group(1))
    status, doc = send(json.dumps({"prompt": text[:limit - 100], "max_tokens": 2}).encode())
    assert status == 400 and doc["error"]["code"] == "context_length_exceeded", doc
    peak = stories.peak_rss_bytes()
    assert peak <= budget_mib << 20, f"peak RSS {peak / 2**20:.1f} MiB > {budget_mib} MiB"
    print(f"peak RSS {peak / 2**20:.1f} MiB, budget {budget_mib} MiB")


def test_a_cross_origin_page_cannot_drive_the_server(stories):
    """What a hostile page's browser sends: a "simple" text/plain POST from its origin (CSRF), and a JSON POST under
    its own host name (DNS rebinding). Neither generates; the same request from this machine's names does."""
    body = json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
    host = f"127.0.0.1:{stories.port}"
    before = stories.health()["tokens_predicted_total"]
    status, headers, _ = stories.call("POST", "/v1/completions", body, {
        "Content-Type": "text/plain", "Origin": "http://evil.example", "Host": "evil.example:80"})
    assert status == 403 and "access-control-allow-origin" not in headers
    status, _, _ = stories.call("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                                   "Origin": "http://evil.example",
                                                                   "Host": f"evil.example:{stories.port}"})
    assert status == 403
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, _, answer = stories.call("POST", "/v1/completions", body, {
            "Content-Type": content_type, "Origin": "http://evil.example", "Host": host})
        assert status == 415 and json.loads(answer)["error"]["message"], (content_type, answer)
    status, headers, _ = stories.call("OPTIONS", "/v1/completions", None, {    # a preflight: no CORS by default
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST", "Host": host})
    assert "access-control-allow-origin" not in headers
    assert stories.health()["tokens_predicted_total"] == before   # none of them generated
    for name in (host, f"localhost:{stories.port}", "localhost", f"[::1]:{stories.port}"):
        status, _, answer = stories.call("POST", "/v1/completions", body,
                                         {"Content-Type": "application/json; charset=utf-8", "Host": name})
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 2, (name, answer)


def test_a_client_gone_mid_body_leaves_no_traceback(stories):
    """Clients that hang up while sending their body: no ClientDisconnect traceback per connection in the log."""
    before = len(stories.stderr())
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", stories.port), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    for _ in range(3):   # the server went through those hang-ups before it answered these
        assert stories.health()["status"] == "ok"
    assert stories.client.completions.create(model="any", prompt="Once", max_tokens=2).usage.completion_tokens == 2
    log = stories.stderr()[before:]
    assert "Traceback" not in log and "ClientDisconnect" not in log, log


def test_cors_api_key_allowed_hosts_and_the_body_timeout():
    """--cors ORIGIN answers that origin's preflight and marks its answers, no other origin's; --api-key refuses a
    missing or wrong key (GET /health stays open); --allow-host adds a proxy's name; --timeout bounds a slow body."""
    app, key = "http://app.example:3000", "s3cret-key"
    with serving("-m", str(STORIES), "--ffn", "dense", "-c", "256", "--cors", app, "--api-key", key,
                 "--allow-host", "proxy.example", "--timeout", "1") as s:
        host = {"Host": f"127.0.0.1:{s.port}"}
        assert s.call("GET", "/health", None, host)[0] == 200
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}, {"Authorization": "Bearer "}):
            status, _, answer = s.call("GET", "/v1/models", None, {**host, **auth})
            assert status == 401 and json.loads(answer)["error"]["code"] == "invalid_api_key", (auth, answer)
        with pytest.raises(openai.AuthenticationError):
            s.client.models.list()
        good = {**host, "Authorization": f"Bearer {key}"}
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
        assert [m.id for m in client.models.list()] == ["stories260K"]
        assert s.call("GET", "/v1/models", None, {**good, "Host": "proxy.example"})[0] == 200
        assert s.call("GET", "/v1/models", None, {**good, "Host": "evil.example"})[0] == 403

        ask = {"Origin": app, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, _ = s.call("OPTIONS", "/v1/completions", None, {**host, **ask})
        assert status == 200 and headers["access-control-allow-origin"] == app
        assert "authorization" in headers["access-control-allow-headers"].lower()
        _, headers, _ = s.call("OPTIONS", "/v1/completions", None, {**host, **ask, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in headers
        body = json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
        status, headers, _ = s.call("POST", "/v1/completions", body, {**good, "Origin": app,
                                                                       "Content-Type": "application/json"})
        assert status == 200 and headers["access-control-allow-origin"] == app
        _, headers, _ = s.call("POST", "/v1/completions", body, {**good, "Origin": "http://evil.example",
                                                                  "Content-Type": "application/json"})
        assert "access-control-allow-origin" not in headers

        # a body that never arrives in full: answered 408 (the status line, read as it comes) instead of held open
        assert s.raw_status(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                            b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: 100\r\n\r\n{") == 408
        assert "Traceback" not in s.stderr()


def test_sigterm_ends_streams_with_an_error_event_and_done():
    """SIGTERM while one stream generates and others wait: every stream ends with an event (its finish, or the error
    of the server shutting down) and `data: [DONE]`; a waiting whole answer is JSON (503 or, had it run, 200)."""
    with serving("-m", str(STORIES), "--ffn", "dense", "-c", "512", "--ignore-eos") as s:
        def request(stream: bool) -> http.client.HTTPConnection:
            c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
            c.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 500,
                                                             "stream": stream}).encode(),
                      {"Content-Type": "application/json"})
            return c

        first = request(True).getresponse()
        assert first.status == 200 and first.readline().startswith(b"data: ")   # generating
        whole = request(False)                                     # waits for the model (its answer comes at the end)
        queued = [request(True).getresponse() for _ in range(2)]   # their 200 is out: waiting for the model
        s.proc.send_signal(signal.SIGTERM)
        errors = 0
        for r in [first, *queued]:
            events = [line[6:].strip() for line in r.read().splitlines() if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]", events[-3:]
            last = json.loads(events[-2])
            if "error" in last:
                assert "shutting down" in last["error"]["message"], last
                errors += 1
            else:
                assert last["choices"][0]["finish_reason"] == "length", last
        assert errors >= 1   # the last queued stream cannot have run its 500 tokens before the signal
        answer = whole.getresponse()
        doc = json.loads(answer.read())
        assert (answer.status, "shutting down" in str(doc)) in ((503, True), (200, False)), (answer.status, doc)
        s.proc.wait(60)
        assert "Traceback" not in s.stderr()


@pytest.mark.parametrize("flag", [["--cors", "app.example"], ["--cors", "http://app.example/path"], ["--api-key", ""],
                                  ["--api-key", "two words"], ["--timeout", "0"], ["--timeout", "nan"]])
def test_bad_server_flags_are_one_line_before_the_model_loads(flag):
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "serve", "-m", str(STORIES), "--port", "0", *flag],
                       capture_output=True, timeout=120, cwd=REPO)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1 and len(err) == 1 and err[0].startswith(f"error: {flag[0]}"), err


# ----------------------------------------------------------------------------------------------------------------------
# logprobs, penalties, n, echo: against the model's own logits, computed here in float64 from a direct forward pass

@pytest.fixture(scope="module")
def smollm2_model(smollm2_gguf):
    """The served model in this process, every weight in DRAM as the server holds it (--ffn dense)."""
    from flashinfer_lite.runtime import load
    return load(str(smollm2_gguf), ffn="dense", say=False)


def fresh(served) -> None:
    """Leave the server's KV cache holding a text no prompt here starts with, so that the next prompt is evaluated
    in one pass, as the oracle evaluates it (a prompt's last token evaluated alone, after a cached prefix, gives
    logits slightly other than a batch's: a near tie can go the other way)."""
    served.client.completions.create(model="any", prompt="Zebra", max_tokens=1)


def float64_log_softmax(logits):
    import numpy as np
    z = np.asarray(logits, np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def oracle_steps(model, ids, n, penalty=lambda logits, out: logits, stop=()):
    """(token, float64 log-softmax of the raw logits) for n greedy steps after ids (or up to a token of stop): a
    prompt pass, then a token at a time, the token the argmax of penalty(logits, output so far)."""
    import numpy as np
    tr = model.transformer
    kv = tr.new_cache(len(ids) + n + 1)
    logits, out, steps = tr.forward(ids, kv), [], []
    for _ in range(n):
        lp = float64_log_softmax(logits)
        tok = int(np.argmax(penalty(np.asarray(logits, np.float64), out)))
        if tok in stop:
            break
        steps.append((tok, lp))
        out.append(tok)
        logits = tr.forward([tok], kv)
    return steps


def test_chat_logprobs_are_the_log_softmax_of_the_model_logits(smollm2, smollm2_model):
    """Each token's logprob, and its top 5, equal float64 log-softmax of the logits a direct forward pass gives
    (within 1e-4); the top alternative is the greedy token; streamed, the same entries."""
    import numpy as np
    model, tok = smollm2_model
    msgs = [{"role": "user", "content": "Name three colors."}]
    kw = dict(model="any", messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    fresh(smollm2)
    r = smollm2.client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    steps = oracle_steps(model, tok.encode_chat(msgs), 12, stop=tok.eos_ids)
    assert len(content) == r.usage.completion_tokens == len(steps) > 5
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e, (want, lp) in zip(content, steps):
        assert bytes(e.bytes) == tok.token_bytes(want)
        assert abs(e.logprob - lp[want]) < 1e-4, (e.logprob, lp[want])
        assert bytes(e.top_logprobs[0].bytes) == bytes(e.bytes)             # the top alternative is the greedy token
        top = np.argsort(-lp, kind="stable")[:5]
        assert [bytes(t.bytes) for t in e.top_logprobs] == [tok.token_bytes(i) for i in top]
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], lp[top], atol=1e-4)
    fresh(smollm2)
    streamed = [c.choices[0].logprobs.content for c in smollm2.client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs]
    entries = [e for part in streamed for e in part]
    assert [(e.token, e.bytes) for e in entries] == [(e.token, e.bytes) for e in content]
    np.testing.assert_allclose([e.logprob for e in entries], [e.logprob for e in content], atol=1e-5)


def test_completions_logprobs_in_the_legacy_shape(smollm2, smollm2_model):
    import numpy as np
    model, tok = smollm2_model
    prompt = "The capital of France is"
    fresh(smollm2)
    r = smollm2.client.completions.create(model="any", prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == r.usage.completion_tokens == 8
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(8)]
    for i, (want, ref) in enumerate(oracle_steps(model, tok.encode(prompt), 8)):
        assert abs(lp.token_logprobs[i] - ref[want]) < 1e-4
        assert len(lp.top_logprobs[i]) == 3 and max(lp.top_logprobs[i].values()) == lp.token_logprobs[i]
        np.testing.assert_allclose(sorted(lp.top_logprobs[i].values(), reverse=True),
                                   np.sort(ref)[::-1][:3], atol=1e-4)


def test_penalties_change_the_choice_as_openai_defines_them(smollm2, smollm2_model):
    """Greedy with frequency and presence penalties: each token is the argmax of logit - count * frequency -
    (count > 0) * presence, count its occurrences in the output so far (float64, from a direct forward pass); the
    penalties change the answer (SmolLM2 repeats itself here)."""
    import numpy as np
    model, tok = smollm2_model
    prompt, n = "List: apple, apple, apple, apple,", 16
    ids = tok.encode(prompt)

    def penalized(frequency, presence):
        def penalty(logits, out):
            counts = np.bincount(np.asarray(out, np.int64), minlength=len(logits)).astype(np.float64)
            return logits - counts * frequency - (counts > 0) * presence
        return tok.decode([t for t, _ in oracle_steps(model, ids, n, penalty, tok.eos_ids)])
    fresh(smollm2)
    plain = smollm2.client.completions.create(model="any", prompt=prompt, max_tokens=n, temperature=0)
    assert plain.choices[0].text == penalized(0, 0)
    for frequency, presence in ((1.5, 0.0), (0.0, 2.0), (0.8, -0.5)):
        fresh(smollm2)
        r = smollm2.client.completions.create(model="any", prompt=prompt, max_tokens=n, temperature=0,
                                              frequency_penalty=frequency, presence_penalty=presence)
        assert r.choices[0].text == penalized(frequency, presence), (frequency, presence)
        if presence >= 0:
            assert r.choices[0].text != plain.choices[0].text
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("presence_penalty", "1")):
        status, doc = smollm2.post("/v1/completions", json.dumps({"prompt": "Hi", field: value}).encode())
        assert status == 400 and doc["error"]["param"] == field, doc


def test_n_choices_and_echo(smollm2):
    """n choices of one prompt: indexed, usage summed, each seeded draw its own (seed + index), greedy ones equal;
    streamed, the same texts under their indexes. echo puts the prompt before the text, streamed first."""
    kw = dict(model="any", prompt="Once upon a time", max_tokens=8)
    fresh(smollm2)
    greedy = smollm2.client.completions.create(**kw, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == sum(8 for _ in greedy.choices)
    drawn = smollm2.client.completions.create(**kw, temperature=1.5, seed=7, n=3)
    assert len({c.text for c in drawn.choices}) > 1
    again = smollm2.client.completions.create(**kw, temperature=1.5, seed=7, n=3)
    assert [c.text for c in again.choices] == [c.text for c in drawn.choices]
    fresh(smollm2)
    chunks = list(smollm2.client.completions.create(**kw, temperature=0, n=2, stream=True))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == greedy.choices[0].text
    chat = smollm2.client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    fresh(smollm2)
    echoed = smollm2.client.completions.create(**kw, temperature=0, echo=True)
    assert echoed.choices[0].text == kw["prompt"] + greedy.choices[0].text
    first = next(iter(smollm2.client.completions.create(**kw, temperature=0, echo=True, stream=True)))
    assert first.choices[0].text == kw["prompt"]
    for body in ({"n": 0}, {"n": 17}, {"n": 1.5}, {"echo": "yes"}, {"echo": True, "logprobs": 1}, {"logprobs": 21},
                 {"logprobs": True}):
        status, doc = smollm2.post("/v1/completions", json.dumps({"prompt": "Hi", **body}).encode())
        assert status == 400 and doc["error"]["param"] == next(iter(body)), (body, doc)
    for body in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": 1}):
        status, doc = smollm2.post("/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}], **body}).encode())
        assert status == 400 and doc["error"]["param"] in body, (body, doc)


# ----------------------------------------------------------------------------------------------------------------------
# Operations: the API key from the environment, --alias, /metrics, a log line per request

def prometheus(text: str) -> dict:
    """{(name, labels): value} of Prometheus' text format; every sample line checked against its grammar."""
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]\w*="[^"]*",?)*\})? (\S+)', line)
        assert m, line
        assert m.group(1) in types, f"{m.group(1)} has no # TYPE"
        samples[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return samples


def test_api_key_from_the_environment_alias_metrics_and_the_request_log():
    key = "k-" + os.urandom(8).hex()
    with serving("-m", str(STORIES), "--ffn", "dense", "-c", "256", "--alias", "my-model",
                 env={"FLASHINFER_LITE_API_KEY": key}) as s:
        for client_key in ("unused", key[:-1] + "x"):
            with pytest.raises(openai.AuthenticationError) as e:
                openai.OpenAI(base_url=s.url + "/v1", api_key=client_key, max_retries=0).models.list()
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert s.call("GET", "/metrics", None, {"Host": "localhost"})[0] == 401
        assert s.health()["status"] == "ok"                     # /health stays open
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["my-model"]
        auth = {"Host": "localhost", "Authorization": f"Bearer {key}"}

        def metrics() -> dict:
            status, headers, body = s.call("GET", "/metrics", None, auth)
            assert status == 200 and headers["content-type"].startswith("text/plain"), status
            return prometheus(body.decode())
        before = metrics()
        r = client.completions.create(model="x", prompt="Once upon a time", max_tokens=7, temperature=0)
        assert r.model == "my-model"
        streamed = list(client.completions.create(model="x", prompt="The dog", max_tokens=5, stream=True,
                                                  stream_options={"include_usage": True}))
        after = metrics()
        used = [r.usage, streamed[-1].usage]
        moved = {name: after[(f"flashinfer_lite_{name}", "")] - before[(f"flashinfer_lite_{name}", "")]
                 for name in ("prompt_tokens_total", "tokens_predicted_total")}
        assert moved["prompt_tokens_total"] == sum(u.prompt_tokens for u in used)
        assert moved["tokens_predicted_total"] == sum(u.completion_tokens for u in used) == 12
        assert after[("flashinfer_lite_requests_total", '{status="401"}')] == 3
        assert after[("flashinfer_lite_requests_total", '{status="200"}')] >= 4
        assert after[("flashinfer_lite_rss_bytes", "")] > 10 << 20
        assert after[("flashinfer_lite_peak_rss_bytes", "")] >= after[("flashinfer_lite_rss_bytes", "")]
        assert after[("flashinfer_lite_requests_waiting", "")] == 0
        log = s.stderr()
        lines = re.findall(r"^POST /v1/completions 200 (\d+)\+(\d+) tokens \d+ ms$", log, re.M)
        assert [tuple(map(int, t)) for t in lines] == [(u.prompt_tokens, u.completion_tokens) for u in used], log
        assert re.search(r"^GET /v1/models 401 - tokens \d+ ms$", log, re.M), log


def test_metrics_of_a_model_on_flash_count_its_reads_and_budget(stories, budget_mib):
    """The stories server runs its FFN from flash under --dram-budget: /metrics says the budget and counts the rows
    read from flash (stories260K's all fit the neuron cache after the first tokens: the count then stays), and the
    peak RSS stays within the budget."""
    def metrics() -> dict:
        status, _, body = stories.call("GET", "/metrics", None, {"Host": "localhost"})
        assert status == 200
        return prometheus(body.decode())
    before = metrics()
    assert before[("flashinfer_lite_dram_budget_bytes", "")] == budget_mib << 20
    stories.client.completions.create(model="any", prompt="Zoe and Max found a shell", max_tokens=24)
    after = metrics()
    read = ("flashinfer_lite_flash_read_bytes_total", "")
    assert after[read] >= before[read] > 0
    assert after[("flashinfer_lite_peak_rss_bytes", "")] <= budget_mib << 20
