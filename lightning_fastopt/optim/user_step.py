"""UserStepOptimizer: an optimizer the kernels do not cover (RAdam, RMSprop, NAdam, a
subclass with its own ``step``, a third-party class, float64 parameters), run by the
offload and ZeRO optimizers all the same.

They drive every optimizer through the interface of
:class:`~lightning_fastopt.optim.base.FusedOptimizer` (``sibling`` over master tensors,
``step(grad_scale=...)`` reading ``grad_source`` and writing ``copies_to``).  This one
implements it with the user's own class: each sibling is an instance of that class over
the masters (host or device), made without calling its ``__init__`` again (torch's
``Optimizer.__init__`` with the user's groups, and every other attribute the user's
``__init__`` set), whose ``param_groups`` and ``state`` are the sibling's.  A step sets
each master's ``.grad`` to its gradient (unscaled first when a loss scale is given: the
user's ``step`` knows nothing of it), calls the user's ``step`` (with the keyword
arguments the step was given beyond the closure, ``step_kwargs``, and the step's closure
as torch would give it, :mod:`~lightning_fastopt.optim.closure`: the share an engine
updates first is entered before the closure is evaluated), and writes the half copies.
The math is torch's (or the user's), where the masters live, so the memory saving and
the copies' overlap still apply; only the kernels' speed does not.

What the class keeps beside its parameters' state (keys of its groups its code writes,
state under keys that are not parameters) is kept per share alike
(:mod:`~lightning_fastopt.optim.beside_parameters`); the methods the user calls on their
optimizer beyond torch's (:func:`shared_methods`: schedule-free's ``train()`` and
``eval()``) run on every share's instance (:meth:`UserStepOptimizer.run_method`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.functional import grads_all_finite
from lightning_fastopt.optim.base import FusedOptimizer, hyperparameters
from lightning_fastopt.optim.beside_parameters import GroupKeys, own_state, put_own_state

# What torch.optim.Optimizer.__init__ sets on an instance (not copied from the user's optimizer)
_OPTIMIZER_OWN = frozenset(vars(torch.optim.Optimizer([torch.zeros(1, requires_grad=True)], {})))
# Set on the user's optimizer by others (LR schedulers, lightning_fastopt's take-over): not the class's
_SET_BY_OTHERS = frozenset({"step", "_opt_called"})
# torch's interface, which the engines run their own way
_TORCH_METHODS = frozenset(name for name in dir(torch.optim.Optimizer) if not name.startswith("_"))


def shared_methods(cls: type) -> tuple[str, ...]:
    """The methods of ``cls`` beyond torch's interface that a user calls on the optimizer to
    change its state (schedule-free's ``train()`` and ``eval()``): public functions its own
    classes define (not torch.optim.Optimizer's) that take no argument.  Functions that take
    arguments are the step's helpers (pytorch-optimizer's ``init_group``), not commands."""
    names = []
    for base in cls.__mro__:
        if base is torch.optim.Optimizer or base is object:
            break
        for name, value in vars(base).items():
            if name.startswith("_") or name in _TORCH_METHODS or name in names or not inspect.isfunction(value):
                continue
            parameters = list(inspect.signature(value).parameters.values())
            if len(parameters) == 1 and parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
                names.append(name)
    return tuple(sorted(names))


class UserStepOptimizer(FusedOptimizer):
    """Args:
        optimizer: the user's optimizer; this one shares its ``param_groups`` dicts (LR
            schedulers keep working) and takes over its state.
    """

    counts_steps = False
    # set where the gradients this step reads are read again after it (a speculated update may
    # be redone): the user's step gets copies, as it may change them in place (schedule-free
    # divides them by its denominator), and so does the unscaling below
    grads_read_again = False
    takes_step_kwargs = True  # the user's step may take keyword arguments (``opt.step(closure, optim="sgd")``)

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.user_class = type(optimizer)
        self._attributes = {k: v for k, v in vars(optimizer).items()
                            if k not in _OPTIMIZER_OWN and k not in _SET_BY_OTHERS and not k.startswith("_fastopt")}
        super().__init__([torch.nn.Parameter(torch.zeros(1))], dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups  # the same dicts (and list)
        self.state.clear()
        for p, st in optimizer.state.items():
            self.state[p] = dict(st)
        self.runner: torch.optim.Optimizer | None = None  # the user's class over this one's tensors
        self.group_keys = GroupKeys(optimizer.param_groups)  # shared with every sibling
        self.shared_methods = shared_methods(self.user_class)

    def take_settings(self, groups: list[dict[str, Any]]) -> None:
        """The user's settings into this one's groups, but for the keys the class's code
        writes (:class:`~lightning_fastopt.optim.beside_parameters.GroupKeys`)."""
        self.group_keys.settings_into(self.param_groups, groups)

    def run_method(self, name: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> Any:
        """The user's class's method ``name`` (one of :attr:`shared_methods`) on this share's
        instance; the group keys it writes are noted as its step's are."""
        if name not in self.shared_methods:
            raise AttributeError(f"{name!r} is not a method {self.user_class.__name__} adds to torch's optimizer "
                                 f"interface (those: {', '.join(self.shared_methods) or 'none'})")
        before = self.group_keys.before(self.param_groups)
        result = getattr(self.runner, name)(*args, **(kwargs or {}))
        self.group_keys.note(self.param_groups, before)
        return result

    def own_state(self) -> dict[Any, Any]:
        """The class's state under keys that are not parameters (MADGRAD's ``"k"``)."""
        return own_state(self.state)

    def put_own_state(self, saved: dict[Any, Any]) -> None:
        put_own_state(self.state, saved)

    def beside_parameters(self) -> tuple[list[dict[str, Any]], dict[Any, Any]]:
        """A copy of what the class keeps beside its parameters' state (its groups' values,
        its own state), for :meth:`put_beside_parameters` to undo a speculated update."""
        kept = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in self.own_state().items()}
        return self.group_keys.before(self.param_groups), kept

    def put_beside_parameters(self, kept: tuple[list[dict[str, Any]], dict[Any, Any]]) -> None:
        groups, state = kept
        self.group_keys.put_back(self.param_groups, groups)
        self.put_own_state(state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        torch.optim.Optimizer.add_param_group(self, param_group)  # any dtype the user's class steps

    def sibling(self, params_per_group: list[list[Tensor]]) -> UserStepOptimizer:
        if len(params_per_group) != len(self.param_groups):
            raise ValueError(f"expected {len(self.param_groups)} parameter lists, got {len(params_per_group)}")
        runner = self.user_class.__new__(self.user_class)
        runner.__dict__.update(self._attributes)
        groups = [dict(hyperparameters(g), params=list(ps)) for g, ps in zip(self.param_groups, params_per_group)]
        torch.optim.Optimizer.__init__(runner, groups, dict(self.defaults))
        new = type(self).__new__(type(self))
        # torch's own attributes are the runner's very objects: one set of groups and state
        new.__dict__.update({k: v for k, v in vars(runner).items() if k in _OPTIMIZER_OWN})
        new.__dict__.update(user_class=self.user_class, _attributes=self._attributes, runner=runner,
                            group_keys=self.group_keys, shared_methods=self.shared_methods,
                            capturable=False, skipped_steps=0, last_step_skipped=False)
        return new

    def masters(self) -> list[Tensor]:
        """The tensors this sibling steps, each once."""
        return list(dict.fromkeys(p for g in self.param_groups for p in g["params"]))

    def _take_step(self, grad_scale, check_finite: bool, found_inf: Tensor | None, step_context: Any) -> bool:
        if self.runner is None:
            raise RuntimeError("UserStepOptimizer steps through its siblings (the offload optimizer's)")
        if found_inf is not None and float(found_inf.reshape(-1)[0]) != 0.0:
            return True
        params = self.masters()
        source = self.grad_source
        grads = {p: p.grad if source is None else source.get(p) for p in params}
        given = [g for g in grads.values() if g is not None]
        if check_finite and not grads_all_finite(given):
            return True
        before = {p: p.grad for p in params}
        try:
            for p, g in grads.items():
                if g is not None and (g.dtype != p.dtype or g.device != p.device):
                    g = g.to(p.device, p.dtype)
                elif g is not None and self.grads_read_again:
                    g = g.clone()  # the gradient we hold, which the step below changes (schedule-free divides it)
                p.grad = g
            if grad_scale is not None:
                inverse = 1.0 / float(grad_scale)
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(inverse)
            evaluated = self.step_closure
            written_before = self.group_keys.before(self.param_groups)
            if evaluated is not None and evaluated.leading is not None and evaluated.leading.share is self:
                evaluated.leading.resume()  # this share's step called the closure, and goes on from there
            else:  # the closure ran when the engine's step began: this share gets it as torch would give it
                given = {} if evaluated is None else {"closure": evaluated.for_share(self.user_class.__name__, params)}
                self.runner.step(**given, **self.step_kwargs)  # as the step was called: Lightning names the closure
            self.group_keys.note(self.param_groups, written_before)
        finally:
            for p in params:
                p.grad = before[p]
        for p, copy in (self.copies_to or {}).items():
            if grads.get(p) is not None:
                copy.copy_(p)
        return False
