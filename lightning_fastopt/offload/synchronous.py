"""The CPU update at the step (the default schedule, see :mod:`~lightning_fastopt.offload.schedule`).

``step()`` launches the device share's update, then updates each host bucket on the CPU
in the order backward produced its gradients, waiting only for that bucket's copies, and
starts sending its new weights to the device while the CPU moves on to the next bucket.

Where each module's forward waits for its own weights (``forward_waits="module"``:
:func:`~lightning_fastopt.offload.left_running.ends_early`) the
step does not run the host buckets' updates itself: once every gradient has left the
device, it fixes each update's plan (this step's hyperparameters, loss scale and context)
and leaves them to the worker thread, which takes the bucket the next forward needs first;
that forward's pre-hook on a module waits for its bucket's update, then for its copy.  The
CPU update then runs beside the next forward instead of before it, bit for bit the same.
Not for the user's own ``step`` (its closure is entered on the first share the step
updates: :meth:`~lightning_fastopt.offload.OffloadOptimizer.leading_share`).
"""

from __future__ import annotations

from lightning_fastopt.offload.left_running import UpdateQueue, ends_early
from lightning_fastopt.offload.schedule import CpuStepSchedule, Sent
from lightning_fastopt.optim.user_step import UserStepOptimizer


class SynchronousStep(CpuStepSchedule):
    """The protocol's own step: every bucket in line at ``step()``, or left to the worker
    when the step ends early."""

    name = "at the step"

    def __init__(self, optimizer) -> None:
        super().__init__(optimizer)
        self._queue = UpdateQueue(optimizer)

    @property
    def ends_early(self) -> bool:
        """Whether ``step()`` returns before its host updates have ended."""
        return ends_early(self.opt) and not isinstance(self.opt.optimizer, UserStepOptimizer)

    @property
    def host_updates_at_step(self) -> bool:
        return not self.ends_early

    def host_step(self, grad_scale, context) -> Sent:
        opt = self.opt
        if not self.ends_early:
            return self.in_line(opt.layout.buckets, grad_scale, context)
        with opt._timer.phase("grad_d2h"):
            for b in opt.layout.buckets:  # (off the device before step() returns: p.grad may be written then)
                opt.copies.wait_on_host(b.grads_ready)
        left = self._queue.put_after_step(opt.layout.buckets, grad_scale, context)
        self._queue.leave(left)
        return [], list(left)

    def wait(self) -> None:
        """The updates the last step left running (ends_early) have ended."""
        self._queue.wait_left()
