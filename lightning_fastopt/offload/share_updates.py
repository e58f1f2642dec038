"""How one share of the parameters is updated (the device's share, or a host bucket's):
the plan fixed when the update is decided, its run in the share's inner optimizer, a host
bucket's whole update with its copy back to the device, and the worker thread that runs
updates beside the main thread (streamed, speculated, delayed), with their CPU time.

When each share's update runs is the step schedules' business
(:mod:`~lightning_fastopt.offload.schedule`); they call these.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_fastopt.functional import scale_grads_
from lightning_fastopt.offload.slots import (HostBucket, ParamSlot, remember_weights, written_in_bucket,
                                             written_in_place)
from lightning_fastopt.optim.base import FusedOptimizer, copy_hyperparameters


UNPLANNED = object()  # bucket_step's plan when none was fixed before


class Plan(NamedTuple):
    """One share's update as :meth:`ShareUpdates.plan` fixed it."""

    updated: list[ParamSlot]  # the slots that have a gradient
    sources: dict[Tensor, Tensor]  # each one's master -> the gradient it reads
    targets: dict[Tensor, Tensor] | None  # master -> the half copy written in the same pass
    step_kwargs: dict[str, Any]  # for the user's own step
    closure: Any  # the step's evaluated closure for it (None during backward)
    scales: list[Tensor]  # factors the gradients are still to be multiplied by, in order (clipping)


