"""`flashinfer-lite serve`: the OpenAI API over HTTP for one model, as llama-server and mlx_lm.server serve it.

POST /v1/chat/completions and /v1/completions (server-sent events with "stream": true), GET /v1/models, GET /health.
The runtime holds one sequence, so one request generates at a time and the others wait in arrival order; its KV
cache is kept, so a request whose prompt extends the last one's (the next turn of a conversation) evaluates only what
it adds. A client that disconnects stops its generation. Starlette and uvicorn (the `serve` extra) are imported only
when this command runs.

No web page can drive it: a browser's cross-site POST has to be a "simple" one (form or text/plain bodies), and every
POST here must be JSON; a DNS-rebinding page reaches it under its own host name, and the Host header must name this
server. CORS is off unless --cors names the one origin allowed; --api-key adds a bearer key.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import os
import re
import socket
import sys
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

from .api import encode_prompt, load, make_prompt_cache, stream_generate
from .default_model import FILENAME as DEFAULT_MODEL_FILE
from storage.errors import UserError
from .generate import (ContextFull, Sampler, SamplingError, add_model_arguments, check_arguments, kv_options_from,
                       rss_summary)
from storage.tokenizer import PromptTooLong, StopStrings

MAX_STOP_STRINGS = 16
JSON_ESCAPE = 6                # JSON spells a byte of text in at most 6 (\u001f)
BODY_FIELDS_BYTES = 64 << 10   # a body's room besides its text: the other fields, the JSON syntax, a chat's roles


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on, 0 = any free one (default 8080)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a host name the Host header may carry besides this machine's loopback names and --host "
                        "(a reverse proxy's; repeatable)")
    p.add_argument("--cors", metavar="ORIGIN", help="let web pages of this origin call the API (e.g. "
                                                    "http://localhost:3000); default: no cross-origin access")
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' (GET /health stays open)")
    p.add_argument("--timeout", type=float, default=60, metavar="SECONDS",
                   help="how long a client may take to send its request body (default 60)")


# ----------------------------------------------------------------------------------------------------------------------
# Requests: the OpenAI fields, checked; anything wrong is a BadRequest (an OpenAI-style error, 4xx)

class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Job:
    """One request's generation: the prompt (text, or chat messages), its ids, and how to sample."""
    prompt: str | list[dict]
    ids: list[int]
    max_tokens: int
    sampling: dict
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def number(body: dict, name: str, default, lo: float | None = None, hi: float | None = None, integer: bool = False):
    """body[name] as a checked int or float; null or absent = default."""
    v = body.get(name)
    if v is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or \
            (isinstance(v, float) and not math.isfinite(v)):
        raise BadRequest(f"'{name}' must be {kind}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise BadRequest(f"'{name}' must be {span}, got {v}", name)
    return v


def message_text(m, i: int) -> dict:
    """A chat message as the template takes it: {"role", "content"} with content a string (text parts joined)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"{where} must be an object with a string 'role'", where)
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise BadRequest(f"{where}.content: only text parts are supported", f"{where}.content")
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return {"role": m["role"], "content": content}


def parse_job(body, chat: bool, server: "Server") -> Job:
    """The Job a request body asks for, with the CLI's flags as the defaults (as llama-server does). Runs on the
    generation worker: one prompt is tokenized at a time, never beside a generation step."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    a = server.args
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        prompt = [message_text(m, i) for i, m in enumerate(messages)]
        if a.system_prompt and prompt[0]["role"] != "system":
            prompt.insert(0, {"role": "system", "content": a.system_prompt})
        if not server.tokenizer.chat_template:
            raise BadRequest("this model has no chat template: use /v1/completions", "messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string", "prompt")
    n = number(body, "n", 1, integer=True)
    if n != 1:
        raise BadRequest("only n = 1 is supported", "n")
    max_tokens = number(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                        a.n_predict if a.n_predict > 0 else server.ctx, lo=1, integer=True)
    sampling = dict(temp=number(body, "temperature", a.temp), top_p=number(body, "top_p", a.top_p),
                    top_k=number(body, "top_k", a.top_k, integer=True), min_p=number(body, "min_p", a.min_p),
                    repeat_penalty=number(body, "repeat_penalty", a.repeat_penalty),
                    seed=number(body, "seed", a.seed, integer=True), repeat_last_n=a.repeat_last_n)
    try:
        Sampler(**sampling)     # the CLI's and the API's check of the ranges
    except SamplingError as e:
        name = "temperature" if e.name == "temp" else e.name
        raise BadRequest(f"'{name}' must be {e.rule}, got {e.value}", name) from None
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    param = "messages" if chat else "prompt"
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in ([m["content"] for m in prompt] if chat else [prompt]))
    if size > server.max_prompt_bytes:   # checked before tokenizing: that takes ~130 bytes of memory a byte
        raise BadRequest(f"the prompt is {size} bytes, more than a context of {server.ctx} tokens holds "
                         f"({server.max_prompt_bytes})", param, code="context_length_exceeded")
    try:   # a long text is refused for the cost of its first pieces, before it is tokenized whole
        server.tokenizer.check_length("\n".join(m["content"] for m in prompt) if chat else prompt, server.ctx)
        ids, _ = encode_prompt(server.tokenizer, prompt, use_chat_template=False)
    except PromptTooLong as e:
        raise BadRequest(str(e), param, code="context_length_exceeded") from None
    except UserError as e:  # bad UTF-8 (a lone surrogate escape), a template that refuses the conversation
        raise BadRequest(str(e), param) from None
    if not ids:   # a model that adds no BOS, given no text: nothing to evaluate
        raise BadRequest("the prompt is empty", param)
    if len(ids) > server.ctx:
        raise BadRequest(f"the prompt is {len(ids)} tokens, more than the context of {server.ctx}",
                         param, code="context_length_exceeded")
    return Job(prompt, ids, max_tokens, sampling, stop, stream, options.get("include_usage") is True, chat)


