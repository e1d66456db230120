"""The Python API in mlx-lm's shape: load() returns (model, tokenizer); generate() returns text; stream_generate()
yields one response per token; make_prompt_cache() keeps a KV cache across calls. load is runtime.load, the one the
commands call too, and the rest runs the same code as `flashinfer-lite generate` (Session.generate, Sampler,
StreamDecoder): one decode loop for the CLI, the API and `flashinfer-lite serve`."""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass
from typing import Iterator

from storage.errors import UserError
from storage.tokenizer import StreamDecoder, Tokenizer, check_utf8

from .constrain import Constraint, json_schema_grammar, text_grammar
from .generate import Sampler, Session, Timings, prompt_ids
from .process import peak_rss_bytes
from .runtime import Model, load  # noqa: F401  (the library's entry: flashinfer_lite.load)


@dataclass
class GenerationResponse:
    """One step of stream_generate: the new text piece (may be "" while a character's bytes are incomplete)."""
    text: str
    token: int
    prompt_tokens: int       # prompt tokens evaluated (not those whose KV a prompt_cache already held)
    prompt_tps: float        # prompt tokens per second
    generation_tokens: int   # tokens sampled so far, this one included
    generation_tps: float    # decode tokens per second so far (forward passes after the prompt)
    token_ms: float          # this token's forward pass; 0 for the first (it came from the prompt's pass)
    peak_memory_mb: float    # the process's peak RSS


def make_prompt_cache(model: Model, tokenizer: Tokenizer) -> Session:
    """A KV cache kept across stream_generate calls (mlx-lm's make_prompt_cache): a call whose prompt extends the last
    call's prompt and output evaluates only what it adds, as `flashinfer-lite chat` does between turns."""
    return Session(model.transformer, tokenizer, model.ctx)


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[int] | list[dict], system_prompt: str | None = None,
                  use_chat_template: bool = True) -> tuple[list[int], bool]:
    """(ids, raw) for a prompt: a str gets the chat template when the model has one (as the CLI does), a list of
    {"role", "content"} messages always gets it, a list of ids is fed as is. raw: the output continues the prompt's
    text, so its first piece is decoded after the prompt's last ids (keeping a SentencePiece leading space)."""
    if isinstance(prompt, str):
        check_utf8(prompt, "prompt")
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
                    repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                    system_prompt: str | None = None, use_chat_template: bool = True,
                    ignore_eos: bool = False, prompt_cache: Session | None = None, logits_processors=None,
                    json_schema: dict | str | None = None, grammar: str | None = None) -> Iterator[GenerationResponse]:
    """Yield a GenerationResponse per sampled token (encode_prompt says how the prompt is read). temp 0 = greedy
    (mlx-lm's default). prompt_cache (make_prompt_cache): reuse its KV cache; its timings are this call's.
    logits_processors: callables (history ids, logits) -> logits, as mlx-lm's, run after the repetition penalty and
    before top-k/top-p/min-p/temperature. json_schema (a dict or its JSON text) or grammar (GBNF or Lark text): the
    output is held to it (llguidance's masks, one more processor) and ends where it is complete."""
    sampler = Sampler(temp, top_k, top_p, seed, min_p, repeat_penalty, repeat_last_n)   # checks them, first
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
    for tok in session.generate(ids, max_tokens, sampler, ignore_eos, processors):
        n += 1
        decode_ms = sum(t.token_ms)
        yield GenerationResponse(
            text=stream.push(tok), token=tok, prompt_tokens=t.prompt_tokens,
            prompt_tps=t.prompt_tokens / t.prompt_ms * 1e3 if t.prompt_ms else 0.0, generation_tokens=n,
            generation_tps=len(t.token_ms) / decode_ms * 1e3 if decode_ms else 0.0,
            token_ms=t.token_ms[-1] if t.token_ms else 0.0, peak_memory_mb=peak_rss_bytes() / 2**20)


def generate(model: Model, tokenizer: Tokenizer, prompt: str | list[int], max_tokens: int = 256,
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
