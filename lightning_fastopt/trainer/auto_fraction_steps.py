"""``offload_fraction="auto"`` around a Trainer strategy's optimizer steps.

The engines start with everything offloaded; :class:`~lightning_fastopt.offload.auto_fraction.AutoFraction`
times the first steps of each offload optimizer (the closure: forward and backward; the
step's phases) and then chooses the fraction, every rank taking rank 0's.  The offload
optimizer is rebuilt with it between two steps
(:meth:`~lightning_fastopt.offload.OffloadOptimizer.with_fraction`, the same state: the run
computes what it would have at any fraction): where it is the engine (DDP's strategy), the
engine is replaced; where a wrapper steps its share through one (FSDP's
:class:`~lightning_fastopt.fsdp.LocalShardOptimizer`, its ``local``), the wrapper's is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.offload.auto_fraction import PROBE_SKIP, PROBE_STEPS, AutoFraction
from lightning_fastopt.offload.local_wrapper import LocalOffloadWrapper
from lightning_fastopt.optim.takeover import engine_of, take_over


class AutoFractionSteps:
    """A mixin of the Trainer strategies, after
    :class:`~lightning_fastopt.trainer.engine_table.EngineTable` (whose ``_engine_at`` it
    updates): the subclass calls :meth:`_start_auto_fraction` once its engines are built
    and runs each optimizer step through :meth:`_step_probed`."""

    _auto: AutoFraction | None = None  # the probe of a fit with offload_fraction="auto"

    def _start_auto_fraction(self, trainer, auto: bool, budget_gb: float | None) -> None:
        self._auto = None
        if not auto:
            return
        if not self.lightning_module.automatic_optimization:
            raise ValueError("offload_fraction='auto' measures the forward and backward that Lightning runs in "
                             "each step's closure (automatic optimization); with manual optimization give a number")
        if budget_gb is not None and self.root_device.type != "cuda":
            raise ValueError(f"gpu_memory_budget_gb needs a CUDA device to measure memory on, this run is on "
                             f"{self.root_device}")
        rank_zero_info(f"lightning_fastopt: offload_fraction='auto': the first {PROBE_SKIP + PROBE_STEPS} steps run "
                       f"with everything offloaded, the last {PROBE_STEPS} of them measured")
        self._auto = AutoFraction(self.root_device, budget_gb, trainer.accumulate_grad_batches,
                                  agree=lambda f: float(self.broadcast(f)))

    def _step_probed(self, optimizer, closure: Callable[[], Any], step: Callable[[Callable[[], Any]], Any]) -> Any:
        """``step(closure)``, the optimizer step, timed while the probe measures; once it
        has chosen, the offload optimizer runs at the chosen fraction from the next step on."""
        engine = engine_of(optimizer)
        probed = _probed(engine) if self._auto is not None else None
        if probed is None:
            return step(closure)
        out = step(self._auto.closure(probed, closure))
        settled = self._auto.after_step(probed, self.precision_plugin.last_step_skipped)
        if settled is not None:
            new, why = settled
            rank_zero_info(f"lightning_fastopt: {why}")
            self._settle(engine, new)
        return out

    def _settle(self, engine, new: OffloadOptimizer) -> None:
        if isinstance(engine, LocalOffloadWrapper):
            engine.local = new
            return
        for i, held in self._engine_at.items():
            if held is engine:
                self._engine_at[i] = new
                take_over(self.optimizers[i], new)


def _probed(engine) -> OffloadOptimizer | None:
    """The offload optimizer whose fraction "auto" chooses: the engine, or the one a wrapper
    steps its share through."""
    if isinstance(engine, OffloadOptimizer):
        return engine
    return engine.local if isinstance(engine, LocalOffloadWrapper) else None