# ----------------------------------------------------------------------------------------------------------------------
# Generation: one at a time, on one worker thread (so the event loop keeps answering), through the library

class ShuttingDown(Exception):
    """The server was told to stop (SIGTERM, Ctrl-C) while a request generated or waited for the model."""

    def __init__(self):
        super().__init__("the server is shutting down")


@dataclass
class Outcome:
    """How a generation ended: its finish reason, the tokens it sampled and llama-server's timings."""
    finish_reason: str
    completion_tokens: int
    timings: dict


class Server:
    def __init__(self, args):
        import numba
        self.args = args
        self.model, self.tokenizer = load(args.model, args.dram_budget, args.ffn, args.ctx_size, args.threads,
                                          args.lookahead, args.verbose, kv=kv_options_from(args))
        self.ctx = self.model.ctx
        self.name = Path(args.model).name if args.model else Path(DEFAULT_MODEL_FILE).stem
        self.cache = make_prompt_cache(self.model, self.tokenizer)
        # The most text a context holds: ctx tokens of the longest vocabulary entry in UTF-8 (byte-level and
        # SentencePiece vocabularies spell a byte of text in 2 or 3 bytes: slack that also covers NFC composing 3
        # bytes into 2). A body holds its text spelt in JSON, at most JSON_ESCAPE bytes a byte.
        longest = max(len(t.encode()) for t in self.tokenizer.tok.get_vocab(with_added_tokens=True))
        self.max_prompt_bytes = self.ctx * longest
        self.max_body_bytes = JSON_ESCAPE * self.max_prompt_bytes + BODY_FIELDS_BYTES
        self.stopping = False   # SIGTERM or Ctrl-C: a generation ends after its token, a waiting request at once
        self.tokens_predicted_total = 0   # llama-server's metric of that name: every token sampled, for /health
        self.lock = asyncio.Lock()   # FIFO: waiting requests get the model in arrival order
        # numba's thread count is per thread: the worker takes the one load() set here (-t)
        self.worker = ThreadPoolExecutor(1, "generate", initializer=numba.set_num_threads,
                                         initargs=(numba.get_num_threads(),))
        self.worker.submit(self.warm_up).result()

    def warm_up(self) -> None:
        """A two-token prompt and one decode step, as llama-server warms up: the kernels' first calls (compiling or
        loading them from numba's cache) are paid before the first request, not by it."""
        ids = self.tokenizer.encode("Hello there", add_special_tokens=True)[:2] or [0, 0]
        for _ in stream_generate(self.model, self.tokenizer, ids, 2, prompt_cache=self.cache, ignore_eos=True):
            pass
        self.cache.reset()

    async def on_worker(self, fn, *args):
        """fn(*args) on the generation worker, after what it was given before."""
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    async def generate(self, job: Job):
        """Yield the text pieces of job's output, stop strings cut out, then its Outcome. Closing this generator
        early (a client gone) stops the generation after the token being computed; a server stopping raises
        ShuttingDown after it."""
        async with self.lock:
            if self.stopping:
                raise ShuttingDown()
            loop = asyncio.get_running_loop()
            steps = stream_generate(self.model, self.tokenizer, job.prompt, job.max_tokens, use_chat_template=job.chat,
                                    prompt_cache=self.cache, ignore_eos=self.args.ignore_eos, **job.sampling)
            stops, n, finish = StopStrings(job.stop), 0, "stop"
            try:
                while not stops.stopped:
                    if self.stopping:
                        raise ShuttingDown()
                    try:
                        step = await loop.run_in_executor(self.worker, next, steps, None)
                    except ContextFull:
                        finish = "length"
                        break
                    if step is None:
                        break
                    n += 1
                    self.tokens_predicted_total += 1
                    if n == job.max_tokens:
                        finish = "length"
                    piece = stops.push(step.text)
                    if piece:
                        yield piece
            finally:
                # the worker runs one call at a time, in order: the close waits for a token still being computed,
                # and the next request's steps wait for the close
                self.worker.submit(steps.close)
            if stops.stopped:
                finish = "stop"
            tail = stops.flush()
            if tail:
                yield tail
            yield Outcome(finish, n, self.timings(job, n))

    def timings(self, job: Job, n: int) -> dict:
        """llama-server's `timings`; predicted_ms counts the forward passes after the prompt's."""
        t = self.cache.timings.as_dict()
        return {"cache_n": len(job.ids) - t["prompt_tokens"], "prompt_n": t["prompt_tokens"],
                "prompt_ms": t["prompt_ms"],
                "prompt_per_token_ms": round(t["prompt_ms"] / t["prompt_tokens"], 3) if t["prompt_tokens"] else 0,
                "prompt_per_second": t["prompt_tokens_per_second"], "predicted_n": n, "predicted_ms": t["eval_ms"],
                "predicted_per_token_ms": t["ms_per_token"], "predicted_per_second": t["tokens_per_second"]}


