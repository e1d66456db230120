"""What the CLI, and a child process of it, turn into a one-line message and a non-zero exit."""
import sys


class UserError(Exception):
    """Bad input from the user or from a model file: reported as one line, never as a traceback."""


class Reported(Exception):
    """A failure already reported in its one line (by a child process): the CLI exits with `code`, adding nothing."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def child_exit_code(work) -> int:
    """work() as the whole of a child process (first-use conversion, first-use training): its UserError is the one
    line on stderr and exit 1, Ctrl-C exit 130; the parent turns a non-zero code into Reported."""
    try:
        work()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0
