"""The delayed parameter update (``delayed_update=True``), as in the ZeRO-Offload paper.

Once ``warmup`` steps have run synchronously, the CPU update of step t runs on a worker
thread while the accelerator computes forward and backward of step t+1, so the CPU step
hides behind compute instead of following it.  What changes in the math, precisely:

- the float32 masters and the optimizer state follow the usual recurrence,
  ``m[t+1] = update(m[t], g[t])``, with the hyperparameters (learning rate, clipping
  coefficient, loss scale) of step t;
- the weights forward and backward of step t+1 use are ``m[t]`` (the masters before
  update t) instead of ``m[t+1]``: each gradient is computed at weights one update old.
  During warm-up, and after a step skipped for an fp16 overflow, the two are the same;
- at the start of step t+1 (after its backward) the worker's result ``m[t+1]`` goes to
  the device, and update t+1 is launched from it.

So between steps the model holds the weights before the last update: validation,
callbacks and anything else that reads them see those.  A weight written by something
other than the optimizer while an update is in flight keeps the write (the in-flight
update of that parameter is dropped; its optimizer state keeps the update).

Only the offloaded share is delayed; parameters updated on the accelerator are updated
at their step as usual.  The gradients of step t+1 land in a second host buffer while
update t reads the first (one more gradient buffer per offloaded parameter).

A checkpoint holds the state after the last launched update: the optimizer state and,
under :data:`SAVED_KEY` in the optimizer's state dict, the masters of that update with
the step count (the model's weights in the checkpoint are the device's, one update
old).  Resuming loads the model first (as Lightning does), then the optimizer state, and
continues exactly where the saving run would have gone.  An optimizer without a delayed
update that loads such a checkpoint writes those masters into the model (the pending
update finishes); torch.optim ignores the key (the weights stay one update behind).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.offload.pieces import WholeValues
from lightning_fastopt.offload.schedule import CpuStepSchedule, Sent
from lightning_fastopt.offload.slots import HostBucket, ParamSlot, written_by_others, written_in_bucket

SAVED_KEY = "delayed_update"  # in the optimizer's state dict: {"steps": int, "weights": {name: float32 tensor}}


class DelayedUpdates:
    """The updates launched by the last step, not yet on the device, and the step count
    that ends the synchronous warm-up."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.steps = 0  # steps taken (skipped ones included)
        self.pending: dict[HostBucket, Future] = {}  # a bucket's update: the slots it updated

    def delays_next_step(self) -> bool:
        return self.steps >= self.warmup

    def wait(self) -> None:
        """Wait for every update in flight (its weights stay pending)."""
        for future in self.pending.values():
            future.result()

    def take(self, bucket: HostBucket) -> list[ParamSlot]:
        """The slots the bucket's pending update changed (waiting for it), now no longer pending."""
        future = self.pending.pop(bucket, None)
        return future.result() if future is not None else []

    def take_all(self) -> list[ParamSlot]:
        return [s for b in list(self.pending) for s in self.take(b)]

    def saved(self, layout) -> dict[str, Any]:
        """What a checkpoint keeps: the step count and the masters not yet on the device
        (read where ``layout``'s tier keeps them)."""
        self.wait()
        tier = layout.tier
        weights = WholeValues(lambda value, dtype: tier.hand_out(value, dtype, copy=True), tier.blank)
        for members in layout.in_residence([s for f in self.pending.values() for s in f.result()], writes=False):
            for s in members:
                weights.add(s, "", s.master.detach())
        return {"steps": self.steps, "weights": weights.under("")}

    def restore(self, weights: Mapping[ParamSlot, Tensor], layout) -> None:
        """Take a checkpoint's pending masters of offloaded slots back as pending updates
        (the model's weights, loaded before, are the device's), written where ``layout``'s
        tier keeps them."""
        self.pending = {}
        by_bucket: dict[HostBucket, list[ParamSlot]] = {}
        for members in layout.in_residence(list(weights)):
            for slot in members:
                put_master(slot, weights[slot])
                by_bucket.setdefault(slot.bucket, []).append(slot)
        for bucket, updated in by_bucket.items():
            done: Future = Future()
            done.set_result(updated)
            self.pending[bucket] = done


