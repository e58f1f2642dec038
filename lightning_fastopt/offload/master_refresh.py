"""The separate float32 masters kept in step with the model's weights.

One source of truth: the model's parameters.  A master is refreshed from its parameter
whenever something other than the optimizer wrote that parameter (``load_state_dict``, a
checkpoint restore, a callback, a write through ``.data``), found by
:func:`~lightning_fastopt.offload.slots.written_by_others` or, for a host bucket, by the
check that travelled with its gradients (:func:`~lightning_fastopt.offload.slots.written_in_bucket`).
The step schedules ask before each share's update; ``refresh_master_weights`` forces it.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_fastopt.offload.slots import ParamSlot, remember_weights, written_by_others

__all__ = ["MasterRefresh"]


class MasterRefresh:
    """Copies weights into masters, each bucket's while its tier holds it (``layout``), after
    the weights still on their way from the last step have landed (``in_flight``)."""

    def __init__(self, layout, in_flight) -> None:
        self._layout = layout
        self._in_flight = in_flight
        self._said = False

    def refresh(self, slots: Sequence[ParamSlot]) -> int:
        """Copy each slot's weight into its master; returns how many."""
        for members in self._layout.in_residence(list(slots)):
            for s in members:
                s.master.copy_(s.weight())
        remember_weights(slots)
        return len(slots)

    def written(self, slots: Sequence[ParamSlot]) -> None:
        """Refresh the masters of ``slots``, found written by others before an update, and
        say so once a run (it is checked before every step)."""
        if self.refresh(slots) and not self._said:
            self._said = True
            rank_zero_info(f"lightning_fastopt: {len(slots)} master weight(s) refreshed from the model, whose "
                           "weights were changed outside the optimizer (said once; it is checked before every step)")

    def every(self, only_changed: bool = False) -> int:
        """Every separate master (``only_changed``: those written by others), the weights in
        flight landed first; returns how many."""
        self._in_flight.wait_all()
        slots = self._layout.slots
        return self.refresh(written_by_others(slots) if only_changed else [s for s in slots if s.separate_master])
