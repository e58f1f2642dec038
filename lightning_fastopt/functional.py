"""The optimizer math as functions over lists of tensors.

What the optimizer classes and the offload/ZeRO strategy call.  Every function updates
``params`` and the state lists in place and shares one contract:

- ``params`` and the states are the float32 master copies (half-precision params are
  accepted too and updated in their own dtype; state is always float32);
- ``grads`` may be float32, float16 or bfloat16 and are never modified (except by
  torch's fused CUDA kernels when ``grad_scale`` is not 1, see below);
- ``grad_scale`` (float or 0-dim tensor): the grads are divided by it inside the kernel
  (loss-scale unscaling);
- ``check_finite=True``: if any gradient holds inf or NaN nothing at all is updated and
  the function returns True (the step was skipped); otherwise it returns False;
- ``param_copies``: optional float16/bfloat16 tensors that receive the updated
  parameters in the same pass;
- ``step`` is the step number after this update (1 on the first call).

CPU tensors go to the compiled kernels (one pass over memory, plus a read of the grads
for ``check_finite``).  On CUDA, float32 Adam/AdamW and SGD run torch's fused kernels
(:mod:`lightning_fastopt.ops.torch_fused`, which unscale the gradients in place) until
our CUDA kernels land.  Everything else goes to the pure-PyTorch backend, which computes
the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fastopt.ops import backend_for, torch_backend, torch_fused, unsupported_tensor_error

TensorList = Sequence[Tensor]

__all__ = [
    "by_device", "fused_adagrad_", "fused_adam_", "fused_lamb_", "fused_lars_", "fused_lion_", "fused_sgd_",
    "grads_all_finite", "global_grad_norm",
]


def _scalar(x) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def _inv_scale(grad_scale) -> float:
    """1 / grad_scale rounded to float32, as torch.amp.GradScaler computes it."""
    if grad_scale is None:
        return 1.0
    scale = _scalar(grad_scale)
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"grad_scale must be a positive finite number, got {scale}")
    return float(torch.tensor(scale, dtype=torch.float64).reciprocal().float())


def _grad_scale_value(grad_scale) -> float:
    """grad_scale as a float (1.0 for None), checked as _inv_scale checks it."""
    _inv_scale(grad_scale)
    return 1.0 if grad_scale is None else _scalar(grad_scale)


def _check_lengths(params: TensorList, **lists) -> None:
    n = len(params)
    for name, lst in lists.items():
        if lst is not None and len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} tensors but params has {n}")


def _device_type(params: TensorList) -> str:
    return params[0].device.type if len(params) else "cpu"


def _call(name: str, params: TensorList, *args):
    """Run backend function `name` for the device of params, falling back to the torch
    backend for tensors the compiled kernels do not take (checked before any write)."""
    backend = backend_for(_device_type(params))
    try:
        return getattr(backend, name)(list(params), *args)
    except unsupported_tensor_error(backend):
        return getattr(torch_backend, name)(list(params), *args)


def _list(x):
    return None if x is None else list(x)


def by_device(tensors: TensorList) -> list[list[Tensor]]:
    """The tensors split into one list per device, in order of first appearance."""
    lists: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        lists.setdefault(t.device, []).append(t)
    return list(lists.values())


def grads_all_finite(grads: TensorList) -> bool:
    """True when no gradient holds inf or NaN (the tensors may be on several devices)."""
    return all(bool(_call("all_finite", same)) for same in by_device(grads))


def global_grad_norm(grads: TensorList, grad_scale=None) -> float:
    """The L2 norm of all gradients together (on any devices), unscaled by grad_scale
    (double accumulation)."""
    total = sum(sum(_call("sum_squares", same)) for same in by_device(grads))
    return math.sqrt(total) * _inv_scale(grad_scale)


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs=None, *, step, lr, beta1, beta2, eps,
                weight_decay, amsgrad=False, adamw_mode=True, maximize=False, bias_correction=True,
                grad_scale=None, check_finite=False, param_copies=None) -> bool:
    """Adam (adamw_mode=False, L2 decay) or AdamW (decoupled decay), torch.optim.Adam's formula."""
    _check_lengths(params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                   max_exp_avg_sqs=max_exp_avg_sqs if amsgrad else None, param_copies=param_copies)
    if amsgrad and max_exp_avg_sqs is None:
        raise ValueError("amsgrad=True needs max_exp_avg_sqs")
    if not len(params):
        return False
    lr = _scalar(lr)
    if bias_correction and torch_fused.takes(params, grads, exp_avgs, exp_avg_sqs,
                                             max_exp_avg_sqs if amsgrad else None, copies=param_copies):
        if check_finite and not grads_all_finite(grads):
            return True
        torch_fused.adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step=step, lr=lr, beta1=beta1,
                          beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, adamw=adamw_mode,
                          maximize=maximize, grad_scale=_grad_scale_value(grad_scale))
        return False
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    return _call("adam_", params, list(grads), list(exp_avgs), list(exp_avg_sqs),
                 _list(max_exp_avg_sqs) if amsgrad else None, _list(param_copies), lr, beta1, beta2, eps,
                 weight_decay, lr / bc1, bc2 ** 0.5, _inv_scale(grad_scale), amsgrad, adamw_mode, maximize,
                 check_finite)


