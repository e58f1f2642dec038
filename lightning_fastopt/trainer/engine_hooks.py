"""The Lightning hooks of a Trainer strategy that concern its engines.

Every Trainer strategy (DDP's and its one-process twin, :mod:`~lightning_fastopt.trainer.strategy`;
FSDP's, :mod:`~lightning_fastopt.trainer.fsdp_strategy`) holds its engines in an
:class:`~lightning_fastopt.trainer.engine_set.EngineSet` (``self._engines``, made here) and
answers these hooks of Lightning's from it:

- ``optimizers``: Lightning's ``LightningOptimizer`` wrappers, made anew wherever Lightning
  makes them, each showing the engine's methods
  (:func:`~lightning_fastopt.optim.takeover.show_through`);
- ``block_backward_sync``: the micro-batches of an accumulation window that do not step, in
  which gradients are not final, so nothing is copied to the host or sent to its owner;
- every new weight in place before anything but a module's forward reads it: with
  ``forward_waits="module"`` a step may return with new weights still on their way (copies
  to the device, or CPU updates of FSDP's host shards); a checkpoint, evaluation (whose
  steps may read weights outside their modules' forward) and prediction wait for every
  one first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from typing_extensions import override

from lightning_fastopt.optim.takeover import show_through
from lightning_fastopt.optim.wrapper import OptimizerWrapper
from lightning_fastopt.trainer.engine_set import EngineSet


class EngineHooks:
    """A base before Lightning's strategy class: it makes ``self._engines`` and answers the
    hooks above from it, and nothing else."""

    _engines: EngineSet

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._engines = EngineSet()
        super().__init__(*args, **kwargs)

    @property
    def engines(self) -> list[OptimizerWrapper]:
        """The engine that steps each of the user's optimizers (in ``trainer.optimizers``,
        which stay the user's), from the last set-up of a fit on: kept after the fit, to
        read (``offloaded_numel``, ``skipped_steps``, ``last_step_times``, ...)."""
        return self._engines.engines

    @property
    def optimizers(self) -> list:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list) -> None:
        """Lightning's setter, which makes a ``LightningOptimizer`` around each (after a
        take-over, and wherever Lightning makes them anew: a strategy copied or unpickled,
        the LR finder), then each of those shows the engine's methods: their class, made
        from the optimizer's own, would find that class's ``zero_grad`` and ``state_dict``
        first."""
        mro = type(self).__mro__
        lightnings = next(c.__dict__["optimizers"] for c in mro[mro.index(EngineHooks) + 1:]
                          if isinstance(c.__dict__.get("optimizers"), property))
        lightnings.fset(self, optimizers)
        for wrapper in self._lightning_optimizers:
            show_through(wrapper)

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning enters this for the micro-batches that do not step (DDP's one-process
        twin, which has no backward sync to block, marks them in ``pre_backward``)."""
        self._engines.set_accumulating(True)
        try:
            with super().block_backward_sync():
                yield
        finally:
            self._engines.set_accumulating(False)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._engines.wait_for_weights()  # a checkpoint reads every weight
        return super().lightning_module_state_dict()

    @override
    def on_validation_start(self) -> None:
        self._engines.wait_for_weights()  # validation_step may read weights outside their modules' forward
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._engines.wait_for_weights()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._engines.wait_for_weights()
        super().on_predict_start()
