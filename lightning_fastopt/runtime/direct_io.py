"""A working file on a fast disk, read and written asynchronously with direct I/O.

:class:`DirectFile` is the disk tier's storage (``offload_optimizer_device="nvme"``): one
file per optimizer in the user's directory, created with a name no other run uses and
unlinked at once, so it lives exactly as long as the process holds it (a run killed at any
moment leaves nothing behind), its whole size reserved when it is made (a disk that cannot
hold it is an error then, naming the path; ``posix_fallocate``).  Reads and writes bypass
the page cache (``O_DIRECT``: the data is not held twice in host memory, and the disk's
own bandwidth is what a step sees) where the file system allows it; where it does not
(tmpfs), buffered I/O, said in one line.  Each transfer is split in chunks that a small
pool of threads moves at once (``os.preadv``/``os.pwritev`` release the GIL): enough
requests in flight to keep an NVMe disk busy, with nothing beyond the standard library.

Direct I/O needs the host buffer's address, the file offset and the length to be
multiples of the disk's block size: :func:`aligned_empty` gives such buffers and
:data:`ALIGN` is the unit (4 KiB, which every common logical block size divides).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_fastopt.runtime.byte_sizes import readable_bytes

__all__ = ["ALIGN", "RANGES", "DirectFile", "aligned_empty", "open_unlinked", "round_up"]

ALIGN = 4096  # bytes: addresses, offsets and lengths of every transfer
CHUNK = 8 * 2**20  # bytes a thread moves in one call
THREADS = 4  # transfers in flight (an NVMe disk needs several to reach its bandwidth)
RANGES = {"reading": "fastopt::disk_read", "writing": "fastopt::disk_write"}  # each transfer's profiler range


def round_up(n: int, unit: int = ALIGN) -> int:
    return -(-n // unit) * unit


def aligned_empty(nbytes: int, pin: bool = False) -> Tensor:
    """An uninitialized uint8 host buffer of ``nbytes`` (rounded up to :data:`ALIGN`) whose
    address is a multiple of :data:`ALIGN` (``pin``: in page-locked memory)."""
    size = round_up(max(nbytes, 1))
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + size]


def check_directory(path: str | os.PathLike) -> Path:
    """``path`` as a directory this process can create files in; a ValueError naming it otherwise."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"nvme_path must be a directory on a fast disk (a str or path), got {path!r}")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(f"nvme_path={str(path)!r} is not an existing directory: create it on a fast disk (NVMe) "
                         "first; the optimizer state's working file is made there")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"nvme_path={str(path)!r} is not writable by this process: the optimizer state's working "
                         "file is made there")
    return directory


def why_failed(directory: Path, e: OSError, nbytes: int | None = None) -> str:
    """What to say of ``e`` (a write or reservation in ``directory`` that failed): a full
    disk with what the write needed and what is free, a directory that is gone."""
    if e.errno == errno.ENOSPC:
        try:
            free = f", {readable_bytes(shutil.disk_usage(directory).free)} free"
        except OSError:
            free = ""
        need = f": it needed {readable_bytes(nbytes)}{free}" if nbytes is not None else free
        return f" (the disk is full{need})"
    if not Path(directory).is_dir():
        return " (the directory is gone: removed while the run used it?)"
    return ""


def open_unlinked(directory: Path, flags: int, suffix: str = ".state", what: str = "optimizer state") -> int:
    """A new file in ``directory``, opened with ``flags`` under a name no other run uses and
    unlinked at once: it lives while this process holds it (its descriptor, or a mapping of
    it), and no longer.  A directory removed since it was checked is a FileNotFoundError
    that says so."""
    try:
        fd, name = tempfile.mkstemp(prefix="fastopt-", suffix=suffix, dir=directory)
    except FileNotFoundError as e:
        if Path(directory).is_dir():
            raise
        raise FileNotFoundError(errno.ENOENT, f"lightning_fastopt: nvme_path={str(directory)!r} is gone (removed "
                                f"while the run used it?): the {what}'s files are made there; create it again, or "
                                "give another nvme_path", str(directory)) from e
    os.close(fd)
    try:
        return os.open(name, flags)
    finally:
        os.unlink(name)