# ----------------------------------------------------------------------------------------------------------------------
# Responses in the OpenAI shapes

def usage(job: Job, out: Outcome) -> dict:
    return {"prompt_tokens": len(job.ids), "completion_tokens": out.completion_tokens,
            "total_tokens": len(job.ids) + out.completion_tokens}


def chunk(job: Job, server: Server, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
    """One streamed event: a text delta (or the first, with the role; or the last, with the finish reason)."""
    if job.chat:
        delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {"id": ("chatcmpl-" if job.chat else "cmpl-") + job.id, "created": job.created, "model": server.name,
            "object": "chat.completion.chunk" if job.chat else "text_completion", "choices": [choice]}


def whole(job: Job, server: Server, text: str, out: Outcome) -> dict:
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": out.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
    return {"id": ("chatcmpl-" if job.chat else "cmpl-") + job.id, "created": job.created, "model": server.name,
            "object": "chat.completion" if job.chat else "text_completion", "choices": [choice],
            "usage": usage(job, out), "timings": out.timings}


def sse(doc) -> str:
    return f"data: {doc if isinstance(doc, str) else json.dumps(doc, ensure_ascii=False)}\n\n"


async def events(job: Job, server: Server):
    """The server-sent events of a streamed response, ending with `data: [DONE]`."""
    async with aclosing(server.generate(job)) as pieces:
        try:
            if job.chat:
                yield sse(chunk(job, server, role=True))
            async for piece in pieces:
                if isinstance(piece, Outcome):
                    last = chunk(job, server, finish=piece.finish_reason)
                    last["timings"] = piece.timings
                    yield sse(last)
                    if job.include_usage:
                        yield sse({**chunk(job, server), "choices": [], "usage": usage(job, piece)})
                else:
                    yield sse(chunk(job, server, piece))
        except ShuttingDown as e:   # the status line has gone out: the error is the stream's last event
            yield sse(error_body(str(e), "server_error"))
        except Exception as e:
            traceback.print_exc()
            yield sse(error_body(f"generation failed: {e}", "server_error"))
    yield sse("[DONE]")


# ----------------------------------------------------------------------------------------------------------------------
# The app

async def read_body(request, server: Server) -> object:
    """The request's JSON: refused past the bytes a context's text needs (413, from Content-Length when it says so,
    before anything is held) and past --timeout seconds (408)."""
    limit = server.max_body_bytes

    def too_big():
        return BadRequest(f"the body is over {limit} bytes, more than a context of {server.ctx} tokens needs",
                          status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big()
    body = bytearray()

    async def receive():
        async for part in request.stream():
            body.extend(part)
            if len(body) > limit:
                raise too_big()
    try:
        await asyncio.wait_for(receive(), server.args.timeout)
    except asyncio.TimeoutError:
        raise BadRequest(f"the body did not arrive within {server.args.timeout:g} s", status=408) from None
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not valid UTF-8 (byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None


def host_name(host: str) -> str:
    """The name in a Host header: "[::1]:8080" -> "::1", "LocalHost.:80" -> "localhost"."""
    host = host.strip().lower()
    name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] if ":" in host else host
    return name.rstrip(".")


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def guarded(app, args):
    """app behind the checks that keep web pages out, in this order: the Host header names this server (403), CORS
    for --cors's origin alone, --api-key (401; GET /health stays open), a POST's body is JSON (415)."""
    from starlette.datastructures import Headers
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import JSONResponse

    # A DNS-rebinding page reaches us under its own host name; an IP address in Host is one the client dialled.
    names = {"localhost", args.host.lower().strip("[]"), *(host_name(n) for n in args.allow_host)}

    def host_refusal(headers, scope):
        host = headers.get("host")
        if host is not None and host_name(host) not in names and not is_ip(host_name(host)):
            return 403, f"Host {host!r} is not this server's name (a reverse proxy's: --allow-host NAME)", None, {}

    def request_refusal(headers, scope):
        if args.api_key and scope["path"] != "/health":
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), args.api_key.encode()):
                return 401, "a valid API key is needed: 'Authorization: Bearer KEY'", "invalid_api_key", \
                    {"WWW-Authenticate": "Bearer"}
        media = headers.get("content-type", "").partition(";")[0].strip().lower()
        if scope["method"] == "POST" and media != "application/json":
            # a browser sends a cross-site form or text/plain POST without asking (CORS preflights only JSON)
            return 415, f"the body must be JSON: Content-Type: application/json (got {media or 'none'!r})", None, {}

    def refusing(inner, refusal):
        async def asgi(scope, receive, send):
            if scope["type"] == "http":
                refused = refusal(Headers(scope=scope), scope)
                if refused:
                    status, message, code, headers = refused
                    answer = JSONResponse(error_body(message, "invalid_request_error", code=code), status, headers)
                    return await answer(scope, receive, send)
            await inner(scope, receive, send)
        return asgi

    inner = refusing(app, request_refusal)
    if args.cors:
        inner = CORSMiddleware(inner, allow_origins=[args.cors], allow_methods=["GET", "POST"],
                               allow_headers=["Authorization", "Content-Type"])
    return refusing(inner, host_refusal)


