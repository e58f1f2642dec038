"""The optimizer math as functions over lists of tensors.

What the optimizer classes and the offload/ZeRO strategy call.  Every function updates
``params`` and the state lists in place and shares one contract:

- ``params`` and the states are the float32 master copies (half-precision params are
  accepted too and updated in their own dtype; state is always float32);
- ``grads`` may be float32, float16 or bfloat16 and are never modified (except by
  torch's fused CUDA kernels when ``grad_scale`` is not 1, see below);
- ``grad_scale`` (float or one-element tensor): the grads are divided by it inside the
  kernel (loss-scale unscaling);
- ``grad_factors`` (Adam, SGD, Adagrad, Lion: numbers, in order): the update reads each
  gradient multiplied by each factor, rounded to the gradient's dtype after each, as
  multiplying the gradients in place by each (``torch._foreach_mul_``: clipping's
  coefficient) would leave them, and the gradients stay as they are; the CPU kernels do
  it as they read the gradient (no pass of its own), elsewhere on copies;
- ``check_finite=True``: if any gradient holds inf or NaN nothing at all is updated and
  the function returns True (the step was skipped); otherwise it returns False;
- ``found_inf`` (one-element float32 tensor, torch.amp's flag): when it is nonzero
  nothing is updated.  The CUDA kernels read it on the device (no synchronisation; the
  function then returns False without knowing); elsewhere it is read on the host and
  the function returns True when it was set;
- ``param_copies``: optional float16/bfloat16 tensors that receive the updated
  parameters in the same pass;
- ``step`` is the step number after this update (1 on the first call), an int or a
  one-element float32 tensor; ``lr`` a float or a one-element tensor.  On the CUDA
  kernels, a ``step`` tensor on the parameters' device (with a device ``lr`` tensor, or a
  float ``lr``) is read on the device: such a call never waits for the GPU and can be
  captured in a CUDA graph.

CPU tensors go to the compiled CPU kernels (one pass over memory, plus a read of the
grads for ``check_finite``).  CUDA tensors go to the compiled CUDA kernels (one
multi-tensor launch series per dtype combination); when those are unavailable, float32
Adam/AdamW and SGD run torch's fused kernels (:mod:`lightning_fastopt.ops.torch_fused`,
which unscale the gradients in place) and everything else the pure-PyTorch backend,
which computes the same thing.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import Tensor

from lightning_fastopt import ops
from lightning_fastopt.ops import Route, torch_fused, unsupported_tensor_error
from lightning_fastopt.ops.torch_backend import times_factors
from lightning_fastopt.ops.rounding import (ADAGRAD_ROUNDINGS, SGD_ROUNDINGS, check_rounding,
                                            check_rounding_device, check_torch_sqrt, fused_cuda_adagrad_clr,
                                            fused_cuda_scalars, kernel_code)

TensorList = Sequence[Tensor]

__all__ = [
    "by_device", "fused_adagrad_", "fused_adam_", "fused_lamb_", "fused_lars_", "fused_lion_", "fused_sgd_",
    "grads_all_finite", "global_grad_norm", "lamb_update_norms", "sum_of_squares", "unscale_grads_",
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


def _route(tensors: TensorList) -> Route:
    """The backends for a call on these tensors (all on the device of the first)."""
    return ops.route(_device_type(tensors))


def _call(route: Route, name: str, **kwargs):
    """Run backend function ``name`` by keyword on the route's kernels; a tensor they
    refuse (checked before any write) sends the call to the route's fallback."""
    try:
        return getattr(route.kernels, name)(**kwargs)
    except unsupported_tensor_error(route.kernels):
        return getattr(route.fallback, name)(**kwargs)


def _list(x):
    return None if x is None else list(x)


class _NotForTheCudaKernels(Exception):
    """The CUDA kernels refused a tensor (before touching anything): redo on the host."""