class ShareUpdates:
    """The updates of one offload optimizer's shares (``opt``: its groups, slots, gradient
    intake, copy streams and step timer)."""

    def __init__(self, optimizer) -> None:
        self.opt = optimizer
        self._worker: ThreadPoolExecutor | None = None
        self._background_ms = 0.0  # CPU time of updates on the worker (wall_clock_breakdown's cpu_step_background)

    def step_inner(self, inner: FusedOptimizer, slots: list[ParamSlot], grad_scale, context,
                   step_kwargs: dict[str, Any] | None = None) -> list[ParamSlot]:
        """Step one inner optimizer over the slots that have a gradient, with the user's
        current hyperparameters; returns them."""
        plan = self.plan(inner, slots, step_kwargs)
        return self.run(inner, plan, grad_scale, context) if plan is not None else []

    def plan(self, inner: FusedOptimizer, slots: list[ParamSlot],
             step_kwargs: dict[str, Any] | None = None) -> Plan | None:
        """What a step of ``inner`` over ``slots`` will read and write, fixed now: the user's
        current hyperparameters (where LR schedulers write) copied in, the slots that have
        a gradient, each one's gradient and half copy, the keyword arguments for the
        user's own ``step`` (``step_kwargs``, by default the running step's), the step's
        evaluated closure for it (none for an update started during backward) and the
        factors a host bucket's gradients are still to be multiplied by before it reads
        them (clipping: :meth:`GradIntake.scale <lightning_fastopt.offload.grad_intake.GradIntake.scale>`,
        taken from the bucket).  None when no slot has a gradient."""
        opt = self.opt
        copy_hyperparameters(inner, opt.param_groups)
        scales = opt._intake.take_scales(slots)
        sources, targets, updated = {}, {}, []
        for s in slots:
            g = opt._intake.grad_of(s)
            if g is None:
                continue
            s.follow_weight()
            sources[s.master] = g
            updated.append(s)
            if s.param.dtype != s.master.dtype:
                targets[s.master] = s.weight() if written_in_place(s) else s.host_copy
        step_kwargs = dict(opt.step_kwargs if step_kwargs is None else step_kwargs)
        return Plan(updated, sources, targets or None, step_kwargs, opt.step_closure, scales) if updated else None

    def run(self, inner: FusedOptimizer, plan: Plan, grad_scale, context) -> list[ParamSlot]:
        """Step ``inner`` as :meth:`plan` fixed it, the gradients multiplied by the plan's
        factors (clipping's) as the kernels read them where the gradients are our own host
        copies, else in place first (``fastopt::grad_scale``); a host bucket's update is the
        profiler range ``fastopt::cpu_update`` (``benchmarks/timeline.py`` draws them)."""
        updated, sources, targets, step_kwargs, closure, scales = plan
        if scales and inner.reads_grad_factors and all(s.host_grad is not None for s in updated):
            # host gradients of our own, forgotten once the step ends: the kernels multiply
            # them as they read them, in the update's one pass over them (a pass of their
            # own otherwise: 8 bytes more a float32 parameter to the update's 28)
            inner.grad_factors = tuple(float(coef) for coef in scales)
        else:  # FSDP's host gradients (read after the step, as torch leaves them), or an optimizer's own step
            _apply(scales, sources)
        inner.grad_source = sources
        inner.copies_to = targets
        inner.element_offsets = {s.master: s.part[0] for s in updated if s.part is not None} or None
        if step_kwargs:
            inner.step_kwargs = step_kwargs
        if closure is not None:
            inner.step_closure = closure
        label = "fastopt::device_update" if inner is self.opt.layout.device_inner else "fastopt::cpu_update"
        try:
            with torch.profiler.record_function(label):
                inner.step(grad_scale=grad_scale, step_context=context)
        finally:
            inner.grad_source = None
            inner.copies_to = None
            inner.element_offsets = None
            inner.__dict__.pop("grad_factors", None)
            inner.__dict__.pop("step_kwargs", None)
            inner.__dict__.pop("step_closure", None)
        return updated

    def norm_sums(self, inner: FusedOptimizer, slots: list[ParamSlot], grad_scale, context) -> dict[Tensor, Tensor]:
        """``inner``'s :meth:`~lightning_fastopt.optim.base.FusedOptimizer.norm_sums` for the
        step :meth:`step_inner` would take over ``slots`` now, under each slot's model parameter."""
        plan = self.plan(inner, slots)
        if plan is None:
            return {}
        updated, sources = plan.updated, plan.sources
        _apply(plan.scales, sources)  # (the update's plan, made later, finds them applied)
        inner.grad_source = sources
        try:
            sums = inner.norm_sums(grad_scale, context)
        finally:
            inner.grad_source = None
        return {s.param: sums[s.master] for s in updated}

    def step_norm_sums(self, grad_scale, context) -> dict[Tensor, Tensor]:
        """For an optimizer with ``whole_tensor_norms`` (LAMB, LARS): each parameter's
        squared norms that its update in the step now under way reads, over every share of
        it this engine holds (nothing written:
        :meth:`~lightning_fastopt.optim.base.FusedOptimizer.norm_sums`).  For the engine's
        ``before_updates`` hook, where the gradients are in place."""
        opt, layout = self.opt, self.opt.layout
        out = self.norm_sums(layout.device_inner, layout.device_slots, grad_scale, context)
        for i, bucket in enumerate(layout.buckets):
            opt.copies.wait_on_host(bucket.grads_ready)
            opt.masters.written(written_in_bucket(bucket))  # (as its update would first)
            layout.tier.prefetch(layout.buckets[i:])
            with layout.tier.resident(bucket, writes=False):
                out.update(self.norm_sums(bucket.inner, bucket.slots, grad_scale, context))
        return out

    def give_norms(self, norms: dict[Tensor, Tensor] | None) -> None:
        """Each parameter's squared norms over its whole tensor (the pieces'
        :meth:`step_norm_sums` summed), for this step's updates; None: each takes its own again."""
        slots = self.opt.layout.slots
        given = None if norms is None else {s.master: norms[s.param] for s in slots if s.param in norms}
        for inner in self.opt.layout.inners():
            inner.given_norms = given

    def bucket_step(self, bucket: HostBucket, grad_scale, context, after, timed: bool = False,
                    plan: Any = UNPLANNED) -> list[ParamSlot]:
        """One bucket's share of a step, once its gradients have landed: refresh masters
        written by others, update on the CPU, send the new weights back (after ``after``).
        ``timed``: into the step's phases (the main thread's steps only); ``plan``: the
        update as :meth:`plan` fixed it earlier (else fixed now)."""
        opt = self.opt
        phase = opt._timer.phase if timed else (lambda name: contextlib.nullcontext())
        with phase("grad_d2h"):
            opt.copies.wait_on_host(bucket.grads_ready)
        with opt.layout.tier.resident(bucket, sent=bucket.params_sent):
            opt.masters.written(written_in_bucket(bucket))
            with phase("cpu_step"), (contextlib.nullcontext() if timed else self.on_worker()):
                if plan is UNPLANNED:
                    plan = self.plan(bucket.inner, bucket.slots)
                updated = self.run(bucket.inner, plan, grad_scale, context) if plan is not None else []
            if updated:
                with phase("param_h2d"):
                    self.send_weights(bucket, updated, after)
        return updated

    def send_weights(self, bucket: HostBucket, slots: list[ParamSlot], after) -> None:
        """Copy the new weights of some of the bucket's slots to the device once ``after`` has
        passed (nothing where the parameters are in host memory: ``host_shards``), and note
        each weight as we left it (:func:`~lightning_fastopt.offload.slots.remember_weights`)
        behind its copy: the compute stream may not have waited for the copies when the step
        ends (``forward_waits="module"``), and a fingerprint taken there could read a weight
        still on its way, then find it "written by others" at the next step."""
        if not self.opt.copies.needed:  # (FSDP's half host shards, written in place by the update)
            remember_weights(slots)
            return
        self.opt.copies.params_to_device(
            [(s.weight(), s.host_copy if s.host_copy is not None else s.master) for s in slots],
            after, bucket.params_sent, then=lambda: remember_weights(slots))

    # ------------------------------------------------------------------ the worker thread
    def pool(self) -> ThreadPoolExecutor:
        """The worker thread of the streamed and delayed CPU updates (one: buckets in order)."""
        if self._worker is None:  # on the step's cores where the strategy bound the threads (bind_cpu_threads)
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastopt-cpu-step",
                                              initializer=_bind_to, initargs=(self.opt.settings.step_cores,))
        return self._worker

    def submit(self, task: Callable[..., Any], *args: Any) -> Future:
        """Run ``task(*args)`` on the worker thread, in the profiler range
        ``fastopt::worker_task`` (``benchmarks/timeline.py``'s ``worker task`` lane: where
        its updates leave gaps, whether the worker had nothing to do or was busy in between)."""
        return self.pool().submit(_as_worker_task, task, args)

    @contextlib.contextmanager
    def on_worker(self) -> Iterator[None]:
        """Time an update on the worker thread into the next step's ``cpu_step_background``
        (while timing is on: the clock is read only then)."""
        started = self.opt._timer.now()
        yield
        self._background_ms += (self.opt._timer.now() - started) * 1e3

    def take_background_ms(self) -> float:
        """The CPU time of the worker's updates since the last call (all joined by then)."""
        ms, self._background_ms = self._background_ms, 0.0
        return ms

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def _bind_to(cores: tuple[int, ...] | None) -> None:
    """The worker thread (and the threads its updates start) on ``cores`` only (None: as it is)."""
    if cores:
        os.sched_setaffinity(0, cores)


def _as_worker_task(task: Callable[..., Any], args: tuple) -> Any:
    with torch.profiler.record_function("fastopt::worker_task"):
        return task(*args)


def _apply(scales: list[Tensor], sources: dict[Tensor, Tensor]) -> None:
    """Multiply the gradients a plan reads by the factors it took, in order, in place: the
    profiler range ``fastopt::grad_scale`` (clipping's pass over a bucket's gradients where
    the update does not read them multiplied: ``benchmarks/timeline.py`` draws them)."""
    if not scales:
        return
    with torch.profiler.record_function("fastopt::grad_scale"):
        for coef in scales:
            scale_grads_(list(sources.values()), coef)
