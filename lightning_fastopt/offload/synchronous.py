"""The CPU update at the step (the default schedule, see :mod:`~lightning_fastopt.offload.schedule`).

``step()`` launches the device share's update, then updates each host bucket on the CPU
in the order backward produced its gradients, waiting only for that bucket's copies, and
starts sending its new weights to the device while the CPU moves on to the next bucket.
"""

from __future__ import annotations

from lightning_fastopt.offload.schedule import CpuStepSchedule


class SynchronousStep(CpuStepSchedule):
    """The protocol's own step: every bucket in line at ``step()``."""

    name = "at the step"