def _routed(body):
    """The public function of ``body(route, params, ...)``: the route is chosen once, from
    the tensors' device.  On CUDA tensors the compiled kernels check every tensor (dense,
    contiguous, on params[0]'s device) in C++ before anything is modified, since checking
    thousands of tensors here would cost more than the step; when they refuse one, the
    call runs on :meth:`Route.host` (torch's fused kernels or the pure-PyTorch path)."""

    @functools.wraps(body)
    def call(params, *args, **kwargs):
        route = _route(params)
        try:
            return body(route, params, *args, **kwargs)
        except _NotForTheCudaKernels:
            return body(route.host(), params, *args, **kwargs)

    signature = inspect.signature(body)
    call.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
    return call


def _device_scalar(t: Tensor, device: torch.device) -> Tensor:
    return t.detach().reshape(1).to(device=device, dtype=torch.float32)


@dataclass
class _Scalars:
    """The scalars of one call.  With the CUDA kernels, tensors on the parameters' device
    travel as device pointers (``kwargs``) and are never read here; otherwise every value
    is read on the host."""

    ext: ModuleType | None
    kwargs: dict = field(default_factory=dict)
    lr: float = 0.0
    step: int = 1
    inv_scale: float = 1.0


def _scalars(route: Route, params: TensorList, *, lr=0.0, step=1, grad_scale=None, found_inf=None,
             counts_steps: bool = True) -> _Scalars | None:
    """Resolve a call's scalars; None when found_inf, read on the host, says skip.

    A device ``lr`` is read on the device together with a device ``step`` (the bias
    corrections need both), or alone by algorithms that do not count steps."""
    ext = route.kernels if route.cuda else None
    if ext is None:
        if found_inf is not None and _scalar(found_inf) != 0:
            return None
        return _Scalars(None, lr=_scalar(lr), step=int(_scalar(step)), inv_scale=_inv_scale(grad_scale))
    device = params[0].device
    out = _Scalars(ext)
    if isinstance(grad_scale, Tensor) and grad_scale.device == device:
        out.kwargs["grad_scale"] = _device_scalar(grad_scale, device)
    else:
        out.inv_scale = _inv_scale(grad_scale)
    if found_inf is not None:
        out.kwargs["found_inf"] = _device_scalar(found_inf, device)
    device_step = isinstance(step, Tensor) and step.device == device
    if device_step:
        out.kwargs["step_tensor"] = _device_scalar(step, device)
    if device_step or not counts_steps:
        if isinstance(lr, Tensor) and lr.device == device:
            out.kwargs["lr_tensor"] = _device_scalar(lr, device)
        else:
            out.lr = _scalar(lr)
    if not device_step:
        out.step = int(_scalar(step))
        if counts_steps:
            out.lr = _scalar(lr)
    return out


def _run(sc: _Scalars, route: Route, name: str, cuda_kwargs: dict | None = None, **kwargs):
    """Call kernel function ``name`` by keyword: on the CUDA kernels (with the device
    scalars and ``cuda_kwargs``; ``grad_factors`` applied to copies of the gradients, which
    they do not read) when the scalars were resolved for them, else on the route's host
    backends."""
    if sc.ext is not None:
        factors = kwargs.pop("grad_factors", [])
        if factors:
            kwargs["grads"] = times_factors(kwargs["grads"], factors)
        return _on_cuda(sc.ext, name, **kwargs, **(cuda_kwargs or {}), **sc.kwargs)
    return _call(route, name, **kwargs)


def _on_cuda(ext: ModuleType, name: str, **kwargs):
    """Call a CUDA-kernel function; a tensor it refuses becomes _NotForTheCudaKernels."""
    try:
        return getattr(ext, name)(**kwargs)
    except ext.UnsupportedTensor as err:
        raise _NotForTheCudaKernels(str(err)) from err


def by_device(tensors: TensorList) -> list[list[Tensor]]:
    """The tensors split into one list per device, in order of first appearance."""
    lists: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        lists.setdefault(t.device, []).append(t)
    return list(lists.values())


