"""The optimizer that runs the user's optimizer in the offload and ZeRO optimizers:
``torch.optim.Adam/AdamW/SGD/Adagrad`` (or a subclass that keeps their ``step``) become
``FusedAdam``/``FusedSGD``/``FusedAdagrad`` with the same hyperparameters; our own
optimizers are used as they are; any other optimizer, or one with parameters the kernels
do not step (float64), runs as a :class:`~lightning_fastopt.optim.user_step.UserStepOptimizer`
(the user's class, its own ``step``).  Each shares the very same ``param_groups`` dicts
(LR schedulers bound to the user's optimizer keep working) without adding keys to them."""

from __future__ import annotations

from types import FunctionType
from typing import Any

import torch

from lightning_fastopt.optim.adagrad import FusedAdagrad
from lightning_fastopt.optim.adam import FusedAdam
from lightning_fastopt.optim.base import SUPPORTED_DTYPES, FusedOptimizer
from lightning_fastopt.optim.sgd import FusedSGD
from lightning_fastopt.optim.user_step import UserStepOptimizer
from lightning_fastopt.ops.rounding import ADAGRAD_ROUNDINGS, SGD_ROUNDINGS, rounding_of

# torch optimizer class -> the fused class that runs it
_MAPPED = {
    torch.optim.Adam: FusedAdam,
    torch.optim.AdamW: FusedAdam,
    torch.optim.SGD: FusedSGD,
    torch.optim.Adagrad: FusedAdagrad,
}


def _defined(step: Any) -> Any:
    """A ``step`` as its class defined it: torch's optimizers wrap their class's ``step`` in
    profiling hooks when the first instance is made (``functools.wraps``: ``__wrapped__``)."""
    while isinstance(step, FunctionType) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


# each mapped class's step as torch defines it: a subclass that keeps it runs fused
_TORCH_STEPS = {cls: _defined(cls.step) for cls in _MAPPED}


def why_not_fused(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the kernels do not run ``optimizer`` (None when they do)."""
    if isinstance(optimizer, FusedOptimizer):
        return None
    base = fused_base(type(optimizer))
    if base is None:
        return "no kernel for its algorithm"
    if _defined(type(optimizer).step) is not _TORCH_STEPS[base]:
        return f"it has its own step (not {base.__name__}'s)"
    for group in optimizer.param_groups:
        for flag in ("differentiable", "capturable"):
            if group.get(flag):
                return f"{flag}=True"
        for p in group["params"]:
            if p.dtype not in SUPPORTED_DTYPES:
                return f"{str(p.dtype).replace('torch.', '')} parameters"
    return None


def fused_base(cls: type) -> type | None:
    """The torch class among :data:`_MAPPED` that ``cls`` is or derives from (None: none)."""
    return next((base for base in cls.__mro__ if base in _MAPPED), None)


def engine_class(optimizer: torch.optim.Optimizer) -> type[FusedOptimizer]:
    """The class of the optimizer that runs ``optimizer`` (what :func:`to_fused_optimizer`
    makes), known before anything is made."""
    if isinstance(optimizer, FusedOptimizer):
        return type(optimizer)
    if why_not_fused(optimizer) is not None:
        return UserStepOptimizer
    return _MAPPED[fused_base(type(optimizer))]


def to_fused_optimizer(optimizer: torch.optim.Optimizer) -> FusedOptimizer:
    """The optimizer that runs ``optimizer`` (see the module's documentation), sharing its
    param_groups and taking its state."""
    if isinstance(optimizer, FusedOptimizer):
        return optimizer
    if why_not_fused(optimizer) is not None:
        return UserStepOptimizer(optimizer)
    base = fused_base(type(optimizer))
    fused_cls = _MAPPED[base]
    placeholder = torch.nn.Parameter(torch.zeros(1))
    fused = fused_cls([placeholder], **_fused_kwargs(optimizer))
    # the same dict objects: a scheduler writing group["lr"] into the user's optimizer
    # reaches ours.  Our own keys are not added to them (the inner optimizers, built by
    # sibling(), get their defaults); a group added later gets the user's defaults, as in torch.
    fused.inner_defaults, fused.defaults = fused.defaults, optimizer.defaults
    fused.param_groups = optimizer.param_groups
    for group in fused.param_groups:
        fused._validate_group(group)
    # the state moves over as it is (not through load_state_dict, which would replace the
    # shared param_groups with copies); ours keeps float32 state
    fused.state.clear()
    for p, st in optimizer.state.items():
        fused.state[p] = {k: v if k == "step" or not torch.is_tensor(v) else v.float().contiguous()
                          for k, v in st.items()}
    return fused


def _fused_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    d = optimizer.defaults
    rounding = rounding_of(optimizer)  # the step torch would take there
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or d.get("decoupled_weight_decay", False)
        # on the CPU without fused=True its square root too (see FusedAdam)
        return dict(lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                    amsgrad=d["amsgrad"], adamw_mode=bool(decoupled), maximize=d.get("maximize", False),
                    torch_sqrt=rounding == "torch_cpu", rounding=rounding)
    if isinstance(optimizer, torch.optim.SGD):
        # its CUDA foreach and for-loop steps round as its CPU step
        return dict(lr=d["lr"], momentum=d["momentum"], dampening=d["dampening"], weight_decay=d["weight_decay"],
                    nesterov=d["nesterov"], maximize=d.get("maximize", False),
                    rounding=rounding if rounding in SGD_ROUNDINGS else "torch_cpu")
    # its CPU fused kernel rounds as its CPU step (with the IEEE root)
    return dict(lr=d["lr"], lr_decay=d["lr_decay"], weight_decay=d["weight_decay"],
                initial_accumulator_value=d["initial_accumulator_value"], eps=d["eps"],
                maximize=d.get("maximize", False), torch_sqrt=rounding == "torch_cpu",
                rounding=rounding if rounding in ADAGRAD_ROUNDINGS else "torch_cpu")
