"""The Python API in mlx-lm's shape: load() returns (model, tokenizer); generate() returns text; stream_generate()
yields one response per token; make_prompt_cache() keeps a KV cache across calls. load is runtime.load, the one the
commands call too (quiet unless verbose), and the rest runs the same code as `flashinfer-lite generate`
(Session.generate, Sampler, StreamDecoder): one decode loop for the CLI, the API and `flashinfer-lite serve`."""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from storage.errors import UserError
from storage.tokenizer import StreamDecoder, Tokenizer, check_utf8

from .constrain import Constraint, json_schema_grammar, text_grammar
from .generate import ContextFull, Sampler, Session, Timings, log_softmax, prompt_ids
from .kv_pages import KVOptions
from .process import peak_rss_bytes
from . import runtime
from .runtime import Model


def load(path=None, dram_budget="auto", ffn: str = "auto", ctx: int = 0, threads: int | None = None,
         lookahead: bool = False, verbose: bool = False, prompt_pruning: float = 0.0, **kwargs):
    """(model, tokenizer): runtime.load (the commands' loader), which prints nothing unless verbose: then its
    decisions (the FFN mode chosen, the budget split) go to stderr as the commands print them. prompt_pruning: the
    CLI's --prompt-pruning RATIO (pruning.py; 0: off), checked before the model loads."""
    if prompt_pruning:
        if not isinstance(prompt_pruning, numbers.Real) or isinstance(prompt_pruning, bool):
            raise UserError(f"prompt_pruning {prompt_pruning!r}: a share of the prompt's tokens such as 0.5")
        kwargs["kv"] = replace(kwargs.get("kv") or KVOptions(), prompt_pruning=float(prompt_pruning))
    return runtime.load(path, dram_budget, ffn, ctx, threads, lookahead, verbose, say=verbose, **kwargs)


@dataclass
class GenerationResponse:
    """One step of stream_generate: the new text piece (may be "" while a character's bytes are incomplete).

    The last response says why the output ended (finish_reason): "length" on the token that reached max_tokens or
    filled the context; "stop" when the model ended it, on a response of its own after the last token (as mlx-lm's:
    token is the end-of-sequence id, text "", generation_tokens unchanged). Every other response: None."""
    text: str
    token: int
    prompt_tokens: int       # prompt tokens evaluated (not those whose KV a prompt_cache already held)
    prompt_tps: float        # prompt tokens per second
    generation_tokens: int   # tokens of the output so far, this one included
    generation_tps: float    # decode tokens per second so far (forward passes after the prompt)
    token_ms: float          # this token's forward pass; 0 for the first (it came from the prompt's pass)
    peak_memory_mb: float    # the process's peak RSS
    finish_reason: str | None = None
    # with logprobs=True: log-softmax [V] of the model's logits this token was drawn from, before the sampling
    # chain (penalties, top-k/p, min-p, temperature), float32
    logprobs: np.ndarray | None = None


def make_prompt_cache(model: Model, tokenizer: Tokenizer) -> Session:
    """A KV cache kept across stream_generate calls (mlx-lm's make_prompt_cache): a call whose prompt extends the last
    call's prompt and output evaluates only what it adds, as `flashinfer-lite chat` does between turns."""
    return Session(model.transformer, tokenizer, model.ctx)


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[int] | list[dict], system_prompt: str | None = None,
                  use_chat_template: bool = True) -> tuple[list[int], bool]:
    """(ids, raw) for a prompt: a str gets the chat template when the model has one (as the CLI does), unless
    use_chat_template is False or the str is templated already (it starts with the template's own opening,
    Tokenizer.template_opening: apply_chat_template's output, as mlx-lm's users pass it); a list of
    {"role", "content"} messages always gets it, a list of ids is fed as is. raw: the output continues the prompt's
    text, so its first piece is decoded after the prompt's last ids (keeping a SentencePiece leading space)."""
    if isinstance(prompt, str):
        check_utf8(prompt, "prompt")
        if use_chat_template and tokenizer.chat_template and tokenizer.is_templated(prompt):
            return tokenizer.encode(prompt, add_special_tokens=False), False   # it spells BOS where the model wants
        return prompt_ids(tokenizer, prompt, system_prompt, use_chat_template), \
            not (use_chat_template and tokenizer.chat_template)
    if isinstance(prompt, (bytes, bytearray, memoryview)):    # iterating bytes gives ints: not token ids
        raise UserError("prompt is bytes: pass text as a str (decode it) or token ids as a list of ints")
    if prompt and all(isinstance(m, dict) for m in prompt):
        return tokenizer.encode_chat(list(prompt)), False
    ids = list(prompt)
    n = tokenizer.vocab_size
    bad = next((i for i in ids if not isinstance(i, numbers.Integral) or isinstance(i, bool) or not 0 <= i < n), None)
    if bad is not None:
        raise UserError(f"prompt token id {bad!r} is not an id of this vocabulary (0 to {n - 1})")
    return [int(i) for i in ids], True


