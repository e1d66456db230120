"""Chat as a person drives it (through a pty), and the KV cache kept across turns against fresh recomputation."""
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from conftest import STORIES, stories_with_chat_template
from flashinfer_lite.generate import Sampler, Session
from flashinfer_lite.model import load_reference


@pytest.fixture(scope="module")
def stories_chat(tmp_path_factory):
    return stories_with_chat_template(tmp_path_factory.mktemp("chat") / "m")


def test_second_turn_reuses_the_cache_and_equals_a_fresh_run(stories_chat):
    model, tok = load_reference(stories_chat)
    chat = Session(model, tok, ctx=512)
    msgs = [{"role": "user", "content": "Once upon a time"}]
    first = list(chat.generate(tok.encode_chat(msgs), 20, Sampler(temp=0)))
    msgs += [{"role": "assistant", "content": tok.decode(first)}, {"role": "user", "content": "The dog ran"}]
    ids = tok.encode_chat(msgs)
    evaluated_before = chat.timings.prompt_tokens
    second = list(chat.generate(ids, 20, Sampler(temp=0)))
    reused = len(ids) - (chat.timings.prompt_tokens - evaluated_before)
    assert reused > len(tok.encode_chat(msgs[:1])) - 1  # the whole first turn came from the cache
    fresh = Session(model, tok, ctx=512)
    assert list(fresh.generate(ids, 20, Sampler(temp=0))) == second


def run_pty(args, steps, timeout=240):
    """Drive the CLI through a pseudo-terminal. steps: (wait_for, keys): wait until the output since the previous
    step contains the text wait_for (if it is a number, until that many new bytes arrived; if a function, until it
    returns true for the child's pid), then type keys. Returns (output, exit code); the child is killed if a step
    times out."""
    pid, fd = pty.fork()
    if pid == 0:
        # a job started in the background of a script (`cmd &`) ignores SIGINT, and Python keeps an ignored SIGINT
        # ignored: the terminal's Ctrl-C must reach the CLI as it does a user's
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, "-m", "flashinfer_lite", *args])
    out, since, deadline = b"", 0, time.time() + timeout

    def pump() -> bool:
        nonlocal out
        r, _, _ = select.select([fd], [], [], 0.5)
        if not r:
            return True
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return False
        out += chunk
        return bool(chunk)

    try:
        for wait_for, keys in steps:
            def ready():
                new = out[since:]
                if callable(wait_for):
                    return wait_for(pid)
                return len(new) >= wait_for if isinstance(wait_for, int) else wait_for.encode() in new
            while not ready():
                if time.time() > deadline or not pump():
                    raise AssertionError(f"waiting for {wait_for!r}; got:\n{out.decode(errors='replace')}")
            since = len(out)
            os.write(fd, keys.encode())
        while time.time() < deadline and pump():
            pass
    finally:
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            os.kill(pid, 9)
            _, status = os.waitpid(pid, 0)
    return out.decode(errors="replace"), os.waitstatus_to_exitcode(status)


def answers(out: str, typed: list[str]) -> list[str]:
    """The answers printed after each of the typed messages' last line (the terminal's echo), up to the next
    prompt; \r\n as \n."""
    out = out.replace("\r\n", "\n")
    got, at = [], 0
    for line in typed:
        at = out.index(line + "\n", at) + len(line) + 1
        got.append(out[at:out.index("\n> ", at)])
    return got


def transformers_answer(path, tok, user: str, n: int) -> str:
    """The greedy answer of transformers (the oracle) to one user turn: what chat must print after a /reset."""
    import torch

    from conftest import transformers_model
    ids = tok.encode_chat([{"role": "user", "content": user}])
    out = transformers_model(path).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                            eos_token_id=tok.eos_ids, pad_token_id=tok.eos_ids[0])
    new = [t for t in out[0, len(ids):].tolist() if t not in tok.eos_ids]
    return tok.decode(new)


def test_chat_through_a_terminal(stories_chat):
    """Two turns around /reset and an unknown command: the second answer is transformers' answer to that turn alone
    (so neither the first turn nor "/foo" reached the model), printed after the echoed input."""
    user = "Lily had a big red ball and she"
    steps = [
        ("> ", "Once upon a time\n"),
        ("> ", "/stats\n"),
        ("eval time", "/reset\n"),
        ("(conversation reset)", "/foo\n"),
        # typed once the prompt that follows the message is there, so that the echo precedes the answer
        ("Ctrl-D exits\r\n> ", user + "\n"),
        ("> ", "\x04"),  # Ctrl-D
    ]
    out, code = run_pty(["chat", "-m", str(stories_chat), "--temp", "0", "-n", "30"], steps)
    assert code == 0, out
    out = out.replace("\r\n", "\n")
    _, tok = load_reference(stories_chat)
    want = transformers_answer(stories_chat, tok, user, 30)
    assert len(want.strip()) > 10
    after_echo = out.split(user + "\n", 1)[1]              # the terminal echoes the typed line; the answer follows
    assert after_echo.startswith(want), (want, after_echo[:200])
    assert "unknown command /foo: /exit quits" in out and "prompt eval time" in out


