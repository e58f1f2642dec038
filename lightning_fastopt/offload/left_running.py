"""Host buckets' updates queued for the worker thread, and the steps that end before them.

The streamed schedule hands host buckets' updates to the optimizer's one worker thread
(:meth:`~lightning_fastopt.offload.share_updates.ShareUpdates.pool`) through an
:class:`UpdateQueue` as their gradients land; each update's plan is fixed when the worker
takes it, or earlier by the step (:meth:`UpdateQueue.fix_plans`, ``put(..., plan=)``): the
step's hyperparameters, which an LR scheduler moves as soon as the step returns.

Where a step may end before its updates (:func:`ends_early`: each module's forward waits
for its own weights, ``forward_waits="module"``), the
streamed step leaves those still queued or running, and the synchronous and speculative
steps leave the ones they would run in line (:meth:`UpdateQueue.put_after_step`); the
worker takes the queued bucket the next forward needs first: the one latest in the
buckets' order, which is the order backward produces the gradients in (the parameters'
reversed: the first layers' land last), the state tier reading ahead in that order (a
disk tier's window).  Otherwise it takes them in the order queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torch import Tensor

from lightning_fastopt.offload.share_updates import UNPLANNED
from lightning_fastopt.offload.slots import HostBucket, ParamSlot

Update = Callable[[HostBucket, Any], list[ParamSlot]]  # a bucket's update given its plan: the slots it updated


def ends_early(opt) -> bool:
    """Whether a step of ``opt`` may return before the host updates it leaves queued or
    running have ended: where each module's forward waits for its own weights
    (``"module"``), and so first for its bucket's update, the weights reach the forward
    through something it waits for (copied back on an accelerator's code path, or
    gathered by FSDP from its host shards, updated in place: ``host_shards``, each unit's
    forward waiting on the host first, :mod:`~lightning_fastopt.fsdp.unit_waits`) and no
    wrapper gives the updates norms at the step (``before_updates``: LAMB's and LARS's
    whole-tensor norms on FSDP's rows).  Wherever the state lives: a disk tier reads
    ahead the buckets in the order the worker takes them (:meth:`UpdateQueue._run_next`)."""
    return (opt.settings.forward_waits == "module" and (opt.copies.needed or opt.settings.host_shards)
            and opt.before_updates is None)


class UpdateQueue:
    """The updates waiting for the worker of one offload optimizer (``opt``), and those the
    last step left running (:meth:`leave`)."""

    def __init__(self, optimizer) -> None:
        self.opt = optimizer
        self.lock = threading.Lock()  # the queue and its plans; a schedule may guard its own records with it
        self._queued: dict[HostBucket, tuple[Future, Update, Any]] = {}  # in the order queued
        self._left: dict[HostBucket, Future] = {}  # the updates the last step left running
        self.left_total = 0  # the updates steps left running, over the run (tests, benchmarks)

    def put(self, bucket: HostBucket, update: Update, plan: Any = UNPLANNED,
            noted_in: dict[HostBucket, Future] | None = None) -> Future:
        """Queue ``update(bucket, plan)`` for the worker; ``plan``: fixed already, else when
        the worker takes it; ``noted_in``: a schedule's record of its updates, where the
        future goes under :attr:`lock` before the worker can take it.  The future ends with
        the slots it updated."""
        return self.put_all({bucket: (update, plan)}, noted_in)[bucket]

    def put_all(self, updates: dict[HostBucket, tuple[Update, Any]],
                noted_in: dict[HostBucket, Future] | None = None) -> dict[HostBucket, Future]:
        """:meth:`put` each, all queued before the worker takes any (so that it takes
        them in its own order from the first)."""
        futures = {b: Future() for b in updates}
        with self.lock:
            for b, (update, plan) in updates.items():
                self._queued[b] = (futures[b], update, plan)
            if noted_in is not None:
                noted_in.update(futures)
        for _ in updates:
            self.opt.updates.submit(self._run_next)
        return futures

    def fix_plans(self) -> None:
        """The plans of the updates still queued fixed now (the step's hyperparameters)."""
        updates = self.opt.updates
        with self.lock:
            for b, (future, update, plan) in list(self._queued.items()):
                if plan is UNPLANNED:
                    self._queued[b] = (future, update, updates.plan(b.inner, b.slots))

    def put_after_step(self, buckets: list[HostBucket], grad_scale, context,
                       before: Callable[[HostBucket], None] | None = None) -> dict[HostBucket, Future]:
        """Each bucket's update in the step now ending, left to the worker: its plan fixed
        now (this step's hyperparameters; ``grad_scale`` and ``context`` copied, as a scaler
        writes its scale in place), ``before(bucket)`` first where given, the new weights
        sent behind the compute stream as the step found it.  A bucket without a gradient
        has none."""
        opt = self.opt
        grad_scale, context = frozen(grad_scale), frozen(context)

        def update(bucket: HostBucket, plan) -> list[ParamSlot]:
            if before is not None:
                before(bucket)
            return opt.updates.bucket_step(bucket, grad_scale, context, opt._compute_done, plan=plan)

        plans = {b: opt.updates.plan(b.inner, b.slots) for b in buckets}
        return self.put_all({b: (update, plan) for b, plan in plans.items() if plan is not None})

    def leave(self, left: dict[HostBucket, Future]) -> None:
        """The step returns with these updates queued or running: a module's forward waits
        for its bucket's (the weights in flight), :meth:`wait_left` for all."""
        with self.lock:
            self._left = dict(left)
        self.left_total += len(left)
        self.opt._in_flight.updating(left)

    def wait_left(self) -> None:
        """The updates the last step left running have ended."""
        with self.lock:
            futures, self._left = self._left, {}
        for f in futures.values():
            f.result()

    def _in_order(self, early: bool) -> list[HostBucket]:
        """The queued buckets in the order the worker takes them (see the module's documentation;
        ``early``: :func:`ends_early`)."""
        if not early:
            return list(self._queued)
        position = {b: i for i, b in enumerate(self.opt.layout.buckets)}
        return sorted(self._queued, key=position.__getitem__, reverse=True)

    def _run_next(self) -> None:
        """On the worker: the update of the first bucket :meth:`_in_order` names, its plan
        fixed now unless it was (where steps end early, the state tier reads ahead first:
        :meth:`_read_ahead`)."""
        early = ends_early(self.opt)
        with self.lock:
            bucket, *ahead = self._in_order(early)
            future, update, plan = self._queued.pop(bucket)
            if plan is UNPLANNED:
                plan = self.opt.updates.plan(bucket.inner, bucket.slots)
            left = bucket in self._left
        if early:
            self._read_ahead(bucket, ahead, left)
        try:
            updated = update(bucket, plan)
        except BaseException as error:
            future.set_exception(error)
            return
        future.set_result(updated)

    def _read_ahead(self, bucket: HostBucket, ahead: list[HostBucket], left: bool) -> None:
        """Where steps end early, the state tier (a disk tier's window; nothing in host memory)
        reads ahead, as slots allow, ``bucket`` and then what the worker takes after it: the
        queued ones (``ahead``, in its order: the next forward's first), then what lands
        next (during backward, the buckets after this one; after a step that left this one
        running, ``left``, the next backward's first)."""
        buckets = self.opt.layout.buckets
        lands_next = buckets if left else buckets[buckets.index(bucket) + 1:]
        self.opt.layout.tier.prefetch([bucket, *ahead, *lands_next])


def frozen(value: Any) -> Any:
    """A copy that later in-place writes do not change (a tensor learning rate, a tensor scale)."""
    return value.detach().clone() if isinstance(value, Tensor) else value