def fused_sgd_(params, grads, momentum_buffers=None, *, step, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
               nesterov=False, maximize=False, wd_after_momentum=False, grad_scale=None, check_finite=False,
               param_copies=None) -> bool:
    """SGD with momentum/Nesterov, torch.optim.SGD's formula (apex's wd_after_momentum option).

    On ``step == 1`` the momentum buffers are initialised from the gradient, as torch does.
    """
    _check_lengths(params, grads=grads, momentum_buffers=momentum_buffers if momentum else None,
                   param_copies=param_copies)
    if momentum and momentum_buffers is None:
        raise ValueError("momentum != 0 needs momentum_buffers")
    if not len(params):
        return False
    if not wd_after_momentum and torch_fused.takes(params, grads, momentum_buffers if momentum else None,
                                                   copies=param_copies):
        if check_finite and not grads_all_finite(grads):
            return True
        torch_fused.sgd_(params, grads, momentum_buffers, lr=_scalar(lr), momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, first_step=step == 1,
                         grad_scale=_grad_scale_value(grad_scale))
        return False
    return _call("sgd_", params, list(grads), _list(momentum_buffers) if momentum else None, _list(param_copies),
                 _scalar(lr), momentum, dampening, weight_decay, _inv_scale(grad_scale), nesterov, maximize,
                 wd_after_momentum, step == 1, check_finite)


def fused_adagrad_(params, grads, state_sums, *, step, lr, lr_decay=0.0, weight_decay=0.0, eps=1e-10,
                   maximize=False, grad_scale=None, check_finite=False, param_copies=None) -> bool:
    """Adagrad, torch.optim.Adagrad's formula."""
    _check_lengths(params, grads=grads, state_sums=state_sums, param_copies=param_copies)
    if not len(params):
        return False
    clr = _scalar(lr) / (1 + (step - 1) * lr_decay)
    return _call("adagrad_", params, list(grads), list(state_sums), _list(param_copies), clr, weight_decay, eps,
                 _inv_scale(grad_scale), maximize, check_finite)


def fused_lion_(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay=0.0, maximize=False, grad_scale=None,
                check_finite=False, param_copies=None) -> bool:
    """Lion: p -= lr * sign(lerp(m, g, 1 - beta1)); m = lerp(m, g, 1 - beta2); decoupled decay."""
    _check_lengths(params, grads=grads, exp_avgs=exp_avgs, param_copies=param_copies)
    if not len(params):
        return False
    return _call("lion_", params, list(grads), list(exp_avgs), _list(param_copies), _scalar(lr), beta1, beta2,
                 weight_decay, _inv_scale(grad_scale), maximize, check_finite)


def fused_lamb_(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay,
                bias_correction=True, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False,
                maximize=False, grad_scale=None, check_finite=False, param_copies=None,
                global_grad_norm_value=None) -> bool:
    """LAMB with apex FusedLAMB's semantics (see :class:`lightning_fastopt.FusedLAMB`).

    ``global_grad_norm_value``: the unscaled norm over every gradient that clipping
    should see (all groups, all ranks); computed from ``grads`` when None.
    """
    _check_lengths(params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, param_copies=param_copies)
    if not len(params):
        return False
    if check_finite and not grads_all_finite(grads):
        return True
    norm = global_grad_norm(grads, grad_scale) if global_grad_norm_value is None else _scalar(global_grad_norm_value)
    if not math.isfinite(norm):
        if check_finite:
            return True
        raise ValueError(f"the global gradient norm is {norm}; pass check_finite=True to skip such steps")
    clip = norm / max_grad_norm if max_grad_norm > 0 and norm > max_grad_norm else 1.0
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    _call("lamb_", params, list(grads), list(exp_avgs), list(exp_avg_sqs), _list(param_copies), _scalar(lr), beta1,
          beta2, 1 - beta1 if grad_averaging else 1.0, eps, weight_decay, bc1, bc2, _inv_scale(grad_scale) / clip,
          adam_w_mode, use_nvlamb or weight_decay != 0, maximize)
    return False


def fused_lars_(params, grads, momentum_buffers, *, lr, momentum=0.0, eeta=1e-3, weight_decay=0.0, epsilon=0.0,
                maximize=False, grad_scale=None, check_finite=False, param_copies=None) -> bool:
    """LARS: per-tensor local lr = eeta*||p|| / (||g|| + wd*||p|| + epsilon) (1 if a norm is 0);
    buf = momentum*buf + (g + wd*p); p -= lr*local_lr*buf."""
    _check_lengths(params, grads=grads, momentum_buffers=momentum_buffers, param_copies=param_copies)
    if not len(params):
        return False
    return _call("lars_", params, list(grads), list(momentum_buffers), _list(param_copies), _scalar(lr), momentum,
                 eeta, weight_decay, epsilon, _inv_scale(grad_scale), maximize, check_finite)