class DirectFile:
    """A working file of ``size`` bytes in ``directory`` (see the module's documentation).

    :meth:`read_into` and :meth:`write_from` move the bytes of an aligned host buffer
    (:func:`aligned_empty`) from or to ``offset`` and return a Future done when all of
    them have moved; an error names the file's directory.  :meth:`grow` reserves more.
    """

    def __init__(self, directory: str | os.PathLike, size: int, what: str = "optimizer state") -> None:
        self.directory = check_directory(directory)
        self.what = what
        self.size = 0
        free = shutil.disk_usage(self.directory).free
        if round_up(size) > free:
            raise ValueError(f"nvme_path={str(self.directory)!r} has {readable_bytes(free)} free; the {what} needs "
                             f"{readable_bytes(round_up(size))} there")
        self.direct = True
        try:
            self.fd = open_unlinked(self.directory, os.O_RDWR | getattr(os, "O_DIRECT", 0), what=what)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct = False  # the file system has no direct I/O (tmpfs)
            self.fd = open_unlinked(self.directory, os.O_RDWR, what=what)
        if not self.direct or not hasattr(os, "O_DIRECT"):
            self.direct = False
            rank_zero_info(f"lightning_fastopt: {self.directory} takes no direct I/O: the {what}'s file is read and "
                           "written through the page cache")
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="fastopt-disk")
        self._mapping: mmap.mmap | None = None  # (made by mapped)
        self.grow(size)

    def grow(self, size: int) -> None:
        """Reserve the file's blocks up to ``size`` bytes (rounded up to :data:`ALIGN`)."""
        size = round_up(size)
        if size <= self.size:
            return
        try:
            os.posix_fallocate(self.fd, self.size, size - self.size)
        except OSError as e:
            raise self._error(f"reserving {readable_bytes(size)} for", e, size - self.size) from e
        self.size = size

    def mapped(self, offset: int, nbytes: int) -> Tensor:
        """``nbytes`` of the file from ``offset`` as a uint8 CPU tensor mapped from it, shared
        (it reads what the file holds and writes to it), for a file no direct I/O writes any
        more (the reads and writes of a closed optimizer's state); the mapping keeps the file
        while any such tensor lives, after :meth:`close` too."""
        if self._mapping is None or len(self._mapping) < self.size:
            self._mapping = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes, offset=offset)

    def read_into(self, buffer: Tensor, offset: int) -> Future:
        return self._move(os.preadv, buffer, offset, "reading")

    def write_from(self, buffer: Tensor, offset: int) -> Future:
        return self._move(os.pwritev, buffer, offset, "writing")

    def _move(self, call, buffer: Tensor, offset: int, doing: str) -> Future:
        n = buffer.numel()
        if buffer.dtype != torch.uint8 or offset % ALIGN or n % ALIGN or buffer.data_ptr() % ALIGN:
            raise ValueError(f"direct I/O moves aligned uint8 buffers at aligned offsets (multiples of {ALIGN} "
                             f"bytes), got {n} bytes of {buffer.dtype} at {buffer.data_ptr():#x} to offset {offset}")
        if offset + n > self.size:
            raise ValueError(f"{doing} bytes {offset}..{offset + n} of a file of {self.size}")
        view = memoryview(buffer.numpy())
        parts = [self._pool.submit(self._transfer, call, view[start:start + CHUNK], offset + start, doing)
                 for start in range(0, n, CHUNK)]
        return _all_of(parts)

    def _transfer(self, call, view: memoryview, offset: int, doing: str) -> None:
        done = 0
        with torch.profiler.record_function(RANGES[doing]):  # (benchmarks/timeline.py draws them)
            while done < len(view):
                try:
                    moved = call(self.fd, [view[done:]], offset + done)
                except OSError as e:
                    raise self._error(doing, e, len(view) - done) from e
                if moved <= 0:
                    raise self._error(doing, OSError(errno.EIO, "the file ended early"))
                done += moved

    def _error(self, doing: str, e: OSError, nbytes: int | None = None) -> OSError:
        return OSError(e.errno, f"lightning_fastopt: {doing} the {self.what}'s working file in "
                                f"nvme_path={str(self.directory)!r} failed{why_failed(self.directory, e, nbytes)}: "
                                f"{e.strerror or e}")

    def close(self) -> None:
        """Wait for the transfers in flight, then close the file."""
        self._close(wait=True)

    def _close(self, wait: bool) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
            self._pool = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        """Close without joining the pool's threads: a finalizer runs wherever the garbage
        collector does, even inside ``threading``'s own bookkeeping (a thread starting,
        holding its shutdown locks), where joining a thread deadlocks (the suite hung there
        once, 2026-11-28).  Nothing is in flight by then: each transfer queued holds this
        object; the idle threads end on their own."""
        try:
            self._close(wait=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _all_of(parts: list[Future]) -> Future:
    """A Future done when every one of ``parts`` is, with the first error among them."""
    whole: Future = Future()
    left = [len(parts)]
    lock = threading.Lock()  # the parts end on several threads

    def one_done(_) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            wait(parts)
            errors = [p.exception() for p in parts if p.exception() is not None]
            if errors:
                whole.set_exception(errors[0])
            else:
                whole.set_result(None)
    if not parts:
        whole.set_result(None)
    for p in parts:
        p.add_done_callback(one_done)
    return whole
