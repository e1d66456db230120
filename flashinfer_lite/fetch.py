"""`flashinfer-lite fetch`: download and verify the default model, print where it is."""
from __future__ import annotations

from .default_model import ensure_default_model


def add_arguments(p) -> None:
    pass


def run(args) -> int:
    print(ensure_default_model())
    return 0
