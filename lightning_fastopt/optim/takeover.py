"""The user's optimizer stays the user's optimizer: the object the fastopt strategies hand
to Lightning (``trainer.optimizers``, hooks, ``self.optimizers()``, LR schedulers,
callbacks) is the very optimizer ``configure_optimizers`` returned, of its very class,
stepped by an offload or ZeRO optimizer (its *engine*) while training runs.

:func:`take_over` gives the user's object, for that time, methods of its own in front of
its class's (instance attributes, as an LR scheduler wraps ``step``), so that
``type(opt) is torch.optim.Adam``, ``isinstance``, ``repr`` and ``LearningRateMonitor``'s
keys are the user's, and LR schedulers bound to it stay bound.  (Until 2026-11-27 it gave
the object a class derived from its own: an exact type test, as a fine-tuning callback may
make, was False, and the callback silently skipped its work.)  What changes:

- ``step`` runs the engine's step (torch's optimizer hooks run around it, and it counts
  as a step for LR schedulers); ``zero_grad`` runs the user's class's, then lets the
  engine forget the gradients it holds;
- ``param_groups`` is the engine's list of the user's very dicts; a list assigned in its
  place (``optimizer.param_groups = [...]``: ``BaseFinetuning`` restoring the groups it
  added) reaches the engine before it next reads the groups (:func:`engine_of`), and
  ``add_param_group`` reaches it at once;
- ``state_dict``/``load_state_dict`` are the engine's (keyed by parameter name, loadable
  by the user's class); ``state`` stays empty while the engine holds it (Lightning moves
  whatever ``state`` holds to the accelerator, which would undo the offload);
- ``copy.deepcopy``, ``copy.copy`` and pickling see the optimizer as given back;
- a method its class adds to torch's interface that changes its state (schedule-free's
  ``train()`` and ``eval()``: :attr:`OptimizerWrapper.shared_methods
  <lightning_fastopt.optim.wrapper.OptimizerWrapper.shared_methods>`) runs on every share the
  engine steps, and the weights it moves reach the model.

:func:`give_back` (at teardown) removes those, restores the attributes set aside, and
hands the final optimizer state back, keyed by the model's parameters as torch keeps it.
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.optim.wrapper import OptimizerWrapper, unwrapped

_ENGINE = "_fastopt_engine"
_SAVED = "_fastopt_set_aside"  # the instance attributes the take-over shadows
_FRONT = "_fastopt_in_front"  # the names of the methods the take-over put in front


@torch.optim.Optimizer.profile_hook_step
def _step(self, closure=None, **kwargs: Any):
    """The engine's step (``grad_scale``, ``check_finite``, ``step_context``: see
    :meth:`OptimizerWrapper.step <lightning_fastopt.optim.wrapper.OptimizerWrapper.step>`)."""
    self._opt_called = True  # LR schedulers bound to this optimizer check it
    return engine_of(self).step(closure, **kwargs)


_step._wrapped_by_lr_sched = True  # torch's LR schedulers: this step tells them it ran (above)


def _zero_grad(self, set_to_none: bool = True) -> None:
    type(self).zero_grad(self, set_to_none)  # the user's class's (it may do more)
    engine = engine_of(self)
    if engine is not unwrapped(self):  # and the gradients the engine holds (none once given back)
        engine.zero_grad(set_to_none)


def _add_param_group(self, param_group: dict[str, Any]) -> None:
    engine_of(self).add_param_group(param_group)


def _state_dict(self) -> dict[str, Any]:
    return engine_of(self).state_dict()


def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
    engine_of(self).load_state_dict(state_dict)


def _reduce_ex(self, protocol):
    """``copy.deepcopy``, ``copy.copy`` and pickling see the optimizer as given back: of
    the user's class, with its groups and the state as torch keeps it.  The engine (its
    host buffers, threads and the hooks on the model) stays with this object."""
    optimizer = unwrapped(self)
    if _ENGINE not in optimizer.__dict__:  # a wrapper kept after give_back: as its class pickles it
        return type(self).__reduce_ex__(self, protocol)
    cls, attributes = _given_back(optimizer)
    return _instance_of, (cls,), attributes


# what take_over puts in front of the class's methods, as instance attributes
_IN_FRONT = {"step": _step, "zero_grad": _zero_grad, "add_param_group": _add_param_group,
             "state_dict": _state_dict, "load_state_dict": _load_state_dict, "__reduce_ex__": _reduce_ex}


def _shared(name: str):
    def run(self, *args: Any, **kwargs: Any) -> Any:
        return engine_of(self).run_method(name, *args, **kwargs)

    run.__name__ = name
    return run


def _in_front(engine: OptimizerWrapper) -> dict[str, Any]:
    """The functions :func:`take_over` puts in front of the class's methods for ``engine``."""
    return {**_IN_FRONT, **{name: _shared(name) for name in engine.shared_methods}}


