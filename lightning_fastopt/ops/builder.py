"""Just-in-time building and loading of our C++/CUDA extensions.

Each build lives in its own directory under ``$TORCH_EXTENSIONS_DIR/lightning_fastopt/``
(torch's default extension root when the variable is unset), named by a key that hashes
everything the binary depends on: the sources, the compiler flags (which include the
instruction set), the compiler version, the torch and Python versions and the machine.

The cache heals itself.  A finished build is the shared object plus a record of it
(``BUILD_OK``: its size and SHA-256, written last and atomically); a process checks the
library against the record before importing it (a truncated or emptied file would crash
the process with a bus error, or fail to load), and rebuilds one that does not match,
saying why in one line.  Compiling happens in a fresh staging directory beside the
build's (``KEY.staging-PID-RANDOM``), and only the finished library moves into place:
compilers left running by a killed build can never write into the directory a later
build uses, and the next build removes their staging directories.
``python -m lightning_fastopt.ops clean`` removes every build.

Building happens under an exclusive ``flock`` with a timeout, so concurrent processes
(several ranks) build once and share the result, and a build killed half-way leaves no
stale lock behind.  A build says, on stderr, what it builds, why and about how long it
takes before it starts, and where the result went when it is done.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from types import ModuleType

from lightning_fastopt.ops import build_time
from lightning_fastopt.ops.locking import BuildLockTimeout, file_lock

BUILD_TIMEOUT_ENV = "LIGHTNING_FASTOPT_BUILD_TIMEOUT"
_OK_MARKER = "BUILD_OK"


class ExtensionBuildError(RuntimeError):
    """The extension could not be built or loaded; the message says why."""


@dataclass(frozen=True)
class ExtensionSpec:
    name: str  # Python module name of the extension
    variant: str  # human-readable part of the directory name (e.g. the ISA)
    sources: tuple[str, ...]
    headers: tuple[str, ...] = ()
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    with_cuda: bool = False
    include_dirs: tuple[str, ...] = field(default=())
    title: str = ""  # what a build message calls it, e.g. "the CPU kernels (avx2)"
    core_seconds: float = 0.0  # compile time on one core, measured: the build's time estimate
    speed_key: str = ""  # whose measured speed on this machine scales the estimate (by default the name)
    pieces: frozenset = frozenset()  # what a build of some pieces holds (ops/cpu.py), for the loader


def cache_root() -> str:
    """The directory holding all our builds (respects ``TORCH_EXTENSIONS_DIR``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return os.path.join(root, "lightning_fastopt")


def compiler() -> str:
    return os.environ.get("CXX", "c++")


@lru_cache(maxsize=None)
def compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


@lru_cache(maxsize=None)
def nvcc_version() -> str:
    """The CUDA compiler's version line ("" when there is none)."""
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc:
        return ""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return lines[-1] if out.returncode == 0 and lines else ""


def build_key(spec: ExtensionSpec) -> str:
    import torch

    h = hashlib.sha256()
    for path in sorted(spec.sources + spec.headers):
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    parts = [
        spec.name, spec.variant, " ".join(spec.cflags), " ".join(spec.ldflags), " ".join(spec.cuda_cflags),
        str(spec.with_cuda), compiler_version(compiler()), torch.__version__, str(torch.version.cuda),
        sys.version.split()[0], str(sysconfig.get_config_var("SOABI")), platform.machine(),
        nvcc_version() if spec.with_cuda else "",
    ]
    h.update("\0".join(parts).encode())
    return h.hexdigest()[:16]


def build_dir(spec: ExtensionSpec) -> str:
    return os.path.join(cache_root(), f"{spec.name}-{spec.variant}-{build_key(spec)}")


def _library(spec: ExtensionSpec, directory: str) -> str:
    return os.path.join(directory, spec.name + ".so")  # the name torch.utils.cpp_extension gives it


def _import_built(spec: ExtensionSpec, directory: str) -> ModuleType:
    path = _library(spec, directory)
    loader = importlib.machinery.ExtensionFileLoader(spec.name, path)
    mod_spec = importlib.util.spec_from_file_location(spec.name, path, loader=loader)
    module = importlib.util.module_from_spec(mod_spec)
    loader.exec_module(module)
    return module


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def damage(spec: ExtensionSpec, directory: str | None = None) -> str | None:
    """What is wrong with the build in ``directory`` (its build directory by default):
    "not built" when there is no record of a finished build, None when the library is
    the one the record describes."""
    directory = directory or build_dir(spec)
    try:
        with open(os.path.join(directory, _OK_MARKER)) as f:
            record = json.load(f)
        size, digest = int(record["size"]), str(record["sha256"])
    except FileNotFoundError:
        return "not built"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its record {os.path.join(directory, _OK_MARKER)} is unreadable"
    library = _library(spec, directory)
    try:
        actual = os.path.getsize(library)
    except OSError:
        return f"{library} is missing"
    if actual != size:
        return f"{library} is {actual} bytes where the build wrote {size}"
    if _sha256(library) != digest:
        return f"{library} differs from what the build wrote (SHA-256)"
    return None


def is_built(spec: ExtensionSpec) -> bool:
    return damage(spec) is None


def missing_tools(spec: ExtensionSpec) -> list[str]:
    """Build tools that are not installed, each with a hint."""
    from torch.utils.cpp_extension import is_ninja_available

    missing = []
    if shutil.which(compiler()) is None:
        missing.append(f"C++ compiler {compiler()!r} (install g++ or set CXX)")
    if not is_ninja_available():
        missing.append("ninja (pip install ninja)")
    if spec.with_cuda and shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        missing.append("nvcc (install the CUDA toolkit or set CUDA_HOME)")
    return missing


def load_extension(spec: ExtensionSpec, timeout: float | None = None) -> ModuleType:
    """Import the extension, building it first if no sound finished build exists.

    Raises ExtensionBuildError with the compiler's own message on failure.
    """
    directory = build_dir(spec)
    if damage(spec, directory) is None:
        return _import_built(spec, directory)
    missing = missing_tools(spec)
    if missing:
        raise ExtensionBuildError("cannot build, missing: " + "; ".join(missing))
    if timeout is None:
        timeout = float(os.environ.get(BUILD_TIMEOUT_ENV, "900"))
    _check_writable(os.path.dirname(directory))
    what = spec.title or spec.name
    waited_since = []

    def say_waiting(holder: str) -> None:
        waited_since.append(time.monotonic())
        _say(f"waiting for {what}: another process ({holder}) holds the build lock {directory}.lock")

    with file_lock(directory + ".lock", timeout=timeout, on_wait=say_waiting):
        problem = damage(spec, directory)  # another process may have built it meanwhile
        if problem is not None:
            return _build_locked(spec, directory, problem)
    if waited_since:
        _say(f"{what} built by another process are ready (waited {time.monotonic() - waited_since[0]:.0f} s): "
             f"{directory}")
    return _import_built(spec, directory)


def _check_writable(root: str) -> None:
    """Building needs the cache directory: say which one and the ways out when it cannot be written."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".write-test-{os.getpid()}-{secrets.token_hex(4)}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise ExtensionBuildError(
            f"the kernel cache {root} cannot be written ({err.strerror or err}): point TORCH_EXTENSIONS_DIR at a "
            "writable directory, build ahead where it can be written (`python -m lightning_fastopt.ops build`), "
            "or set LIGHTNING_FASTOPT_BACKEND=torch for the pure-PyTorch path") from None


def _say(message: str) -> None:
    print(f"lightning_fastopt: {message}", file=sys.stderr, flush=True)


def _fresh_staging(directory: str) -> str:
    """An empty staging directory for a build of ``directory``, the old build and the
    staging directories of killed builds removed (their compilers may still run)."""
    shutil.rmtree(directory, ignore_errors=True)
    for stale in glob.glob(glob.escape(directory) + ".staging-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = f"{directory}.staging-{os.getpid()}-{secrets.token_hex(4)}"
    os.makedirs(staging)
    return staging


def _install(spec: ExtensionSpec, staging: str, directory: str) -> str:
    """Move the library built in ``staging`` into ``directory`` (the loaded module keeps its
    mapping), then write the record that marks the build whole (fsynced, atomic); returns
    the library's path."""
    os.makedirs(directory)
    library = _library(spec, directory)
    os.replace(_library(spec, staging), library)
    record = {"key": build_key(spec), "size": os.path.getsize(library), "sha256": _sha256(library)}
    marker = os.path.join(directory, _OK_MARKER)
    with open(marker + ".tmp", "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker + ".tmp", marker)
    shutil.rmtree(staging, ignore_errors=True)
    return library


def _build_locked(spec: ExtensionSpec, directory: str, problem: str) -> ModuleType:
    from torch.utils import cpp_extension

    what = spec.title or spec.name
    if problem == "not built":
        why = "not in the cache yet"
    else:
        why = f"the cached build is damaged: {problem}"
        _say(f"rebuilding {what}: {why}")
    root = os.path.dirname(directory)
    about = ""
    if spec.core_seconds:
        about = f", {build_time.estimate(spec.speed_key or spec.name, spec.core_seconds, len(spec.sources), root)}"
    predicted = build_time.predicted_seconds(spec.core_seconds, len(spec.sources))  # under the load now
    _say(f"building {what} for this machine ({why}{about}, once)")
    start = time.perf_counter()
    staging = _fresh_staging(directory)
    # torch renames a module built again in one process (NAME_v1: its staging directory is new
    # each time), and the library would not be where this build expects it, nor import under
    # its name in the next process: each build of ours has a directory of its own, so the
    # count starts afresh (a cache cleaned, or a build of other pieces, in the same process)
    versions = getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", None)
    if isinstance(versions, dict):
        versions.pop(spec.name, None)
    try:
        with _progress(what, staging, len(spec.sources), start):
            module = cpp_extension.load(
                name=spec.name,
                sources=list(spec.sources),
                extra_cflags=list(spec.cflags),
                extra_cuda_cflags=list(spec.cuda_cflags) or None,
                extra_ldflags=list(spec.ldflags),
                extra_include_paths=list(spec.include_dirs),
                build_directory=staging,
                with_cuda=spec.with_cuda,
                verbose=False,
            )
    except Exception as err:  # torch raises RuntimeError with the captured compiler output
        shutil.rmtree(staging, ignore_errors=True)
        raise ExtensionBuildError(str(err).strip()) from err
    module.__file__ = _install(spec, staging, directory)
    took = time.perf_counter() - start
    if spec.core_seconds:
        build_time.record(spec.speed_key or spec.name, predicted, took, root)
    _say(f"built {what} in {took:.0f} s: {directory}")
    return module


@contextmanager
def _progress(what: str, staging: str, sources: int, start: float):
    """Say each source as ninja finishes compiling it (its log, ``.ninja_log``, gains a line
    per finished step), until the block ends."""
    done = threading.Event()
    said: set[str] = set()

    def say_new() -> None:
        for name in _finished_objects(staging):
            if name not in said:
                said.add(name)
                _say(f"{what}: {name} compiled ({len(said)} of {sources}, {time.perf_counter() - start:.0f} s)")

    def watch() -> None:
        while not done.wait(0.5):
            say_new()

    thread = threading.Thread(target=watch, name="lightning_fastopt build progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        say_new()


def _finished_objects(staging: str) -> list[str]:
    """The object files ninja's log in ``staging`` records as built, in the order built."""
    try:
        with open(os.path.join(staging, ".ninja_log")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    names = []
    for line in lines:
        fields = line.split("\t")
        if len(fields) >= 4 and fields[3].endswith(".o"):
            names.append(fields[3].removesuffix(".cuda.o").removesuffix(".o"))
    return names


def clean() -> tuple[list[str], list[str], int]:
    """Remove every build in the cache: (removed, skipped because a build holds its lock,
    bytes freed).  The lock files stay (removing one that a waiting process has open
    would let two processes build at once)."""
    root = cache_root()
    removed, busy, freed = [], [], 0
    entries = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for entry in entries:
        path = os.path.join(root, entry)
        if entry.endswith(".lock") or not os.path.isdir(path):
            continue
        try:
            with file_lock(os.path.join(root, entry.split(".staging-")[0] + ".lock"), timeout=0):
                freed += _tree_bytes(path)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except BuildLockTimeout:
            busy.append(path)
    return removed, busy, freed


def _tree_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total
