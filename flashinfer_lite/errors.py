"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input from the user or from a model file: reported as one line, never as a traceback."""


class Reported(Exception):
    """A failure already reported in its one line (by a child process): the CLI exits with `code`, adding nothing."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code