class DelayedStep(CpuStepSchedule):
    """The schedule: after the warm-up, ``step()`` sends the last step's update to the
    device and launches this step's on the worker thread."""

    name = "delayed by one step"
    host_updates_at_step = False
    needs_spare_grads = True  # the next step's gradients land while an update reads these

    def __init__(self, optimizer, warmup: int) -> None:
        super().__init__(optimizer)
        self.updates = self.delayed = DelayedUpdates(warmup)
        self._delays = False  # this step's update is delayed

    def before_step(self) -> Sent:
        updates = self.updates
        self._delays = updates.delays_next_step()
        sent: Sent = ([], [])
        if self._delays or updates.pending:
            sent = self._send_pending()  # the last step's update: its weights go to the device now
        updates.steps += 1
        return sent

    def host_step(self, grad_scale, context) -> Sent:
        if not self._delays:
            return self.in_line(self.opt.layout.buckets, grad_scale, context)
        self._launch(grad_scale, context)
        return [], []

    def wait(self) -> None:
        self.updates.wait()  # they stay pending

    def _launch(self, grad_scale, context) -> None:
        """Start every bucket's CPU update on the worker; its weights go to the device at the
        next step.  What it reads is fixed here, on this thread: the gradients (the next
        ones go to the spare buffers) and the hyperparameters."""
        opt = self.opt
        if isinstance(grad_scale, Tensor):
            grad_scale = grad_scale.clone()
        for b in reversed(opt.layout.buckets):  # forward order: the first layers' weights are ready first
            plan = opt.updates.plan(b.inner, b.slots)
            if plan is None:
                continue
            for s in b.slots:
                s.swap_grad_buffers()
            self.updates.pending[b] = opt.updates.submit(self._run, b, plan, grad_scale, context)

    def _run(self, bucket: HostBucket, plan, grad_scale, context) -> list[ParamSlot]:
        opt = self.opt
        opt.copies.wait_on_host(bucket.params_sent)  # the last copy to the device has read what this update writes
        with opt.updates.on_worker(), opt.layout.tier.resident(bucket):
            return opt.updates.run(bucket.inner, plan, grad_scale, context)

    def _send_pending(self) -> Sent:
        """Once backward is done: wait for each bucket's update the last step launched and
        send its weights to the device (the next forward uses them), in forward order; a
        master whose parameter something else wrote meanwhile takes the write instead."""
        opt = self.opt
        timer, sent, buckets = opt._timer, [], []
        for b in reversed(opt.layout.buckets):
            with timer.phase("grad_d2h"):
                opt.copies.wait_on_host(b.grads_ready)  # the written flags land with the gradients
            with timer.phase("cpu_step"):
                updated = self.updates.take(b)
            written = written_in_bucket(b)
            b.written_flags.zero_()  # answered: a step in line after this one must not refresh again
            opt.masters.written(written)
            keep = [s for s in updated if s not in written]
            if keep:
                with timer.phase("param_h2d"), opt.layout.tier.resident(b, sent=b.params_sent, writes=False):
                    opt.updates.send_weights(b, keep, opt._compute_done)
                sent, buckets = sent + keep, buckets + [b]
        return sent, buckets

    def apply_pending(self) -> int:
        """Send the pending update's weights to the model now (see
        :meth:`OffloadOptimizer.apply_pending_update`); how many it sent."""
        opt = self.opt
        if not self.updates.pending:
            return 0
        opt._in_flight.wait_all()  # the checks below read the weights
        updated = self.updates.take_all()
        written = written_by_others(updated)
        opt.masters.written(written)
        keep = [s for s in updated if s not in written]
        opt.copies.mark_compute_done(opt._compute_done)
        last = None
        for b in opt.layout.buckets:
            mine = [s for s in keep if s.bucket is b]
            if mine:
                with opt.layout.tier.resident(b, sent=b.params_sent, writes=False):
                    opt.updates.send_weights(b, mine, opt._compute_done)
                last = b.params_sent
        opt.copies.compute_waits_for(last)  # (each weight noted behind its copy: send_weights)
        return len(keep)


def check_delayed_update(delayed_update: Any, warmup: Any, stream_cpu_step: bool) -> None:
    """Refuse bad ``delayed_update`` arguments, naming them."""
    if not isinstance(delayed_update, bool):
        raise TypeError(f"delayed_update must be True or False, got {delayed_update!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"delayed_update_warmup must be a whole number of steps >= 0, got {warmup!r}")
    if delayed_update and stream_cpu_step:
        raise ValueError("delayed_update=True and stream_cpu_step=True exclude each other: the delayed update "
                         "already runs each CPU step during the next forward and backward")


def put_master(slot: ParamSlot, weight: Tensor) -> None:
    """Set a slot's float32 master (and the half copy that goes to the device) to ``weight``."""
    with torch.no_grad():
        slot.master.copy_(weight)
        if slot.host_copy is not None:
            slot.host_copy.copy_(slot.master)
