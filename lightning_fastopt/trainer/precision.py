"""The Trainer's precision plugin with DeepSpeed-style fp16 loss scaling, written once for
both Lightning packages (:class:`TrainerPrecision`; the classes users name,
``FastOptPrecision``, are in :mod:`~lightning_fastopt.trainer.lightning_pytorch` and
:mod:`~lightning_fastopt.trainer.pytorch_lightning`).

Usable on its own, ``Trainer(plugins=[FastOptPrecision("16-mixed")])`` (on the CPU, where
Lightning turns ``precision="16-mixed"`` into bf16, this is the way to get fp16), and by
the fastopt strategies.

One optimizer step, in fp16:
1. forward under fp16 autocast, the loss multiplied by the current scale, backward;
2. the gradients are checked for inf/NaN; on overflow, clipping and the whole step are
   skipped (no parameter or optimizer state changes), ``skipped_steps`` grows, and the
   scale follows the rule of :class:`~lightning_fastopt.core.loss_scaler.DynamicLossScaler`;
3. otherwise, where a hook between the closure and the step can read the gradients
   (``on_before_optimizer_step``, ``configure_gradient_clipping``), they are unscaled in
   place first, as Lightning's own plugin unscales them before those hooks (float32
   gradients; half ones stay scaled); else hooks and clipping run on the still scaled
   gradients, with the scale taken out of the arithmetic so that the clipping thresholds
   mean what they mean in fp32, and the optimizer steps: our fused optimizers unscale
   inside the kernel (one pass fewer), any other optimizer gets its gradients unscaled in
   place first.

What is not Trainer-specific is :class:`~lightning_fastopt.core.precision.PrecisionCore`,
shared with Fabric's plugin.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from lightning_fastopt.core.precision import SUPPORTED_PRECISIONS, PrecisionCore, needs_closure
from lightning_fastopt.optim.takeover import engine_of
from lightning_fastopt.optim.wrapper import OptimizerWrapper
from lightning_fastopt.trainer.grad_readers import readers_after_the_closure
from lightning_fastopt.trainer.package import TrainerPackage

__all__ = ["SUPPORTED_PRECISIONS", "TrainerPrecision"]


class TrainerPrecision(PrecisionCore):
    """Precision plugin: ``"16-mixed"`` (fp16 autocast, dynamic loss scaling with DeepSpeed's
    knobs), ``"bf16-mixed"`` (bf16 autocast), ``"32-true"``, or the half weights of
    ``"bf16-true"`` and ``"16-true"`` (fp16, with the same loss scaling): the model holds
    bf16/fp16 weights and gradients (2 bytes per parameter on the device), and the fastopt
    optimizers keep float32 master weights and write the half copy in the same pass, as
    apex O2 and DeepSpeed do.

    Args:
        precision: one of ``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``, ``"bf16-true"``,
            ``"16-true"``.
        loss_scale: 0 for dynamic scaling, or a fixed scale (fp16 only).
        initial_scale_power: dynamic scaling starts at ``2 ** initial_scale_power``.
        loss_scale_window: clean steps before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        min_loss_scale: the scale never goes below this.
        at_min_loss_scale: when a step overflows with the scale at its minimum: ``"raise"``
            (default), ``"warn"`` or ``"skip"`` (see :mod:`~lightning_fastopt.core.loss_scaler`).
        device: autocast device type; by default the device of the model's parameters.

    After construction ``loss_scale`` is the current scale (1.0 unless fp16) and
    ``skipped_steps`` the number of optimizer steps skipped for overflow.

    A mixin: each front-end's ``FastOptPrecision`` puts it before its package's
    ``Precision`` class and names the package (``package``).
    """

    package: TrainerPackage

    @override
    def connect(self, model, optimizers, lr_schedulers):
        if self.device is None:
            param = next(iter(model.parameters()), None)
            self.device = param.device.type if param is not None else "cpu"
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if needs_closure(optimizer, getattr(model.trainer.strategy, "closure_optimizers", ())):
            if self.scaler is not None:
                raise TypeError(f"{type(optimizer).__name__} evaluates the closure again after changing the weights: "
                                "it cannot run with fp16 loss scaling (as with Lightning's own 16-mixed)")
            return super().optimizer_step(optimizer, model, closure, **kwargs)  # its step runs the closure
        self.announce_grad_scale(optimizer)  # an update speculated during backward takes it
        if self.scaler is None:  # as Lightning's plugin: the optimizer's step runs the closure (and the hooks after it)
            self._overflow = False
            out = self._step(optimizer, closure=functools.partial(self._wrap_closure, model, optimizer, closure),
                             **kwargs)
            self._refuse_an_ignored_closure(optimizer, closure, model)
            return out
        closure_result = closure()
        if self._training_step_returned_none(closure, closure_result, model):
            return closure_result  # Lightning skipped backward (and said so): its GradScaler path skips the step
        overflow = self._check_overflow(optimizer)
        self._unscale_for_hooks(optimizer, model)  # on overflow too, as Lightning's plugin
        try:
            self._after_closure(model, optimizer)  # hooks, then clipping (skipped on overflow)
            if overflow:
                self._skip_step(optimizer)
                return closure_result
            self._step(optimizer, **kwargs)
        finally:
            self._unscaled = False
        return closure_result

    def _unscale_for_hooks(self, optimizer, model) -> bool:
        """Unscale the gradients in place (:meth:`_unscale_in_place`) where a hook between the
        closure and the step can read them (``on_before_optimizer_step``,
        ``configure_gradient_clipping``), as Lightning's own plugin unscales them before
        those hooks; else they stay scaled and the kernels take the scale out as they read
        them (one pass fewer)."""
        return bool(readers_after_the_closure(model, model.trainer.callbacks, self.package)) and \
            self._unscale_in_place(optimizer)

    def _refuse_an_ignored_closure(self, optimizer, closure: Callable[[], Any], model) -> None:
        """An optimizer's own step that never called the closure it was given: under
        Lightning automatic optimization's closure then never runs, and its loop raises;
        here the engine ran it when the step began, so the same error is raised here."""
        engine = engine_of(optimizer)
        if isinstance(engine, OptimizerWrapper) and engine.closure_ignored and self._is_automatic(closure, model):
            raise self.package.MisconfigurationException(
                f"The closure hasn't been executed: {type(optimizer).__name__}.step did not call the closure it was "
                "given (training_step and backward). Pass it on, as `super().step(closure)`")

    def _is_automatic(self, closure: Callable[[], Any], model) -> bool:
        """Whether ``closure`` is automatic optimization's own (through wrappers of ours)."""
        while hasattr(closure, "__wrapped__"):  # a wrapper of ours (the timed closure of "auto")
            closure = closure.__wrapped__
        return model.automatic_optimization and isinstance(closure, self.package.Closure)

    def _training_step_returned_none(self, closure: Callable[[], Any], closure_result: Any, model) -> bool:
        """Whether this step's closure was automatic optimization's and found no loss.  A
        closure that returns None is also what ``optimizer.step()`` without one passes down
        (Lightning's do-nothing closure), after the user's ``optimizer_step`` ran the real
        one itself: its backward happened, and the step must run (it once was skipped,
        silently).  Asked with a loss scaler only: without one the optimizer's step runs the
        closure, as under Lightning's own plugin, and steps whatever gradients there are."""
        return closure_result is None and self._is_automatic(closure, model)

    @override
    def _clip_gradients(self, model, optimizer, clip_val=None, gradient_clip_algorithm=None) -> None:
        if self._overflow:
            return  # the step is skipped anyway; inf/NaN gradients have no meaningful norm
        super()._clip_gradients(model, optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_gradients(self, optimizer, clip_val: float | int = 0.0, gradient_clip_algorithm="norm") -> None:
        """Clip the (possibly still scaled) gradients as if they were unscaled
        (``gradient_clip_algorithm``: Lightning's ``GradClipAlgorithmType``, a string)."""
        self.clip_scaled_gradients(optimizer, clip_val, by_value=gradient_clip_algorithm == "value")

    @classmethod
    def from_lightning(cls, plugin, **scale_knobs: Any) -> TrainerPrecision:
        """This class's plugin for the one Lightning built from the ``precision`` flag
        (``scale_knobs``: the loss-scaling arguments); a TypeError naming the supported
        precisions for anything else."""
        package = cls.package
        if isinstance(plugin, cls):
            return plugin
        if isinstance(plugin, package.MixedPrecision):
            return cls(plugin.precision, device=getattr(plugin, "device", None), **scale_knobs)
        if isinstance(plugin, (package.HalfPrecision, package.DoublePrecision)):
            return cls(plugin.precision, **scale_knobs)
        if type(plugin) is package.Precision:
            return cls("32-true")
        raise TypeError(f"the fastopt strategies support precision in {SUPPORTED_PRECISIONS} "
                        f"(or plugins=[FastOptPrecision(...)]), got {type(plugin).__name__}"
                        f"({getattr(plugin, 'precision', '?')!r})")
