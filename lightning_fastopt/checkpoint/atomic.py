"""Files that are either complete or absent: the one place lightning_fastopt writes
checkpoint files.

:func:`save_synced` serializes into a file and flushes it to the disk before returning
(a shard inside a sharded checkpoint's staging directory, which becomes visible as a
whole later).  :func:`save_atomically` writes into a temporary file beside the target,
flushes it, renames it over the target in one step (``os.replace``) and flushes the
directory entry: a process killed mid-write (out of memory, SIGKILL, node failure)
leaves the previous file, never a truncated one under the final name.
:func:`replace_path` is that rename, also over a directory (a sharded checkpoint saved
under the same name by a ZeRO run) and for a directory (the sharded writer).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import IO, Any

import torch


def write_synced(path, write: Callable[[IO[bytes]], None]) -> None:
    """``write(file)`` into ``path``, flushed to the disk before returning."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_synced(obj: Any, path) -> None:
    """``torch.save`` into ``path``, flushed to the disk before returning."""
    write_synced(path, lambda f: torch.save(obj, f))


def save_atomically(obj: Any, path) -> None:
    """``torch.save`` into ``path`` so that it is replaced whole or not at all."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        save_synced(obj, tmp)
        replace_path(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


def replace_path(src: str, dst: str) -> None:
    """Move ``src`` (a file or a directory) to ``dst``, replacing whatever is there: one
    rename, after moving a directory in the way aside (deleted afterwards)."""
    old = None
    if os.path.isdir(dst) or (os.path.lexists(dst) and os.path.isdir(src)):
        old = f"{dst}.old-{uuid.uuid4().hex[:12]}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)


def fsync_directory(directory: str) -> None:
    """Flush a directory's entries (a rename into it) to the disk, where the system allows."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some systems cannot open directories; the rename itself is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
