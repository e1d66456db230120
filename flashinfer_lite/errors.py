"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input from the user or from a model file: reported as one line, never as a traceback."""
