"""OptimizerWrapper: the contract between the optimizers that run a fused optimizer's
parameters their own way (:class:`~lightning_fastopt.offload.OffloadOptimizer`,
:class:`~lightning_fastopt.zero.ZeroOptimizer`) and the code that drives them (the
precision plugin and the strategy, which speak to this type only).

A wrapper takes over a :class:`~lightning_fastopt.optim.base.FusedOptimizer`: its
parameters, hyperparameters and state.  It shares that optimizer's ``param_groups`` dicts
(torch's ``add_param_group`` keeps the dict objects it is given), so LR schedulers bound
to either, or to the user's torch optimizer the fused one was mapped from, keep working;
the wrapped optimizer is not stepped itself afterwards.

What a driver may use:

- :meth:`gradients`: every gradient the next step reads, where it reads it (host memory
  for offloaded parameters, once landed); overflow checks and clipping read and scale
  them in place.  With :attr:`shards_gradients` they are this rank's shard only, so
  norms and overflow flags must be combined over the ranks.
- :meth:`gradient_norm`: their L2 norm as torch's ``get_total_norm`` computes it over the
  whole model's gradients (clipping by norm), also where they are sharded.
- :meth:`step` with ``grad_scale`` (unscaled inside the kernels), ``check_finite`` and
  ``step_context``, as :meth:`FusedOptimizer.step
  <lightning_fastopt.optim.base.FusedOptimizer.step>`, and any other keyword arguments
  for the user's own ``step`` (:attr:`step_kwargs` while it runs); ``skipped_steps`` and
  ``last_step_skipped`` count the steps skipped for overflow; :meth:`step_skipped` where a
  precision plugin skips the step itself, without calling :meth:`step`.
- :attr:`accumulating`: set while gradients accumulate over micro-batches that do not
  step (nothing is copied or communicated yet).
- :attr:`expected_grad_scale`: the ``grad_scale`` the next :meth:`step` will be given,
  announced before backward (an offload optimizer that speculates updates during
  backward uses it; a step given another one redoes them).
- :meth:`state_of`, :meth:`owns`, :meth:`partition`, :attr:`last_step_times`, and
  :meth:`close` at teardown.
- :meth:`run_method`: a method of the user's class beyond torch's interface
  (:attr:`shared_methods`), run on every share.
- :meth:`add_param_group` at any time (``BackboneFinetuning``): the group joins the
  wrapped optimizer's list (the user's, when it was mapped from a torch optimizer, so LR
  schedulers bound to that one see it) and the wrapper takes its parameters over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.functional import scale_grads_
from lightning_fastopt.optim.base import COMPUTE, FusedOptimizer, duplicates_warned_already, run_step
from lightning_fastopt.optim.closure import LeadingStep, StepClosure


class OptimizerWrapper(torch.optim.Optimizer):
    shards_gradients = False  # gradients() holds this rank's shard only
    accumulating = False  # set by the driver while gradients accumulate without a step
    expected_grad_scale: float | None = None  # the grad_scale the next step will be given
    step_kwargs: dict[str, Any] = {}  # during a step: the keyword arguments for the user's own step
    step_closure: StepClosure | None = None  # during a step given one: its closure, evaluated (optim.closure)
    last_step_closure: StepClosure | None = None

    def __init__(self, optimizer: FusedOptimizer) -> None:
        if not isinstance(optimizer, FusedOptimizer):
            raise TypeError(f"{type(self).__name__} runs lightning_fastopt's fused optimizers (to_fused_optimizer "
                            f"makes one of any torch optimizer), got {type(optimizer).__name__}")
        self.optimizer = optimizer
        with duplicates_warned_already():
            super().__init__(optimizer.param_groups, optimizer.defaults)  # the same group dicts
        self.skipped_steps = 0
        self.last_step_skipped = False

    def __repr__(self) -> str:
        """The subclass's description once it is built (``_ready``); before (its ``__init__``
        raised, and a traceback or debugger shows the object), its class alone."""
        if not self.__dict__.get("_ready", False):
            return f"{type(self).__name__}(not built)"
        return self._describe()

    def _describe(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``.  Once the subclass is built (``_ready``), the group
        goes to the wrapped optimizer first (which validates it, fills in the defaults and,
        like torch, refuses a parameter that is already in a group) and the very same dict
        joins this optimizer's groups; :meth:`_adopt_group` then takes its parameters over."""
        if not self.__dict__.get("_ready", False):
            super().add_param_group(param_group)  # construction: torch's __init__ adds the groups
            return
        self.optimizer.add_param_group(param_group)
        group = self.optimizer.param_groups[-1]
        self.param_groups.append(group)
        self._adopt_group(group)

    def replace_param_groups(self, groups: list[dict[str, Any]]) -> None:
        """``optimizer.param_groups = groups`` (``BaseFinetuning`` restoring, on resume, the
        groups it added in the earlier run): a group over the parameters of this
        optimizer's group at the same position replaces that dict (its hyperparameters
        are taken); the groups after this optimizer's are added (:meth:`add_param_group`).
        Parameters moved between groups, or groups dropped, are a ValueError: the state
        of the groups is kept per group."""
        groups = list(groups)
        mine = self.param_groups
        ids = [[id(p) for p in g["params"]] for g in groups]
        if len(groups) < len(mine) or any(new != [id(p) for p in old["params"]] for new, old in zip(ids, mine)):
            raise ValueError(f"{type(self).__name__} takes new param_groups that keep each of its "
                             f"{len(mine)} group(s) with the same parameters, in order, and may add groups after them")
        for i, group in enumerate(groups[:len(mine)]):
            group = self.optimizer._normalize_group(group)
            for key, value in self.optimizer.defaults.items():
                group.setdefault(key, value)
            self.optimizer._validate_group(group)
            self.optimizer.param_groups[i] = mine[i] = group
        for group in groups[len(mine):]:
            self.add_param_group(group)

    def _adopt_group(self, group: dict[str, Any]) -> None:
        """Start stepping the parameters of a group added after construction."""
        raise NotImplementedError

    @property
    def shared_methods(self) -> tuple[str, ...]:
        """The methods beyond torch's interface that the user's optimizer has and that run on
        every share (:func:`~lightning_fastopt.optim.user_step.shared_methods`: schedule-free's
        ``train()`` and ``eval()``); none for an optimizer the kernels run."""
        return getattr(self.optimizer, "shared_methods", ())

    def state_beside_parameters(self) -> dict[Any, Any]:
        """The user's class's state under keys that are not parameters (MADGRAD's
        ``state["k"]``), as its shares keep it alike; none for the kernels' optimizers."""
        return {}

    def run_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The user's method ``name`` (one of :attr:`shared_methods`) run on every share's
        instance of its class, and the weights it changed in the model (a subclass's)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scale: float | Tensor | None = None,
             check_finite: bool = False, step_context: Any = COMPUTE, **step_kwargs: Any):
        """One step of every parameter; the arguments mean what they mean for
        :meth:`FusedOptimizer.step <lightning_fastopt.optim.base.FusedOptimizer.step>`.
        ``step_kwargs``: any other keyword arguments, for the user's own ``step``
        (``opt.step(closure, optim="sgd")``), which gets them on every share of the
        parameters; an optimizer the kernels run takes none, as torch's own step."""
        if step_kwargs and not self.optimizer.takes_step_kwargs:
            raise TypeError(f"step() got unexpected keyword argument(s) {', '.join(map(repr, step_kwargs))}: the "
                            f"optimizer runs as {type(self.optimizer).__name__}, whose step (like torch's own) takes "
                            f"none beyond the closure; keyword arguments reach an optimizer that runs its own step")
        self.step_kwargs = step_kwargs
        share = self.leading_share() if callable(closure) and not isinstance(closure, StepClosure) else None
        try:
            return run_step(self, closure, lambda evaluated: self._take_step_with(evaluated, grad_scale, check_finite,
                                                                                 step_context),
                            LeadingStep(share, step_kwargs) if share is not None else None)
        finally:
            self.step_kwargs = {}

    def leading_share(self) -> FusedOptimizer | None:
        """The inner optimizer this wrapper's step updates first, when it runs the user's own
        ``step`` (:class:`~lightning_fastopt.optim.user_step.UserStepOptimizer`) and is
        updated at ``step()``: its ``step`` is entered before the closure is evaluated, as
        torch's is (:class:`~lightning_fastopt.optim.closure.LeadingStep`).  None: the
        closure is evaluated when the step begins."""
        return None

    def _take_step_with(self, evaluated: StepClosure | None, grad_scale, check_finite: bool, step_context: Any) -> bool:
        """:meth:`_take_step` with :attr:`step_closure` set to the step's evaluated closure
        (kept afterwards as :attr:`last_step_closure`)."""
        self.step_closure = self.last_step_closure = evaluated
        try:
            return self._take_step(grad_scale, check_finite, step_context)
        finally:
            self.step_closure = None

    @property
    def closure_ignored(self) -> bool:
        """The last step's closure was handed to the optimizer's own step and none of its
        shares called it (as ``torch.optim.SGD`` subclasses that drop it do; under Lightning
        the closure then never runs, and the training loop raises)."""
        return self.last_step_closure is not None and self.last_step_closure.ignored

    def _take_step(self, grad_scale, check_finite: bool, step_context: Any) -> bool:
        """The step itself; returns True when it was skipped (an inf/NaN gradient)."""
        raise NotImplementedError

    def gradients(self) -> list[Tensor]:
        raise NotImplementedError

    def scale_gradients(self, coef: Tensor) -> None:
        """Multiply every gradient the next step reads by ``coef`` (a float32 tensor:
        clipping by norm), each as ``torch._foreach_mul_`` multiplies it on its device; an
        offload optimizer multiplies a host bucket's in its update, where they are read
        (:meth:`OffloadOptimizer.scale_gradients <lightning_fastopt.offload.OffloadOptimizer.scale_gradients>`)."""
        scale_grads_(self.gradients(), coef)

    def gradient_norm(self, grad_scale: float = 1.0) -> Tensor:
        """The L2 norm of every gradient the next step reads, unscaled by ``grad_scale``
        (fp16 loss scaling), as torch's ``get_total_norm`` computes it over the model's
        gradients (the norm gradient clipping takes); a sharded optimizer combines the
        ranks' shards into the same bits."""
        total = torch.nn.utils.get_total_norm(self.gradients(), 2.0)
        return total / grad_scale if grad_scale != 1.0 else total

    def owns(self, param: Tensor) -> bool:
        """Whether this optimizer keeps (and updates) the state of ``param``."""
        raise NotImplementedError

    def state_of(self, param: Tensor) -> dict[str, Any]:
        """The optimizer state of one of the optimizer's parameters (empty before its first
        step, and where another rank owns it)."""
        raise NotImplementedError

    def partition(self) -> dict[str, int] | None:
        """The rank that owns each parameter's state, by name, when :meth:`state_dict`
        holds this rank's shard only; None when it holds the whole state."""
        return None

    @property
    def last_step_times(self) -> dict[str, float]:
        """Milliseconds per phase of the last step (with ``wall_clock_breakdown``)."""
        return {}

    def wait_for_weights(self, params: list[Tensor] | None = None) -> None:
        """Wait for the new weights of ``params`` (every one: None) that the last step left
        on their way: before anything but their modules' forward reads them.  Here none is."""

    def step_skipped(self) -> None:
        """A precision plugin skipped this step (an overflow) without calling :meth:`step`:
        undo, now, whatever was begun for it during backward (before the next forward reads
        the weights)."""

    def close(self) -> None:
        """Undo what construction attached to the model (backward hooks) and wait for
        work in flight."""


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer itself, not Lightning's ``LightningOptimizer`` around it (manual
    optimization and some hooks hand that one over)."""
    return getattr(optimizer, "_optimizer", optimizer)


def unscales_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``step(grad_scale=...)`` unscales the gradients inside the kernels (ours
    do; any other optimizer needs its gradients unscaled before it steps)."""
    return isinstance(optimizer, (FusedOptimizer, OptimizerWrapper))