def scale_grads_(grads: TensorList, factor: Tensor) -> None:
    """Multiply each tensor in place by ``factor`` (a float32 tensor: clipping's coefficient),
    as ``torch._foreach_mul_`` does, on each one's device (``factor`` moved there); a tensor
    listed twice is multiplied once."""
    unique = list({id(g): g for g in grads}.values())
    for same in by_device(unique):
        torch._foreach_mul_(same, factor.to(same[0].device))


def checked_grad_factors(grad_factors, check_finite: bool) -> list[float]:
    """``grad_factors`` as numbers, each finite, refused beside ``check_finite`` (which
    checks the gradients as they are, not as the factors make them)."""
    factors = [_scalar(f) for f in grad_factors]
    for f in factors:
        if not math.isfinite(f):
            raise ValueError(f"grad_factors must be finite numbers, got {f}")
    if factors and check_finite:
        raise ValueError("check_finite reads the gradients before grad_factors: pass one or the other "
                         "(check them with grads_all_finite first)")
    return factors


def grads_all_finite(grads: TensorList) -> bool:
    """True when no gradient holds inf or NaN (the tensors may be on several devices)."""
    return all(bool(_call(_route(same), "all_finite", tensors=list(same))) for same in by_device(grads))


def square_sums(tensors: TensorList) -> list[float]:
    """Each tensor's sum of the squares of its elements (double accumulation, the
    multi-tensor L2-norm kernels on CPU and CUDA), in the tensors' order (on any devices)."""
    at = {id(t): i for i, t in enumerate(tensors)}
    out = [0.0] * len(tensors)
    for same in by_device(tensors):
        for t, v in zip(same, _call(_route(same), "sum_squares", tensors=list(same))):
            out[at[id(t)]] = v
    return out


def sum_of_squares(tensors: TensorList) -> float:
    """The sum of the squares of every element of every tensor (on any devices): the
    tensors' :func:`square_sums` added in their order."""
    return sum(square_sums(tensors))


def norm_of_square_sums(sums: list[float], grad_scale=None) -> float:
    """The L2 norm of tensors whose :func:`square_sums` are ``sums`` (added in their
    order), unscaled by grad_scale."""
    return math.sqrt(sum(sums)) * _inv_scale(grad_scale)


def global_grad_norm(grads: TensorList, grad_scale=None) -> float:
    """The L2 norm of all gradients together (on any devices), unscaled by grad_scale
    (double accumulation)."""
    return norm_of_square_sums(square_sums(grads), grad_scale)


def unscale_grads_(grads: TensorList, grad_scale, found_inf: Tensor | None = None) -> None:
    """Divide the gradients by grad_scale in place (one pass per device).  With
    ``found_inf`` (a one-element float32 tensor), set it to 1 if any gradient holds inf
    or NaN; on the CUDA kernels, when found_inf is on the gradients' device, this is
    done in the same pass and without synchronising."""
    inv = _inv_scale(grad_scale)
    for same in by_device(grads):
        route = _route(same)
        if route.cuda:
            ext = route.kernels
            local = found_inf is not None and found_inf.device == same[0].device
            flag = found_inf if local else torch.zeros(1, dtype=torch.float32, device=same[0].device)
            try:
                ext.unscale_(grads=list(same), inv_grad_scale=inv, found_inf=flag)
            except ext.UnsupportedTensor:
                pass  # a non-contiguous gradient: nothing was touched, torch does it below
            else:
                if found_inf is not None and not local:
                    found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device).reshape(found_inf.shape)))
                continue
        if found_inf is not None and not grads_all_finite(same):
            found_inf.fill_(1.0)
        torch._foreach_mul_(list(same), inv)


