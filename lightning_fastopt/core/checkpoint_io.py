"""AtomicCheckpointIO: Lightning checkpoints that are either complete or absent.

Each tensor's checksum is saved beside it and checked when the file is read
(:mod:`~lightning_fastopt.checkpoint.checksums`).  Lightning's own writer streams the bytes
into the final file name; a process killed
mid-write (out of memory, SIGKILL, node failure) can leave a truncated file under the
name that ``ckpt_path="last"`` then picks.  This writer saves local paths with
:func:`lightning_fastopt.checkpoint.atomic.save_atomically` (a temporary file, flushed,
renamed over the target) and, on POSIX systems, reads them mapped into memory (``torch.load(mmap=True)``,
as Lightning's ``ModelParallelStrategy`` reads a full checkpoint: a checkpoint larger than
host memory, such as one holding an optimizer state kept on disk, is read tensor by tensor
as the strategy takes it in, never whole; a new checkpoint under the same name is a new
file, so the one read stays whole).  Remote paths (``s3://`` ...) go through Lightning's writer
unchanged.  A sharded checkpoint directory of the same name (a ZeRO run resumed without
ZeRO), or a distributed one, is replaced whole where it holds nothing else; any other
directory in the way is an error (:mod:`~lightning_fastopt.checkpoint.replacing`).  Reading a sharded
checkpoint directory gives the merged checkpoint
(:func:`~lightning_fastopt.checkpoint.sharded.load_sharded`: Fabric's ``fabric.load``).
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_fastopt.checkpoint.atomic import save_atomically
from lightning_fastopt.checkpoint.reading import read_checkpoint_file
from lightning_fastopt.checkpoint.replacing import refuse_to_replace_a_directory
from lightning_fastopt.checkpoint.sharded import is_sharded, load_sharded


class AtomicCheckpointIO(TorchCheckpointIO):
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        refuse_to_replace_a_directory(path)  # a checkpoint directory holding nothing else is replaced
        save_atomically(checkpoint, path)

    @override
    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory merged; a local file read mapped; a damaged file, or one that
        torch's safe loader refuses, one error naming it and what is wrong
        (:func:`~lightning_fastopt.checkpoint.reading.read_checkpoint_file`)."""
        if is_sharded(path):
            return load_sharded(path, weights_only)
        location = _as_saved if map_location is None else map_location
        if _maps(path):
            return read_checkpoint_file(path, lambda p: torch.load(p, map_location=location, weights_only=weights_only,
                                                                   mmap=True), needs=None)
        if isinstance(get_filesystem(path), LocalFileSystem):
            return read_checkpoint_file(path, lambda p: super(AtomicCheckpointIO, self).load_checkpoint(
                p, location, weights_only), needs=None)
        return super().load_checkpoint(path, location, weights_only)


def _maps(path) -> bool:
    """Whether ``path`` is read mapped: a local file in torch's zip format, on a POSIX system
    (where a file replaced while mapped stays whole for its readers; Windows refuses to
    replace a mapped file, which the next save of the same name does)."""
    return (os.name == "posix" and isinstance(get_filesystem(path), LocalFileSystem) and os.path.isfile(path)
            and zipfile.is_zipfile(path))


def _as_saved(storage, location):
    """Lightning's default ``map_location``: every tensor where it was saved from."""
    return storage
