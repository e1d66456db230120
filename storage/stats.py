"""FlashStats: the one record of what the flash path did, filled as a read flows reader -> neuron cache -> runtime.

  reader        requested_bytes, read_bytes, n_reads, io_s           (one request: PendingRead.wait() returns them)
  neuron cache  hits, misses, evictions, moved, prefetched, prefetch_used, lookup_s, read_s
  expert cache  the same, and read_busy_s, read_busy_bytes, read_op_s, first_touch_s
  runtime       tokens (counted per forward pass), rows/active per layer, streamed_layers, prefill_bytes_read,
                predictor_s, compute_s

Records add with +=, so one request's, one token's and the run's totals are the same type. The runtime hands its
record to the neuron cache, which adds each finished read to it: nothing is copied field by field.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass
class FlashStats:
    # reader
    requested_bytes: int = 0        # bundles asked for x stride
    read_bytes: int = 0             # fetched from the file: requested + coalescing over-read (+ lookahead guesses)
    n_reads: int = 0                # preadv calls, retries included
    io_s: float = 0.0               # reads in flight, overlapped with compute or not
    # neuron cache
    hits: int = 0
    misses: int = 0
    evictions: int = 0              # rows deleted (window expiry + overflow)
    moved: int = 0                  # rows copied to keep the window dense (deletions no newcomer filled)
    prefetched: int = 0             # rows read ahead on a lookahead guess
    prefetch_used: int = 0          # of those, rows the exact set then needed
    lookup_s: float = 0.0           # bookkeeping: slot lookup, evictions, row moves
    read_s: float = 0.0             # the caller blocked waiting for reads
    read_busy_s: float = 0.0        # expert cache: per layer, the time its misses' reads were in flight (at least one
                                    # of them: submitted to the kernel, not yet landed, as the ring's stamps say)
    read_busy_bytes: int = 0        # the bytes of those reads: over read_busy_s, the rate the device gave them
    read_op_s: float = 0.0          # the same reads' times in flight, summed: over read_busy_s, the mean in flight
    first_touch_s: float = 0.0      # expert cache: faulting in the pages of slots used for the first time
    # runtime
    tokens: int = 0                 # tokens whose FFNs went through the neuron cache (the decode path)
    streamed_layers: int = 0        # layer passes served by prefill streaming of whole layers
    prefill_bytes_read: int = 0     # bytes of that streaming (not in read_bytes)
    predictor_s: float = 0.0
    compute_s: float = 0.0          # the sparse FFN kernels
    rows: np.ndarray | None = None     # [L] token rows through each layer's FFN
    active: np.ndarray | None = None   # [L] neurons that fired, summed over those rows
    n_neurons: int = 0              # per layer: what active_share divides by (a size, not a count: never summed)

    @classmethod
    def for_layers(cls, n_layers: int, n_neurons: int) -> "FlashStats":
        return cls(rows=np.zeros(n_layers, np.int64), active=np.zeros(n_layers, np.int64), n_neurons=n_neurons)

    def __iadd__(self, o: "FlashStats") -> "FlashStats":
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(o, f.name)
            if b is None or f.name == "n_neurons":
                continue
            setattr(self, f.name, b.copy() if a is None and isinstance(b, np.ndarray) else a + b)
        return self

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    def active_share(self) -> np.ndarray:
        """[L] share of each layer's neurons that fired per token row."""
        return self.active / np.maximum(self.rows * max(self.n_neurons, 1), 1)

    def as_dict(self) -> dict:
        tok = max(self.tokens, 1)
        share = float(self.active_share().mean()) if self.rows is not None else 0.0
        return {"active_share": round(share, 4), "hit_rate": round(self.hit_rate, 4),
                "mb_read": round(self.read_bytes / 2**20, 3),
                "mb_read_per_token": round(self.read_bytes / 2**20 / tok, 3),
                "prefill_mb_read": round(self.prefill_bytes_read / 2**20, 3),
                "read_mb_per_s": round((self.read_bytes + self.prefill_bytes_read) / 2**20 / self.io_s, 1)
                if self.io_s else 0.0,
                "read_wait_ms_per_token": round(self.read_s * 1e3 / tok, 3),
                "read_in_flight_ms_per_token": round(self.io_s * 1e3 / tok, 3),
                "overlapped_share": round(max(0.0, 1 - self.read_s / self.io_s), 4) if self.io_s else 0.0,
                "predictor_ms": round(self.predictor_s * 1e3, 3), "lookup_ms": round(self.lookup_s * 1e3, 3),
                "read_ms": round(self.read_s * 1e3, 3), "io_ms": round(self.io_s * 1e3, 3),
                "compute_ms": round(self.compute_s * 1e3, 3),
                "decode_tokens": self.tokens, "streamed_layers": self.streamed_layers,
                "prefetched_rows": self.prefetched, "prefetch_used_rows": self.prefetch_used}
