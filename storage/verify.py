"""`flashinfer-lite verify FLASHDIR`: check the manifest, file sizes and every checksum of a flash directory."""
from __future__ import annotations

import argparse

from .format import verify


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("flashdir", help="flash directory written by `flashinfer-lite convert`")


def run(args) -> int:
    layout = verify(args.flashdir)
    E = layout.experts
    if E is not None:
        print(f"ok: {args.flashdir}: {E.n_layers * E.n_experts} expert chunks ({(E.end - E.offset) / 2**20:.1f} MiB) "
              f"and resident weights match their checksums")
        return 0
    total = sum(layout.region_bytes(i) for i in range(layout.n_layers))
    print(f"ok: {args.flashdir}: {layout.n_layers} layer regions ({total / 2**20:.1f} MiB) and resident weights "
          f"match their checksums")
    return 0
