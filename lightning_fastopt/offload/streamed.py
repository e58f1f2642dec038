"""The CPU update streamed into backward (``stream_cpu_step=True``).

As soon as a host bucket's gradients are on their way, a worker thread waits for them to
land, updates the bucket on the CPU and sends its new weights back (after the compute
stream's work as it was then: backward no longer reads them), while backward computes
the gradients of the earlier layers.  FSDP's host shards (``host_shards``) are updated in
place, nothing sent: compute reads only the copies FSDP gathers from them, and the next
gather is the next forward's.  ``step()`` only waits for what is left.

Where each module's forward waits only for its own weights (``forward_waits="module"``:
:attr:`StreamedStep.ends_early`) the step does not wait for what is
left either: it fixes each queued update's plan (this step's hyperparameters: an LR
scheduler may move them as soon as it returns) and hands the updates to the weights in
flight, and the next forward's pre-hook on a module waits on the host for its bucket's
update, then on the device for its copy.  The worker then takes the queued bucket the
next forward needs first (the last landed: backward produces the first layers' gradients
last), so that forward runs beside the updates of the layers it reaches later, where
waiting at the step ran it only after all of them.  Whatever reads the state or the
weights otherwise waits for every update (:meth:`StreamedStep.wait`, the weights in flight).

The result is the synchronous step's, bit for bit, provided nothing needs every gradient before the
step starts: no overflow check, no clipping, no loss scale or step context, no keyword
arguments for the user's own step, nobody reading ``gradients()``, one backward per
step (or the optimizer told that the others accumulate: ``accumulating``); those steps
are refused here (the speculative schedule takes them).
"""

from __future__ import annotations

from concurrent.futures import Future

from lightning_fastopt.offload.left_running import UpdateQueue, ends_early
from lightning_fastopt.offload.schedule import CpuStepSchedule, Sent
from lightning_fastopt.offload.slots import HostBucket, ParamSlot
from lightning_fastopt.optim.base import COMPUTE


class StreamedStep(CpuStepSchedule):
    name = "streamed into backward"
    host_updates_at_step = False
    starts_in_backward = True

    def __init__(self, optimizer) -> None:
        super().__init__(optimizer)
        self.running: dict[HostBucket, Future] = {}  # a bucket's update, started during backward
        self.started = 0  # buckets whose update started during backward, over the whole run (tests, benchmarks)
        self._queue = UpdateQueue(optimizer)  # its lock guards the finished list too
        self._finished: list[HostBucket] = []  # this step's, in the order the worker ended them

    @property
    def ends_early(self) -> bool:
        """Whether ``step()`` returns before the updates it finds queued or running have
        ended (:func:`~lightning_fastopt.offload.left_running.ends_early`)."""
        return ends_early(self.opt)

    def grads_landed(self, bucket: HostBucket) -> None:
        """Queue the bucket's update and copy back for the worker.  The copy back waits (on
        the device) for the compute stream as it is now: every use of those weights by
        backward precedes the hook that sent their last gradient."""
        opt = self.opt
        if not opt.lands_during_backward:
            return
        opt.copies.mark_compute_done(bucket.backward_done)
        self._queue.put(bucket, self._update, noted_in=self.running)  # (before the worker may end it)
        self.started += 1

    def _update(self, bucket: HostBucket, plan) -> list[ParamSlot]:
        """On the worker: the bucket's update as planned, the next buckets' masters and
        state read meanwhile where they are on disk (in landing order; where steps end
        early the queue has them read in the order the worker takes them)."""
        opt = self.opt
        if not self.ends_early:
            opt.layout.tier.prefetch(opt.layout.buckets[opt.layout.buckets.index(bucket):])
        updated = opt.updates.bucket_step(bucket, None, None, bucket.backward_done, plan=plan)
        with self._queue.lock:
            if bucket in self.running:  # (not one a step left running: that step has ended, and the next
                self._finished.append(bucket)  # backward adds none before every update left has ended)
        return updated

    def grads_changed(self, bucket: HostBucket) -> None:
        """A second backward before the step: refused.  The bucket's update started on the
        first backward's gradients (and its weights may have reached the forward before
        this backward), so the sum can no longer be what it steps; without this the result
        depended on how far the worker had got."""
        self.join()
        raise RuntimeError("stream_cpu_step=True updates each host bucket as soon as its gradients land, but a "
                           "second backward before step() added to gradients an update had already used (and the "
                           "forward before it may have read weights already updated): accumulate with the "
                           "optimizer told (Lightning's accumulate_grad_batches and Fabric's no_backward_sync do; "
                           "by hand, set optimizer.accumulating = True for every backward but the last), or keep "
                           "each update apart until the step with speculate=True")

    def check_step(self, needs_gradients: bool, grad_scale, step_context) -> None:
        if needs_gradients or grad_scale is not None or step_context not in (COMPUTE, None) or self.opt.step_kwargs:
            self.join()
            raise RuntimeError("stream_cpu_step=True updates buckets during backward, so the step may not need "
                               "every gradient first (check_finite, a grad_scale or a step context) or give "
                               "keyword arguments to the optimizer's own step unless speculate=True keeps each "
                               "update apart until the step has checked it")

    def before_gradients_read(self) -> None:
        if self.running:
            raise RuntimeError("gradients() after the streamed CPU step began: those buckets were already updated "
                               "with their gradients (stream_cpu_step=True without speculate=True is for steps that "
                               "need no gradient before they start)")

    def host_step(self, grad_scale, context) -> Sent:
        """What is left of the updates started during backward (where the step ends early,
        left running: each queued one's plan fixed now, with this step's hyperparameters,
        and each handed to the weights in flight); the buckets none was started for (a
        parameter without a backward hook) in line.  The weights sent are listed in the
        order their copies were issued (the worker's), those left running last."""
        opt = self.opt
        futures = dict(self.running)
        if self.ends_early:
            self._queue.fix_plans()
        else:
            with opt._timer.phase("cpu_step"):
                self.join()
        with self._queue.lock:  # (together: an update the worker ends after this is left running, not finished)
            finished, self._finished = self._finished, []
            self.running = {}
        if not self.ends_early:  # every one has ended: those the worker ended once join() took them were not noted
            noted = set(finished)
            finished += [b for b in futures if b not in noted]  # (the last it ended, in its order)
        ended = set(finished)
        left = {b: f for b, f in futures.items() if b not in ended}
        written: list[ParamSlot] = []
        sent: list[HostBucket] = []
        for b in finished:
            updated = futures[b].result()
            written += updated
            sent += [b] if updated else []
        for b in opt.layout.buckets:
            if b not in futures:
                w, s = self.in_line([b], grad_scale, context)
                written, sent = written + w, sent + s
        self._queue.leave(left)
        return written, sent + [b for b in opt.layout.buckets if b in left]

    def wait(self) -> None:
        """The updates the last step left running (ends_early) have ended."""
        self._queue.wait_left()

    def end(self) -> None:
        self.join()  # a backward that was not followed by a step (an error): let it finish
        with self._queue.lock:
            self._finished = []

    def join(self) -> dict[HostBucket, list[ParamSlot]]:
        """Wait for the updates started during backward; the slots each one updated."""
        futures, self.running = self.running, {}
        return {b: f.result() for b, f in futures.items()}
