"""A build lock that never hangs forever and never stays stale.

``fcntl.flock`` locks belong to the open file: the kernel drops them when the process
holding them exits, however it exits (even SIGKILL), so a killed build leaves nothing
behind that blocks the next one.  Waiting is bounded by a timeout with a clear error.
The holder writes its pid and the time it took the lock into the file, so that a process
that has to wait can say for whom (:func:`holder_of`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


class BuildLockTimeout(TimeoutError):
    pass


@contextlib.contextmanager
def file_lock(path: str, timeout: float, poll: float = 0.1,
              on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed) for the ``with`` body;
    ``on_wait(holder)`` is called once if another process holds it (:func:`holder_of`)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if fcntl is not None:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if on_wait is not None:
                        on_wait(holder_of(path))
                        on_wait = None
                    if time.monotonic() >= deadline:
                        raise BuildLockTimeout(
                            f"waited {timeout:.0f} s for the build lock {path} held by another process; "
                            "raise LIGHTNING_FASTOPT_BUILD_TIMEOUT or build ahead with "
                            "`python -m lightning_fastopt.ops build`"
                        ) from None
                    time.sleep(poll)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {time.time():.0f}".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def holder_of(path: str) -> str:
    """Who holds the lock on ``path``, as its holder wrote it: ``pid N since HH:MM:SS``
    (``unknown`` when unreadable)."""
    try:
        with open(path) as f:
            pid, since = f.read().split()
        return f"pid {int(pid)} since {time.strftime('%H:%M:%S', time.localtime(float(since)))}"
    except (OSError, ValueError):
        return "unknown"
