"""Sharding a model with torch's ``fully_shard`` for a project that has no
``configure_model``: the one-line form of ``fastopt_fsdp``.

As an FSDP auto-wrap policy decides: either every submodule of the given classes
(``auto_wrap_policy={Block}``, the usual choice for transformers), or, without classes,
every submodule whose parameters not yet sharded below it number at least
``min_num_params`` (torch's size-based policy, visited children first).  Then the root:
a Fabric model, whose forward the loop calls, is sharded itself; of a LightningModule,
whose own forward may never run (``training_step`` calls its children's), each child that
still holds unsharded parameters is sharded as a root (FSDP2 all-gathers a module's
parameters when its forward runs; a container without forward, such as a ModuleList, is
never sharded itself: its children are, the same way).

A parameter shared by several modules (tied input and output embeddings) must be sharded
with all of them at once: a module is picked only when every module holding its shared
parameters lies within it; where two children of the LightningModule are tied that way,
the LightningModule itself is sharded as the root (one log line says so: its forward must
then run, as when ``training_step`` calls ``self(...)``).  A LightningModule that holds
parameters itself, outside any child, cannot be sharded this way: that is an error
saying to shard it in ``configure_model``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

__all__ = ["Unit", "check_auto_wrap_policy", "plan_units", "shard_model"]


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
                forward_runs: bool = False, **shard_args: Any) -> str:
    """Shard ``module``'s submodules with ``fully_shard(..., mesh=mesh, **shard_args)`` by
    the policy (``classes``, or ``min_num_params``), then ``module`` itself as the root when
    its forward runs (``forward_runs``), else its children that still hold unsharded
    parameters, as roots; returns what it did, in words, for a log line."""
    from torch.distributed.fsdp import fully_shard

    def shard(modules: list[nn.Module], root: bool) -> None:
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, **shard_args)
    return _pass(module, classes, min_num_params, forward_runs, shard)


class Unit(NamedTuple):
    """What one ``fully_shard`` call of :func:`shard_model` takes: its modules, and whether
    they are a root (FSDP keeps a root's weights gathered from its forward to its backward)."""

    modules: list[nn.Module]
    root: bool


def plan_units(module: nn.Module, classes: tuple[type, ...], min_num_params: int, *,
               forward_runs: bool = False) -> list[Unit]:
    """The units :func:`shard_model` would make of ``module``, in the order it makes them,
    sharding nothing (``module`` may be on the meta device: ``estimate_memory``)."""
    units: list[Unit] = []
    _pass(module, classes, min_num_params, forward_runs, lambda modules, root: units.append(Unit(modules, root)),
          say=False)
    return units


def _pass(module: nn.Module, classes: tuple[type, ...], min_num_params: int, forward_runs: bool, shard,
          say: bool = True) -> str:
    """One pass of the policy over ``module`` (see :func:`shard_model`), calling
    ``shard(modules, root)`` for each unit it makes; returns what it did, in words
    (``say``: a choice the user should know of in a log line)."""
    name = type(module).__name__
    policy = (f"each {', '.join(c.__name__ for c in classes)}" if classes
              else f"modules of at least {min_num_params:,} parameters")
    if not forward_runs and any(True for _ in module.parameters(recurse=False)):
        names = [n for n, _ in module.named_parameters(recurse=False)]
        raise ValueError(f"{name} holds parameters of its own ({', '.join(names)}), outside any "
                         "submodule: the strategy cannot shard them on its own; shard the model in the "
                         "LightningModule's configure_model (with torch's fully_shard), as under ModelParallelStrategy")
    sharder = _Sharder(module, classes, min_num_params, shard)
    sharder.visit(module)
    picked = sharder.sharded
    if not forward_runs:
        try:
            for root in sharder.roots(module):
                sharder.shard([root], root=True)
            rest = sharder.sharded - picked
            return f"sharded {picked} module(s) with fully_shard ({policy}), then {rest} holding the rest"
        except _Tied as tied:
            if say:
                rank_zero_info(f"lightning_fastopt: {' and '.join(type(m).__name__ for m in tied.modules)} share a "
                               f"parameter: {name} itself is sharded as the root, so its forward must run "
                               "(training_step calling self(...)); else shard the model in configure_model")
    sharder.shard([module], root=True)
    return f"sharded {picked} module(s) with fully_shard ({policy}), then {name} itself"


class _Sharder:
    """One pass of the policy over ``module``: what is sharded so far (``apply`` shards,
    or notes, each unit)."""

    def __init__(self, module: nn.Module, classes: tuple[type, ...], min_num_params: int, apply) -> None:
        self.module, self.classes, self.min_num_params, self.apply = module, classes, min_num_params, apply
        self.holders = _holders(module)
        self.done: set[int] = set()  # the parameters sharded so far
        self.sharded = 0  # fully_shard calls made

    def shard(self, modules: list[nn.Module], root: bool = False) -> None:
        self.apply(modules, root)
        self.done.update(id(p) for m in modules for p in m.parameters())
        self.sharded += len(modules)

    def visit(self, sub: nn.Module) -> None:
        """Shard what the policy picks below ``sub``, then ``sub`` if it picks it."""
        for child in sub.children():
            self.visit(child)
        left = sum(p.numel() for p in sub.parameters() if id(p) not in self.done)
        picked = isinstance(sub, self.classes) if self.classes else left >= self.min_num_params
        if sub is not self.module and left and picked and _has_forward(sub) and _holds_its_ties(sub, self.holders):
            self.shard([sub])

    def roots(self, sub: nn.Module) -> list[nn.Module]:
        """The modules below ``sub`` that hold the rest, to be sharded as roots: its
        children, or a container's children; raises :class:`_Tied` where a shared
        parameter ties two of them (FSDP takes one root module per parameter group)."""
        found = []
        pending = [c for c in sub.children() if any(id(p) not in self.done for p in c.parameters())]
        for group in _tied_groups(pending, self.holders):
            if len(group) > 1:
                raise _Tied(group)
            if _has_forward(group[0]):
                found.append(group[0])
            elif not any(True for _ in group[0].parameters(recurse=False)):
                found += self.roots(group[0])  # a container: its children, the same way
            else:
                raise ValueError(f"{type(group[0]).__name__} (a container without forward) holds parameters of its "
                                 "own: the strategy cannot shard them on its own; shard the model in the "
                                 "LightningModule's configure_model")
        return found


class _Tied(Exception):
    """Modules that share a parameter and cannot each be a root."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.modules = modules


def _holders(module: nn.Module) -> dict[int, set[int]]:
    """For each parameter held by more than one module: the ids of the modules holding it."""
    holders: dict[int, set[int]] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(sub))
    return {p: mods for p, mods in holders.items() if len(mods) > 1}


def _holds_its_ties(sub: nn.Module, holders: dict[int, set[int]]) -> bool:
    """Whether every module holding a shared parameter of ``sub`` lies within ``sub``."""
    inside = {id(m) for m in sub.modules()}
    return all(holders[id(p)] <= inside for p in sub.parameters() if id(p) in holders)


def _tied_groups(children: list[nn.Module], holders: dict[int, set[int]]) -> list[list[nn.Module]]:
    """``children`` in groups: those that share a parameter (through any module below them) together."""
    groups: list[list[nn.Module]] = []
    shared_of = [{id(p) for p in c.parameters() if id(p) in holders} for c in children]
    for child, shared in zip(children, shared_of):
        joined = [g for g in groups if any(shared & s for _, s in g)]
        merged = [(child, shared)] + [member for g in joined for member in g]
        groups = [g for g in groups if g not in joined] + [merged]
    order = {id(c): i for i, c in enumerate(children)}
    return [sorted((c for c, _ in g), key=lambda c: order[id(c)]) for g in sorted(
        groups, key=lambda g: min(order[id(c)] for c, _ in g))]


def _has_forward(module: nn.Module) -> bool:
    """Whether the module's class implements ``forward`` (containers such as ModuleList do not)."""
    return type(module).forward is not nn.Module.forward

