"""AtomicCheckpointIO: checkpoints that are either complete or absent.

Lightning's own writer streams the bytes into the final file name; a process killed
mid-write (out of memory, SIGKILL, node failure) can leave a truncated file under the
name that ``ckpt_path="last"`` then picks.  This writer serializes into a temporary file
in the same directory, flushes it to disk, and renames it over the target in one step
(``os.replace``), then flushes the directory entry.  Remote paths (``s3://`` ...) go
through Lightning's writer unchanged.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_fastopt.checkpoint import save_synced


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
        os.close(fd)
        try:
            save_synced(checkpoint, tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
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