def writing_its_answer(pid: int) -> bool:
    """The child is in write(2) on its standard output: the answer has begun, and the stopped terminal holds it."""
    return open(f"/proc/{pid}/syscall").read().split()[:2] == ["1", "0x1"]


def test_ctrl_c_stops_the_answer_not_the_session(stories_chat):
    """Ctrl-C during an endless answer (-n -1 --ignore-eos) stops it, and the session goes on. Nothing here depends
    on the machine's speed (a busy one let the answer run to its end before the Ctrl-C typed after 200 bytes of it):
    Ctrl-S, typed with the line, stops the terminal's output, so the answer blocks at its first write; Ctrl-C goes in
    while it is blocked there (the terminal restarts output on it). The answer must stop there: /stats counts the
    decode steps it ran, at most 2, where the context had room for 500. --simple-io: readline's own echo of the line
    would be what Ctrl-S blocks (the terminal's echo, without it, is the kernel's)."""
    steps = [
        ("> ", "Once upon a time\n\x13"),     # the line, then Ctrl-S
        (writing_its_answer, "\x03"),          # Ctrl-C
        ("[answer stopped]", "/stats\n"),
        ("eval time", "/exit\n"),
    ]
    out, code = run_pty(["chat", "-m", str(stories_chat), "--temp", "0", "-n", "-1", "--ignore-eos", "-c", "512",
                         "--simple-io"], steps)
    assert code == 0, out
    stats = out.split("[answer stopped]", 1)[1]
    runs = int(re.search(r"eval time = +[\d.]+ ms / +(\d+) runs", stats).group(1))
    assert runs <= 2, out


def test_chat_context_overflow_is_reported_and_survivable(stories_chat):
    steps = [("> ", "Once upon a time " * 30 + "\n"), ("shorten the message", "/exit\n")]
    out, code = run_pty(["chat", "-m", str(stories_chat), "--temp", "0", "-c", "32"], steps)
    assert code == 0 and "prompt is too long" in out, out


def test_chat_refuses_a_model_without_template():
    r = subprocess.run([sys.executable, "-m", "flashinfer_lite", "chat", "-m", str(STORIES)], capture_output=True,
                       stdin=subprocess.DEVNULL, timeout=120)
    assert r.returncode == 1 and b"no chat template" in r.stderr


UP = "\x1b[A"


def greedy_answer(path, tok, messages: list[dict], n: int) -> str:
    """transformers' greedy answer (the oracle) to a conversation, as chat stores and prints it."""
    import torch

    from conftest import transformers_model
    ids = tok.encode_chat(messages)
    out = transformers_model(path).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                            eos_token_id=tok.eos_ids, pad_token_id=tok.eos_ids[0])
    return tok.decode([t for t in out[0, len(ids):].tolist() if t not in tok.eos_ids])


def test_history_multiline_and_help_in_a_terminal(stories_chat, tmp_path):
    """/help lists the commands; a \"\"\" block and a line continued by a backslash are one message each (answered
    as transformers answers that text); the up arrow recalls earlier lines (twice: the one before /reset), in a next
    session too, from the history file in the cache directory."""
    env = {"FLASHINFER_LITE_CACHE": str(tmp_path / "cache")}
    args = ["chat", "-m", str(stories_chat), "--temp", "0", "-n", "12", "--ffn", "dense"]
    steps = [
        # each line typed once its prompt is there: typed before, the terminal would echo it a second time
        ("> ", "/help\n"),
        ("\n> ", '"""\n'),
        ("... ", "Lily saw\n"),
        ("... ", 'a big dog"""\n'),
        ("\n> ", "Once upon \\\n"),
        ("... ", "a time\n"),
        ("\n> ", "/reset\n"),
        ("\n> ", "The cat\n"),
        ("\n> ", "/reset\n"),
        ("\n> ", UP + UP + "\n"),                   # recalls "The cat" (the line before /reset)
        ("\n> ", "/exit\n"),
    ]
    out, code = run_with_env(env, args, steps)
    assert code == 0, out
    assert "/help    this list" in out and "unknown command" not in out and "^[[A" not in out
    _, tok = load_reference(stories_chat)
    block, continued = "Lily saw\na big dog", "Once upon \na time"
    got = answers(out, ['a big dog"""', "a time", "The cat", "The cat"])
    assert got[0] == greedy_answer(stories_chat, tok, [{"role": "user", "content": block}], 12), got
    conversation = [{"role": "user", "content": block}, {"role": "assistant", "content": got[0]},
                    {"role": "user", "content": continued}]
    assert got[1] == greedy_answer(stories_chat, tok, conversation, 12)
    assert got[2] == got[3] == greedy_answer(stories_chat, tok, [{"role": "user", "content": "The cat"}], 12)
    history = (tmp_path / "cache" / "chat_history").read_text()
    assert "The cat" in history and "/help" in history
    out, code = run_with_env(env, args, [("> ", UP + UP + "\n"), ("\n> ", "/exit\n")])    # a next session
    assert code == 0 and answers(out, ["The cat"]) == [got[2]], out


