"""Copies of tensors that live in files on a disk, not in the process's own memory.

A state on disk (``offload_optimizer_device="nvme"``) may be larger than host memory:
whatever copies it out of the working file whole (a checkpoint's state dict while training
runs, bfloat16 moments given back as float32 after fit, the masters moved to an optimizer
at another fraction) must not make that copy in host memory.  :class:`MappedCopies` makes
each copy a file of its own in the same directory, created under a name no other run uses
and unlinked at once, its blocks reserved (a disk that cannot hold it is an error naming
the path), and mapped into memory shared with the file: the copy's pages belong to the
page cache, written back to the disk and dropped as the kernel needs the memory, and the
file goes when the last tensor viewing it does.  The tensors are ordinary CPU tensors
(``torch.save`` writes them, torch's optimizers step them); small ones (under
:data:`SMALL` bytes, such as Adam's step counts) are copied into host memory, where a file
each would cost more than it holds.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch
from torch import Tensor

from lightning_fastopt.runtime.byte_sizes import readable_bytes
from lightning_fastopt.runtime.direct_io import open_unlinked, why_failed

__all__ = ["SMALL", "MappedCopies"]

SMALL = 2**20  # bytes: a copy smaller than this stays in host memory


class MappedCopies:
    """Copies of tensors in memory-mapped files in ``directory`` (see the module's documentation)."""

    def __init__(self, directory: str | os.PathLike, what: str = "optimizer state") -> None:
        self.directory = Path(directory)  # checked where it was given (nvme_path); gone later: said at the copy
        self.what = what

    def copy(self, tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A copy of ``tensor`` (in ``dtype``, else its own), contiguous, on the CPU."""
        dtype = tensor.dtype if dtype is None else dtype
        nbytes = tensor.numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes < SMALL:
            return tensor.detach().to("cpu", dtype, copy=True)
        out = self.empty(tensor.shape, dtype)
        out.copy_(tensor.detach())
        return out

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialized CPU tensor whose memory is a file of its own (at least one byte)."""
        numel = math.prod(shape)
        nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
        fd = open_unlinked(self.directory, os.O_RDWR, suffix=".copy", what=self.what)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                raise OSError(e.errno, f"lightning_fastopt: a copy of the {self.what} ({readable_bytes(nbytes)}) in "
                                       f"nvme_path={str(self.directory)!r} failed"
                                       f"{why_failed(self.directory, e, nbytes)}: {e.strerror or e}") from e
            mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping holds the file
        return torch.frombuffer(mapped, dtype=dtype, count=numel).view(tuple(shape))