@_routed
def fused_adam_(route, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs=None, *, step, lr, beta1, beta2, eps,
                weight_decay, amsgrad=False, adamw_mode=True, maximize=False, bias_correction=True,
                grad_scale=None, check_finite=False, found_inf=None, param_copies=None, torch_sqrt=False,
                rounding="torch_cpu", index_bases=None, grad_factors=()) -> bool:
    """Adam (adamw_mode=False, L2 decay) or AdamW (decoupled decay), torch.optim.Adam's formula,
    each operation rounded as the torch implementation ``rounding`` names rounds it
    (:mod:`lightning_fastopt.ops.rounding`; by default torch's CPU step), with the IEEE square
    root (``torch_sqrt``: torch's CPU square root, see :class:`~lightning_fastopt.optim.adam.FusedAdam`).

    ``exp_avgs`` and ``exp_avg_sqs`` are float32, or (CPU, float32 params, no amsgrad)
    bfloat16, stored with stochastic rounding seeded by the step count and each element's
    index in its tensor (:func:`lightning_fastopt.ops.torch_backend.round_bf16_stochastic`);
    ``index_bases``, where given, the index of each tensor's first element in a whole tensor
    it is a piece of, so that a tensor stepped in pieces rounds as the whole one does."""
    factors = checked_grad_factors(grad_factors, check_finite)
    check_rounding(rounding)
    check_rounding_device(rounding, params)
    check_torch_sqrt(torch_sqrt, rounding)
    _check_lengths(params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                   max_exp_avg_sqs=max_exp_avg_sqs if amsgrad else None, param_copies=param_copies)
    if amsgrad and max_exp_avg_sqs is None:
        raise ValueError("amsgrad=True needs max_exp_avg_sqs")
    if not len(params):
        return False
    maxes = max_exp_avg_sqs if amsgrad else None
    sc = _scalars(route, params, lr=lr, step=step, grad_scale=grad_scale, found_inf=found_inf)
    if sc is None:
        return True
    if (sc.ext is None and rounding == "torch_cuda_fused" and bias_correction
            and torch_fused.takes(params, grads, exp_avgs, exp_avg_sqs, maxes, copies=param_copies)):
        if check_finite and not grads_all_finite(grads):
            return True
        torch_fused.adam_(params, times_factors(grads, factors), exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                          step=sc.step, lr=sc.lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          amsgrad=amsgrad, adamw=adamw_mode, maximize=maximize,
                          grad_scale=_grad_scale_value(grad_scale))
        return False
    if rounding == "torch_cuda_fused":
        step_size, bc2_sqrt = fused_cuda_scalars(sc.lr, beta1, beta2, sc.step, bias_correction)
    else:
        bc1 = 1 - beta1 ** sc.step if bias_correction else 1.0
        bc2 = 1 - beta2 ** sc.step if bias_correction else 1.0
        step_size, bc2_sqrt = sc.lr / bc1, bc2 ** 0.5
    return _run(sc, route, "adam_", cuda_kwargs={"bias_correction": bias_correction},
                params=list(params), grads=list(grads), exp_avgs=list(exp_avgs), exp_avg_sqs=list(exp_avg_sqs),
                max_exp_avg_sqs=_list(maxes), copies=_list(param_copies), lr=sc.lr, beta1=beta1, beta2=beta2,
                eps=eps, weight_decay=weight_decay, step_size=step_size, bias_correction2_sqrt=bc2_sqrt,
                inv_grad_scale=sc.inv_scale, amsgrad=amsgrad, adamw=adamw_mode, maximize=maximize,
                check_finite=check_finite, state_seed=sc.step & 0xFFFFFFFF, decay=1 - sc.lr * weight_decay,
                torch_sqrt=torch_sqrt, rounding=kernel_code(rounding), index_bases=list(index_bases or []),
                grad_factors=factors)


