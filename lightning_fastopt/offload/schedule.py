"""When the offloaded share's CPU update runs: the protocol of the step schedules.

An :class:`~lightning_fastopt.offload.OffloadOptimizer` keeps the buffers, the copies and
the optimizer state; one schedule decides when each host bucket's update runs:

- :class:`~lightning_fastopt.offload.synchronous.SynchronousStep`: at ``step()``, bucket
  after bucket as their gradients land (the default);
- :class:`~lightning_fastopt.offload.streamed.StreamedStep`: on a worker thread as soon as
  a bucket's gradients have landed, during backward, for steps that need no gradient
  before they start (``stream_cpu_step=True``);
- :class:`~lightning_fastopt.offload.speculative.SpeculativeStep`: the same, for steps
  that do (clipping, fp16 overflow checks, LAMB's global norm): each update is kept
  apart until ``step()`` has checked it, then committed or redone
  (``stream_cpu_step=True, speculate=True``);
- :class:`~lightning_fastopt.offload.delayed.DelayedStep`: during the next forward and
  backward (``delayed_update=True``).

Every schedule ends where the synchronous one ends, bit for bit, except the delayed one,
which changes the math (see its module).
"""

from __future__ import annotations

from lightning_fastopt.offload.slots import HostBucket, ParamSlot, written_in_bucket

Sent = tuple[list[ParamSlot], list[HostBucket]]  # the slots a step wrote, and the buckets whose weights it sent


class CpuStepSchedule:
    """The protocol (and the synchronous step every schedule falls back on)."""

    name = "at the step"  # how the optimizer's repr and the strategy's log line say it
    needs_spare_grads = False  # a second gradient buffer per offloaded parameter
    host_updates_at_step = True  # every host bucket is updated at step(), in order (none earlier or later)
    _queue = None  # the schedules that may leave updates running hand them to the worker through an UpdateQueue
    ends_early = False  # whether step() may return before its host updates end (those schedules say when)
    starts_in_backward = False  # whether host updates start as their gradients land during backward
    delayed = None  # the delayed updates' record (DelayedStep's), whose update a step leaves to the next

    def __init__(self, optimizer) -> None:
        self.opt = optimizer  # the OffloadOptimizer whose host buckets it updates (it imports this module)

    @property
    def updates_left_running(self) -> int:
        """How many host buckets' updates steps left running, over the run (a step that ends
        early: :func:`~lightning_fastopt.offload.left_running.ends_early`)."""
        return self._queue.left_total if self._queue is not None else 0

    def grads_landed(self, bucket: HostBucket) -> None:
        """During backward: every gradient of ``bucket`` is on its way to the host."""

    def grads_changed(self, bucket: HostBucket) -> None:
        """During backward: a second backward added to gradients of ``bucket`` that had landed."""

    def check_step(self, needs_gradients: bool, grad_scale, step_context) -> None:
        """At ``step()``, before anything is read: refuse a step this schedule cannot take."""

    def before_step(self) -> Sent:
        """At ``step()``, once backward is done, before the step reads any gradient: the
        weights of earlier work to send to the device now."""
        return [], []

    def before_gradients_read(self) -> None:
        """Code outside the optimizer is about to read, and may scale, the gradients."""

    def host_step(self, grad_scale, context) -> Sent:
        """The offloaded share's update of this step."""
        return self.in_line(self.opt.layout.buckets, grad_scale, context)

    def skipped(self) -> None:
        """The step changes nothing (an inf/NaN gradient)."""

    def end(self) -> None:
        """The step's gradients are forgotten (after a step, a skipped one, or ``zero_grad``)."""

    def wait(self) -> None:
        """Wait for work in flight that reads or writes the optimizer state."""

    def apply_pending(self) -> int:
        """Send weights computed but not yet on the device to the model now; how many."""
        return 0

    def breakdown(self) -> dict[str, float]:
        """What the schedule adds to ``last_step_times`` (counts and milliseconds)."""
        return {}

    def in_line(self, buckets: list[HostBucket], grad_scale, context) -> Sent:
        """Update ``buckets`` now, each once its gradients have landed, sending its weights
        back while the next one updates."""
        opt, written, sent = self.opt, [], []
        for i, b in enumerate(buckets):
            opt.layout.tier.prefetch(buckets[i:])  # a disk tier reads the next buckets (as slots allow) meanwhile
            if not opt.copies.needed:  # a CPU run: nothing to wait for or copy
                with opt._timer.phase("cpu_step"), opt.layout.tier.resident(b):
                    opt.masters.written(written_in_bucket(b))
                    written += opt.updates.step_inner(b.inner, b.slots, grad_scale, context)
                continue
            updated = opt.updates.bucket_step(b, grad_scale, context, opt._compute_done, timed=True)
            written += updated
            if updated:
                sent.append(b)
        return written, sent
