"""The user's optimizer stays the user's optimizer: the object the fastopt strategies hand
to Lightning (``trainer.optimizers``, hooks, ``self.optimizers()``, LR schedulers,
callbacks) is the very optimizer ``configure_optimizers`` returned, stepped by an
offload or ZeRO optimizer (its *engine*) while training runs.

:func:`take_over` gives the user's object, for that time, a class made at run time that
derives from its own class (as Lightning's ``LightningOptimizer`` does) and carries its
class name: ``isinstance``, ``type(opt).__name__``, ``repr`` and ``LearningRateMonitor``'s
keys are the user's, and LR schedulers bound to it stay bound.  What the class changes:

- ``step`` runs the engine's step (torch's optimizer hooks run around it, and it counts
  as a step for LR schedulers); ``zero_grad`` runs the user's class's, then lets the
  engine forget the gradients it holds;
- ``param_groups`` is the engine's list of the user's very dicts: ``add_param_group``
  and ``optimizer.param_groups = [...]`` (``BaseFinetuning`` restoring the groups it
  added) reach the engine;
- ``state_dict``/``load_state_dict`` are the engine's (keyed by parameter name, loadable
  by the user's class); ``state`` stays empty while the engine holds it (Lightning moves
  whatever ``state`` holds to the accelerator, which would undo the offload).

:func:`give_back` (at teardown) restores the class and the attributes set aside, and hands
the final optimizer state back, keyed by the model's parameters as torch keeps it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.optim.wrapper import OptimizerWrapper, unwrapped

_ENGINE = "_fastopt_engine"
_SAVED = "_fastopt_set_aside"  # the user's class and the instance attributes the take-over shadows
_CLASSES: dict[type, type] = {}


class SteppedByEngine(torch.optim.Optimizer):
    """The behaviour :func:`take_over` adds in front of the user's optimizer class (also
    seen through Lightning's ``LightningOptimizer``, whose class derives from this one)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return engine_of(self).param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        engine_of(self).replace_param_groups(groups)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        engine_of(self).add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # the user's class's (it may do more)
        engine_of(self).zero_grad(set_to_none)  # and the gradients the engine holds

    def state_dict(self) -> dict[str, Any]:
        return engine_of(self).state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        engine_of(self).load_state_dict(state_dict)

    def __reduce_ex__(self, protocol):
        """``copy.deepcopy``, ``copy.copy`` and pickling see the optimizer as given back: of
        the user's class, with its groups and the state as torch keeps it.  The engine (its
        host buffers, threads and the hooks on the model) stays with this object."""
        cls, attributes = _given_back(self)
        return _instance_of, (cls,), attributes


@torch.optim.Optimizer.profile_hook_step
def _step(self, closure=None, **kwargs: Any):
    """The engine's step (``grad_scale``, ``check_finite``, ``step_context``: see
    :meth:`OptimizerWrapper.step <lightning_fastopt.optim.wrapper.OptimizerWrapper.step>`)."""
    self._opt_called = True  # LR schedulers bound to this optimizer check it
    return engine_of(self).step(closure, **kwargs)


_step._wrapped_by_lr_sched = True  # torch's LR schedulers: this step tells them it ran (above)
SteppedByEngine.step = _step


def take_over(optimizer: torch.optim.Optimizer, engine: OptimizerWrapper) -> torch.optim.Optimizer:
    """Let ``engine`` step ``optimizer`` (the user's object, returned) until :func:`give_back`;
    again with another engine (``offload_fraction="auto"`` rebuilds it) replaces the first."""
    if _ENGINE in optimizer.__dict__:
        optimizer.__dict__[_ENGINE] = engine
        return optimizer
    cls = type(optimizer)
    shadowed = {k: optimizer.__dict__.pop(k) for k in ("step", "param_groups") if k in optimizer.__dict__}
    optimizer.__dict__[_SAVED] = (cls, shadowed)
    optimizer.__dict__[_ENGINE] = engine
    optimizer.state = defaultdict(dict)  # the engine took the state over
    optimizer.__class__ = _front_class(cls)
    return optimizer


