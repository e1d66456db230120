"""`flashinfer-lite chat`: a multi-turn conversation that keeps its KV cache between turns.

Commands at the prompt: /exit, /reset (forget the conversation), /stats (timings so far); any other /word is
answered with this list, never sent to the model.
Ctrl-C stops the answer being written, not the session; Ctrl-D (end of input) exits.
"""
from __future__ import annotations

import sys

from storage.errors import UserError
from .generate import (ContextFull, Session, add_model_arguments, check_arguments, open_model, sampler_from,
                       streamed_head)
from storage.tokenizer import StreamDecoder, check_utf8

HELP = "/exit quits, /reset forgets the conversation, /stats shows timings; Ctrl-C stops an answer, Ctrl-D exits"


def add_arguments(p) -> None:
    add_model_arguments(p)


def read_line() -> str | None:
    """One line from the user, or None at end of input."""
    try:
        return input("> ")
    except EOFError:
        return None


def print_stats(session: Session, ffn) -> None:
    session.timings.report(sys.stdout, ffn=ffn, head=streamed_head(session.model))


def run(args) -> int:
    check_arguments(args)
    if sys.stdin is None:                      # started with stdin closed (`<&-`)
        raise UserError("chat reads the conversation from standard input, which is closed")
    model, tokenizer = open_model(args)
    ffn = model.ffn
    if not tokenizer.chat_template:
        raise UserError("this model has no chat template; use `flashinfer-lite generate` for plain text")
    # A template that fails to render (it comes from the model file) is one line now, not an error at every turn.
    tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    session = Session(model.transformer, tokenizer, model.ctx)
    session.timings.load_ms = model.load_ms
    sampler = sampler_from(args)
    # Undecodable input bytes arrive as surrogates, so one bad line gets a message instead of killing the session.
    sys.stdin.reconfigure(errors="surrogateescape")
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages = list(system)
    print(f"== chat, context {session.ctx} tokens. {HELP}", file=sys.stderr)
    while True:
        try:
            line = read_line()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, as in a shell
            print()
            continue
        if line is None or line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            messages = list(system)
            session.reset()
            print("(conversation reset)", file=sys.stderr)
            continue
        if line.strip() == "/stats":
            print_stats(session, ffn)
            continue
        if line.strip().startswith("/"):      # a mistyped command must not reach the model as text
            print(f"unknown command {line.split()[0]}: {HELP}", file=sys.stderr)
            continue
        if not line.strip():
            continue
        answer, stream, note = [], StreamDecoder(tokenizer), None
        try:
            check_utf8(line, "input")
            ids = tokenizer.encode_chat(messages + [{"role": "user", "content": line}])
            for tok in session.generate(ids, args.n_predict, sampler, args.ignore_eos):
                answer.append(tok)
                sys.stdout.write(stream.push(tok))
                sys.stdout.flush()
        except ContextFull as e:
            note = f"{e}; /reset to start over"
        except KeyboardInterrupt:  # Ctrl-C during the prompt or the answer: stop this answer only
            note = "answer stopped"
        except UserError as e:
            print(f"error: {e}; /reset to start over" if "too long" in str(e) else f"error: {e}", file=sys.stderr)
            continue
        print()
        if note:
            print(f"[{note}]", file=sys.stderr)
        messages += [{"role": "user", "content": line}, {"role": "assistant", "content": tokenizer.decode(answer)}]
    print(file=sys.stderr)
    session.timings.report(ffn=ffn, head=streamed_head(session.model))
    return 0
