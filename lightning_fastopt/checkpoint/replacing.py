"""What a save may replace at its path: a checkpoint, never something else.

Saving twice to one path is what the user asked, whatever kind each save writes (one
file, a ZeRO directory of shards, torch's distributed checkpoint): the new checkpoint
replaces the old one, as Lightning's strategies replace theirs.  A directory is replaced by
a file only where it is recognisably a checkpoint and holds nothing else
(:func:`refuse_to_replace_a_directory`); a directory that is not one, or a checkpoint
directory that also holds files of the user's, is refused with an error that says which
(Lightning's ``ModelParallelStrategy`` deletes the second whole).  A directory saved
over a directory keeps the user's files (:func:`~lightning_fastopt.checkpoint.atomic.replace_path`).
``consolidate`` writes a new file and replaces one only when asked
(:func:`~lightning_fastopt.checkpoint.atomic.check_output_file`).
"""

from __future__ import annotations

import os

from lightning_fastopt.checkpoint.atomic import DISTRIBUTED_CHECKPOINT_FILES, SHARDED_METADATA, CheckpointFiles
from lightning_fastopt.checkpoint.sharded import MANIFEST, SHARDED_FILES

# the kinds of checkpoint directory a file may replace: the files that mark one, and what it consists of
_DIRECTORY_KINDS = (
    ("a distributed checkpoint (torch's, through Lightning's or our FSDP strategies)",
     (".metadata", SHARDED_METADATA), DISTRIBUTED_CHECKPOINT_FILES),
    ("a lightning_fastopt sharded (ZeRO) checkpoint", (MANIFEST,), SHARDED_FILES),
)


class NotACheckpointDirectoryError(IsADirectoryError):
    """A checkpoint file was to be saved where a directory that is not a checkpoint stands."""


class CheckpointDirectoryHoldsOtherFilesError(IsADirectoryError):
    """A checkpoint file was to replace a checkpoint directory that also holds files that
    are not the checkpoint's (the user's): they would be deleted with it."""


def _kind(entries: list[str]) -> tuple[str, CheckpointFiles] | None:
    for name, markers, files in _DIRECTORY_KINDS:
        if any(marker in entries for marker in markers):
            return name, files
    return None


def refuse_to_replace_a_directory(path) -> None:
    """Raise where a checkpoint file saved at ``path`` would replace a directory that is not
    a checkpoint (:class:`NotACheckpointDirectoryError`), or a checkpoint directory that
    holds other files too (:class:`CheckpointDirectoryHoldsOtherFilesError`); both
    ``IsADirectoryError``, worded as Lightning's refusal first.  A checkpoint directory
    holding nothing else (ours or Lightning's or torch's) may be replaced."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return
    entries = sorted(os.listdir(path))
    found = _kind(entries)
    if found is None:
        held = f"it holds {_listed(entries)}" if entries else "it is empty"
        raise NotACheckpointDirectoryError(
            f"The checkpoint path exists and is a directory: {path}, which is not a checkpoint ({held}): nothing was "
            "saved and it is kept; save to another path, or remove it yourself")
    kind, files = found
    others = [e for e in entries if not files.own(e)]
    if others:
        raise CheckpointDirectoryHoldsOtherFilesError(
            f"The checkpoint path exists and is a directory: {path}, {kind} that also holds files that are not "
            f"the checkpoint's ({_listed(others)}): nothing was saved and all of it is kept; a checkpoint file "
            "would replace the whole directory: move them, or save to another path")


def _listed(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
