"""Just-in-time building and loading of our C++/CUDA extensions.

Each build lives in its own directory under ``$TORCH_EXTENSIONS_DIR/lightning_fastopt/``
(torch's default extension root when the variable is unset), named by a key that hashes
everything the binary depends on: the sources, the compiler flags (which include the
instruction set), the compiler version, the torch and Python versions and the machine.
A finished build is marked by a ``BUILD_OK`` file, and a process that finds the marker
imports the shared object directly (a few milliseconds) without invoking ninja.

Building happens under an exclusive ``flock`` with a timeout, so concurrent processes
(several ranks) build once and share the result, and a build killed half-way leaves no
stale lock behind.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache
from types import ModuleType

from lightning_fastopt.ops.locking import file_lock

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


def _import_built(spec: ExtensionSpec, directory: str) -> ModuleType:
    path = os.path.join(directory, spec.name + ".so")  # the name torch.utils.cpp_extension gives it
    loader = importlib.machinery.ExtensionFileLoader(spec.name, path)
    mod_spec = importlib.util.spec_from_file_location(spec.name, path, loader=loader)
    module = importlib.util.module_from_spec(mod_spec)
    loader.exec_module(module)
    return module


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


def is_built(spec: ExtensionSpec) -> bool:
    return os.path.exists(os.path.join(build_dir(spec), _OK_MARKER))


def load_extension(spec: ExtensionSpec, timeout: float | None = None) -> ModuleType:
    """Import the extension, building it first if no finished build exists.

    Raises ExtensionBuildError with the compiler's own message on failure.
    """
    directory = build_dir(spec)
    if os.path.exists(os.path.join(directory, _OK_MARKER)):
        return _import_built(spec, directory)
    missing = missing_tools(spec)
    if missing:
        raise ExtensionBuildError("cannot build, missing: " + "; ".join(missing))
    if timeout is None:
        timeout = float(os.environ.get(BUILD_TIMEOUT_ENV, "900"))
    os.makedirs(directory, exist_ok=True)
    with file_lock(directory + ".lock", timeout=timeout):
        if not os.path.exists(os.path.join(directory, _OK_MARKER)):
            return _build_locked(spec, directory)
    return _import_built(spec, directory)


def _build_locked(spec: ExtensionSpec, directory: str) -> ModuleType:
    from torch.utils import cpp_extension

    # torch's own baton file: we hold the real lock, so one found here is left by a killed build.
    stale = os.path.join(directory, "lock")
    if os.path.exists(stale):
        os.remove(stale)
    try:
        module = cpp_extension.load(
            name=spec.name,
            sources=list(spec.sources),
            extra_cflags=list(spec.cflags),
            extra_cuda_cflags=list(spec.cuda_cflags) or None,
            extra_ldflags=list(spec.ldflags),
            extra_include_paths=list(spec.include_dirs),
            build_directory=directory,
            with_cuda=spec.with_cuda,
            verbose=False,
        )
    except Exception as err:  # torch raises RuntimeError with the captured compiler output
        raise ExtensionBuildError(str(err).strip()) from err
    marker = os.path.join(directory, _OK_MARKER)
    with open(marker + ".tmp", "w") as f:
        f.write(build_key(spec) + "\n")
    os.replace(marker + ".tmp", marker)
    return module