@_routed
def fused_sgd_(route, params, grads, momentum_buffers=None, *, step, lr, momentum=0.0, dampening=0.0,
               weight_decay=0.0, nesterov=False, maximize=False, wd_after_momentum=False, grad_scale=None,
               check_finite=False, found_inf=None, param_copies=None, rounding="torch_cpu", grad_factors=()) -> bool:
    """SGD with momentum/Nesterov, torch.optim.SGD's formula (apex's wd_after_momentum option),
    each operation rounded as torch's CPU step (and its CUDA foreach step) rounds it, or as
    its CUDA fused kernel (``rounding="torch_cuda_fused"``) or its CPU fused kernel
    (``"torch_cpu_fused"``, CPU tensors) (:mod:`lightning_fastopt.ops.rounding`).

    On ``step == 1`` the momentum buffers are initialised from the gradient, as torch does.
    """
    factors = checked_grad_factors(grad_factors, check_finite)
    check_rounding(rounding, SGD_ROUNDINGS)
    check_rounding_device(rounding, params)
    _check_lengths(params, grads=grads, momentum_buffers=momentum_buffers if momentum else None,
                   param_copies=param_copies)
    if momentum and momentum_buffers is None:
        raise ValueError("momentum != 0 needs momentum_buffers")
    if not len(params):
        return False
    buffers = momentum_buffers if momentum else None
    # SGD's step only says whether this is the first one: it is an int here
    sc = _scalars(route, params, lr=lr, grad_scale=grad_scale, found_inf=found_inf, counts_steps=False)
    if sc is None:
        return True
    if (sc.ext is None and rounding == "torch_cuda_fused" and not wd_after_momentum
            and torch_fused.takes(params, grads, buffers, copies=param_copies)):
        if check_finite and not grads_all_finite(grads):
            return True
        torch_fused.sgd_(params, times_factors(grads, factors), momentum_buffers, lr=sc.lr, momentum=momentum,
                         dampening=dampening, weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                         first_step=step == 1, grad_scale=_grad_scale_value(grad_scale))
        return False
    return _run(sc, route, "sgd_", params=list(params), grads=list(grads), momentum_buffers=_list(buffers),
                copies=_list(param_copies), lr=sc.lr, momentum=momentum, dampening=dampening,
                weight_decay=weight_decay, inv_grad_scale=sc.inv_scale, nesterov=nesterov, maximize=maximize,
                wd_after_momentum=wd_after_momentum, first_step=step == 1, check_finite=check_finite,
                rounding=kernel_code(rounding), grad_factors=factors)


@_routed
def fused_adagrad_(route, params, grads, state_sums, *, step, lr, lr_decay=0.0, weight_decay=0.0, eps=1e-10,
                   maximize=False, grad_scale=None, check_finite=False, found_inf=None, param_copies=None,
                   torch_sqrt=False, rounding="torch_cpu", grad_factors=()) -> bool:
    """Adagrad, torch.optim.Adagrad's formula, each operation rounded as torch's default CPU
    step rounds it, with the IEEE square root (``torch_sqrt``: torch's CPU square root), or
    (``rounding="torch_cuda_fused"``) as its fused CUDA kernel, in double, or
    (``"torch_cuda_for_loop"``) as its CUDA for-loop step (:mod:`lightning_fastopt.ops.rounding`)."""
    factors = checked_grad_factors(grad_factors, check_finite)
    check_rounding(rounding, ADAGRAD_ROUNDINGS)
    check_torch_sqrt(torch_sqrt, rounding)
    _check_lengths(params, grads=grads, state_sums=state_sums, param_copies=param_copies)
    if not len(params):
        return False
    sc = _scalars(route, params, lr=lr, step=step, grad_scale=grad_scale, found_inf=found_inf)
    if sc is None:
        return True
    if rounding == "torch_cuda_fused":
        clr = fused_cuda_adagrad_clr(sc.lr, lr_decay, sc.step)
    else:
        clr = sc.lr / (1 + (sc.step - 1) * lr_decay)
    return _run(sc, route, "adagrad_", cuda_kwargs={"lr": sc.lr, "lr_decay": lr_decay},
                params=list(params), grads=list(grads), state_sums=list(state_sums), copies=_list(param_copies),
                clr=clr, weight_decay=weight_decay, eps=eps, inv_grad_scale=sc.inv_scale, maximize=maximize,
                check_finite=check_finite, torch_sqrt=torch_sqrt, rounding=kernel_code(rounding),
                grad_factors=factors)


