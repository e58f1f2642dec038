"""Every new weight in place before anything but a module's forward reads it.

With ``forward_waits="module"`` a step of the Trainer strategies may return with new
weights still on their way: copies to the device (DDP's strategies), or CPU updates of
FSDP's host shards still running (the FSDP strategy, :mod:`~lightning_fastopt.fsdp.unit_waits`).
The next forward waits module by module; a checkpoint, evaluation (whose steps may read
weights outside their modules' forward) and prediction wait for every one first.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override


class WeightWaits:
    """A mixin before Lightning's strategy class, after
    :class:`~lightning_fastopt.trainer.engine_table.EngineTable` (its ``engines``)."""

    engines: list

    def _wait_for_weights(self) -> None:
        for engine in self.engines:
            engine.wait_for_weights()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._wait_for_weights()  # a checkpoint reads every weight
        return super().lightning_module_state_dict()

    @override
    def on_validation_start(self) -> None:
        self._wait_for_weights()  # validation_step may read weights outside their modules' forward
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._wait_for_weights()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._wait_for_weights()
        super().on_predict_start()