def give_back(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`take_over`: the user's class and attributes, the engine's last groups,
    and its state keyed by the model's parameters (float32 tensors where the engine kept them)."""
    if _ENGINE not in optimizer.__dict__:
        return
    cls, attributes = _given_back(optimizer)
    optimizer.__dict__.clear()
    optimizer.__dict__.update(attributes)
    optimizer.__class__ = cls


def _given_back(optimizer: torch.optim.Optimizer) -> tuple[type, dict[str, Any]]:
    """The class and the attributes :func:`give_back` would leave ``optimizer`` with (it
    keeps its engine meanwhile)."""
    engine = optimizer.__dict__[_ENGINE]
    cls, shadowed = optimizer.__dict__[_SAVED]
    attributes = {k: v for k, v in optimizer.__dict__.items() if k not in (_ENGINE, _SAVED)}
    attributes.update(shadowed)
    attributes["param_groups"] = engine.param_groups
    state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for group in engine.param_groups:
        for p in group["params"]:
            held = engine.state_of(p) if engine.owns(p) else None
            if held:
                state[p] = {k: _own(_as_torch_keeps(v, p), seen) for k, v in held.items()}
    attributes["state"] = state
    return cls, attributes


def _as_torch_keeps(value: Any, param: Tensor) -> Any:
    """A state tensor as torch keeps it: bfloat16 moments of a float32 parameter
    (``host_state_dtype="bfloat16"``) as float32, as checkpoints hold them (torch's step
    would refuse them beside float32 gradients)."""
    if isinstance(value, Tensor) and value.dtype == torch.bfloat16 and param.dtype == torch.float32:
        return value.float()
    return value


def _own(value: Any, seen: set[tuple[int, int, tuple[int, ...]]]) -> Any:
    """``value``, or a copy where another parameter's state holds the same tensor (an engine
    keeps one ``step`` per group; torch keeps one per parameter and increments each in
    place, so a shared one would count every parameter's step)."""
    if not isinstance(value, Tensor) or value.numel() == 0:
        return value
    local = getattr(value, "_local_tensor", value)  # a DTensor's rows (the FSDP engine's state)
    region = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
    if region in seen:
        return value.clone()
    seen.add(region)
    return value


def held_as_torch(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` as torch would hold it (the user's class, the engine's groups,
    the state keyed by the model's parameters) that the engine does not step: its ``step``
    is its class's, not an LR scheduler's wrapper around the original's step, so that
    torch's distributed state dicts, which may step an optimizer without state to make
    its state, make it in the copy."""
    optimizer = unwrapped(optimizer)
    if _ENGINE in optimizer.__dict__:
        cls, attributes = _given_back(optimizer)
    else:  # given back already (a checkpoint saved after fit)
        cls, attributes = type(optimizer), dict(vars(optimizer))
    attributes.pop("step", None)
    copy = _instance_of(cls)
    copy.__dict__.update(attributes)
    return copy


def _instance_of(cls: type) -> torch.optim.Optimizer:
    """A new, empty object of ``cls`` (a copy's or an unpickled one's state is set next)."""
    return cls.__new__(cls)


def engine_of(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The engine stepping ``optimizer`` (Lightning's ``LightningOptimizer`` around it
    unwrapped first), or the optimizer itself when no engine does."""
    optimizer = unwrapped(optimizer)
    return optimizer.__dict__.get(_ENGINE, optimizer)


def _front_class(cls: type) -> type:
    """The class :func:`take_over` gives an optimizer of class ``cls`` (one per class)."""
    front = _CLASSES.get(cls)
    if front is None:
        front = type(cls.__name__, (SteppedByEngine, cls), {"__module__": cls.__module__,
                                                             "__qualname__": cls.__qualname__})
        _CLASSES[cls] = front
    return front