@_routed
def fused_lion_(route, params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay=0.0, maximize=False,
                grad_scale=None, check_finite=False, found_inf=None, param_copies=None, grad_factors=()) -> bool:
    """Lion: p -= lr * sign(lerp(m, g, 1 - beta1)); m = lerp(m, g, 1 - beta2); decoupled decay."""
    factors = checked_grad_factors(grad_factors, check_finite)
    _check_lengths(params, grads=grads, exp_avgs=exp_avgs, param_copies=param_copies)
    if not len(params):
        return False
    sc = _scalars(route, params, lr=lr, grad_scale=grad_scale, found_inf=found_inf, counts_steps=False)
    if sc is None:
        return True
    return _run(sc, route, "lion_", params=list(params), grads=list(grads), exp_avgs=list(exp_avgs),
                copies=_list(param_copies), lr=sc.lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                inv_grad_scale=sc.inv_scale, maximize=maximize, check_finite=check_finite, grad_factors=factors)


@_routed
def fused_lamb_(route, params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay,
                bias_correction=True, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False,
                maximize=False, grad_scale=None, check_finite=False, found_inf=None, param_copies=None,
                global_grad_norm_value=None, norms=None) -> bool:
    """LAMB with apex FusedLAMB's semantics (see :class:`lightning_fastopt.FusedLAMB`).

    ``global_grad_norm_value``: the unscaled norm over every gradient that clipping
    should see (all groups, all ranks); computed from ``grads`` when None (on the CUDA
    kernels: on the device, without synchronising, unless ``check_finite`` asks for a
    host answer first).  The host path raises on a non-finite norm; the device path
    cannot, so guard it with ``check_finite`` or ``found_inf`` when gradients may
    overflow (FusedLAMB always passes a host norm and raises).

    ``norms``: where ``params`` are pieces of larger tensors (FSDP2's rows), each whole
    tensor's (||p||^2, ||u||^2) (a float64 CPU tensor [len(params), 2], the pieces'
    :func:`lamb_update_norms` summed), which the trust ratios then take (the CUDA kernels
    round them to float32, where they keep their own per-chunk partial sums).
    """
    _check_lengths(params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, param_copies=param_copies)
    if not len(params):
        return False
    sc = _scalars(route, params, lr=lr, step=step, grad_scale=grad_scale, found_inf=found_inf)
    if sc is None:
        return True
    if check_finite and not grads_all_finite(grads):
        return True
    tensors = dict(params=list(params), grads=list(grads), exp_avgs=list(exp_avgs), exp_avg_sqs=list(exp_avg_sqs),
                   copies=_list(param_copies))
    scalars = dict(lr=sc.lr, use_trust_ratio=use_nvlamb or weight_decay != 0,
                   **_lamb_scalars(sc.step, beta1, beta2, eps, weight_decay, bias_correction, adam_w_mode,
                                   grad_averaging, maximize))
    if norms is not None:
        scalars["norms"] = norms
    if sc.ext is not None and global_grad_norm_value is None:
        _, total = _on_cuda(sc.ext, "sum_squares_device", tensors=list(grads))  # clipping resolved on the device
        _run(sc, route, "lamb_", **tensors, **scalars, grad_factor=sc.inv_scale,
             cuda_kwargs={"bias_correction": bias_correction, "grad_sum_squares": total,
                          "max_grad_norm": max_grad_norm, "inv_grad_scale": sc.inv_scale})
        return False
    factor, norm = _lamb_grad_factor(grads, grad_scale, global_grad_norm_value, max_grad_norm)
    if factor is None:
        if check_finite:
            return True
        raise ValueError(f"the global gradient norm is {norm}; pass check_finite=True to skip such steps")
    _run(sc, route, "lamb_", **tensors, **scalars, grad_factor=factor, cuda_kwargs={"bias_correction": bias_correction})
    return False


def _lamb_scalars(step: int, beta1, beta2, eps, weight_decay, bias_correction, adam_w_mode, grad_averaging,
                  maximize) -> dict:
    """The LAMB kernels' scalars of step number ``step`` (those :func:`lamb_update_norms` takes too)."""
    return dict(beta1=beta1, beta2=beta2, beta3=1 - beta1 if grad_averaging else 1.0, eps=eps,
                weight_decay=weight_decay, bias_correction1=1 - beta1 ** step if bias_correction else 1.0,
                bias_correction2=1 - beta2 ** step if bias_correction else 1.0, adam_w_mode=adam_w_mode,
                maximize=maximize)


