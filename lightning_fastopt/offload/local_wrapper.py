"""LocalOffloadWrapper: an optimizer wrapper that steps its share of the parameters through
an :class:`~lightning_fastopt.offload.OffloadOptimizer` of its own (``local``): ZeRO's
shard of whole parameters (:class:`~lightning_fastopt.zero.ZeroOptimizer`), FSDP's local
rows of every parameter (:class:`~lightning_fastopt.fsdp.LocalShardOptimizer`).  What the
driver sets and reads of the step itself goes straight to that one."""

from __future__ import annotations

from lightning_fastopt.functional import scale_grads_
from lightning_fastopt.offload.optimizer import OffloadOptimizer
from lightning_fastopt.optim.wrapper import OptimizerWrapper


class LocalOffloadWrapper(OptimizerWrapper):
    """A subclass builds ``local`` in its ``__init__``."""

    local: OffloadOptimizer

    @property
    def expected_grad_scale(self):
        return self.local.expected_grad_scale

    @expected_grad_scale.setter
    def expected_grad_scale(self, scale) -> None:
        """The loss scale the next step will take (the local optimizer speculates with it)."""
        self.local.expected_grad_scale = scale

    @property
    def accumulating(self) -> bool:
        return self.local.accumulating

    @accumulating.setter
    def accumulating(self, value: bool) -> None:
        """Set while Lightning accumulates gradients: nothing is copied (or communicated) yet."""
        self.local.accumulating = value

    @property
    def last_step_times(self) -> dict[str, float]:
        return self.local.last_step_times

    def scale_gradients(self, coef) -> None:
        """The local optimizer's gradients multiplied its way (a host bucket's in its
        update), the others this wrapper's step reads (:meth:`_gradients_beside_local`) now."""
        self.gradients()  # (final once read: ZeRO's reductions finished, FSDP's rows taken)
        self.local.scale_gradients(coef)
        scale_grads_(self._gradients_beside_local(), coef)

    def _gradients_beside_local(self) -> list:
        """The gradients the step reads besides the local optimizer's (FSDP's taken at the step)."""
        return []

    def leading_share(self):
        return self.local.leading_share()

    def step_skipped(self) -> None:
        self.local.step_skipped()

    def state_beside_parameters(self):
        return self.local.state_beside_parameters()

    def run_method(self, name: str, *args, **kwargs):
        """On the local optimizer's shares; then the weights it changed reach the others
        (:meth:`_weights_changed`)."""
        result = self.local.run_method(name, *args, **kwargs)
        self._weights_changed()
        return result

    def _weights_changed(self) -> None:
        """The local optimizer's weights were written outside a step: what a step does
        after its update to share them (ZeRO's broadcast); nothing for FSDP's rows."""
