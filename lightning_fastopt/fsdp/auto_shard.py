"""Sharding a model with torch's ``fully_shard`` for a project that has no
``configure_model``: the one-line form of ``fastopt_fsdp``.

As an FSDP auto-wrap policy decides: either every submodule of the given classes
(``auto_wrap_policy={Block}``, the usual choice for transformers), or, without classes,
every submodule whose parameters not yet sharded below it number at least
``min_num_params`` (torch's size-based policy, visited children first).  Then the root:
a Fabric model, whose forward the loop calls, is sharded itself; of a LightningModule,
whose own forward may never run (``training_step`` calls its children's), each child that
still holds unsharded parameters is sharded as a root (FSDP2 all-gathers a module's
parameters when its forward runs).  A LightningModule that holds parameters itself,
outside any child, cannot be sharded this way: that is an error saying to shard it in
``configure_model``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["check_auto_wrap_policy", "shard_model"]


def check_auto_wrap_policy(policy: Any, min_num_params: Any) -> tuple[type, ...]:
    """The module classes of ``auto_wrap_policy`` (None: size-based), checked with ``min_num_params``."""
    if isinstance(min_num_params, bool) or not isinstance(min_num_params, int) or min_num_params < 1:
        raise ValueError(f"min_num_params must be a positive integer, got {min_num_params!r}")
    if policy is None:
        return ()
    classes = [policy] if isinstance(policy, type) else list(policy) if isinstance(policy, Iterable) else None
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"auto_wrap_policy must be a set of torch.nn.Module classes (each instance is sharded) or "
                        f"None (modules of at least min_num_params parameters), got {policy!r}")
    return tuple(classes)


def shard_model(module: nn.Module, mesh, classes: tuple[type, ...], min_num_params: int, *,
                forward_runs: bool = False, **shard_args: Any) -> int:
    """Shard ``module``'s submodules with ``fully_shard(..., mesh=mesh, **shard_args)`` by
    the policy (``classes``, or ``min_num_params``), then ``module`` itself as the root when
    its forward runs (``forward_runs``), else its children that still hold unsharded
    parameters, as roots; returns how many modules were sharded."""
    from torch.distributed.fsdp import fully_shard

    if not forward_runs and any(True for _ in module.parameters(recurse=False)):
        names = [n for n, _ in module.named_parameters(recurse=False)]
        raise ValueError(f"{type(module).__name__} holds parameters of its own ({', '.join(names)}), outside any "
                         "submodule: the strategy cannot shard them on its own; shard the model in the "
                         "LightningModule's configure_model (with torch's fully_shard), as under ModelParallelStrategy")
    sharded = 0

    def visit(sub: nn.Module) -> int:
        """Shard what the policy picks below ``sub`` (and ``sub``); the unsharded parameters left."""
        nonlocal sharded
        left = sum(p.numel() for p in sub.parameters(recurse=False))
        for child in sub.children():
            left += visit(child)
        if sub is not module and left and (isinstance(sub, classes) if classes else left >= min_num_params):
            fully_shard(sub, mesh=mesh, **shard_args)
            sharded += 1
            return 0
        return left

    visit(module)
    if forward_runs:
        fully_shard(module, mesh=mesh, **shard_args)
        return sharded + 1
    for child in module.children():
        if _has_unsharded(child):
            fully_shard(child, mesh=mesh, **shard_args)
            sharded += 1
    return sharded


def _has_unsharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(not isinstance(p, DTensor) for p in module.parameters())
