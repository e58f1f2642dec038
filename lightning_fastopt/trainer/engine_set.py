"""Which engine steps each optimizer of a Trainer strategy of lightning_fastopt.

Every Trainer strategy (DDP's and its one-process twin, :mod:`~lightning_fastopt.trainer.strategy`;
FSDP's, :mod:`~lightning_fastopt.trainer.fsdp_strategy`) takes each optimizer from
``configure_optimizers`` over with an engine (an
:class:`~lightning_fastopt.optim.wrapper.OptimizerWrapper`) while the user's object stays
the one Lightning, LR schedulers and callbacks see (:mod:`~lightning_fastopt.optim.takeover`).
:class:`EngineSet` is the part of the strategy that holds them: which engine steps which of
the strategy's optimizers (by position, kept after fit: a checkpoint written then holds the
same state), and what is asked of all of them at once (gradients accumulating without a
step, every new weight in place, closing).  The strategy asks it; nothing else holds the
engines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.optim.takeover import give_back, take_over
from lightning_fastopt.optim.wrapper import OptimizerWrapper, unwrapped
from lightning_fastopt.plan.run_plan import OptimizerPlan


class EngineSet:
    """The engines of a strategy's optimizers, by the optimizer's position."""

    def __init__(self) -> None:
        self._at: dict[int, OptimizerWrapper] = {}

    def __len__(self) -> int:
        return len(self._at)

    @property
    def engines(self) -> list[OptimizerWrapper]:
        """Each engine, in the optimizers' order."""
        return list(self._at.values())

    def offload_optimizers(self) -> list[OffloadOptimizer]:
        """The engines that are offload optimizers themselves (DDP's strategies')."""
        return [e for e in self._at.values() if isinstance(e, OffloadOptimizer)]

    def take_over(self, optimizers: Sequence[Any], plans: Sequence[OptimizerPlan],
                  make_engine: Callable[[Any, OptimizerPlan], OptimizerWrapper]) -> None:
        """Give each of ``optimizers`` whose plan (in ``plans``, by position) puts it in an
        engine the engine ``make_engine(optimizer, plan)`` builds (said in one line each); the
        set holds only those."""
        self._at = {}
        for i, (opt, plan) in enumerate(zip(optimizers, plans)):
            if not plan.runner.in_engine:
                continue
            engine = make_engine(opt, plan)
            rank_zero_info(f"lightning_fastopt: {engine!r}")
            self._at[i] = engine
            take_over(opt, engine)

    def engine_for(self, optimizers: Sequence[Any], optimizer) -> OptimizerWrapper | None:
        """The engine of one of ``optimizers`` (or of Lightning's wrapper around it), also
        after fit gave the optimizer back."""
        optimizer = unwrapped(optimizer)
        return next((self._at.get(i) for i, opt in enumerate(optimizers) if opt is optimizer), None)

    def replace(self, optimizers: Sequence[Any], old: OptimizerWrapper, new: OptimizerWrapper) -> None:
        """``new`` steps the optimizer ``old`` stepped (taken over by it)."""
        for i, held in self._at.items():
            if held is old:
                self._at[i] = new
                take_over(optimizers[i], new)

    def hand_over(self, grads: list[tuple[Any, Any]]) -> None:
        """Averaged gradients ``(parameter, gradient)`` of one of DDP's buckets, to the engines
        that step them (with ZeRO stage 1, each rank's to the shard it owns)."""
        for engine in self._at.values():
            for p, g in grads:
                if engine.owns(p):
                    engine.grad_reduced(p, g)

    def partitions(self) -> list:
        """Each engine's partition (ZeRO's: the owner of each parameter), where it has one."""
        return [p for p in (e.partition() for e in self._at.values()) if p is not None]

    def set_accumulating(self, value: bool) -> None:
        """Gradients accumulate without a step (True) or are final (False): nothing is
        copied to the host or sent to its owner before they are."""
        for engine in self._at.values():
            engine.accumulating = value

    def wait_for_weights(self) -> None:
        """Every new weight in place (before anything but a module's forward reads them)."""
        for engine in self._at.values():
            engine.wait_for_weights()

    def release(self, optimizers: Sequence[Any]) -> None:
        """At teardown: the engines finish their work (kept: ``trainer.save_checkpoint``
        after fit saves their state) and ``optimizers`` are given back."""
        for engine in self._at.values():
            engine.close()
        for opt in optimizers:
            give_back(opt)
