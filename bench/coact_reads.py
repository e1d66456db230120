#!/usr/bin/env python3
"""Issue 44's co-activation order: a decoded token's down-column reads, in the model's order and in the order of a
FLASHDIR written by `flashinfer-lite order-neurons` from the same source, counted by the reader's own planner
(BundleReader.read_ops: runs, holes read through up to its gap, 1 MiB ops, 512-byte widening) at several gaps.

    PYTHONPATH=. python bench/coact_reads.py -m FLASHDIR --coact COACT_FLASHDIR --text FILE [--skip 1024] [--tokens 512]

Each token of --text after the first --skip (those the order was fitted on) runs through FLASHDIR's exact gate in a
prompt; the neurons over its thresholds are what a decoded token would read. Counts only: no read is made."""
import argparse

import numpy as np

import harness as h

from predictors.coact import fired_bits
from storage.format import read_layout
from storage.reader import BundleReader, aligned_empty
from storage.tokenizer import token_segments

GAPS = (0, 2, 8, None)      # rows read through; None: the reader's own (the device profile's, or its default)


def counts(down, bits, order, gap) -> tuple[float, float]:
    """(requests, bytes) a token: bits per layer uint8 [n, T/8] in the model's order; order: bundle -> neuron."""
    with BundleReader(down, coalesce_gap=gap) as r:
        req = nbytes = 0
        for i, (b, o) in enumerate(zip(bits, order)):
            fired = np.unpackbits(b[o], axis=1).astype(bool)      # [n, T] by bundle
            dest = aligned_empty((fired.shape[0], down.stride), np.uint8)
            for t in range(fired.shape[1]):
                ids = np.flatnonzero(fired[:, t])
                plan, _, got = r.read_ops(i, ids, dest, np.arange(ids.size))
                req, nbytes = req + len(plan), nbytes + got
        return req / fired.shape[1], nbytes / fired.shape[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="the FLASHDIR in the model's order, calibrated (gate.json)")
    ap.add_argument("--coact", required=True, help="the same source written by order-neurons")
    ap.add_argument("--text", required=True, help="held-out text (after --skip tokens)")
    for flag, v in (("--skip", 1024), ("--tokens", 512)):
        ap.add_argument(flag, type=int, default=v)
    a = ap.parse_args()
    ctx = 256
    model, tok, ffn = h.load_model(a.model, "gate", ctx=ctx, base_bytes=0)
    windows = list(token_segments(tok, open(a.text).read(), a.skip + a.tokens, ctx, ffn.cfg.bos_id))[a.skip // ctx:]
    bits = fired_bits(model, ffn, windows)
    ffn.reader.close()
    ident, coact = read_layout(a.model), read_layout(a.coact)
    down = ident.parts["down"]
    fired = np.mean([np.bitwise_count(b).sum() for b in bits]) / sum(map(len, windows))
    rows = [[name, *(f"{req:,.0f} / {nbytes / 1e6:.1f} MB" for req, nbytes in (counts(down, bits, L.order, gap)
                                                                          for gap in GAPS))]
            for name, L in (("model's order", ident), ("coact", coact))]
    gap = BundleReader(down).coalesce_gap
    print(f"{len(windows)} windows, {fired:,.0f} of {down.n_neurons[0]} neurons fired a layer and token")
    print("\n".join(h.table(["order", *(f"gap {g if g is not None else gap} rows" for g in GAPS)], rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
