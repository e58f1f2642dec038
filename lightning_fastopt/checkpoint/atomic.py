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
:func:`save_staged` does the same for a checkpoint that every rank writes part of (torch's
distributed checkpoints under FSDP): into a staging path, moved over the target once all
have written.

Temporary files and staging directories are named by :func:`temp_path`
(``.NAME.HOST.PID.RANDOM.tmp`` beside ``NAME``), so that a save killed mid-write leaves
something the next save to the same name recognises and removes
(:func:`remove_stale_temps`: only those of this machine whose process is gone).  Files
are created with mode 0666 less the umask, as ``open`` and Lightning's writer do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from lightning_fastopt.checkpoint.checksums import RECORD, save_checksummed


def write_synced(path, write: Callable[[IO[bytes]], None], target=None) -> None:
    """``write(file)`` into ``path`` (opened new, for writing and reading), flushed to the
    disk before returning.  A system error while writing (a full disk, a quota) is raised as
    that ``OSError``, naming ``target`` (what ``path`` will become; default ``path``), even
    where the writer replaced it with its own error (``torch.save``'s says ``unexpected pos
    ...``)."""
    try:
        with open(path, "w+b") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        raise
    except Exception as e:
        cause = _system_error_in(e)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, os.fspath(target if target is not None else path)) from e


def _system_error_in(exc: BaseException) -> OSError | None:
    """The OSError that ``exc`` was raised during or from, if any; in a distributed
    checkpoint's failure, in the error of a rank that failed (``failures``: each rank's
    error and its traceback, torch's ``CheckpointException``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        seen.add(id(exc))
        for failed, _ in dict(getattr(exc, "failures", None) or {}).values():
            cause = _system_error_in(failed)
            if cause is not None:
                return cause
        exc = exc.__cause__ or exc.__context__
    return None


def save_synced(obj: Any, path, target=None) -> None:
    """``torch.save`` into ``path``, with the checksums of its tensors
    (:func:`~lightning_fastopt.checkpoint.checksums.save_checksummed`), flushed to the disk
    before returning (errors name ``target``, see :func:`write_synced`)."""
    write_synced(path, lambda f: save_checksummed(obj, f), target)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0]) or "host"


def temp_path(path) -> str:
    """A new name beside ``path`` for what will become ``path`` (a file or a directory)."""
    path = os.path.abspath(os.fspath(path))
    return os.path.join(os.path.dirname(path),
                        f".{os.path.basename(path)}.{_host()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # it exists (another user's): not ours to judge
    return False


def remove_stale_temps(path) -> list[str]:
    """Remove the temporary files and directories that saves to ``path`` killed mid-write
    left on this machine (their process no longer exists); returns their paths."""
    path = os.path.abspath(os.fspath(path))
    directory, base = os.path.split(path)
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    removed = []
    host = _host()
    for entry in entries:
        if not (entry.startswith(f".{base}.") and entry.endswith(".tmp")):
            continue
        parts = entry[len(base) + 2:-len(".tmp")].split(".")
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit() or not _process_gone(int(parts[1])):
            continue
        stale = os.path.join(directory, entry)
        try:
            shutil.rmtree(stale) if os.path.isdir(stale) else os.unlink(stale)
        except FileNotFoundError:
            continue  # another process cleaned it first
        removed.append(stale)
    return removed


def save_atomically(obj: Any, path) -> None:
    """``torch.save`` into ``path`` so that it is replaced whole or not at all."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temps(path)
    tmp = temp_path(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask applies, as for open()
    try:
        save_synced(obj, tmp, target=path)
        replace_path(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


def _written(write: Callable[[str], None], staging: str) -> BaseException | None:
    """``write(staging)``'s error, if it fails (torch's ``CheckpointException`` is not an
    ``Exception``; an interruption is not caught: it ends the process)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        write(staging)
    except (Exception, CheckpointException) as error:
        return error
    return None


def _raise_failed(error: BaseException | None, path: str) -> None:
    """Raise the error of a save to ``path`` that failed: this rank's (a system error as an
    ``OSError`` naming ``path``), or, where another rank's write failed, one saying so."""
    if error is None:
        raise RuntimeError(f"saving the checkpoint {path} failed on another process (its error says why); "
                           "what the path held is kept")
    cause = _system_error_in(error) or _full_disk_behind(error, os.path.dirname(path))
    if cause is None:
        raise error
    raise OSError(cause.errno, f"{cause.strerror}: the checkpoint was not saved (what the path held is kept)",
                  path) from error


def _full_disk_behind(error: BaseException, directory: str) -> OSError | None:
    """ENOSPC where torch's file writer failed (``unexpected pos ...``, which keeps no system
    error when given a path, as Lightning gives it ``meta.pt``'s) and the disk under
    ``directory`` has less than 1 MiB left."""
    if "unexpected pos" not in str(error) and "failed writing" not in str(error):
        return None
    try:
        full = shutil.disk_usage(directory).free < 2**20
    except OSError:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if full else None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclass(frozen=True)
class CheckpointFiles:
    """The names of the files a checkpoint directory of one kind consists of (a regular
    expression each must match whole): those a new checkpoint supersedes.  Anything else
    in the directory is someone else's, and stays."""

    pattern: str

    def own(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None


# Lightning's FSDP strategies mark a sharded checkpoint directory with this file
SHARDED_METADATA = "meta.pt"
def is_distributed(path) -> bool:
    """``path`` is a directory holding a distributed checkpoint written through Lightning."""
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, SHARDED_METADATA))


