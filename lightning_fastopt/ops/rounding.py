"""Which of torch's implementations a step reproduces, rounding for rounding.

torch computes Adam differently on each device: its CPU step (one ATen op after another),
its CPU ``fused=True`` kernel, its CUDA ``foreach`` step (the default there) and its CUDA
``fused=True`` kernel each round in their own places, and their results differ in the last
bits.  A fastopt run must end where the user's own run ends, so the kernels follow the
implementation the user's optimizer would have run, on the CPU as on the GPU, whatever
share of the parameters is offloaded (csrc/cpu/adam.cpp spells out each one):

``"torch_cpu"``           torch's CPU step (the for-loop one).  The default of
                          :class:`FusedAdam` and :class:`FusedSGD`.
``"torch_cuda_foreach"``  torch's CUDA ``foreach`` step (torch >= 2.11).
``"torch_cuda_fused"``    torch's CUDA ``fused=True`` kernel (torch >= 2.11), its scalars in
                          float32, the bias corrections from CUDA's ``powf``.
``"torch_cpu_fused"``     torch's CPU ``fused=True`` kernel: as ``"torch_cpu"`` with the IEEE
                          square root, but for each tensor's last ``numel % 8`` elements,
                          which its scalar loop rounds otherwise (csrc/cpu/tensor_walk.h).
                          CPU tensors only.

SGD takes ``"torch_cpu"`` (its CPU and CUDA foreach steps round alike),
``"torch_cuda_fused"`` (its CUDA kernel subtracts the dampening from 1 in float32 and rounds
the momentum update otherwise in some tensors: csrc/common/sgd_rounding.h) and
``"torch_cpu_fused"`` (:data:`SGD_ROUNDINGS`); Adagrad ``"torch_cpu"`` (its CPU step, its
CUDA foreach step, and its CPU fused kernel with the IEEE square root) and
``"torch_cuda_fused"``, its CUDA fused kernel, which computes in double between float loads
and stores (csrc/common/fused_cuda_adagrad.h; :data:`ADAGRAD_ROUNDINGS`).
:func:`rounding_of` picks the rounding for a torch optimizer from its parameters' device
and its ``fused`` flag.  A ``foreach=False`` optimizer on CUDA (torch's for-loop there
multiplies by the reciprocal of the bias correction) gets ``"torch_cuda_foreach"``, which
differs from it in the last bit of some elements (:func:`unfollowed`: a warning says so).
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from functools import lru_cache

import torch

ROUNDINGS = ("torch_cpu", "torch_cuda_foreach", "torch_cuda_fused", "torch_cpu_fused")
SGD_ROUNDINGS = ("torch_cpu", "torch_cuda_fused", "torch_cpu_fused")
ADAGRAD_ROUNDINGS = ("torch_cpu", "torch_cuda_fused")
CPU_ONLY = ("torch_cpu_fused",)


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
    device and its ``fused`` flag."""
    fused = bool(optimizer.defaults.get("fused"))
    if not _on_cuda(optimizer):
        return "torch_cpu_fused" if fused else "torch_cpu"
    return "torch_cuda_fused" if fused else "torch_cuda_foreach"


def unfollowed(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the kernels cannot end on the bits of ``optimizer`` (a torch Adam, AdamW or
    Adagrad), or None: with ``foreach=False`` on CUDA torch runs its for-loop step, which
    rounds otherwise than its foreach step there (Adam divides by the bias correction
    through a float32 reciprocal, Adagrad's ``addcdiv`` is one fused multiply-add) and is
    not followed; SGD's for-loop step rounds as its foreach step."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)):
        return None
    if not _on_cuda(optimizer) or optimizer.defaults.get("foreach") is not False or optimizer.defaults.get("fused"):
        return None
    return (f"{type(optimizer).__name__}(foreach=False) on CUDA: torch's for-loop step there rounds otherwise than "
            "its foreach step, which the kernels follow, so the run may end an ulp away from the same run without "
            "lightning_fastopt in some elements (docs/correctness.md); foreach=None or True, or fused=True, is "
            "followed bit for bit")


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
