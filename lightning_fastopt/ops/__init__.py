"""Building, loading and choosing the optimizer kernels.

A *backend* is a module-like object with the low-level functions ``adam_``, ``sgd_``,
``adagrad_``, ``lion_``, ``lamb_``, ``lars_``, ``all_finite`` and ``sum_squares``, with
the same argument names everywhere (callers pass them by keyword): the compiled CPU
extension, the compiled CUDA extension (plus keyword-only device scalars and
``check_finite_``, ``unscale_``, ``sum_squares_device``), or
:mod:`lightning_fastopt.ops.torch_backend`.  :func:`route` chooses them for a device
type, with the fallback for tensors the compiled kernels refuse.  ``LIGHTNING_FASTOPT_BACKEND`` chooses:
``auto`` (default: compiled when it builds), ``torch`` (always the pure-PyTorch path, and
torch's fused kernels on CUDA) or ``compiled`` (fail if the extension for the tensors'
device does not build).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import NamedTuple

from lightning_fastopt.ops import torch_backend
from lightning_fastopt.ops.builder import ExtensionBuildError
from lightning_fastopt.ops.cpu import cuda_roundings_setting
from lightning_fastopt.ops.cpu_kernels import CpuKernels
from lightning_fastopt.ops.cuda import cuda_extension_error, load_cuda_extension
from lightning_fastopt.ops.isa import detect_isa

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


def check_environment() -> None:
    """Refuse, naming the variable and what it accepts, a setting of ours that cannot
    work (``LIGHTNING_FASTOPT_BACKEND``, ``LIGHTNING_FASTOPT_ISA``,
    ``LIGHTNING_FASTOPT_CUDA_ROUNDINGS``): called when a strategy is built and by the command
    line tools, so the error comes before any training."""
    if backend_choice() != "torch":
        detect_isa()
        cuda_roundings_setting()  # the setting only: no device query at construction


def prepare(device_type: str, cpu_work: bool, pieces=frozenset()) -> None:
    """Load (building if needed) the kernels a run on ``device_type`` will call, now rather
    than at the first optimizer step: the CPU kernels' ``pieces`` (the optimizers'
    :meth:`~lightning_fastopt.optim.base.FusedOptimizer.kernel_pieces`) where the run steps
    on the CPU, or offloads a share there (``cpu_work``).  On an accelerator the CPU kernels
    build beside the accelerator's, on a thread of their own (each build runs its compiler
    processes): one after the other, a GPU run's first set-up waited for both.  A build that
    fails falls back as it would at the step, after one warning."""
    backend = cpu_backend()
    if not (pieces and (device_type == "cpu" or cpu_work) and isinstance(backend, CpuKernels)):
        route(device_type)
        return
    if device_type == "cpu":
        backend.need(pieces)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastopt-cpu-build") as beside:
        cpu_built = beside.submit(backend.need, pieces)
        try:
            route(device_type)
        finally:
            cpu_built.result()  # (its error, where LIGHTNING_FASTOPT_BACKEND=compiled raises one)


_cpu_kernels: dict[str, CpuKernels] = {}


def cpu_backend() -> ModuleType | CpuKernels:
    """The backend for CPU tensors: the compiled kernels (:class:`CpuKernels`, built of the
    pieces the calls need), or the pure-PyTorch one (``LIGHTNING_FASTOPT_BACKEND=torch``)."""
    choice = backend_choice()
    if choice == "torch":
        return torch_backend
    if choice not in _cpu_kernels:
        _cpu_kernels[choice] = CpuKernels(warn=choice == "auto", compiled=choice == "compiled")
    return _cpu_kernels[choice]


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


class Route(NamedTuple):
    """Where a call on tensors of one device runs, chosen before calling (:func:`route`).

    ``kernels`` is called first; ``fallback`` takes the call when ``kernels`` refuses one
    of its tensors (the compiled kernels raise their ``UnsupportedTensor`` before writing
    anything, e.g. for a non-contiguous tensor).  ``cuda``: ``kernels`` are the compiled
    CUDA kernels, which read device-resident scalars on the device; the host backends
    need every scalar as a number."""

    kernels: ModuleType
    fallback: ModuleType
    cuda: bool = False

    def host(self) -> Route:
        """The route without the CUDA kernels: what runs a call they refused."""
        return Route(self.fallback, torch_backend) if self.cuda else self


def route(device_type: str) -> Route:
    """The backends for tensors on a device of this type ("cpu", "cuda", ...)."""
    if device_type == "cpu":
        return Route(cpu_backend(), torch_backend)
    if device_type == "cuda":
        ext = cuda_backend()
        if ext is not None:
            return Route(ext, torch_backend, cuda=True)
    return Route(torch_backend, torch_backend)


def backend_for(device_type: str) -> ModuleType:
    """The backend called first for tensors on a device of this type."""
    return route(device_type).kernels


def unsupported_tensor_error(backend: ModuleType) -> type[BaseException]:
    """The exception a backend raises for tensors it does not take (none for torch)."""
    return getattr(backend, "UnsupportedTensor", _NeverRaised)


class _NeverRaised(Exception):
    pass


__all__ = ["BACKEND_ENV", "KERNELS", "CpuKernels", "ExtensionBuildError", "Route", "backend_for", "check_environment", "cpu_backend",
           "cuda_backend", "prepare", "route", "torch_backend", "unsupported_tensor_error"]
