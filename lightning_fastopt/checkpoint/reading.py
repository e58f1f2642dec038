"""Reading checkpoint files, with one message naming the file and what is wrong with it.

torch.load on a damaged file says ``EOFError`` (an empty file), ``PytorchStreamReader
failed reading zip archive: failed finding central directory`` (a truncated one) or a
bare ``KeyError`` (a file that is no checkpoint at all), without the file's name;
Lightning adds ``KeyError: 'state_dict'`` for a torch file that holds something else.
:func:`read_checkpoint_file` says which file, and what it looks like, in one line (the
original error is chained beneath it); files that are missing or unreadable keep
Python's own message, which names them already.  A file that torch's safe loader
(``weights_only=True``) refuses is not damaged: it is
:class:`~lightning_fastopt.checkpoint.safe_loading.SafeLoaderRefusedError`, naming what
was refused and how to load a file one trusts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning_fastopt.checkpoint.checksums import verify_file
from lightning_fastopt.checkpoint.errors import BrokenCheckpointError
from lightning_fastopt.checkpoint.safe_loading import (CheckpointClassNotFoundError, SafeLoaderRefusedError,
                                                       missing_classes, refusal)

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format is a zip archive


def _diagnosis(path: str) -> str:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(len(_ZIP_MAGIC))
    except OSError:
        return "it cannot be read"
    if size == 0:
        return "the file is empty (0 bytes)"
    if head == _ZIP_MAGIC:
        return f"the file ({size} bytes) is cut short or damaged: an interrupted save or copy?"
    return f"the file ({size} bytes) is not a torch checkpoint"


def read_checkpoint_file(path, load: Callable[[str], Any], *, what: str = "checkpoint",
                         needs: str | None = "state_dict", verify: bool = True) -> Any:
    """``load(path)``, checked against the checksums the file holds
    (:func:`~lightning_fastopt.checkpoint.checksums.verify_file`), or BrokenCheckpointError
    naming ``path`` when the file cannot be read as one (ChecksumMismatchError, one of them,
    where a tensor does not match its checksum; SafeLoaderRefusedError where torch's safe
    loader refused it); ``needs``: a key the loaded dictionary must have; ``verify=False``:
    the checksums are left to ``load`` (our checkpoint plugin checks them itself)."""
    path = os.fspath(path)
    try:
        loaded = load(path)
    except (FileNotFoundError, PermissionError, IsADirectoryError, BrokenCheckpointError, SafeLoaderRefusedError,
            CheckpointClassNotFoundError):
        raise
    except Exception as err:  # torch.load's errors for damaged files vary by damage and version
        not_damaged = refusal(path, err, f"the {what} {path}") or missing_classes(path, err, f"the {what} {path}")
        if not_damaged is not None:
            raise not_damaged from err
        raise BrokenCheckpointError(f"cannot read the {what} {path}: {_diagnosis(path)} "
                                    f"({type(err).__name__}: {_first_line(err)})") from err
    if verify:
        verify_file(loaded, path, f"the {what} {path}")
    if needs is not None:
        check_holds(loaded, path, needs, what)
    return loaded


def check_holds(loaded: Any, path, needs: str = "state_dict", what: str = "checkpoint") -> None:
    """BrokenCheckpointError naming ``path`` unless ``loaded`` is a dictionary with the key ``needs``."""
    if not (isinstance(loaded, dict) and needs in loaded):
        kind = f"a dictionary without {needs!r}" if isinstance(loaded, dict) else f"a {type(loaded).__name__}"
        raise BrokenCheckpointError(f"cannot read the {what} {os.fspath(path)}: it holds {kind}, not a Lightning "
                                    "checkpoint")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"
