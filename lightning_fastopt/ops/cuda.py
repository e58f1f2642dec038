"""The CUDA kernel extension: its sources, the GPU architectures it is built for, and
loading it once.

Built only when torch has CUDA, for the compute capabilities in ``TORCH_CUDA_ARCH_LIST``
or, when that is unset, those of the visible GPUs; the architectures and torch's CUDA
version are part of the build's directory name and cache key, so a build for one GPU is
never loaded for another.  As with the CPU extension, a failed build never breaks
anything: `load_cuda_extension` returns None after one warning that quotes the compiler,
and CUDA tensors then take torch's fused kernels or the pure-PyTorch path.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from types import ModuleType

from lightning_fastopt.ops.builder import ExtensionBuildError, ExtensionSpec, load_extension
from lightning_fastopt.ops.cpu import COMMON_HEADERS, source_root

# Adam in four sources, one a rounding (csrc/cuda/adam_roundings.cuh): compiled side by side
CUDA_SOURCES = ("adam.cu", "adam_foreach.cu", "adam_fused.cu", "adam_for_loop.cu", "adam_torch_cpu.cu", "adagrad.cu",
                "lamb.cu", "lars.cu", "lion.cu", "reduce.cu", "sgd.cu", "bindings.cpp")
CUDA_HEADERS = ("adam_roundings.cuh", "chunk_walk.cuh", "cuda_api.h", "elementwise.cuh", "launch_plan.h",
                "multi_tensor_apply.cuh", "optimizer_math.cuh", "tensor_roles.h")
ARCH_ENV = "TORCH_CUDA_ARCH_LIST"
# No FMA contraction: fmaf appears exactly where the CPU kernels use fmadd, so both compute
# the same IEEE operations.  Division and square roots stay IEEE-rounded (no fast math).
_CUDA_CFLAGS = ("-O3", "--fmad=false", "-lineinfo")
_CXX_CFLAGS = ("-O3",)
# one core's compile time for one architecture (the build's time estimate): 82 s with
# MAX_JOBS=2 and 18 s on 16 cores were measured for sm_90 (nvcc 13)
_CORE_SECONDS = 150.0
_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([a-z]?)(\+PTX)?$")


def cuda_unavailable_reason() -> str | None:
    """Why this torch cannot use CUDA kernels at all (None when it can)."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return None


def target_archs() -> tuple[str, ...]:
    """The compute capabilities to build for, e.g. ``("9.0",)``."""
    env = os.environ.get(ARCH_ENV, "").strip()
    if env:
        archs = tuple(a for a in re.split(r"[;\s,]+", env) if a)
        for a in archs:
            if not _ARCH_RE.match(a):
                raise ExtensionBuildError(f"{ARCH_ENV}={env!r}: {a!r} is not a compute capability like 9.0 or 8.6+PTX")
        return archs
    import torch

    if not torch.cuda.is_available():
        raise ExtensionBuildError(f"no CUDA GPU is visible and {ARCH_ENV} is not set: set it to the compute "
                                  "capability to build for (9.0 for an H100)")
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return tuple(f"{major}.{minor}" for major, minor in sorted(caps))


def _gencode(arch: str) -> list[str]:
    major, minor, suffix, ptx = _ARCH_RE.match(arch).groups()
    num = f"{major}{minor}{suffix}"
    flags = [f"-gencode=arch=compute_{num},code=sm_{num}"]
    if ptx:
        flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def cuda_extension_spec(archs: tuple[str, ...] | None = None) -> ExtensionSpec:
    import torch

    reason = cuda_unavailable_reason()
    if reason:
        raise ExtensionBuildError(f"cannot build the CUDA kernels: {reason}")
    archs = target_archs() if archs is None else tuple(archs)
    root = source_root()
    tag = "_".join(a.replace(".", "").replace("+PTX", "ptx") for a in archs)
    return ExtensionSpec(
        name=f"lightning_fastopt_cuda_sm{tag}",
        variant=f"cu{torch.version.cuda.replace('.', '')}-sm{tag}",
        sources=tuple(str(root / "cuda" / s) for s in CUDA_SOURCES),
        headers=(tuple(str(root / "cuda" / h) for h in CUDA_HEADERS)
                 + tuple(str(root / "common" / h) for h in COMMON_HEADERS)),
        cflags=_CXX_CFLAGS,
        cuda_cflags=_CUDA_CFLAGS + tuple(f for a in archs for f in _gencode(a)),
        with_cuda=True,
        title=f"the CUDA kernels (sm_{tag})",
        core_seconds=_CORE_SECONDS * len(archs),
    )


_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}


def load_cuda_extension(warn: bool = True) -> ModuleType | None:
    """The compiled CUDA kernels, built on first use; None if unavailable (after one
    warning, unless torch has no CUDA at all, which needs no warning)."""
    with _lock:
        if "auto" in _loaded:
            return _loaded["auto"]
        module = None
        reason = cuda_unavailable_reason()
        if reason:
            _errors["auto"] = reason
        else:
            try:
                module = load_extension(cuda_extension_spec())
            except (ExtensionBuildError, OSError, ImportError, TimeoutError, ValueError) as err:
                _errors["auto"] = f"{type(err).__name__}: {err}"
                if warn:
                    warnings.warn(
                        "lightning_fastopt: the compiled CUDA optimizers are unavailable; CUDA tensors use "
                        f"torch's fused kernels or the (correct, slower) pure-PyTorch path. Reason:\n{err}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        _loaded["auto"] = module
        return module


def cuda_extension_error() -> str | None:
    return _errors.get("auto")
