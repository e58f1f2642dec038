"""Which engine steps each optimizer of a Trainer strategy of lightning_fastopt.

Every Trainer strategy (DDP's and its one-process twin, :mod:`~lightning_fastopt.trainer.strategy`;
FSDP's, :mod:`~lightning_fastopt.trainer.fsdp_strategy`) takes each optimizer from
``configure_optimizers`` over with an engine (an
:class:`~lightning_fastopt.optim.wrapper.OptimizerWrapper`) while the user's object stays
the one Lightning, LR schedulers and callbacks see (:mod:`~lightning_fastopt.optim.takeover`).
:class:`EngineTable` keeps which engine steps which of ``self.optimizers`` (by position,
kept after fit: a checkpoint written then holds the same state), tells the engines when
gradients accumulate without a step, and closes them and gives the optimizers back at
teardown.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_fastopt.core.cpu_threads import TorchThreads
from lightning_fastopt.optim.known_steps import say_runs_as_torch
from lightning_fastopt.core.precision import needs_closure
from lightning_fastopt.optim.takeover import give_back, show_through, take_over
from lightning_fastopt.optim.wrapper import OptimizerWrapper, unwrapped
from lightning_fastopt.trainer.package import TrainerPackage


class EngineTable:
    """A mixin before Lightning's strategy class.  The subclass sets ``_engine_at = {}`` and
    ``_threads`` in its ``__init__`` and names ``package`` and ``closure_optimizers``."""

    package: TrainerPackage
    closure_optimizers: tuple[str, ...]
    _engine_at: dict[int, OptimizerWrapper]  # the engine of each of self.optimizers that has one, by position
    _threads: TorchThreads

    @property
    def engines(self) -> list[OptimizerWrapper]:
        """The engine that steps each of the user's optimizers (in ``trainer.optimizers``,
        which stay the user's), from the last set-up of a fit on: kept after the fit, to
        read (``offloaded_numel``, ``skipped_steps``, ``last_step_times``, ...)."""
        return list(self._engine_at.values())

    def _decide_engines(self) -> list[bool]:
        """Which of ``self.optimizers`` an engine steps (:meth:`_runs_in_engine`; each other
        one said in one line), for :meth:`_take_over_optimizers`."""
        return [self._runs_in_engine(opt) for opt in self.optimizers]

    def _steps_as_torch(self, in_engine: list[bool]) -> list[str]:
        """The names of the optimizers that run as torch runs them and step (Lightning's
        stand-in for no optimizer steps nothing), from :meth:`_decide_engines`."""
        return [type(opt).__name__ for opt, engine in zip(self.optimizers, in_engine)
                if not engine and not isinstance(opt, self.package.MockOptimizer)]

    def _take_over_optimizers(self, make_engine: Callable[[Any], OptimizerWrapper],
                              in_engine: list[bool] | None = None) -> None:
        """Give each of ``self.optimizers`` that an engine can step (``in_engine``, else
        decided here: :meth:`_decide_engines`) the engine ``make_engine(optimizer)``
        builds (said in one line each)."""
        if in_engine is None:
            in_engine = self._decide_engines()
        self._engine_at = {}
        for i, (opt, runs) in enumerate(zip(self.optimizers, in_engine)):
            if not runs:
                continue
            engine = make_engine(opt)
            rank_zero_info(f"lightning_fastopt: {engine!r}")
            self._engine_at[i] = engine
            take_over(opt, engine)
        self.optimizers = self.optimizers  # Lightning's LightningOptimizer wrappers, made anew (below)

    @property
    def optimizers(self) -> list:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list) -> None:
        """Lightning's setter, which makes a ``LightningOptimizer`` around each (here, after
        a take-over, and wherever Lightning makes them anew: a strategy copied or unpickled,
        the LR finder), then each of those shows the engine's methods
        (:func:`~lightning_fastopt.optim.takeover.show_through`): their class, made from the
        optimizer's own, would find that class's ``zero_grad`` and ``state_dict`` first."""
        mro = type(self).__mro__
        lightnings = next(c.__dict__["optimizers"] for c in mro[mro.index(EngineTable) + 1:]
                          if isinstance(c.__dict__.get("optimizers"), property))
        lightnings.fset(self, optimizers)
        for wrapper in self._lightning_optimizers:
            show_through(wrapper)

    def _runs_in_engine(self, optimizer) -> bool:
        """Whether an engine can step ``optimizer``, else it runs as under Lightning's own
        strategy (said in one line): not Lightning's stand-in when ``configure_optimizers``
        returns None, nor LBFGS and the classes named in ``closure_optimizers``, whose step
        evaluates the closure again after changing the weights (the weights it changes
        must be the model's), nor a step not known to give torch's bits on the strategy's
        shares (:meth:`_steps_on_shares`)."""
        if isinstance(optimizer, self.package.MockOptimizer):
            return False
        if needs_closure(optimizer, self.closure_optimizers):
            say_runs_as_torch(optimizer)
            return False
        return self._steps_on_shares(optimizer)

    def _steps_on_shares(self, optimizer) -> bool:
        """Whether ``optimizer``'s step gives torch's bits on the shares this strategy's
        engines step (:mod:`~lightning_fastopt.optim.known_steps`), else said in one line."""
        raise NotImplementedError

    def _engine_for(self, optimizer) -> OptimizerWrapper | None:
        """The engine of one of ``self.optimizers`` (or of Lightning's wrapper around it),
        also after fit gave the optimizer back."""
        optimizer = unwrapped(optimizer)
        return next((self._engine_at.get(i) for i, opt in enumerate(self.optimizers) if opt is optimizer), None)

    @contextlib.contextmanager
    def _accumulating(self) -> Iterator[None]:
        """A micro-batch of an accumulation window that does not step: gradients are not
        final, so nothing is copied to the host or sent to its owner yet."""
        self._set_accumulating(True)
        try:
            yield
        finally:
            self._set_accumulating(False)

    def _set_accumulating(self, value: bool) -> None:
        for engine in self.engines:
            engine.accumulating = value

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning enters this for the micro-batches that do not step (DDP's one-process
        twin, which has no backward sync to block, marks them in ``pre_backward``)."""
        with self._accumulating(), super().block_backward_sync():
            yield

    def _release_engines(self) -> None:
        """At teardown: the engines finish their work (kept: ``trainer.save_checkpoint``
        after fit saves their state), the user's optimizers are given back, torch's threads
        restored."""
        for engine in self._engine_at.values():
            engine.close()
        for opt in self.optimizers:
            give_back(opt)
        self._threads.restore()
