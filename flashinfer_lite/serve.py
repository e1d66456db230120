"""`flashinfer-lite serve`: the OpenAI API over HTTP for one model, as llama-server and mlx_lm.server serve it.

POST /v1/chat/completions and /v1/completions (server-sent events with "stream": true), GET /v1/models, GET /health,
GET /metrics (Prometheus' text format). Each request answered is one line on stderr.
By default one request generates at a time and the others wait in arrival order; --parallel N decodes up to N
together (generate.DecodeBatch: one pass over the weights for all their tokens, each with a KV cache of its own).
The KV caches are kept, so a request whose prompt extends an earlier one's (the next turn of a conversation)
evaluates only what it adds. A client that disconnects stops its generation. Starlette and uvicorn (the `serve` extra) are imported only
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

import numpy as np

from .api import encode_prompt, make_prompt_cache, stream_generate
from .constrain import Constraint, checked, json_schema_grammar
from .default_model import FILENAME as DEFAULT_MODEL_FILE
from storage.errors import UserError
from .generate import (DecodeBatch, Sampler, SamplingError, Session, add_model_arguments, check_arguments,
                       kv_options_from, rss_summary, streamed_head)
from .process import peak_rss_bytes, rss_bytes
from .runtime import load
from .tools import ToolError, ToolText, call_grammar, check_tool_choice, check_tools, template_message
from storage.tokenizer import PromptTooLong, StopStrings

MAX_STOP_STRINGS = 16
MAX_PARALLEL = 64             # --parallel: a batched step's rows stay far below a prompt chunk's (the budget's
                               # transients), each sequence a KV cache of its own
MAX_CHOICES = 16               # n: choices of one prompt, generated one after the other
MAX_TOP_LOGPROBS = 20          # OpenAI's bound of top_logprobs (the legacy completions' logprobs: 5)
API_KEY_ENV = "FLASHINFER_LITE_API_KEY"
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
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require 'Authorization: Bearer KEY' (GET /health stays open); default: ${API_KEY_ENV}")
    p.add_argument("--alias", metavar="NAME", help="the model's id in responses and /v1/models (default: its file "
                                                   "or directory name)")
    p.add_argument("--timeout", type=float, default=60, metavar="SECONDS",
                   help="how long a client may take to send its request body (default 60)")
    p.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                   help="sequences decoded together, each with a KV cache of its own that the budget counts: up to N "
                        "requests generate at once, their tokens through one pass over the weights (default 1)")


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
    grammar: str | None = None    # the output's grammar (response_format, a required tool call): llguidance's
    tools: list[str] | None = None   # the functions the answer may call (its tool calls are parsed out)
    logprobs: int | None = None   # the top alternatives to list beside each token's logprob; None: no logprobs
    echo: bool = False            # completions: the prompt's text before the output's
    n: int = 1                    # choices, generated one after the other (choice i samples with seed + i)
    cache_n: int = 0              # prompt tokens the first choice found in the KV cache
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
    try:
        return {"role": m["role"], "content": content, **template_message(m, where)}
    except ToolError as e:
        raise BadRequest(str(e), e.param) from None


def response_grammar(body: dict) -> str | None:
    """The grammar `response_format` asks for: {"type": "json_object"} any JSON object, {"type": "json_schema",
    "json_schema": {"schema": ...}} the schema's documents (held to it whether "strict" or not); "text" or none: None."""
    form = body.get("response_format")
    kind = form.get("type") if isinstance(form, dict) else None
    if form is None or kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    spec = form.get("json_schema") if kind == "json_schema" else None
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise BadRequest("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                         "response_format")
    return json_schema_grammar(spec.get("schema", {}))


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
    n = number(body, "n", 1, lo=1, hi=MAX_CHOICES, integer=True)
    if chat:
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise BadRequest("'logprobs' must be true or false", "logprobs")
        top = number(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
        if top is not None and not want:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs, echo = (top or 0) if want else None, False
    else:
        logprobs = number(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise BadRequest("'echo' must be true or false", "echo")
        if echo and logprobs is not None:
            # the prompt's logprobs take logits at every prompt position: [T, V] floats no budget planned for
            raise BadRequest("'echo' with 'logprobs' (the prompt's log probabilities) is not supported", "echo")
    max_tokens = number(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                        a.n_predict if a.n_predict > 0 else server.ctx, lo=1, integer=True)
    sampling = dict(temp=number(body, "temperature", a.temp), top_p=number(body, "top_p", a.top_p),
                    top_k=number(body, "top_k", a.top_k, integer=True), min_p=number(body, "min_p", a.min_p),
                    repeat_penalty=number(body, "repeat_penalty", a.repeat_penalty),
                    seed=number(body, "seed", a.seed, integer=True), repeat_last_n=a.repeat_last_n,
                    presence_penalty=number(body, "presence_penalty", a.presence_penalty),
                    frequency_penalty=number(body, "frequency_penalty", a.frequency_penalty))
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
    tools, choice = job_tools(body, chat, server)
    try:
        grammar = response_grammar(body)
        if choice not in ("auto", "none"):      # "required" or a named function: held to one call
            if grammar is not None:
                raise BadRequest("'response_format' and a required tool call cannot both hold the answer",
                                 "response_format")
            grammar = checked(call_grammar(server.tokenizer, tools, None if choice == "required" else choice))
    except UserError as e:   # llguidance missing, a schema it refuses
        raise BadRequest(str(e), "tool_choice" if choice not in ("auto", "none") else "response_format") from None
    param = "messages" if chat else "prompt"
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in ([m["content"] for m in prompt] if chat else [prompt]))
    if size > server.max_prompt_bytes:   # checked before tokenizing: that takes ~130 bytes of memory a byte
        raise BadRequest(f"the prompt is {size} bytes, more than a context of {server.ctx} tokens holds "
                         f"({server.max_prompt_bytes})", param, code="context_length_exceeded")
    try:   # a long text is refused for the cost of its first pieces, before it is tokenized whole
        server.tokenizer.check_length("\n".join(m["content"] for m in prompt) if chat else prompt, server.ctx)
        ids = server.tokenizer.encode_chat(prompt, tools=tools) if tools else \
            encode_prompt(server.tokenizer, prompt, use_chat_template=False)[0]
    except PromptTooLong as e:
        raise BadRequest(str(e), param, code="context_length_exceeded") from None
    except UserError as e:  # bad UTF-8 (a lone surrogate escape), a template that refuses the conversation
        raise BadRequest(str(e), param) from None
    if not ids:   # a model that adds no BOS, given no text: nothing to evaluate
        raise BadRequest("the prompt is empty", param)
    if len(ids) > server.ctx:
        raise BadRequest(f"the prompt is {len(ids)} tokens, more than the context of {server.ctx}",
                         param, code="context_length_exceeded")
    return Job(prompt, ids, max_tokens, sampling, stop, stream, options.get("include_usage") is True, chat,
               grammar, [t["function"]["name"] for t in tools] if tools and choice != "none" else None,
               logprobs, echo, n)


def job_tools(body: dict, chat: bool, server: "Server") -> tuple[list[dict] | None, str]:
    """(tools, tool_choice) of a request: tools the template renders, None without tools or with tool_choice "none"
    (the model is not told of them)."""
    tools = body.get("tools")
    if tools is None or not chat:
        if tools is not None:
            raise BadRequest("'tools' are for /v1/chat/completions", "tools")
        return None, "none"
    try:
        tools = check_tools(tools)
        choice = check_tool_choice(body.get("tool_choice"), tools)
    except ToolError as e:
        raise BadRequest(str(e), e.param) from None
    if not server.tokenizer.takes_tools:
        raise BadRequest("this model's chat template does not render tools: it cannot call them", "tools")
    return (None if choice == "none" else tools), choice


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
    tool_calls: list[dict] | None = None


class Logprobs(list):
    """Log probabilities of tokens sampled ({"id", "logprob", "top": [(id, logprob)], "offset": its text's}), yielded
    by Server.generate before the text they make."""


def next_step(steps, top: int | None):
    """(the next GenerationResponse or None, its token's logprob entry or None): on the worker, which alone touches
    the [V] log-softmax; top: how many alternatives to list (None: no logprobs)."""
    step = next(steps, None)
    if step is None or step.logprobs is None or step.finish_reason == "stop":
        return step, None
    lp, step.logprobs = step.logprobs, None
    best = np.argpartition(-lp, top)[:top] if 0 < top < len(lp) else np.arange(len(lp) if top else 0)
    best = best[np.argsort(-lp[best], kind="stable")]
    return step, {"id": step.token, "logprob": float(lp[step.token]), "top": [(int(i), float(lp[i])) for i in best]}


class Server:
    def __init__(self, args):
        import numba
        self.args = args
        self.model, self.tokenizer = load(args.model, args.dram_budget, args.ffn, args.ctx_size, args.threads,
                                          args.lookahead, args.verbose, kv=kv_options_from(args),
                                          parallel=args.parallel)
        self.ctx = self.model.ctx
        self.name = args.alias or (Path(args.model).name if args.model else Path(DEFAULT_MODEL_FILE).stem)
        # --parallel N: N sessions (a KV cache each) whose passes run together on the batch's thread; a request takes
        # a free one, the one whose cache holds the longest prefix of its prompt
        self.batch = DecodeBatch(self.model.transformer, numba.get_num_threads()) if args.parallel > 1 else None
        self.slots = [Session(self.model.transformer, self.tokenizer, self.ctx, batch=self.batch)
                      for _ in range(args.parallel)] if self.batch else [make_prompt_cache(self.model, self.tokenizer)]
        self.free = list(self.slots)
        self.room = asyncio.Semaphore(len(self.slots))   # FIFO: waiting requests get a session in arrival order
        # The most text a context holds: ctx tokens of the longest vocabulary entry in UTF-8 (byte-level and
        # SentencePiece vocabularies spell a byte of text in 2 or 3 bytes: slack that also covers NFC composing 3
        # bytes into 2). A body holds its text spelt in JSON, at most JSON_ESCAPE bytes a byte.
        longest = max(len(t.encode()) for t in self.tokenizer.tok.get_vocab(with_added_tokens=True))
        self.max_prompt_bytes = self.ctx * longest
        self.max_body_bytes = JSON_ESCAPE * self.max_prompt_bytes + BODY_FIELDS_BYTES
        self.stopping = False   # SIGTERM or Ctrl-C: a generation ends after its token, a waiting request at once
        self.tokens_predicted_total = 0   # llama-server's metric of that name: every token sampled, for /health
        self.prompt_tokens_total = 0      # the prompts' tokens (usage.prompt_tokens), cached or evaluated
        self.requests: dict[int, int] = {}   # HTTP status -> requests answered so (/metrics)
        self.waiting = 0                  # requests waiting for the model
        # numba's thread count is per thread: the worker takes the one load() set here (-t)
        self.worker = ThreadPoolExecutor(1, "generate", initializer=numba.set_num_threads,
                                         initargs=(numba.get_num_threads(),))
        # the sessions' generation loops (sampling, grammars, logprobs) with --parallel; one at a time on the
        # worker without
        self.steppers = ThreadPoolExecutor(len(self.slots), "sequence") if self.batch else self.worker
        if self.batch:
            list(self.steppers.map(self.warm_up, self.slots))
        else:
            self.worker.submit(self.warm_up, self.slots[0]).result()

    def warm_up(self, session) -> None:
        """A two-token prompt and one decode step, as llama-server warms up: the kernels' first calls (compiling or
        loading them from numba's cache) are paid before the first request, not by it (with --parallel, every
        session at once: the batched step's too)."""
        ids = self.tokenizer.encode("Hello there", add_special_tokens=True)[:2] or [0, 0]
        for _ in stream_generate(self.model, self.tokenizer, ids, 2, prompt_cache=session, ignore_eos=True):
            pass
        session.reset()

    def take_slot(self, ids: list[int]):
        """The free session whose cache holds the longest prefix of ids (a conversation's next turn finds its own)."""
        def shared(session) -> int:
            n = 0
            for a, b in zip(session.cached, ids):
                if a != b:
                    break
                n += 1
            return n
        best = max(self.free, key=shared)
        self.free.remove(best)
        return best

    async def on_worker(self, fn, *args):
        """fn(*args) on the generation worker, after what it was given before."""
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    async def generate(self, job: Job, choice: int = 0):
        """Yield the text pieces of job's output (its choice-th choice), stop strings cut out, then its Outcome; with
        logprobs, each token's Logprobs before its text. Closing this generator early (a client gone) stops the
        generation after the token being computed; a server stopping raises ShuttingDown after it."""
        self.waiting += 1
        try:
            await self.room.acquire()
        finally:
            self.waiting -= 1
        session, loop, closed = self.take_slot(job.ids), asyncio.get_running_loop(), None
        try:
            if self.stopping:
                raise ShuttingDown()
            if choice == 0:
                self.prompt_tokens_total += len(job.ids)
            sampling = dict(job.sampling)
            if choice:
                if sampling["seed"] >= 0:      # n choices of one seed: each its own draw, reproducibly
                    sampling["seed"] += choice
                # each choice evaluates the prompt as the first did (from the same cached prefix, the rest in one
                # pass): a prompt's last token evaluated alone gives slightly other logits than in a batch
                await loop.run_in_executor(self.steppers, session.reset, min(job.cache_n, len(session.cached)))
            # a grammar per choice: its matcher follows one output
            constraint = None if job.grammar is None else await loop.run_in_executor(self.worker, self.constraint, job)
            # with tools the prompt's ids were rendered with them: those are fed as they are
            steps = stream_generate(self.model, self.tokenizer, job.ids if job.tools else job.prompt, job.max_tokens,
                                    use_chat_template=job.chat, prompt_cache=session,
                                    ignore_eos=self.args.ignore_eos, logits_processors=constraint and [constraint],
                                    logprobs=job.logprobs is not None, **sampling)
            stops, n, finish, shown = StopStrings(job.stop), 0, "stop", 0
            calls = ToolText(job.tools) if job.tools else None
            try:
                while not stops.stopped:
                    if self.stopping:
                        raise ShuttingDown()
                    step, entry = await loop.run_in_executor(self.steppers, next_step, steps, job.logprobs)
                    if step is None or step.finish_reason == "stop":   # the end-of-sequence token: no text of its own
                        break
                    n += 1
                    self.tokens_predicted_total += 1
                    if step.finish_reason == "length":
                        finish = "length"
                    if entry is not None:
                        yield Logprobs([{**entry, "offset": shown}])
                    shown += len(step.text)
                    piece = stops.push(step.text)
                    if piece and calls:
                        piece = calls.push(piece)
                    if piece:
                        yield piece
            finally:
                # the session goes back to the free ones once its generation is closed (a token still being computed
                # is awaited there); without --parallel the worker runs one call at a time, in order, so the next
                # request's steps wait for the close anyway
                closed = self.steppers.submit(steps.close)
            if stops.stopped or (constraint is not None and constraint.matcher.is_stopped()):
                finish = "stop"     # a grammar complete at the last token allowed ends as it would before it
            tail, found = stops.flush(), None
            if calls:
                shown = calls.push(tail)
                rest, found = calls.finish()
                tail = shown + rest
                finish = "tool_calls" if found else finish
            if tail:
                yield tail
            out = Outcome(finish, n, self.timings(job, n, session), found or None)
            job.cache_n = out.timings["cache_n"]
            yield out
        finally:
            def release(_=None):
                self.free.append(session)
                self.room.release()
            if closed is None:
                release()
            else:
                closed.add_done_callback(lambda _: loop.call_soon_threadsafe(release))

    def constraint(self, job: Job):
        """job's grammar as a logits processor (the worker builds llguidance's vocabulary on first use)."""
        return Constraint(self.tokenizer, job.grammar, self.model.transformer.cfg.vocab_size)

    def timings(self, job: Job, n: int, session) -> dict:
        """llama-server's `timings`; predicted_ms counts the forward passes after the prompt's (with --parallel, the
        batched steps this sequence was in, waits for them included)."""
        t = session.timings.as_dict()
        return {"cache_n": len(job.ids) - t["prompt_tokens"], "prompt_n": t["prompt_tokens"],
                "prompt_ms": t["prompt_ms"],
                "prompt_per_token_ms": round(t["prompt_ms"] / t["prompt_tokens"], 3) if t["prompt_tokens"] else 0,
                "prompt_per_second": t["prompt_tokens_per_second"], "first_token_ms": t["first_token_ms"],
                "predicted_n": n, "predicted_ms": t["eval_ms"],
                "predicted_per_token_ms": t["ms_per_token"], "predicted_per_second": t["tokens_per_second"],
                **({"constrain_ms": t["constrain_ms"], "constrain_per_token_ms": t["constrain_ms_per_token"]}
                   if "constrain_ms" in t else {})}


# ----------------------------------------------------------------------------------------------------------------------
# Responses in the OpenAI shapes

def usage(job: Job, outs: list[Outcome]) -> dict:
    done = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": len(job.ids), "completion_tokens": done, "total_tokens": len(job.ids) + done}


def logprobs_doc(job: Job, server: Server, entries: list[dict]) -> dict | None:
    """OpenAI's logprobs of tokens: chat's {"content": [{token, logprob, bytes, top_logprobs}]}, the legacy
    completions' {tokens, token_logprobs, top_logprobs, text_offset}. A token's text is its bytes decoded, a piece of
    a character replaced by U+FFFD (its bytes say which)."""
    if job.logprobs is None or not entries:
        return None
    tok = server.tokenizer

    def text(i: int) -> str:
        return tok.token_bytes(i).decode("utf-8", "replace")
    if job.chat:
        def one(i: int, lp: float) -> dict:
            return {"token": text(i), "logprob": lp, "bytes": list(tok.token_bytes(i))}
        return {"content": [{**one(e["id"], e["logprob"]), "top_logprobs": [one(i, lp) for i, lp in e["top"]]}
                            for e in entries], "refusal": None}
    base = len(job.prompt) if job.echo else 0
    return {"tokens": [text(e["id"]) for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{text(i): lp for i, lp in e["top"]} for e in entries],
            "text_offset": [base + e["offset"] for e in entries]}


def chunk(job: Job, server: Server, text: str | None = None, finish: str | None = None, role: bool = False,
          index: int = 0, entries=(), tool_calls: list[dict] | None = None) -> dict:
    """One streamed event: a text delta (or the first, with the role; or the calls, whole; or the last, with the
    finish reason)."""
    logprobs = logprobs_doc(job, server, list(entries))
    if job.chat:
        delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
        if tool_calls:
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return {"id": ("chatcmpl-" if job.chat else "cmpl-") + job.id, "created": job.created, "model": server.name,
            "object": "chat.completion.chunk" if job.chat else "text_completion", "choices": [choice]}


def whole(job: Job, server: Server, answers: list[tuple[str, Outcome, list]]) -> dict:
    """The response to a request not streamed: answers are each choice's (text, Outcome, logprob entries)."""
    choices = []
    for i, (text, out, entries) in enumerate(answers):
        if job.chat:
            message = {"role": "assistant", "content": text or None if out.tool_calls else text}
            if out.tool_calls:
                message["tool_calls"] = out.tool_calls
            choices.append({"index": i, "message": message, "logprobs": logprobs_doc(job, server, entries),
                            "finish_reason": out.finish_reason})
        else:
            choices.append({"index": i, "text": job.prompt + text if job.echo else text,
                            "logprobs": logprobs_doc(job, server, entries), "finish_reason": out.finish_reason})
    return {"id": ("chatcmpl-" if job.chat else "cmpl-") + job.id, "created": job.created, "model": server.name,
            "object": "chat.completion" if job.chat else "text_completion", "choices": choices,
            "usage": usage(job, [out for _, out, _ in answers]), "timings": answers[-1][1].timings}


def sse(doc) -> str:
    return f"data: {doc if isinstance(doc, str) else json.dumps(doc, ensure_ascii=False)}\n\n"


async def events(job: Job, server: Server, state: dict):
    """The server-sent events of a streamed response, ending with `data: [DONE]`; state["usage"]: its usage."""
    outs = []
    try:
        for i in range(job.n):
            async with aclosing(server.generate(job, i)) as pieces:
                if job.chat:
                    yield sse(chunk(job, server, role=True, index=i))
                elif job.echo:
                    yield sse(chunk(job, server, job.prompt, index=i))
                pending = []
                async for piece in pieces:
                    if isinstance(piece, Logprobs):
                        pending += piece
                    elif isinstance(piece, Outcome):
                        outs.append(piece)
                        if piece.tool_calls:
                            yield sse(chunk(job, server, index=i, tool_calls=piece.tool_calls))
                        last = chunk(job, server, finish=piece.finish_reason, index=i, entries=pending)
                        last["timings"] = piece.timings
                        yield sse(last)
                    else:
                        yield sse(chunk(job, server, piece, index=i, entries=pending))
                        pending = []
        state["usage"] = usage(job, outs)
        if job.include_usage:
            yield sse({**chunk(job, server), "choices": [], "usage": state["usage"]})
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


def logged(app, server: Server):
    """app, each HTTP request counted by its status (/metrics) and logged in one line on stderr when answered:
    method, path, status, tokens (prompt + completion, from the usage the handler put in the scope's state), ms."""
    async def asgi(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        t0, state, status = time.perf_counter(), scope.setdefault("state", {}), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await app(scope, receive, sending)
        finally:
            server.requests[status[0]] = server.requests.get(status[0], 0) + 1
            u = state.get("usage")
            tokens = f"{u['prompt_tokens']}+{u['completion_tokens']} tokens" if u else "- tokens"
            print(f"{scope['method']} {scope['path']} {status[0]} {tokens} {(time.perf_counter() - t0) * 1e3:.0f} ms",
                  file=sys.stderr, flush=True)
    return asgi


def metrics_text(server: Server) -> str:
    """/metrics in Prometheus' text format (version 0.0.4)."""
    ffn, head = server.model.ffn, streamed_head(server.model.transformer)
    flash = (ffn.stats.read_bytes + ffn.stats.prefill_bytes_read if ffn is not None else 0) + \
        (head.stats.read_bytes if head is not None else 0)
    plan = getattr(ffn, "plan", None)
    rows = [("prompt_tokens_total", "counter", "prompt tokens of the requests (usage.prompt_tokens)",
             [("", server.prompt_tokens_total)]),
            ("tokens_predicted_total", "counter", "tokens generated", [("", server.tokens_predicted_total)]),
            ("requests_total", "counter", "HTTP requests answered, by status",
             [(f'{{status="{k}"}}', v) for k, v in sorted(server.requests.items())]),
            ("requests_waiting", "gauge", "requests waiting for the model (the queue)", [("", server.waiting)]),
            ("requests_processing", "gauge", "requests generating", [("", len(server.slots) - len(server.free))]),
            ("flash_read_bytes_total", "counter", "bytes of weights read from flash", [("", flash)]),
            ("rss_bytes", "gauge", "resident memory of the process", [("", rss_bytes())]),
            ("peak_rss_bytes", "gauge", "the kernel's high-water mark of the resident memory",
             [("", peak_rss_bytes())])]
    if server.batch is not None:
        rows.append(("batch_steps_total", "counter", "decode steps of --parallel, by the sequences each computed",
                     [(f'{{sequences="{k}"}}', v) for k, v in sorted(server.batch.steps.items())]))
    if plan is not None and plan.requested:
        rows.append(("dram_budget_bytes", "gauge", "--dram-budget", [("", plan.budget_bytes)]))
    lines = []
    for name, kind, help_, samples in rows:
        lines += [f"# HELP flashinfer_lite_{name} {help_}", f"# TYPE flashinfer_lite_{name} {kind}"]
        lines += [f"flashinfer_lite_{name}{labels} {value}" for labels, value in samples]
    return "\n".join(lines) + "\n"


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
            return EventStream(events(job, server, request.scope["state"]), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        answers = []
        try:
            for i in range(job.n):
                text, out, entries = [], None, []
                async with aclosing(server.generate(job, i)) as pieces:
                    async for piece in pieces:
                        if isinstance(piece, Outcome):
                            out = piece
                        elif isinstance(piece, Logprobs):
                            entries += piece
                        else:
                            text.append(piece)
                        if await request.is_disconnected():
                            return JSONResponse(error_body("client disconnected", "invalid_request_error"), 499)
                answers.append(("".join(text), out, entries))
        except ShuttingDown as e:
            return error(BadRequest(str(e), status=503))
        except Exception as e:
            traceback.print_exc()
            return error(BadRequest(f"generation failed: {e}", status=500))
        doc = whole(job, server, answers)
        request.scope["state"]["usage"] = doc["usage"]
        return JSONResponse(doc)

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

    async def metrics(request):
        return Response(metrics_text(server), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request, exc: HTTPException):
        return error(BadRequest(str(exc.detail), status=exc.status_code))

    async def server_error(request, exc: Exception):
        return error(BadRequest(f"internal error: {exc}", status=500))

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", text_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
    return logged(guarded(app, server.args), server)


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
    if not 1 <= args.parallel <= MAX_PARALLEL:
        raise UserError(f"--parallel {args.parallel} is out of range: 1 to {MAX_PARALLEL} sequences")


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
            server.steppers.shutdown(wait=True)
    return 0
