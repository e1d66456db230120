"""Checksums of what lies on disk: blake2b-128 digests of file regions, files and manifests.

Regions are read through one reused buffer and dropped from the page cache behind the reader, so checking a model
bigger than RAM neither grows the process nor fills a memory cgroup's page cache.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CHECKSUM_CHUNK = 1 << 20


def new_checksum():
    return hashlib.blake2b(digest_size=16)


def drop_from_page_cache(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Ask the kernel to forget these pages (0 bytes: the whole file). A no-op where posix_fadvise does not exist
    (macOS): there buffered reads simply stay cached."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def region_checksum(f, offset: int, nbytes: int, chunk: int = CHECKSUM_CHUNK, progress=None, h=None) -> str:
    """Digest of nbytes at offset, read into one reused `chunk`-sized buffer: memory stays at one chunk whatever the
    file size, and the pages read are dropped from the page cache behind us (a verify of a bigger-than-RAM model
    must not fill a memory cgroup with it; the runtime reads with O_DIRECT and never wants them). h: the digest to
    continue (a layer's, FlashLayout.layer_checksum), else a new one."""
    h = new_checksum() if h is None else h
    buf = bytearray(min(chunk, max(nbytes, 1)))
    view = memoryview(buf)
    fd = f.fileno()
    pos, end = offset, offset + nbytes
    while pos < end:
        got = os.preadv(fd, [view[:min(len(buf), end - pos)]], pos)
        if got <= 0:
            break   # truncated: the digest will not match
        h.update(view[:got])
        drop_from_page_cache(fd, pos, got)
        pos += got
        if progress is not None:
            progress.update(got)
    return h.hexdigest()


def file_checksum(path: Path) -> str:
    with open(path, "rb") as f:
        return region_checksum(f, 0, os.fstat(f.fileno()).st_size)


def manifest_checksum(m: dict) -> str:
    """The digest a manifest (a FLASHDIR's, its predictors') records of itself (field manifest_checksum): of its
    canonical JSON without that field, so its config, geometry, thresholds and settings are checked as the files
    it lists are."""
    h = new_checksum()
    h.update(json.dumps({k: v for k, v in m.items() if k != "manifest_checksum"}, sort_keys=True).encode())
    return h.hexdigest()
