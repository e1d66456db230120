"""Write safetensors files one tensor at a time, so that memory holds one tensor whatever the file's size.

A safetensors file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} that
may be padded with spaces, then the tensors' bytes back to back (offsets relative to the end of the header).
storage.checkpoint.SafetensorsFile reads them; so does the safetensors package.
"""
from __future__ import annotations

import json

import numpy as np

# What FLASHDIRs and the benchmark models store (U8: matrices in a block format). No name is longer than "F32", which
# the room SafetensorsWriter reserves for its header relies on.
ST_NAMES = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("u1"): "U8", np.dtype("<u2"): "U16"}


def header_bytes(entries, metadata: dict | None = None, size: int = 0) -> bytes:
    """Length prefix + JSON header of tensors `entries` [(name, dtype, shape)] stored back to back in that order,
    padded with spaces to a multiple of 8 bytes (the tensors that follow stay aligned, as the package writes them),
    or to `size` bytes when that is more."""
    header, pos = {}, 0
    for name, dtype, shape in entries:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": ST_NAMES[dtype], "shape": [int(s) for s in shape], "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    if metadata:
        header["__metadata__"] = metadata
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * max(-len(js) % 8, size - 8 - len(js))
    return len(js).to_bytes(8, "little") + js


class SafetensorsWriter:
    """Tensors written as they come, in the order of `shapes` [(name, shape)], into the binary file `f`.

    The header comes first in the file, but a tensor's dtype (float16 or float32) may be known only once its values
    are (convert keeps a matrix float32 when it overflows float16): room for the header is reserved with every tensor
    at float32, its largest size, and the header is written into it by finish(), padded with spaces. A uint8 tensor
    (blocks) is given with its stored shape."""

    def __init__(self, f, shapes, metadata: dict | None = None):
        self.f, self.shapes, self.metadata = f, [(n, tuple(s)) for n, s in shapes], metadata
        self.room = len(header_bytes([(n, np.float32, s) for n, s in self.shapes], metadata))
        self.written: list[tuple[str, np.dtype, tuple]] = []
        self.start = f.tell()
        f.seek(self.start + self.room)

    def write(self, name: str, a: np.ndarray) -> None:
        """The next tensor of `shapes`, float16, float32 or uint8; written without a copy when C-contiguous."""
        want, shape = self.shapes[len(self.written)]
        if (name, a.shape) != (want, shape) or a.dtype not in ST_NAMES:
            raise ValueError(f"expected tensor {want} {shape} (float16/32, uint8), got {name} {a.shape} {a.dtype}")
        self.f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        self.written.append((name, a.dtype, shape))

    def finish(self) -> None:
        """Write the header into its room, once every tensor is written; leaves `f` at the end of the file."""
        if len(self.written) != len(self.shapes):
            raise ValueError(f"{len(self.shapes) - len(self.written)} tensors not written, e.g. "
                             f"{self.shapes[len(self.written)][0]}")
        end = self.f.tell()
        self.f.seek(self.start)
        header = header_bytes(self.written, self.metadata, size=self.room)
        assert len(header) == self.room, (len(header), self.room)   # smaller offsets are never longer than float32's
        self.f.write(header)
        self.f.seek(end)
