"""Temporary directories that a killed process leaves behind, named so that the next run can tell them apart.

Every writer of a directory (convert, train-predictor, first use) builds it beside its destination as
`.NAME.KIND-PID` and renames it into place, so a reader never sees half of one. A SIGKILL skips every cleanup, so
the next writer in the same parent removes the temporary directories of processes that no longer exist.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path

from storage.errors import UserError

TEMP_KINDS = ("tmp", "old", "calibrate")
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<kind>" + "|".join(TEMP_KINDS) + r")-(?P<pid>\d+)$")


def disk_bytes(p: Path) -> int:
    """Bytes of a file, or of every file under a directory (a model, a FLASHDIR; a conversion in progress, whose
    files come and go as they are counted: one gone meanwhile counts nothing)."""
    p = Path(p)
    if p.is_file():
        return p.stat().st_size
    total = 0
    for top, _, names in os.walk(p):
        for n in names:
            try:
                st = os.stat(os.path.join(top, n))
            except OSError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def temp_path(dest: Path, kind: str) -> Path:
    """Where this process builds (kind "tmp") or parks (kind "old") dest."""
    assert kind in TEMP_KINDS
    return dest.parent / f".{dest.name}.{kind}-{os.getpid()}"


def is_scratch(name: str) -> bool:
    """Whether a directory entry is one of the hidden files this program's writers leave beside what they make:
    temp directories (.NAME.KIND-PID), locks (.NAME.lock), stamps (.NAME.json and its temp .NAME.json.PID)."""
    return name.startswith(".") and bool(_TEMP.match(name) or re.fullmatch(r"\..+\.(lock|json(\.\d+)?)", name))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:        # someone else's live process
        return True
    return True


def write_best_effort(path: Path, text: str) -> bool:
    """Write path whole or not at all (a temp file beside it, renamed over it), for what only saves work: a stamp,
    a digest, an index. False when it could not be written (a read-only or full filesystem, no permission): the
    caller then does the work again next time. Never raises, and leaves no temp file behind that it could remove."""
    path = Path(path)
    tmp = path.with_name(f"{'' if path.name.startswith('.') else '.'}{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        return True
    except OSError:
        remove_quietly(tmp)
        return False


def remove_quietly(path: Path) -> None:
    """Remove a temp file on a failure's way out, raising nothing that would hide that failure: a read-only
    filesystem refuses even to unlink a file it never made (EROFS)."""
    try:
        Path(path).unlink(missing_ok=True)
    except OSError:
        pass


def temp_entries(parent: Path) -> list[tuple[Path, int]]:
    """parent's `.NAME.KIND-PID` entries, each with the PID of the process that writes it (or wrote it, if gone)."""
    try:
        entries = sorted(Path(parent).iterdir())
    except OSError:
        return []
    return [(p, int(m["pid"])) for p in entries if (m := _TEMP.match(p.name))]


def is_stale(pid: int) -> bool:
    """Whether a temp entry of process pid is a leftover: its writer is gone (killed: no cleanup ran)."""
    return pid != os.getpid() and not pid_alive(pid)


def remove_temp(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def remove_stale_temp_dirs(parent: Path) -> list[Path]:
    """Remove parent's `.NAME.KIND-PID` entries whose process is gone; returns what was removed."""
    removed = []
    for p, pid in temp_entries(parent):
        if is_stale(pid):
            remove_temp(p)
            removed.append(p)
    return removed


@contextmanager
def exclusive(dest: Path, what: str):
    """Hold an exclusive lock for making dest (one first-use conversion or training at a time: a second process
    waits here, then finds dest made). The lock is .NAME.lock beside dest, an flock that the kernel releases when
    its holder exits, however it exits: a killed holder never leaves it held."""
    path = dest.parent / f".{dest.name}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise UserError(f"cannot create the lock {path} for {what}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