def run_with_env(env: dict, args, steps):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return run_pty(args, steps)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_a_full_context_shifts_and_the_chat_goes_on(stories_chat, tmp_path):
    """-c 128: the fourth message finds the context full; the oldest exchanges go (one line says so), the system
    prompt stays, and the answer is transformers' answer to what was kept. Then, -c 96, answers that fill the
    context themselves: shifted mid-answer, each goes on to its 30 tokens."""
    _, tok = load_reference(stories_chat)
    system = {"role": "system", "content": "Tell a story."}
    users = ["Once upon a time", "The dog ran", "Lily had a ball", "Tom saw a bird"]
    args = ["chat", "-m", str(stories_chat), "--temp", "0", "-n", "10", "-c", "128", "--ffn", "dense",
            "-sys", system["content"]]
    steps = [("> ", users[0] + "\n")] + [("\n> ", u + "\n") for u in users[1:]] + [("\n> ", "/exit\n")]
    out, code = run_with_env({"FLASHINFER_LITE_CACHE": str(tmp_path / "cache")}, args, steps)
    assert code == 0, out
    flat = out.replace("\r\n", "\n")
    lines = re.findall(r"\[context full: dropped the (\d+) oldest messages; kept the system prompt and the latest "
                       r"(\d+)\]", flat)
    assert len(lines) == 1, out
    dropped, kept = map(int, lines[0])
    assert dropped >= 2 and dropped % 2 == 0
    conversation = []
    for i, user in enumerate(users):
        if i == len(users) - 1:
            assert len(conversation) == dropped + kept
            conversation = conversation[dropped:]
        conversation.append({"role": "user", "content": user})
        said = answers(flat, [user])[0]
        if i == len(users) - 1:
            said = said.split("]\n", 1)[1]          # the line comes before the answer
        assert said == greedy_answer(stories_chat, tok, [system] + conversation, 10), (i, out)
        conversation.append({"role": "assistant", "content": said})

    args = ["chat", "-m", str(stories_chat), "--temp", "0", "-n", "30", "--ignore-eos", "-c", "96", "--ffn",
            "dense"]
    steps = [("> ", "Once upon a time\n"), ("\n> ", "The dog ran\n"), ("\n> ", "Lily had a ball\n"),
             ("\n> ", "/stats\n"), ("eval time", "/exit\n")]
    out, code = run_with_env({"FLASHINFER_LITE_CACHE": str(tmp_path / "cache")}, args, steps)
    assert code == 0, out
    # the line comes inside the answer to the second message, which goes on after it
    assert re.search(r"The dog ran\n\S[^\n]*\n\[context full: dropped the 2 oldest messages[^\n]*\]\n\S",
                     out.replace("\r\n", "\n")), out
    runs = int(re.search(r"eval time = +[\d.]+ ms / +(\d+) runs", out).group(1))
    assert runs >= 3 * 29 - 2 and "answer stopped" not in out     # every answer ran its 30 tokens


def test_the_history_file_is_bounded(tmp_path, monkeypatch):
    """The history kept in the cache directory holds the last HISTORY_LINES lines, however many were typed."""
    readline = pytest.importorskip("readline")
    from flashinfer_lite.chat import HISTORY_LINES, open_history
    monkeypatch.setenv("FLASHINFER_LITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    readline.clear_history()
    try:
        save = open_history()
        for i in range(HISTORY_LINES + 500):
            readline.add_history(f"line {i}")
        save()
        lines = (tmp_path / "cache" / "chat_history").read_text().splitlines()
        assert len(lines) == HISTORY_LINES and lines[-1] == f"line {HISTORY_LINES + 499}"
    finally:
        readline.clear_history()
        sys.stdin.close()