def make_app(server: Server):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    class EventStream(StreamingResponse):
        """Closes its events when the response ends however it ends, so a client gone mid-stream frees the model
        at once (Starlette cancels the sending, which can leave the generator suspended)."""

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()

    def error(e: BadRequest) -> JSONResponse:
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return JSONResponse(error_body(str(e), kind, e.param, e.code), status_code=e.status)

    async def completions(request, chat: bool):
        try:
            body = await read_body(request, server)
            job = await server.on_worker(parse_job, body, chat, server)
        except BadRequest as e:
            return error(e)
        except ClientDisconnect:   # gone while sending its body: no one to answer, nothing worth a log line
            return Response(status_code=499)
        if job.stream:
            return EventStream(events(job, server), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, out = [], None
        try:
            async with aclosing(server.generate(job)) as pieces:
                async for piece in pieces:
                    if isinstance(piece, Outcome):
                        out = piece
                    else:
                        text.append(piece)
                    if await request.is_disconnected():
                        return JSONResponse(error_body("client disconnected", "invalid_request_error"), 499)
        except ShuttingDown as e:
            return error(BadRequest(str(e), status=503))
        except Exception as e:
            traceback.print_exc()
            return error(BadRequest(f"generation failed: {e}", status=500))
        return JSONResponse(whole(job, server, "".join(text), out))

    async def chat_completions(request):
        return await completions(request, chat=True)

    async def text_completions(request):
        return await completions(request, chat=False)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": server.name, "object": "model", "created": 0,
                                                          "owned_by": "flashinfer-lite", "context_length": server.ctx}]})

    async def health(request):
        return JSONResponse({"status": "ok", "tokens_predicted_total": server.tokens_predicted_total,
                             **rss_summary(server.model.ffn)})

    async def http_error(request, exc: HTTPException):
        return error(BadRequest(str(exc.detail), status=exc.status_code))

    async def server_error(request, exc: Exception):
        return error(BadRequest(f"internal error: {exc}", status=500))

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", text_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
    return guarded(app, server.args)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so that a taken port is one line, not a wasted load."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}") from None


