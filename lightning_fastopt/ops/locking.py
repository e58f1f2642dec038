"""A build lock that never hangs forever and never stays stale.

``fcntl.flock`` locks belong to the open file: the kernel drops them when the process
holding them exits, however it exits (even SIGKILL), so a killed build leaves nothing
behind that blocks the next one.  Waiting is bounded by a timeout with a clear error.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


class BuildLockTimeout(TimeoutError):
    pass


@contextlib.contextmanager
def file_lock(path: str, timeout: float, poll: float = 0.1) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed) for the ``with`` body."""
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
                    if time.monotonic() >= deadline:
                        raise BuildLockTimeout(
                            f"waited {timeout:.0f} s for the build lock {path} held by another process; "
                            "raise LIGHTNING_FASTOPT_BUILD_TIMEOUT or build ahead with "
                            "`python -m lightning_fastopt.ops build`"
                        ) from None
                    time.sleep(poll)
        yield
    finally:
        os.close(fd)  # releases the flock
