"""Which schedule the host share's update of one optimizer takes, and why not the others:

- ``"synchronous"``: at the step, once every gradient has landed;
- ``"streamed"`` (``stream_cpu_step=True``): each host bucket's update starts during
  backward, once its gradients have landed;
- ``"speculated"``: streamed where the step checks every gradient first (fp16 loss
  scaling, clipping, a global norm), kept apart until the check, then committed or redone
  (:mod:`~lightning_fastopt.offload.speculative`);
- ``"delayed"`` (``delayed_update=True``): after a warm-up, during the next forward and
  backward, which use weights one update old (:mod:`~lightning_fastopt.offload.delayed`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_fastopt.optim.base import FusedOptimizer, spans_parameters

__all__ = ["SCHEDULES", "Schedule", "choose_schedule", "in_place_refusals", "rows_refusals"]

SCHEDULES = ("synchronous", "streamed", "speculated", "delayed")


@dataclass(frozen=True)
class Schedule:
    """The choice: ``kind`` one of :data:`SCHEDULES`; ``line`` what the set-up says of it
    (what it does, or why streaming was not used where asked; None: nothing to say);
    ``warmup`` the synchronous steps before a delayed update."""

    kind: str = "synchronous"
    line: str | None = None
    warmup: int = 0

    @property
    def streams(self) -> bool:
        return self.kind in ("streamed", "speculated")

    def engine_arguments(self) -> dict[str, Any]:
        """The offload optimizer's arguments of this schedule."""
        if self.kind == "delayed":
            return {"delayed_update": True, "delayed_update_warmup": self.warmup}
        if self.streams:
            return {"stream_cpu_step": True, **({"speculate": True} if self.kind == "speculated" else {})}
        return {}


def choose_schedule(*, stream_cpu_step: bool, landed: str, checks: Iterable[tuple[str, bool]] = (),
                    refusals: Iterable[tuple[str, bool]] = (), delayed_update: bool = False,
                    delayed_update_warmup: int = 0, offloaded: bool = True) -> Schedule:
    """The schedule asked for (``stream_cpu_step``, ``delayed_update``: never both, the
    options check that) where it can run: streamed once the gradients have ``landed``,
    speculated where the step checks them (``checks``: what it may check, each with whether
    it does), synchronous where one of ``refusals`` (reasons, each with whether it applies)
    applies; a delayed update delays nothing where nothing is ``offloaded``."""
    if delayed_update:
        if not offloaded:
            return Schedule(line="delayed_update=True delays nothing: nothing is offloaded")
        return Schedule("delayed", f"after {delayed_update_warmup} synchronous step(s), each CPU update runs during "
                                   "the next forward and backward, which use weights one update old "
                                   "(delayed_update=True)", delayed_update_warmup)
    if not stream_cpu_step:
        return Schedule()
    why_not = [reason for reason, applies in refusals if applies]
    if why_not:
        return Schedule(line=f"stream_cpu_step=True not used: {'; '.join(why_not)}")
    checked = [check for check, applies in checks if applies]
    if checked:
        return Schedule("speculated", f"each host bucket's CPU update is speculated during backward, once its "
                                      f"gradients have {landed}, and checked at the step ({', '.join(checked)}): "
                                      "committed, or redone where the check changed it (stream_cpu_step=True)")
    return Schedule("streamed", f"each host bucket's CPU update starts during backward, once its gradients have "
                                f"{landed} (stream_cpu_step=True)")


def in_place_refusals(offload_fraction: float, device: torch.device, copy_on_cpu: bool) -> list[tuple[str, bool]]:
    """The reasons not to stream that every strategy shares (for :func:`choose_schedule`):
    nothing offloaded, or a CPU run updating in place."""
    return [("nothing is offloaded", offload_fraction == 0),
            ("a CPU run updates in place, with nothing to copy", device.type == "cpu" and not copy_on_cpu)]


def rows_refusals(engine: type[FusedOptimizer]) -> list[tuple[str, bool]]:
    """The reason not to stream on FSDP2's rows that an optimizer's class may give (for
    :func:`choose_schedule`): norms over whole parameters, summed over every rank's rows
    when the step starts (LAMB, LARS)."""
    return [(f"{engine.__name__} reads norms over whole parameters, summed over every rank's rows when the "
             "step starts", spans_parameters(engine))]
