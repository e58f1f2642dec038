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

One share gets more: the share an engine updates first at ``step()`` (its "leading
share", :meth:`OptimizerWrapper.leading_share
<lightning_fastopt.optim.wrapper.OptimizerWrapper.leading_share>`) is entered before the
closure is evaluated, as torch enters ``step`` and Lightning's plugin calls
``optimizer.step(closure=...)``: what the user's ``step`` does before calling the closure
happens before ``training_step`` (:class:`LeadingStep`).  Its ``step`` runs on a thread
of its own that waits at the closure call while the engine evaluates the closure, takes
the gradients in and reaches that share, then goes on from there with the share's
gradients in place; the engine waits for it.  One thing runs at a time, in torch's order.
"""

from __future__ import annotations

import threading
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
    return check_optimizer_names(value, "closure_optimizers")


def check_optimizer_names(value: Any, argument: str) -> tuple[str, ...]:
    """A strategy's ``argument`` that names optimizer classes: classes or their names (one,
    or a list of them), as names."""
    items = [value] if isinstance(value, (str, type)) else value
    try:
        items = list(items)
    except TypeError:
        items = None
    if items is None or not all(isinstance(v, type) or (isinstance(v, str) and v) for v in items):
        raise TypeError(f"{argument} must be optimizer classes or class names (a list of them), got {value!r}")
    return tuple(v if isinstance(v, str) else v.__name__ for v in items)


class StepClosure:
    """The closure of one step, already evaluated: ``loss`` is what it returned.  It is
    handed to each share's own step through :meth:`for_share`; :attr:`offered` counts the
    shares it was handed to, :attr:`taken` those whose step called it.  ``leading``: the
    :class:`LeadingStep` whose call of the closure evaluated it (its share's step waits
    there for the engine), if any."""

    def __init__(self, loss: Any, leading: LeadingStep | None = None) -> None:
        self.loss = loss
        self.leading = leading
        self.offered = self.taken = 0 if leading is None else 1  # the leading step called it
        if leading is not None:
            leading.loss = loss

    @classmethod
    def not_called(cls) -> StepClosure:
        """The closure a leading share's step was given and ended without calling."""
        ignored = cls(None)
        ignored.offered = 1
        return ignored

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
            raise _evaluated_again(self._name)
        self._called = True
        self._step.taken += 1
        return self._step.loss


def _evaluated_again(optimizer_name: str) -> ClosureEvaluatedAgain:
    return ClosureEvaluatedAgain(
        f"{optimizer_name}'s step evaluates the closure again after changing the weights (as SAM-style "
        f"optimizers and LBFGS do); its offloaded share holds the weights apart from the model, where forward "
        f"and backward cannot see them. Name it in the strategy's argument closure_optimizers=[{optimizer_name!r}] "
        f"(FastOptStrategy, FastOptFabricStrategy): it then runs as torch runs it, on the model's weights, "
        f"not offloaded")


class StepAbandoned(Exception):
    """Raised inside a leading share's step, at its closure call, when the engine's step
    failed after the closure ran: the user's step ends there and the engine's error is raised."""


class LeadingStep:
    """The user's ``step`` on an engine's leading share, entered before the closure is
    evaluated (see the module).

    :meth:`enter` calls ``step(closure=...)`` on a thread of its own and returns once that
    step has called the closure (True) or ended without calling it (False; the closure
    then never runs, as under torch); the caller then evaluates the closure.  When the
    engine reaches the share, :meth:`resume` returns the loss from the closure call with
    the share's gradients in place, and waits for the step to end.  :meth:`close` ends a
    step the engine never reached (a skipped step, a share without gradients: it goes on
    without gradients, as torch's step passes over a parameter whose ``grad`` is None) or
    one the engine gave up on (``error``).  The thread starts with the caller's grad mode
    and, on a GPU, its device and current stream.  A second call of the closure, or a
    first one after the step changed the share's weights, raises
    :class:`ClosureEvaluatedAgain` in the user's step, which the engine raises.
    """

    def __init__(self, share, step_kwargs: dict[str, Any]) -> None:
        self.share = share  # a UserStepOptimizer sibling (optim.user_step)
        self._kwargs = dict(step_kwargs)
        self._params = share.masters()
        self._versions = [p._version for p in self._params]
        self._asked = threading.Event()  # the step called the closure, or ended
        self._go = threading.Event()  # the engine answers the call
        self._called = False
        self._ended = False
        self._error: BaseException | None = None  # what the user's step raised
        self._abandoned: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.loss: Any = None

    @property
    def waiting(self) -> bool:
        """The user's step is at its closure call, waiting for the engine."""
        return self._called and not self._go.is_set()

    def enter(self) -> bool:
        grad_enabled = torch.is_grad_enabled()
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

        def run() -> None:
            try:
                torch.set_grad_enabled(grad_enabled)
                if stream is not None:
                    torch.cuda.set_device(stream.device)
                    torch.cuda.set_stream(stream)
                self.share.runner.step(closure=self._closure, **self._kwargs)
            except StepAbandoned:
                pass
            except BaseException as e:  # noqa: BLE001 - raised again on the engine's thread
                self._error = e
            finally:
                self._ended = True
                self._asked.set()

        self._thread = threading.Thread(target=run, name="fastopt-leading-step", daemon=True)
        self._thread.start()
        self._asked.wait()
        if self._ended and not self._called:
            self._thread.join()
            self._raise_error()
        return self._called

    def _closure(self) -> Any:
        changed = any(p._version != v for p, v in zip(self._params, self._versions))
        if self._called or changed:
            raise _evaluated_again(self.share.user_class.__name__)
        self._called = True
        self._asked.set()
        self._go.wait()
        if self._abandoned is not None:
            raise StepAbandoned() from self._abandoned
        return self.loss

    def resume(self) -> None:
        """The engine reached the share, its gradients in place: the step goes on; wait for it."""
        self._go.set()
        self._thread.join()
        self._raise_error()

    def close(self, error: BaseException | None = None) -> None:
        """After the engine's step (``error``: what it raised): end a step still waiting."""
        if not self.waiting:
            return
        if error is not None:
            self._abandoned = error
            self._go.set()
            self._thread.join()
            return
        before = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        try:
            self.resume()
        finally:
            for p, g in zip(self._params, before):
                p.grad = g

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error
