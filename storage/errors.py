"""What the CLI, and a child process of it, turn into a one-line message and a non-zero exit; and how the two
processes end together (a child never outlives its parent, nor leaves its temp files behind when interrupted)."""
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

PARENT_ENV = "FLASHINFER_LITE_PARENT"   # the parent's pid, for the child to check it is still there
CHILD_CLEANUP_SECONDS = 60              # how long an interrupted parent waits for its child to clean up
RESIGNAL_SECONDS = 5                    # ... asking again this often (an interrupt can be swallowed, see below)
DUPLICATE_SECONDS = 2                   # a child takes signals this close to the first as the same interrupt


class UserError(Exception):
    """Bad input from the user or from a model file: reported as one line, never as a traceback."""


class Reported(Exception):
    """A failure already reported in its one line (by a child process): the CLI exits with `code`, adding nothing."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def run_child(argv: list[str]) -> None:
    """Run a child process to its end; its non-zero exit becomes Reported. On Ctrl-C the child is sent SIGINT (the
    terminal sends it to both; `kill -INT` to this process alone would not reach it) and waited for, so that it
    removes its temp files: subprocess.run would kill it 0.25 s after the interrupt."""
    p = subprocess.Popen(argv, env=dict(os.environ, **{PARENT_ENV: str(os.getpid())}))
    try:
        code = p.wait()
    except KeyboardInterrupt:
        end = time.monotonic() + CHILD_CLEANUP_SECONDS
        sig = signal.SIGINT
        while p.poll() is None:
            if time.monotonic() > end:
                p.kill()
                p.wait()
                break
            p.send_signal(sig)   # again if a library swallowed the first KeyboardInterrupt (seen once in a test)
            sig = signal.SIGTERM
            try:
                p.wait(timeout=RESIGNAL_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        raise
    if code:
        raise Reported(code)


_first_interrupt: list[float] = []


def _interrupted(signum, frame):
    """SIGINT or SIGTERM in a child: unwind (every `finally` removes its temp files). The terminal's Ctrl-C and the
    parent's forwarded one both arrive: a signal right after the first must not interrupt that cleanup, so it is
    dropped; a later one (the parent asking again) unwinds again."""
    now = time.monotonic()
    if _first_interrupt and now - _first_interrupt[0] < DUPLICATE_SECONDS:
        return
    _first_interrupt[:] = [now]
    raise KeyboardInterrupt


@contextmanager
def commit():
    """The rename that publishes a child's work (predictors, a conversion): not done once an interrupt has come. The
    handler's record decides, not its exception: a KeyboardInterrupt raised inside a library's __del__ is printed as
    "Exception ignored" and dropped, and the child would go on to publish what its parent reports as interrupted
    (seen in CI). The signals wait during the rename itself, so that it is either not begun or finished."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if _first_interrupt:
            raise KeyboardInterrupt
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def end_with_parent() -> None:
    """SIGTERM this process when its parent dies, even by SIGKILL (Linux: prctl PR_SET_PDEATHSIG). A parent already
    gone before that took effect is seen by its pid no longer being our parent's."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = os.environ.get(PARENT_ENV)
    if parent and int(parent) != os.getppid():
        raise KeyboardInterrupt


def child_exit_code(work) -> int:
    """work() as the whole of a child process (first-use conversion, first-use training): its UserError is the one
    line on stderr and exit 1, Ctrl-C (or SIGTERM, or its parent's death) exit 130 once its temp files are removed;
    the parent (run_child) turns a non-zero code into Reported."""
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        end_with_parent()
        work()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except OSError as e:     # a full disk (ENOSPC), a read-only one (EROFS): the writers removed their temp files
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 1
    return 0


def os_error_line(e: OSError) -> str:
    """An OSError as one line naming the path: "cannot write PATH: No space left on device"."""
    return f"cannot write {e.filename}: {e.strerror}" if e.filename else f"{e.strerror or e}"
