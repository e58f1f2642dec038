"""The tests' child processes, forked from one that has imported torch already.

A two-process run of a test script spent about 3.5 of its 7 s importing torch, torch's
compiler stack (which Lightning imports) and Lightning, on each rank, on 2 cores.  The
tests that start real processes (DDP, ZeRO, FSDP, torchrun-style ranks: most of the slow
suite) start them from a server process instead, which has imported ``torch``,
``torch._dynamo``, ``torch.distributed`` and ``torchmetrics`` once (1.2 of the 1.4 s
Lightning's import took in each child, transformers included where installed).  Not
Lightning, not ours: their import-time reading of the environment, Lightning's rank among
it, stays the child's own; torchmetrics reads one thing, its rank, which the child sets
again from its own environment.  Each child is a real process with its own arguments,
environment, working directory, standard output and error, run as ``python SCRIPT ARGS``
(or ``-m MODULE``) runs it, the exit handlers included; it differs from a fresh
interpreter in what those imports read when they were imported (the server's
environment: the test process's, without the distributed variables) and in OpenMP's
settings, which libgomp reads once when torch loads it (the tests set none), and numpy's
OpenBLAS, which runs one thread in them (a thread server would make the fork unsafe; the
server checks it runs no other).

``FASTOPT_TESTS_FORK=0`` starts every child as a fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["ForkServer", "fork_server"]

# the server: reads one JSON request a line on stdin, answers one JSON line each on stdout
_SERVER = r'''
import json, os, select, sys
import torch, torch._dynamo, torch.distributed  # noqa: F401  (what every child imports first)
import torchmetrics  # noqa: F401  (Lightning's import of it: 1.2 of its 1.4 s, transformers included where installed)


def child(request):
    import atexit, runpy, traceback
    os.environ.clear()
    os.environ.update(request["env"])
    # what torchmetrics read of the environment when imported: the child's own, as its import would
    torchmetrics.utilities.prints.rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0))
    os.chdir(request["cwd"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def say(message):
    os.write(1, (json.dumps(message) + "\n").encode())


# forking is safe only where nothing runs beside this thread (no OpenMP or other pool started yet)
threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
say({"ready": threads == 1, "threads": threads})
pending = b""
running = set()
while True:
    readable, _, _ = select.select([0], [], [], 0.05)
    if readable:
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if request["op"] == "kill":
                try:
                    os.kill(request["pid"], 9)
                except ProcessLookupError:
                    pass
                continue
            pid = os.fork()
            if pid == 0:
                child(request)
            running.add(pid)
            say({"started": pid})
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        running.discard(pid)
        say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
'''


class ForkServer:
    """A server process (started with ``env``, in ``cwd``) that forks the children."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        # (numpy's OpenBLAS, which torch loads, starts a thread server unless it has one thread)
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env={**env, "OPENBLAS_NUM_THREADS": "1"}, cwd=cwd)
        self._buffer = b""
        self._started: list[int] = []
        self._exited: dict[int, int] = {}
        self._ready = False
        deadline = time.monotonic() + 120
        while not self._ready:
            self._read(deadline)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def start(self, argv: list, env: dict[str, str], cwd: Path, out: Path, err: Path) -> int:
        """A child running ``python ARGV`` with ``env`` in ``cwd``, its output in ``out`` and
        ``err``; returns its pid."""
        self._send({"op": "run", "argv": [str(a) for a in argv], "env": env, "cwd": str(cwd),
                    "out": str(out), "err": str(err)})
        deadline = time.monotonic() + 60
        while not self._started:
            self._read(deadline)
        return self._started.pop(0)

    def poll(self, pid: int) -> int | None:
        """The child's exit code (negative: the signal that ended it), or None while it runs."""
        while select.select([self._proc.stdout], [], [], 0)[0]:
            self._read(time.monotonic() + 5)
        return self._exited.get(pid)

    def kill(self, pid: int) -> None:
        self._send({"op": "kill", "pid": pid})

    def wait(self, pid: int, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while pid not in self._exited:
            self._read(deadline)
        return self._exited[pid]

    def close(self) -> None:
        """End the server (it ends by itself when the session's process does)."""
        self._proc.stdin.close()
        self._proc.wait(timeout=30)

    def _send(self, message: dict) -> None:
        self._proc.stdin.write((json.dumps(message) + "\n").encode())
        self._proc.stdin.flush()

    def _read(self, deadline: float) -> None:
        """Read what the server says (waiting until ``deadline`` for something) and note it."""
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self._proc.stdout], [], [], left)[0]:
            raise RuntimeError("the fork server did not answer")
        data = os.read(self._proc.stdout.fileno(), 1 << 16)
        if not data:
            raise RuntimeError(f"the fork server exited ({self._proc.wait()})")
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "exited" in message:
                self._exited[message["exited"]] = message["code"]
            elif "started" in message:
                self._started.append(message["started"])
            elif "ready" in message:
                if not message["ready"]:
                    raise RuntimeError(f"the fork server runs {message['threads']} threads: forking it is not safe")
                self._ready = True


_server: ForkServer | None = None
_refused = False  # the server could not fork safely: fresh interpreters for the rest of the session


def fork_server(env: dict[str, str], cwd: Path) -> ForkServer | None:
    """The session's fork server (started on first use), or None with ``FASTOPT_TESTS_FORK=0``
    or where it cannot fork safely (a thread besides its own: said once, and not tried again)."""
    global _server, _refused
    if os.environ.get("FASTOPT_TESTS_FORK", "1") == "0" or _refused:
        return None
    if _server is None or not _server.alive():
        try:
            _server = ForkServer(env, cwd)
        except RuntimeError as e:
            _refused = True
            print(f"tests: child processes start as fresh interpreters: {e}", file=sys.stderr)
            return None
    return _server
