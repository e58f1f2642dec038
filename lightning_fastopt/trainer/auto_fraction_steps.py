"""``offload_fraction="auto"`` around a Trainer strategy's optimizer steps.

The engines start with everything offloaded; :class:`~lightning_fastopt.offload.auto_fraction.AutoFraction`
times the first steps of each offload optimizer (the closure: forward and backward; the
step's phases) and then chooses the fraction, every rank taking rank 0's.  The offload
optimizer is rebuilt with it between two steps
(:meth:`~lightning_fastopt.offload.OffloadOptimizer.with_fraction`, the same state: the run
computes what it would have at any fraction): where it is the engine (DDP's strategy), the
strategy's :class:`~lightning_fastopt.trainer.engine_set.EngineSet` takes the new one in
its place; where a wrapper steps its share through one (FSDP's
:class:`~lightning_fastopt.fsdp.LocalShardOptimizer`, its ``local``), the wrapper's is.

:class:`AutoFractionSteps` is the strategy's part for it: started at each set-up, asked to
run every optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.offload.auto_fraction import PROBE_SKIP, PROBE_STEPS, AutoFraction
from lightning_fastopt.offload.local_wrapper import LocalOffloadWrapper
from lightning_fastopt.optim.takeover import engine_of
from lightning_fastopt.trainer.engine_set import EngineSet


class AutoFractionSteps:
    """The probe of a fit with ``offload_fraction="auto"`` (none otherwise), over the
    strategy's ``engines``."""

    def __init__(self, engines: EngineSet) -> None:
        self.engines = engines
        self._auto: AutoFraction | None = None

    def start(self, trainer, auto: bool, budget_gb: float | None, root_device, broadcast: Callable[[Any], Any]) -> None:
        """At each set-up, once the engines are built: a new probe where ``auto``."""
        self._auto = None
        if not auto:
            return
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError("offload_fraction='auto' measures the forward and backward that Lightning runs in "
                             "each step's closure (automatic optimization); with manual optimization give a number")
        if budget_gb is not None and root_device.type != "cuda":
            raise ValueError(f"gpu_memory_budget_gb needs a CUDA device to measure memory on, this run is on "
                             f"{root_device}")
        rank_zero_info(f"lightning_fastopt: offload_fraction='auto': the first {PROBE_SKIP + PROBE_STEPS} steps run "
                       f"with everything offloaded, the last {PROBE_STEPS} of them measured")
        self._auto = AutoFraction(root_device, budget_gb, trainer.accumulate_grad_batches,
                                  agree=lambda f: float(broadcast(f)))

    def step(self, optimizer, optimizers: Sequence[Any], closure: Callable[[], Any],
             step: Callable[[Callable[[], Any]], Any], skipped: Callable[[], bool]) -> Any:
        """``step(closure)``, the optimizer step, timed while the probe measures; once it
        has chosen, the offload optimizer runs at the chosen fraction from the next step on.
        ``skipped()``: whether the precision plugin skipped that step (an fp16 overflow)."""
        engine = engine_of(optimizer)
        probed = _probed(engine) if self._auto is not None else None
        if probed is None:
            return step(closure)
        out = step(self._auto.closure(probed, closure))
        settled = self._auto.after_step(probed, skipped())
        if settled is not None:
            new, why = settled
            rank_zero_info(f"lightning_fastopt: {why}")
            if isinstance(engine, LocalOffloadWrapper):
                engine.local = new
            else:
                self.engines.replace(optimizers, engine, new)
        return out


def _probed(engine) -> OffloadOptimizer | None:
    """The offload optimizer whose fraction "auto" chooses: the engine, or the one a wrapper
    steps its share through."""
    if isinstance(engine, OffloadOptimizer):
        return engine
    return engine.local if isinstance(engine, LocalOffloadWrapper) else None
