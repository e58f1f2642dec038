"""Which of torch's implementations a step reproduces, rounding for rounding.

torch computes Adam differently on each device: its CPU step (one ATen op after another),
its CPU ``fused=True`` kernel, its CUDA ``foreach`` step (the default there) and its CUDA
``fused=True`` kernel each round in their own places, and their results differ in the last
bits.  A fastopt run must end where the user's own run ends, so the kernels follow the
implementation the user's optimizer would have run, on the CPU as on the GPU, whatever
share of the parameters is offloaded (csrc/cpu/adam_math.h spells out each one):

``"torch_cpu"``           torch's CPU step (the for-loop one).  The default of
                          :class:`FusedAdam` and :class:`FusedSGD`.
``"torch_cuda_foreach"``  torch's CUDA ``foreach`` step (torch >= 2.11).
``"torch_cuda_fused"``    torch's CUDA ``fused=True`` kernel (torch >= 2.11), its scalars in
                          float32, the bias corrections from CUDA's ``powf``.
``"torch_cpu_fused"``     torch's CPU ``fused=True`` kernel: as ``"torch_cpu"`` with the IEEE
                          square root, but for each tensor's last ``numel % 8`` elements,
                          which its scalar loop rounds otherwise (csrc/cpu/tensor_walk.h).
                          CPU tensors only.
``"torch_cuda_for_loop"`` torch's CUDA step with ``foreach=False`` (its for-loop one, torch
                          >= 2.11): as ``"torch_cuda_foreach"`` but that CUDA's division by
                          a host scalar multiplies by its reciprocal (the bias correction:
                          :func:`float_reciprocal`).

SGD takes ``"torch_cpu"`` (its CPU and CUDA foreach steps round alike),
``"torch_cuda_fused"`` (its CUDA kernel subtracts the dampening from 1 in float32 and rounds
the momentum update otherwise in some tensors: csrc/common/sgd_rounding.h) and
``"torch_cpu_fused"`` (:data:`SGD_ROUNDINGS`; its CUDA for-loop step rounds as its foreach
step); Adagrad ``"torch_cpu"`` (its CPU step, its CUDA foreach step, and its CPU fused kernel
with the IEEE square root), ``"torch_cuda_for_loop"`` (its CUDA for-loop step: ``addcdiv``
one fused multiply-add there) and ``"torch_cuda_fused"``, its CUDA fused kernel, which
computes in double between float loads and stores (csrc/common/fused_cuda_adagrad.h;
:data:`ADAGRAD_ROUNDINGS`).  :func:`rounding_of` picks the rounding for a torch optimizer
from its parameters' device and its ``fused`` and ``foreach`` flags.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from functools import lru_cache

import torch

# in the order of the kernels' codes (kernel_code)
ROUNDINGS = ("torch_cpu", "torch_cuda_foreach", "torch_cuda_fused", "torch_cpu_fused", "torch_cuda_for_loop")
SGD_ROUNDINGS = ("torch_cpu", "torch_cuda_fused", "torch_cpu_fused")
ADAGRAD_ROUNDINGS = ("torch_cpu", "torch_cuda_fused", "torch_cuda_for_loop")
CPU_ONLY = ("torch_cpu_fused",)
CUDA_ROUNDINGS = ("torch_cuda_foreach", "torch_cuda_fused", "torch_cuda_for_loop")


def check_rounding(rounding: str, accepted: tuple[str, ...] = ROUNDINGS) -> str:
    if rounding not in accepted:
        raise ValueError(f"rounding must be one of {', '.join(map(repr, accepted))}, got {rounding!r}")
    return rounding


def check_rounding_device(rounding: str, tensors) -> None:
    """A CPU-only rounding (torch's CPU fused kernel) with tensors elsewhere is a ValueError."""
    if rounding in CPU_ONLY:
        device = next((t.device for t in tensors if t.device.type != "cpu"), None)
        if device is not None:
            raise ValueError(f"rounding={rounding!r} is torch's CPU kernel, for CPU tensors, got a tensor on {device}")


def check_torch_sqrt(torch_sqrt: bool, rounding: str) -> None:
    """``torch_sqrt=True`` (torch's CPU square root, MKL's) belongs to the ``"torch_cpu"``
    rounding only: with any other it is a ValueError."""
    if torch_sqrt and rounding != "torch_cpu":
        raise ValueError(f"torch_sqrt=True is torch's CPU square root, for rounding='torch_cpu', got {rounding!r}")


def kernel_code(rounding: str) -> int:
    """The kernels' ``Rounding`` (csrc/common/kernel_args.h) for ``rounding``."""
    return ROUNDINGS.index(rounding)


def _on_cuda(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.device.type == "cuda" for g in optimizer.param_groups for p in g["params"])


def rounding_of(optimizer: torch.optim.Optimizer) -> str:
    """The rounding of the step ``optimizer`` (a torch optimizer) would take: its parameters'
    device and its ``fused`` and ``foreach`` flags (on CUDA torch takes its foreach step
    unless told ``foreach=False``)."""
    fused = bool(optimizer.defaults.get("fused"))
    if not _on_cuda(optimizer):
        return "torch_cpu_fused" if fused else "torch_cpu"
    if fused:
        return "torch_cuda_fused"
    return "torch_cuda_for_loop" if optimizer.defaults.get("foreach") is False else "torch_cuda_foreach"


_POWERS_PER_BLOCK = 1024


def _f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest, ties to even).  One +, -, *, / or square root
    of float32 values computed in double and rounded so is the float32 operation's result
    (double has more than twice float32's precision)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@lru_cache(maxsize=64)
def _float_powers(base: float, block: int) -> tuple[float, ...]:
    """``powf(base, s)`` for the steps s of one block, as torch's CUDA kernels compute it
    (torch.pow of two float32 CUDA tensors runs the same ``powf``); without CUDA, the CPU's
    float32 pow (another implementation: no CUDA run to match here)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = torch.arange(block * _POWERS_PER_BLOCK, (block + 1) * _POWERS_PER_BLOCK, dtype=torch.float32,
                         device=device)
    return tuple(torch.pow(torch.full_like(steps, base), steps).tolist())


def _powf(base: float, step: int) -> float:
    block, at = divmod(int(step), _POWERS_PER_BLOCK)
    return _float_powers(_f32(base), block)[at]


def fused_cuda_scalars(lr: float, beta1: float, beta2: float, step: int,
                       bias_correction: bool = True) -> tuple[float, float]:
    """``(step_size, bias_correction2_sqrt)`` as torch's fused CUDA Adam computes them: in
    float32 from float32 lr and betas and a float32 step count, ``lr / (1 - beta1**step)``
    and ``sqrt(1 - beta2**step)``, each operation rounded once (both are float32 values)."""
    bc1 = _f32(1.0 - _powf(beta1, step)) if bias_correction else 1.0
    bc2 = _f32(1.0 - _powf(beta2, step)) if bias_correction else 1.0
    return _f32(_f32(lr) / bc1), _f32(math.sqrt(bc2))


def float_reciprocal(x: float) -> float:
    """``float(1.0 / x)``: what ATen's CUDA division by a host scalar multiplies by (torch's
    CUDA for-loop Adam divides by its bias correction so): the double reciprocal, rounded
    once to float32.  Measured, not read: ``benchmarks/rounding_probe.py`` on torch
    2.11.0+cu130 (H200, 2026-11-28) found every element so, where float32's own reciprocal
    of the rounded scalar (what ``BinaryDivTrueKernel.cu`` reads as) matched 28.6%."""
    return _f32(1.0 / x)


def sgd_one_minus_dampening(dampening: float, rounding: str) -> float:
    """SGD's ``1 - dampening`` as the step of ``rounding`` rounds it (csrc/common/sgd_rounding.h):
    torch's CUDA fused kernel subtracts the float32 dampening from 1 in float32, its other
    steps round the double ``1 - dampening`` once."""
    if rounding == "torch_cuda_fused":
        return _f32(1.0 - _f32(dampening))  # exact in double, then rounded once: float32's subtraction
    return _f32(1.0 - dampening)


def fused_cuda_adagrad_clr(lr: float, lr_decay: float, step: float) -> float:
    """Adagrad's ``lr / (1 + (step - 1) * lr_decay)`` as torch's fused CUDA kernel computes
    it: ``step - 1`` in float32, the rest in double with the multiply and the add fused."""
    step_minus_one = _f32(_f32(float(step)) - 1.0)
    denom = float(Fraction(step_minus_one) * Fraction(lr_decay) + 1)  # one rounding: fma
    return lr / denom