def _lamb_grad_factor(grads, grad_scale, global_grad_norm_value, max_grad_norm) -> tuple[float | None, float]:
    """What LAMB multiplies each gradient by: the loss scale's inverse over the clipping
    divisor of the global norm (``global_grad_norm_value``, or that of ``grads``; None when
    that norm is not finite), and the norm."""
    norm = global_grad_norm(grads, grad_scale) if global_grad_norm_value is None else _scalar(global_grad_norm_value)
    if not math.isfinite(norm):
        return None, norm
    clip = norm / max_grad_norm if max_grad_norm > 0 and norm > max_grad_norm else 1.0
    return _inv_scale(grad_scale) / clip, norm


def lamb_update_norms(params, grads, exp_avgs, exp_avg_sqs, *, step, beta1, beta2, eps, weight_decay,
                      bias_correction=True, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
                      maximize=False, grad_scale=None, global_grad_norm_value=None) -> Tensor:
    """Each parameter's (||p||^2, ||u||^2), ``u`` the update :func:`fused_lamb_` with the
    same arguments would make, nothing written: a float64 CPU tensor [len(params), 2]
    (the compiled CPU kernels on CPU tensors, the pure-PyTorch path elsewhere).  Where the
    parameters are pieces of larger tensors, the pieces' sums add up to ``fused_lamb_``'s
    ``norms``."""
    _check_lengths(params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if not len(params):
        return torch.zeros(0, 2, dtype=torch.float64)
    factor, norm = _lamb_grad_factor(grads, grad_scale, global_grad_norm_value, max_grad_norm)
    if factor is None:
        raise ValueError(f"the global gradient norm is {norm}: LAMB's update has no norm")
    route = _route(params)
    host = route.host() if route.cuda else route
    sums = _call(host, "lamb_norms_", params=list(params), grads=list(grads), exp_avgs=list(exp_avgs),
                 exp_avg_sqs=list(exp_avg_sqs), grad_factor=factor,
                 **_lamb_scalars(int(_scalar(step)), beta1, beta2, eps, weight_decay, bias_correction, adam_w_mode,
                                 grad_averaging, maximize))
    return sums.to("cpu", torch.float64)


@_routed
def fused_lars_(route, params, grads, momentum_buffers, *, lr, momentum=0.0, eeta=1e-3, weight_decay=0.0,
                epsilon=0.0, maximize=False, grad_scale=None, check_finite=False, found_inf=None,
                param_copies=None, norms=None) -> bool:
    """LARS: per-tensor local lr = eeta*||p|| / (||g|| + wd*||p|| + epsilon) (1 if a norm is 0);
    buf = momentum*buf + (g + wd*p); p -= lr*local_lr*buf.

    ``norms``: where ``params`` are pieces of larger tensors (FSDP2's rows), each whole
    tensor's (||g||^2 of the loss-scaled gradient, ||p||^2) (a float64 CPU tensor
    [len(params), 2], the pieces' :func:`square_sums` summed), which the local learning
    rates then take (the CUDA kernels round them to float32, as LAMB's)."""
    _check_lengths(params, grads=grads, momentum_buffers=momentum_buffers, param_copies=param_copies)
    if not len(params):
        return False
    sc = _scalars(route, params, lr=lr, grad_scale=grad_scale, found_inf=found_inf, counts_steps=False)
    if sc is None:
        return True
    return _run(sc, route, "lars_", params=list(params), grads=list(grads), momentum_buffers=list(momentum_buffers),
                copies=_list(param_copies), lr=sc.lr, momentum=momentum, eeta=eeta, weight_decay=weight_decay,
                epsilon=epsilon, inv_grad_scale=sc.inv_scale, maximize=maximize, check_finite=check_finite,
                **({} if norms is None else {"norms": norms}))