def stream_generate(model: Model, tokenizer: Tokenizer, prompt: str | list[int] | list[dict], max_tokens: int = 256,
                    temp: float = 0.0, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, seed: int = -1,
                    repeat_penalty: float = 1.0, repeat_last_n: int = 64, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0, system_prompt: str | None = None, use_chat_template: bool = True,
                    ignore_eos: bool = False, prompt_cache: Session | None = None, logprobs: bool = False,
                    logits_processors=None, json_schema: dict | str | None = None,
                    grammar: str | None = None) -> Iterator[GenerationResponse]:
    """Yield a GenerationResponse per sampled token (encode_prompt says how the prompt is read), the last with its
    finish_reason. temp 0 = greedy (mlx-lm's default). prompt_cache (make_prompt_cache): reuse its KV cache; its
    timings are this call's. logprobs: each response carries the log-softmax of the logits its token came from.
    logits_processors: callables (history ids, logits) -> logits, as mlx-lm's, run after the penalties and before
    top-k/top-p/min-p/temperature. json_schema (a dict or its JSON text) or grammar (GBNF or Lark text): the output is
    held to it (llguidance's masks, one more processor) and ends where it is complete."""
    sampler = Sampler(temp, top_k, top_p, seed, min_p, repeat_penalty, repeat_last_n,   # checks them, first
                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
    processors = list(logits_processors or [])
    if json_schema is not None or grammar is not None:
        if json_schema is not None and grammar is not None:
            raise UserError("give one constraint: json_schema or grammar, not both")
        rules = json_schema_grammar(json_schema) if json_schema is not None else text_grammar(grammar)
        processors.append(Constraint(tokenizer, rules, model.transformer.cfg.vocab_size))
    ids, raw = encode_prompt(tokenizer, prompt, system_prompt, use_chat_template)
    session = prompt_cache or Session(model.transformer, tokenizer, model.ctx)
    session.timings = Timings()
    stream = StreamDecoder(tokenizer, ids[-StreamDecoder.CONTEXT_IDS:] if raw else [])
    t = session.timings
    n = 0

    def response(text: str, tok: int, finish: str | None) -> GenerationResponse:
        decode_ms = sum(t.token_ms)
        return GenerationResponse(
            text=text, token=tok, prompt_tokens=t.prompt_tokens,
            prompt_tps=t.prompt_tokens / t.prompt_ms * 1e3 if t.prompt_ms else 0.0, generation_tokens=n,
            generation_tps=len(t.token_ms) / decode_ms * 1e3 if decode_ms else 0.0,
            token_ms=t.token_ms[-1] if t.token_ms else 0.0, peak_memory_mb=peak_rss_bytes() / 2**20,
            finish_reason=finish, logprobs=log_softmax(session.logits) if logprobs else None)
    steps = session.generate(ids, max_tokens, sampler, ignore_eos, processors)
    try:
        for tok in steps:
            n += 1
            # the generation ends after this token when it is the max_tokens-th or fills the context (ContextFull)
            full = n == max_tokens or session.kv.length >= session.ctx
            yield response(stream.push(tok), tok, "length" if full else None)
            if full:
                try:    # a grammar hears of the last token (it may be complete); nothing more is computed
                    next(steps, None)
                except ContextFull:
                    pass
                return
    finally:
        steps.close()
    # the model ended it (its end-of-sequence id), or the grammar did (complete: the end-of-sequence id is all it
    # would allow next)
    last = sampler.drawn[-1] if sampler.drawn else None
    eos = last in tokenizer.eos_ids
    if eos or (last is not None and any(hasattr(p, "done") for p in processors)):
        yield response("", last if eos else (tokenizer.eos_ids or [last])[0], "stop")


def generate(model: Model, tokenizer: Tokenizer, prompt: str | list[int] | list[dict], max_tokens: int = 256,
             verbose: bool = False, **kwargs) -> str:
    """The generated text (stream_generate's pieces joined). verbose: stream it to stdout and print timings."""
    pieces, last = [], None
    t0 = time.perf_counter()
    for last in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        pieces.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print(f"\nprompt: {last.prompt_tokens} tokens, {last.prompt_tps:.2f} tokens/s; generation: "
              f"{last.generation_tokens} tokens, {last.generation_tps:.2f} tokens/s; "
              f"{time.perf_counter() - t0:.2f} s; peak memory {last.peak_memory_mb:.1f} MiB")
    return "".join(pieces)
