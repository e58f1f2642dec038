"""The closure of ``optimizer.step(closure)``, as the engines give it to an optimizer's own step.

torch's optimizers evaluate the closure once, with gradients enabled, at the top of
``step`` (``loss = closure()``), then update from the gradients it left.  The engines do
the same (:func:`~lightning_fastopt.optim.base.run_step`): the closure runs when the step
is called, before any share of the parameters (the device's, each host bucket) is
updated.  An optimizer that runs its own ``step`` on the masters
(:class:`~lightning_fastopt.optim.user_step.UserStepOptimizer`) is then given, on each
share, the closure as torch would have given it: a callable whose first call returns the
loss the closure returned (its gradients are the ones the share steps on), as evaluating
it there would.  What cannot be given on a share is a second evaluation, after the step
changed the weights (SAM and its variants, LBFGS): forward and backward would have to run
on the weights the share holds.  Such a call raises :class:`ClosureEvaluatedAgain`
before the closure's loss is returned, and says what to do: an optimizer named in the
strategy's ``closure_optimizers`` (and LBFGS, :func:`evaluates_closure_again`) runs as
torch runs it, on the model's weights, not offloaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class ClosureEvaluatedAgain(RuntimeError):
    """An optimizer's own step called the closure after changing its weights, or twice."""


def evaluates_closure_again(optimizer: torch.optim.Optimizer, named: tuple[str, ...] = ()) -> bool:
    """Whether the optimizer's step evaluates the closure again after changing the weights,
    so that it must run as torch runs it, on the model's weights: LBFGS, and any class
    (or subclass of one) whose name is in ``named`` (the strategies' ``closure_optimizers``)."""
    return isinstance(optimizer, torch.optim.LBFGS) or any(c.__name__ in named for c in type(optimizer).__mro__)


def check_closure_optimizers(value: Any) -> tuple[str, ...]:
    """The strategies' ``closure_optimizers``: optimizer classes or their names, as names."""
    items = [value] if isinstance(value, (str, type)) else value
    try:
        items = list(items)
    except TypeError:
        items = None
    if items is None or not all(isinstance(v, type) or (isinstance(v, str) and v) for v in items):
        raise TypeError(f"closure_optimizers must be optimizer classes or class names (a list of them), got {value!r}")
    return tuple(v if isinstance(v, str) else v.__name__ for v in items)


class StepClosure:
    """The closure of one step, already evaluated: ``loss`` is what it returned.  It is
    handed to each share's own step through :meth:`for_share`; :attr:`offered` counts the
    shares it was handed to, :attr:`taken` those whose step called it."""

    def __init__(self, loss: Any) -> None:
        self.loss = loss
        self.offered = 0
        self.taken = 0

    @property
    def ignored(self) -> bool:
        """Some share's own step ran, and none called the closure it was given."""
        return self.offered > 0 and self.taken == 0

    def for_share(self, optimizer_name: str, params: list[Tensor]) -> _ShareClosure:
        """The closure for one share's step over ``params`` (its masters), as torch gives
        it: call it before changing them, once."""
        self.offered += 1
        return _ShareClosure(self, optimizer_name, params)


class _ShareClosure:
    def __init__(self, step: StepClosure, optimizer_name: str, params: list[Tensor]) -> None:
        self._step = step
        self._name = optimizer_name
        self._params = params
        self._versions = [p._version for p in params]
        self._called = False

    def __call__(self) -> Any:
        changed = any(p._version != v for p, v in zip(self._params, self._versions))
        if self._called or changed:
            raise ClosureEvaluatedAgain(
                f"{self._name}'s step evaluates the closure again after changing the weights (as SAM-style "
                f"optimizers and LBFGS do); its offloaded share holds the weights apart from the model, where forward "
                f"and backward cannot see them. Name it in the strategy's argument closure_optimizers=[{self._name!r}] "
                f"(FastOptStrategy, FastOptFabricStrategy): it then runs as torch runs it, on the model's weights, "
                f"not offloaded")
        self._called = True
        self._step.taken += 1
        return self._step.loss
