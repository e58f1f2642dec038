"""Building, loading and choosing the optimizer kernels.

A *backend* is a module-like object with the low-level functions ``adam_``, ``sgd_``,
``adagrad_``, ``lion_``, ``lamb_``, ``lars_``, ``all_finite`` and ``sum_squares``: the
compiled CPU extension, the compiled CUDA extension (the same functions, plus keyword-only
device scalars and ``check_finite_``, ``unscale_``, ``sum_squares_device``), or
:mod:`lightning_fastopt.ops.torch_backend`.  ``LIGHTNING_FASTOPT_BACKEND`` chooses:
``auto`` (default: compiled when it builds), ``torch`` (always the pure-PyTorch path, and
torch's fused kernels on CUDA) or ``compiled`` (fail if the extension for the tensors'
device does not build).
"""

from __future__ import annotations

import os
from types import ModuleType

from lightning_fastopt.ops import torch_backend
from lightning_fastopt.ops.builder import ExtensionBuildError
from lightning_fastopt.ops.cpu import cpu_extension_error, load_cpu_extension
from lightning_fastopt.ops.cuda import cuda_extension_error, load_cuda_extension

BACKEND_ENV = "LIGHTNING_FASTOPT_BACKEND"
_CHOICES = ("auto", "torch", "compiled")

# The optimizer kernels every backend provides, with the optimizers of
# lightning_fastopt.optim that run on each (named for `python -m lightning_fastopt.ops info`;
# ops stays below optim and does not import it).
KERNELS = {
    "adam_": ("FusedAdam", "CPUAdam"),
    "adagrad_": ("FusedAdagrad",),
    "lamb_": ("FusedLAMB",),
    "lars_": ("FusedLars",),
    "lion_": ("FusedLion",),
    "sgd_": ("FusedSGD",),
}


def backend_choice() -> str:
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected one of {_CHOICES}")
    return choice


def cpu_backend() -> ModuleType:
    """The backend for CPU tensors."""
    choice = backend_choice()
    if choice == "torch":
        return torch_backend
    ext = load_cpu_extension(warn=choice == "auto")
    if ext is None:
        if choice == "compiled":
            raise ExtensionBuildError(
                f"{BACKEND_ENV}=compiled but the CPU extension is unavailable: {cpu_extension_error()}"
            )
        return torch_backend
    return ext


def cuda_backend() -> ModuleType | None:
    """The compiled CUDA kernels, or None when they are not to be used or did not build."""
    choice = backend_choice()
    if choice == "torch":
        return None
    ext = load_cuda_extension(warn=choice == "auto")
    if ext is None and choice == "compiled":
        raise ExtensionBuildError(
            f"{BACKEND_ENV}=compiled but the CUDA extension is unavailable: {cuda_extension_error()}"
        )
    return ext


def backend_for(device_type: str) -> ModuleType:
    """The backend for tensors on a device of this type ("cpu", "cuda", ...)."""
    if device_type == "cpu":
        return cpu_backend()
    if device_type == "cuda":
        ext = cuda_backend()
        return ext if ext is not None else torch_backend
    return torch_backend


def unsupported_tensor_error(backend: ModuleType) -> type[BaseException]:
    """The exception a backend raises for tensors it does not take (none for torch)."""
    return getattr(backend, "UnsupportedTensor", _NeverRaised)


class _NeverRaised(Exception):
    pass


__all__ = ["BACKEND_ENV", "KERNELS", "ExtensionBuildError", "backend_for", "cpu_backend", "cuda_backend", "torch_backend",
           "unsupported_tensor_error"]