def check_server_arguments(args) -> None:
    """serve's own flags; generate's (sampling, -t, -c) are generate.check_arguments'."""
    if args.cors is not None:
        args.cors = args.cors.rstrip("/")
        if not re.fullmatch(r"https?://[^/\s]+", args.cors):
            raise UserError(f"--cors {args.cors!r} is not an origin: scheme://host[:port], as a browser sends it")
    if args.api_key is not None and (not args.api_key or not args.api_key.isprintable() or " " in args.api_key):
        raise UserError("--api-key must be a non-empty key of printable characters without spaces")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UserError(f"--timeout {args.timeout} is out of range: a number of seconds > 0")


def run(args) -> int:
    check_arguments(args)
    check_server_arguments(args)
    try:  # before the model loads, so that the budget's process base counts them
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise UserError("serve needs starlette and uvicorn: pip install 'flashinfer-lite[serve]'") from None

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):   # SIGTERM, Ctrl-C: streams end with an error event, waiting requests 503
            server.stopping = True
            super().handle_exit(sig, frame)
    sock = listen(args.host, args.port)
    with sock:
        server = Server(args)
        port = sock.getsockname()[1]    # --port 0: the one the system chose
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"serving {server.name} on http://{host}:{port}/v1 (context {server.ctx} tokens); Ctrl-C stops",
              file=sys.stderr, flush=True)
        try:
            config = uvicorn.Config(make_app(server), log_level="warning", timeout_graceful_shutdown=5)
            Uvicorn(config).run(sockets=[sock])
        finally:
            server.worker.shutdown(wait=True)
    return 0