# torch's distributed checkpoint (its metadata and each rank's shards) and Lightning's file beside them
DISTRIBUTED_CHECKPOINT_FILES = CheckpointFiles(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp|"
                                               + re.escape(SHARDED_METADATA) + "|" + re.escape(RECORD))


def check_output_file(path, overwrite: bool) -> None:
    """Where a new file is to be written under ``path`` (``consolidate``'s output): a
    directory there is never replaced (IsADirectoryError), an existing file only when
    ``overwrite`` is set (FileExistsError); both name ``path``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory: nothing was written (a directory is never replaced; "
                                "name a file)", path)
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(errno.EEXIST, "exists: nothing was written (to replace it, pass --overwrite, or "
                              "overwrite=True)", path)


def save_staged(path, write: Callable[[str], None], ranks, files: CheckpointFiles | None = None,
                before_move: Callable[[str], None] | None = None) -> None:
    """Every rank's part of writing a checkpoint (a file or a directory) whole or not at all
    (call it on every rank at once): ``write(staging)`` writes into a staging path beside
    ``path`` (rank 0's name), then rank 0 moves it over ``path`` once every rank has
    written (:func:`replace_path`: a directory's files that are not a checkpoint's,
    ``files``, stay).  A process killed meanwhile leaves what ``path`` held, and a staging
    path the next save removes.  A write that fails on any rank (a full disk) leaves what
    ``path`` held too: the ranks agree on it, rank 0 removes the staging path, and each
    raises its error, a system error as an ``OSError`` naming ``path`` (torch's distributed
    checkpoint hides it inside its own exception, and its writer may replace it with
    ``unexpected pos ...``).  ``before_move``: what rank 0 does to the staging path once
    every rank has written, before the move (a sharded checkpoint's manifest).  ``ranks``:
    ``broadcast``, ``barrier``, ``is_global_zero``, ``world_size`` and
    ``reduce_boolean_decision``, as a Lightning strategy has them."""
    path = ranks.broadcast(os.path.abspath(os.fspath(path)))
    staging = ranks.broadcast(temp_path(path))
    if ranks.is_global_zero:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        remove_stale_temps(path)
    ranks.barrier("fastopt_checkpoint_staging")
    _settle(ranks, _written(write, staging), staging, path)

    def finish(staging: str) -> None:
        if before_move is not None:
            before_move(staging)
        replace_path(staging, path, files)
        fsync_directory(os.path.dirname(path))

    _settle(ranks, _written(finish, staging) if ranks.is_global_zero else None, staging, path)


def _settle(ranks, error: BaseException | None, staging: str, path: str) -> None:
    """The ranks agree whether each did its part (``error``: this rank's failure, if any);
    where one failed, rank 0 removes the staging path and every rank raises
    (:func:`_raise_failed`)."""
    everywhere = ranks.reduce_boolean_decision(error is None, all=True) if ranks.world_size > 1 else error is None
    if everywhere:
        return
    if ranks.is_global_zero:
        shutil.rmtree(staging, ignore_errors=True) if os.path.isdir(staging) else _unlink(staging)
    _raise_failed(error, path)


def replace_path(src: str, dst: str, files: CheckpointFiles | None = None) -> None:
    """Move ``src`` (a file or a directory) to ``dst``, replacing what is there: one
    rename, after moving a directory in the way aside (deleted afterwards).  Where both
    are directories, the entries of ``dst`` that are not a checkpoint's (``files``; all of
    them without it) and that ``src`` lacks are linked into ``src`` first (hard links, or
    copies where the file system has none), so that they are in ``dst`` before, during
    and after the move: a save never deletes a file it did not write."""
    old = None
    if os.path.isdir(dst) or (os.path.lexists(dst) and os.path.isdir(src)):
        if os.path.isdir(dst) and os.path.isdir(src):
            _link_others(dst, src, files)
        old = f"{dst}.old-{uuid.uuid4().hex[:12]}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)


def _link_others(directory: str, into: str, files: CheckpointFiles | None) -> None:
    """Link the entries of ``directory`` that are not checkpoint files, and that ``into``
    lacks, into ``into`` (directories as trees of links; symbolic links as themselves)."""
    for entry in os.listdir(directory):
        target = os.path.join(into, entry)
        if (files is not None and files.own(entry)) or os.path.lexists(target):
            continue
        source = os.path.join(directory, entry)
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(source, target)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


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
