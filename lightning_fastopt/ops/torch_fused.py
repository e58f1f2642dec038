"""torch's own fused kernels (``torch._fused_adam_/_fused_adamw_/_fused_sgd_``) for
accelerator tensors where lightning_fastopt's CUDA kernels are not built, for the rounding
of torch's fused kernel (``rounding="torch_cuda_fused"``) only.

They take the cases they compute exactly as we do: float32 parameters, gradients and
state on one device, bias-corrected Adam, SGD without ``wd_after_momentum``, no
half-precision copies.  Everything else goes to the pure-PyTorch backend.  One
difference from the rest of lightning_fastopt: with a ``grad_scale`` other than 1 torch's
kernels unscale the gradients in place (the step has read them; training zeroes them
next).
"""

from __future__ import annotations

import torch
from torch import Tensor

# device types this path serves (tests add "cpu": torch ships the same kernels there)
DEVICE_TYPES = ("cuda",)


def takes(params, *lists, copies=None) -> bool:
    """True when torch's fused kernels compute this call exactly as ours would (dense,
    contiguous float32 tensors on one device: anything else takes the pure-PyTorch path)."""
    if copies is not None or not len(params):
        return False
    device = params[0].device
    if device.type not in DEVICE_TYPES:
        return False
    for tensors in (params, *lists):
        if tensors is None:
            continue
        for t in tensors:
            if (t.dtype != torch.float32 or t.device != device or t.layout is not torch.strided
                    or not t.is_contiguous()):
                return False
    return True


def _scale(grad_scale: float, device) -> Tensor | None:
    return None if grad_scale == 1.0 else torch.full((), grad_scale, dtype=torch.float32, device=device)


def adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, *, step: int, lr: float, beta1: float,
          beta2: float, eps: float, weight_decay: float, amsgrad: bool, adamw: bool, maximize: bool,
          grad_scale: float) -> None:
    device = params[0].device
    steps = [torch.full((), float(step), dtype=torch.float32, device=device)] * len(params)
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    kernel(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
           list(max_exp_avg_sqs) if amsgrad else [], steps, lr=lr, beta1=beta1, beta2=beta2,
           weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
           grad_scale=_scale(grad_scale, device), found_inf=None)


def sgd_(params, grads, momentum_buffers, *, lr: float, momentum: float, dampening: float, weight_decay: float,
         nesterov: bool, maximize: bool, first_step: bool, grad_scale: float) -> None:
    torch._fused_sgd_(list(params), list(grads), list(momentum_buffers) if momentum else [],
                      weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                      maximize=maximize, is_first_step=first_step,
                      grad_scale=_scale(grad_scale, params[0].device), found_inf=None)
