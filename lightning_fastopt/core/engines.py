"""What the strategies of every front-end share: the names they are registered under, the
check of the arguments they pass on to ``DDPStrategy``, and the engine built for each of
the user's optimizers (the optimizer that runs it, inside an offload or ZeRO optimizer)."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel

from lightning_fastopt.core.param_checks import check_parameters
from lightning_fastopt.from_deepspeed.arguments import NO_EFFECT, REFUSED
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.optim.base import FusedOptimizer
from lightning_fastopt.optim.from_torch import to_fused_optimizer
from lightning_fastopt.optim.wrapper import OptimizerWrapper
from lightning_fastopt.zero import ZeroOptimizer

__all__ = ["FSDP_DOES_NOT_TAKE", "FSDP_STRATEGY_NAMES", "STRATEGY_NAMES", "check_ddp_kwargs", "check_passed_kwargs",
           "fused_for", "register_fsdp_names", "register_names", "wrap_fused_optimizer"]

# The names ``import lightning_fastopt`` registers: (name, description, offload_fraction, zero_stage).
STRATEGY_NAMES = (
    ("fastopt", "DDP with lightning_fastopt's fused optimizers and fp16 loss scaling", 0.0, 0),
    ("fastopt_offload", "fastopt with every master weight and all optimizer state in CPU memory", 1.0, 0),
    ("fastopt_zero1", "fastopt with masters and optimizer state sharded across ranks (ZeRO stage 1)", 0.0, 1),
    ("fastopt_zero2", "fastopt_zero1 with gradients sharded too (ZeRO stage 2)", 0.0, 2),
    ("fastopt_zero2_offload", "fastopt_zero2 with every rank's shard in CPU memory", 1.0, 2),
)


# The names of ZeRO stage 3 on FSDP2 (the Trainer's and Fabric's): (name, description, offload_fraction).
FSDP_STRATEGY_NAMES = (
    ("fastopt_fsdp", "Lightning's ModelParallelStrategy (FSDP2, ZeRO-3) with lightning_fastopt's fused step on each "
                     "rank's shards", dict(offload_fraction=0.0)),
    ("fastopt_fsdp_offload", "fastopt_fsdp with every rank's shard of masters and optimizer state in CPU memory",
     dict(offload_fraction=1.0)),
    ("fastopt_fsdp_offload_parameters", "fastopt_fsdp_offload with the parameter shards themselves in CPU memory "
                                        "(CPUOffloadPolicy), the masters the CPU kernels update in place",
     dict(offload_fraction=1.0, offload_parameters=True)),
)


def register_names(cls, strategy_registry) -> None:
    """Register :data:`STRATEGY_NAMES` for ``cls`` (a Trainer's strategy or Fabric's) in a
    registry that lacks them."""
    for name, description, offload_fraction, zero_stage in STRATEGY_NAMES:
        if name not in strategy_registry:
            strategy_registry.register(name, cls, description=description, offload_fraction=offload_fraction,
                                       zero_stage=zero_stage)


def register_fsdp_names(cls, strategy_registry) -> None:
    """Register :data:`FSDP_STRATEGY_NAMES` for ``cls`` (a Trainer's FSDP strategy or
    Fabric's) in a registry that lacks them."""
    for name, description, arguments in FSDP_STRATEGY_NAMES:
        if name not in strategy_registry:
            strategy_registry.register(name, cls, description=description, **arguments)


def check_ddp_kwargs(kwargs: dict[str, Any], base: type, ours: type) -> None:
    """``**kwargs`` go to ``base`` (Lightning's or Fabric's DDPStrategy) and from there to
    DistributedDataParallel, which is not built with one process: a misspelt argument
    would be silently ignored there.  Refuse anything neither accepts, suggesting the
    nearest name (among ``ours``'s arguments too)."""
    check_passed_kwargs(kwargs, (base.__init__, DistributedDataParallel.__init__), ours,
                        "DDPStrategy's and DistributedDataParallel's", _DDP_DOES_NOT_TAKE)


FSDP_DOES_NOT_TAKE = {
    "zero_stage": "FSDP shards the parameters, gradients and optimizer state itself (ZeRO stage 3)",
    "per_parameter_optimizers": "on FSDP's rows of each parameter a step must work element by element "
                                "(elementwise_optimizers names such classes)",
}
"""Our DDP strategies' arguments that the FSDP strategies do not take, and why."""

_DDP_DOES_NOT_TAKE = {
    "elementwise_optimizers": "it is the FSDP strategies' (steps on rows of each parameter); here shares are whole "
                              "parameters: per_parameter_optimizers names the classes whose step updates each "
                              "parameter alone",
}


def check_passed_kwargs(kwargs: dict[str, Any], takers: tuple[Any, ...], ours: type, whose: str,
                        not_taken: Mapping[str, str] | None = None) -> None:
    """Refuse the ``**kwargs`` a strategy passes on that none of ``takers`` (functions)
    accepts, suggesting the nearest name (among ``ours``'s arguments too); ``whose`` says
    whose arguments it accepts besides its own.  ``not_taken``: arguments of our other
    strategies that this one does not take, each refused with its reason."""
    for name, why in (not_taken or {}).items():
        if name in kwargs:
            raise ValueError(f"{ours.__name__} does not take {name} ({name}={kwargs[name]!r}): {why}")

    def names(fn) -> set[str]:
        return {n for n, p in inspect.signature(fn).parameters.items()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self", "module"}

    forwarded = set().union(*(names(fn) for fn in takers))
    unknown = sorted(set(kwargs) - forwarded)
    if unknown:
        known = names(ours.__init__) | forwarded | set(NO_EFFECT) | set(REFUSED)  # DeepSpeedStrategy's too
        hints = [f"{k!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, known, 1))
                             else "") for k in unknown]
        raise TypeError(f"{ours.__name__} got unexpected keyword argument(s) {', '.join(hints)}: it accepts its "
                        f"own arguments, {whose} and DeepSpeedStrategy's (docs/from_deepspeed.md)")


def fused_for(optimizer: torch.optim.Optimizer, module: torch.nn.Module, precision: str) -> FusedOptimizer:
    """The user's optimizer checked against ``module``'s parameters and mapped to the
    optimizer that runs it (the same ``param_groups`` dicts; the plan has said which,
    :mod:`~lightning_fastopt.plan.runner`); ``precision``: the run's flag, see
    :func:`_say_half_masters`."""
    check_parameters(optimizer, module)
    _say_half_masters(optimizer, precision)
    return to_fused_optimizer(optimizer)


def wrap_fused_optimizer(fused: FusedOptimizer, names: dict[torch.Tensor, str], *, zero_stage: int,
                         **offload_args: Any) -> OptimizerWrapper:
    """The optimizer the strategy steps: ZeRO at ``zero_stage`` 1 or 2, else offload
    (``offload_args``: the shared arguments of both)."""
    if zero_stage:
        return ZeroOptimizer(fused, names, stage=zero_stage, **offload_args)
    return OffloadOptimizer(fused, names, **offload_args)


def _say_half_masters(optimizer: torch.optim.Optimizer, precision: str) -> None:
    """One line when half-precision parameters train under a precision that keeps the
    weights as they are (``"32-true"``): they get float32 master weights and state here,
    where plain Lightning would update them in their own dtype."""
    if precision != "32-true":
        return  # "-true" halves are the precision's own weights; mixed precision keeps float32 ones
    halves = sorted({str(p.dtype).removeprefix("torch.") for g in optimizer.param_groups for p in g["params"]
                     if p.dtype in (torch.float16, torch.bfloat16)})
    if halves:
        rank_zero_info(f"lightning_fastopt: {' and '.join(halves)} parameters under precision '32-true' are updated "
                       "through float32 master weights and state (plain Lightning would update them in "
                       f"{' and '.join(halves)}, where small updates round away)")