def take_over(optimizer: torch.optim.Optimizer, engine: OptimizerWrapper) -> torch.optim.Optimizer:
    """Let ``engine`` step ``optimizer`` (the user's object, returned) until :func:`give_back`;
    again with another engine (``offload_fraction="auto"`` rebuilds it) replaces the first."""
    if _ENGINE not in optimizer.__dict__:
        in_front = _in_front(engine)
        optimizer.__dict__[_SAVED] = {k: optimizer.__dict__.pop(k) for k in (*in_front, "param_groups")
                                      if k in optimizer.__dict__}
        optimizer.__dict__[_FRONT] = tuple(in_front)
        optimizer.__dict__.update({k: types.MethodType(f, optimizer) for k, f in in_front.items()})
        optimizer.state = defaultdict(dict)  # the engine took the state over
    optimizer.__dict__[_ENGINE] = engine
    optimizer.__dict__["param_groups"] = engine.param_groups
    return optimizer


def for_class_wrappers(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """What to hand a wrapper that makes its class from the optimizer's (Fabric's
    ``_FabricOptimizer``: its class derives from the optimizer's, so the class's own methods
    come before anything it forwards): for an optimizer with methods that run on every
    share (``train()``, ``eval()``), an object of a subclass of the user's class that routes
    them to the engine, sharing every attribute with ``optimizer`` (the same ``__dict__``:
    its groups, state, engine; :func:`give_back` reaches both); ``optimizer`` itself
    otherwise.  The user's own object keeps its class."""
    optimizer = unwrapped(optimizer)
    names = engine_of(optimizer).shared_methods if _ENGINE in optimizer.__dict__ else ()
    if not names:
        return optimizer
    cls = type(optimizer)
    routed = _ROUTED.get((cls, names))
    if routed is None:
        routed = _ROUTED[(cls, names)] = type(cls.__name__, (cls,), {
            **{name: _shared(name) for name in names}, _ROUTES: cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__name__} with {', '.join(names)} run on every share (lightning_fastopt)"})
    twin = routed.__new__(routed)
    twin.__dict__ = optimizer.__dict__  # the very attributes: one optimizer, seen through another class
    return twin


_ROUTED: dict[tuple[type, tuple[str, ...]], type] = {}
_ROUTES = "_fastopt_routes_for"  # on a routing class: the user's class it derives from


def _user_class(optimizer: torch.optim.Optimizer) -> type:
    """The user's class (not the routing one of :func:`for_class_wrappers`)."""
    return getattr(type(optimizer), _ROUTES, type(optimizer))


def show_through(wrapper) -> None:
    """Put the taken-over optimizer's methods in front of those of ``wrapper``'s class too:
    Lightning's ``LightningOptimizer`` (what ``self.optimizers()`` gives) has a class made
    from the optimizer's own, so it finds the class's ``zero_grad`` and ``state_dict``
    itself, and reaches the optimizer only for what its class lacks (``param_groups``,
    ``state``).  Its ``step`` stays Lightning's, which calls the optimizer's."""
    optimizer = unwrapped(wrapper)
    if _ENGINE in optimizer.__dict__:
        in_front = _in_front(engine_of(optimizer))
        wrapper.__dict__.update({k: types.MethodType(f, wrapper) for k, f in in_front.items() if k != "step"})


def give_back(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`take_over`: the user's attributes, the engine's last groups, and its
    state keyed by the model's parameters (float32 tensors where the engine kept them)."""
    if _ENGINE not in optimizer.__dict__:
        return
    _, attributes = _given_back(optimizer)
    optimizer.__dict__.clear()
    optimizer.__dict__.update(attributes)


def _given_back(optimizer: torch.optim.Optimizer) -> tuple[type, dict[str, Any]]:
    """The class and the attributes :func:`give_back` would leave ``optimizer`` with (it
    keeps its engine meanwhile)."""
    engine = engine_of(optimizer)
    shadowed = optimizer.__dict__[_SAVED]
    attributes = {k: v for k, v in optimizer.__dict__.items()
                  if k not in (_ENGINE, _SAVED, _FRONT, *optimizer.__dict__[_FRONT])}
    attributes.update(shadowed)
    attributes["param_groups"] = engine.param_groups
    state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for group in engine.param_groups:
        for p in group["params"]:
            held = engine.state_of(p) if engine.owns(p) else None
            if held:
                state[p] = {k: _own(_as_torch_keeps(v, p), seen) for k, v in held.items()}
    state.update(engine.state_beside_parameters())  # MADGRAD's state["k"]
    attributes["state"] = state
    return _user_class(optimizer), attributes


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
        cls, attributes = _user_class(optimizer), dict(vars(optimizer))
    attributes.pop("step", None)
    copy = _instance_of(cls)
    copy.__dict__.update(attributes)
    return copy


def _instance_of(cls: type) -> torch.optim.Optimizer:
    """A new, empty object of ``cls`` (a copy's or an unpickled one's state is set next)."""
    return cls.__new__(cls)


def engine_of(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The engine stepping ``optimizer`` (Lightning's ``LightningOptimizer`` around it
    unwrapped first), or the optimizer itself when no engine does.  A list of groups
    assigned to the optimizer since (``optimizer.param_groups = [...]``) is handed to the
    engine first (``replace_param_groups``), and the optimizer shows the engine's again."""
    optimizer = unwrapped(optimizer)
    engine = optimizer.__dict__.get(_ENGINE)
    if engine is None:
        return optimizer
    groups = optimizer.__dict__.get("param_groups")
    if groups is not engine.param_groups:
        engine.replace_param_groups(groups)
        optimizer.__dict__["param_groups"] = engine.param_groups
    return engine
