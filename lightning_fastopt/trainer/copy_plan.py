"""Where a DDP Trainer strategy's engines take the gradients and send the weights, decided
at set-up from what the run's code can read (said in one log line each):

- gradients stay in ``p.grad`` until the step when a hook or callback of the run can
  read them (:func:`~lightning_fastopt.trainer.grad_readers.gradient_readers`, or
  ``keep_gradients=True``); otherwise the offloaded ones are copied to the host during
  backward and freed on the device (with DDP, at the step), and ZeRO stage 2 reduces
  them to their owner during backward (as stage 1 where they are read);
- ``stream_cpu_step`` starts host updates during backward where nothing stands in the way
  (with DDP, its buckets handed over as each all-reduce completes,
  :mod:`~lightning_fastopt.core.ddp_reductions`);
- ``forward_waits="module"`` lets each module's forward wait only for its own weights
  where nothing but the modules' forward reads weights between steps.
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel

from lightning_fastopt.core.ddp_reductions import DDPReductions
from lightning_fastopt.core.engines import in_place_refusals, stream_arguments
from lightning_fastopt.optim.base import FusedOptimizer, needs_step_context
from lightning_fastopt.trainer.grad_readers import forward_waits_refusals, gradient_readers, say_forward_waits
from lightning_fastopt.trainer.package import TrainerPackage


class CopyPlan:
    """A mixin of :class:`~lightning_fastopt.trainer.strategy.TrainerStrategy`: it reads the
    strategy's options (``zero_stage``, ``keep_gradients``, ``stream_cpu_step``,
    ``forward_waits``, ...) and sets ``_grad_readers = None`` and ``_torch_steps = []``
    (decided again in each run) and ``_ddp_reductions = None`` in its ``__init__``."""

    package: TrainerPackage
    _grad_readers: list[str] | None
    _torch_steps: list[str]
    _ddp_reductions: DDPReductions | None

    @property
    def _effective_stage(self) -> int:
        """The ZeRO stage that runs: stage 2 frees other ranks' gradients during backward,
        so it reduces them as stage 1 does when user code reads them, or an optimizer runs
        as torch runs it (``_torch_steps``, known once the optimizers are: DDP wraps the
        model then)."""
        return 1 if self.zero_stage == 2 and (self._readers() or self._torch_steps) else self.zero_stage

    def _readers(self) -> list[str]:
        if self._grad_readers is None:
            module = self.lightning_module
            self._grad_readers = gradient_readers(module, module.trainer.callbacks, self.package, self.keep_gradients)
        return self._grad_readers

    def _device_grads(self) -> str:
        """The offload optimizers' ``device_grads``, said in one log line with the reason."""
        readers = self._readers()
        if readers:
            note = " (ZeRO stage 2 reduces them as stage 1 does)" if self.zero_stage == 2 else ""
            rank_zero_info(f"lightning_fastopt: gradients stay in p.grad until the optimizer step{note}, as in "
                           f"torch: {', '.join(readers)} can read them")
            return "keep"
        if self.offload_fraction != 0:  # with nothing offloaded nothing is copied: no line to say so
            rank_zero_info("lightning_fastopt: gradients of offloaded parameters are copied to the host and freed "
                           "on the device during backward (no hook or callback reads p.grad; "
                           "FastOptStrategy(keep_gradients=True) keeps them for code that reads them elsewhere)")
        return "copy_at_step" if isinstance(self.model, DistributedDataParallel) else "copy_in_backward"

    def _streams(self, trainer, fused: FusedOptimizer, device_grads: str) -> dict[str, bool]:
        """How the CPU step streams into backward (``stream_cpu_step``): the offload
        optimizer's arguments, said in one line."""
        if not self.stream_cpu_step:
            return {}
        ddp = device_grads == "copy_at_step"
        refusals = [
            ("user code reads gradients before the step", device_grads == "keep"),
            ("a DDP communication hook of the run's own reduces the gradients", ddp and _user_comm_hook(self)),
            ("DDP finds the parameters no rank used only when backward has ended (find_unused_parameters=True)",
             ddp and getattr(self.model, "find_unused_parameters", False)),
            *in_place_refusals(self.offload_fraction, self.root_device, self.copy_on_cpu),
        ]
        checks = [*self._step_checks(trainer), (f"{type(fused).__name__}'s global norm", needs_step_context(fused))]
        streams = stream_arguments("been reduced and landed" if ddp else "landed", checks, refusals)
        if not streams:
            return {}
        if ddp:  # DDP's buckets, each handed over once its all-reduce has completed
            if self._ddp_reductions is None:
                self._ddp_reductions = DDPReductions(self.model, self._hand_over)
            streams["reduced_by"] = self._ddp_reductions.reduces
        return streams

    def _hand_over(self, grads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """DDP's averaged gradients of a bucket, to the engines that step them (with ZeRO
        stage 1, each rank's to the shard it owns)."""
        for engine in self.engines:
            for p, g in grads:
                if engine.owns(p):
                    engine.grad_reduced(p, g)

    def _waits_by_module(self, trainer) -> bool:
        """Whether each module's forward waits only for its own new weights
        (``forward_waits="module"``), said in one line."""
        if self.forward_waits == "step":
            return False
        why_not = forward_waits_refusals(self.lightning_module, trainer.callbacks, self.package)
        why_not += [reason for reason, applies in (
            ("nothing is offloaded", self.offload_fraction == 0 and not self.auto_fraction),
            ("a CPU run updates in place, with nothing to copy",
             self.root_device.type == "cpu" and not (self.copy_on_cpu or self.delayed_update)),
        ) if applies]
        return say_forward_waits(why_not, "each module's forward waits only for its own new weights")


def _user_comm_hook(strategy) -> bool:
    """Whether the run registers a DDP communication hook of its own (``DDPStrategy(ddp_comm_hook=...)``)."""
    return any(getattr(strategy, a, None) is not None for a in ("_ddp_comm_hook", "_ddp_comm_wrapper"))
