"""`flashinfer-lite chat`: a multi-turn conversation that keeps its KV cache between turns.

Commands at the prompt: /help, /exit, /reset (forget the conversation), /stats (timings so far); any other /word is
answered with the list, never sent to the model. On a terminal, lines are edited and recalled as in a shell (the
stdlib's readline: arrows, Ctrl-R), the history kept in the cache directory. A line ending in a backslash goes on
on the next line; three double quotes open a block of lines that a line ending in them closes (as llama.cpp and
Ollama read them). When the context fills, the oldest exchanges are dropped (the system prompt stays) and the answer
goes on.
Ctrl-C stops the answer being written, not the session; Ctrl-D (end of input) exits.
"""
from __future__ import annotations

import sys

from storage.cache import cache_dir
from storage.errors import UserError
from .generate import (ContextFull, Session, add_model_arguments, check_arguments, open_model, sampler_from,
                       streamed_head)
from storage.tokenizer import StreamDecoder, check_utf8

HELP = "/exit quits, /reset forgets the conversation, /stats shows timings, /help lists all; Ctrl-C stops an " \
       "answer, Ctrl-D exits"
COMMANDS = f"""commands:
  /help    this list
  /reset   forget the conversation (the system prompt stays)
  /stats   the timings so far
  /exit    quit (Ctrl-D too)
input:
  a line ending in \\ goes on on the next line; {'"' * 3} opens a block of lines, a line ending in {'"' * 3} closes it
  up and down arrows recall earlier input; Ctrl-C stops an answer"""
HISTORY_FILE = "chat_history"
HISTORY_LINES = 1000       # lines kept in the history file
BLOCK = '"""'


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--simple-io", action="store_true",
                   help="plain line input: no line editing or history (as llama.cpp's, for limited terminals)")


def read_line(prompt: str = "> ") -> str | None:
    """One line from the user, or None at end of input."""
    try:
        return input(prompt)
    except EOFError:
        return None


def read_message() -> str | None:
    """One message: a line, lines joined by a trailing backslash, or a block between BLOCKs; None at end of input."""
    line = read_line()
    if line is None:
        return None
    if line.lstrip().startswith(BLOCK):
        lines, line = [], line.lstrip()[len(BLOCK):]
        while not line.rstrip().endswith(BLOCK):
            lines.append(line)
            line = read_line("... ")
            if line is None:            # end of input closes the block
                return "\n".join(lines)
        lines.append(line.rstrip()[:-len(BLOCK)])
        return "\n".join(lines).strip("\n")
    while line.endswith("\\"):
        more = read_line("... ")
        line = line[:-1] + ("\n" + more if more is not None else "")
        if more is None:
            break
    return line


def open_history():
    """Line editing and a history kept across sessions (bounded), when the input is a terminal; returns the
    function that saves the history at exit (or None)."""
    if not sys.stdin.isatty():
        return None
    try:
        import readline      # input() edits lines through it once imported
    except ImportError:      # a Python without it: plain input
        return None
    path = cache_dir() / HISTORY_FILE
    readline.parse_and_bind("set enable-bracketed-paste off")   # no escape codes around each prompt
    try:
        readline.read_history_file(path)
    except OSError:          # none yet, or unreadable: a fresh history
        pass
    readline.set_history_length(HISTORY_LINES)

    def save():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:      # a read-only cache: the history is not kept, the chat goes on
            pass
    return save


def fit(tokenizer, system: list[dict], turns: list[dict], user: dict, answer: list[int], ctx: int):
    """(turns kept, ids) when system + turns + user + answer so far leave no room in the context: the oldest
    exchanges dropped until a quarter of it is free again (the system prompt and the user's message stay); None if
    even those alone leave no room."""
    for k in range(0, len(turns) + 1, 2):
        ids = tokenizer.encode_chat(system + turns[k:] + [user]) + answer
        if len(ids) + ctx // 4 <= ctx:
            return turns[k:], ids
    return None


def print_stats(session: Session, ffn) -> None:
    session.timings.report(sys.stdout, ffn=ffn, head=streamed_head(session.model))


def shifted(dropped: int, kept: int) -> str:
    return f"[context full: dropped the {dropped} oldest messages; kept the system prompt and the latest {kept}]"


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
    turns: list[dict] = []          # the conversation after the system prompt: user and assistant messages
    save_history = None if args.simple_io else open_history()
    print(f"== chat, context {session.ctx} tokens. {HELP}", file=sys.stderr)
    try:
        while True:
            try:
                line = read_message()
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, as in a shell
                print()
                continue
            if line is None or line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                turns = []
                session.reset()
                print("(conversation reset)", file=sys.stderr)
                continue
            if line.strip() == "/stats":
                print_stats(session, ffn)
                continue
            if line.strip() == "/help":
                print(COMMANDS, file=sys.stderr)
                continue
            if line.strip().startswith("/"):      # a mistyped command must not reach the model as text
                print(f"unknown command {line.split()[0]}: {HELP}", file=sys.stderr)
                continue
            if not line.strip():
                continue
            turns = answer_turn(session, sampler, args, system, turns, {"role": "user", "content": line})
    finally:
        if save_history:
            save_history()
    print(file=sys.stderr)
    session.timings.report(ffn=ffn, head=streamed_head(session.model))
    return 0


def answer_turn(session: Session, sampler, args, system: list[dict], turns: list[dict], user: dict) -> list[dict]:
    """Write the answer to the user's message; the conversation after it. A context too full for the prompt, or
    filled by the answer, drops the oldest exchanges (fit), says so in one line, and the answer goes on."""
    tokenizer, ctx = session.tokenizer, session.ctx
    answer, stream, note = [], StreamDecoder(tokenizer), None
    sampler.reset()                 # the frequency and presence penalties count this answer's tokens
    try:
        check_utf8(user["content"], "input")
        ids = tokenizer.encode_chat(system + turns + [user])
        while True:
            if len(ids) >= ctx:     # no room for a token: drop the oldest exchanges
                kept = fit(tokenizer, system, turns, user, answer, ctx)
                if kept is None and not answer:
                    raise UserError(f"prompt is too long ({len(ids)} tokens, context is {ctx}); raise -c or "
                                    f"shorten the message")
                if kept is None:
                    note = f"context is full ({ctx} tokens) with this exchange alone; answer stopped"
                    break
                print(("\n" if answer else "") + shifted(len(turns) - len(kept[0]), len(kept[0])), file=sys.stderr)
                turns, ids = kept
            try:
                left = args.n_predict - len(answer) if args.n_predict > 0 else -1
                for tok in session.generate(ids, left, sampler, args.ignore_eos):
                    answer.append(tok)
                    sys.stdout.write(stream.push(tok))
                    sys.stdout.flush()
                break
            except ContextFull:     # the answer filled it: shift, then go on from where it is
                ids = tokenizer.encode_chat(system + turns + [user]) + answer
    except KeyboardInterrupt:  # Ctrl-C during the prompt or the answer: stop this answer only
        note = "answer stopped"
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return turns
    print()
    if note:
        print(f"[{note}]", file=sys.stderr)
    return turns + [user, {"role": "assistant", "content": tokenizer.decode(answer)}]
