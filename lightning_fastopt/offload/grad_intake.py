"""Where the offloaded parameters' gradients go, and when: the offload optimizer's
gradient intake (``device_grads``).

- ``"copy_in_backward"`` (the memory saving): copied from backward hooks and freed on the
  device at once.  ``p.grad`` is None afterwards, so nothing outside the optimizer may
  read or edit it; a second backward before the step adds its gradient to the host
  copy, as torch would add it to ``p.grad``.
- ``"copy_at_step"``: copied when the step starts (after DDP has reduced them), then freed;
  or, given ``reduced_by``, those a reducer hands over earlier (:meth:`GradIntake.reduced`:
  DDP's buckets whose all-reduce completed during backward) then, the rest at the step.
- ``"copy_when_reduced"``: copied, then freed, as something that reduces them during
  backward hands each final one over (:meth:`GradIntake.reduced`; ZeRO stage 2's
  reducer, whose ``reduced_by`` says which parameters it hands over).
- ``"keep"``: ``p.grad`` stays on the device as in torch, for user code to read and edit
  (Lightning's ``grad_norm``, hooks, manual optimization); copied when the step starts.

When a bucket's last gradient is on its way, its parameters are checked for writes from
outside the optimizer on the same stream (the answer lands with the gradients) and the
step schedule is told (``grads_landed``: a streamed schedule starts the bucket's update).
FSDP's host shards (``host_shards``) are their own masters and their gradients land in
host memory: a reducer hands each over, nothing is copied or checked, and the schedule is
told all the same once a bucket's last one is there.

A parameter split into pieces (:mod:`~lightning_fastopt.offload.pieces`) has its gradient
copied piece by piece, each piece counted in its own bucket; the gradient's norm (for
clipping) is the whole gradient's, under the first piece.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.functional import scale_grads_
from lightning_fastopt.offload.copies import CopiesElsewhere
from lightning_fastopt.offload.grad_norms import DeviceGradNorms
from lightning_fastopt.offload.slots import HostBucket, ParamSlot
from lightning_fastopt.offload.weight_watch import changed_flags
from lightning_fastopt.runtime.grad_hooks import GradReadyHooks

DEVICE_GRADS = ("copy_in_backward", "copy_at_step", "copy_when_reduced", "keep")
STREAMING_GRADS = ("copy_in_backward", "copy_when_reduced")  # gradients that leave during backward


def check_device_grads(device_grads: str, stream_cpu_step: bool, reduced_by: Callable[[Tensor], bool] | None) -> None:
    """Refuse a ``device_grads`` mode, or a combination with streaming or a reducer, that cannot work."""
    if device_grads not in DEVICE_GRADS:
        raise ValueError(f"device_grads must be one of {DEVICE_GRADS}, got {device_grads!r}")
    if stream_cpu_step and device_grads not in STREAMING_GRADS and reduced_by is None:
        raise ValueError(f"stream_cpu_step=True needs gradients that leave during backward, device_grads one of "
                         f"{STREAMING_GRADS} (or 'copy_at_step' with a reducer that hands them over as they are "
                         f"reduced, reduced_by), got {device_grads!r}")
    if (device_grads == "copy_when_reduced" and reduced_by is None) or \
            (reduced_by is not None and device_grads not in ("copy_when_reduced", "copy_at_step")):
        raise ValueError(f"reduced_by (which gradients a reducer hands over, grad_reduced) goes with "
                         f"device_grads 'copy_when_reduced' (it hands over every one) or 'copy_at_step' (the "
                         f"step copies the rest), got device_grads={device_grads!r}, reduced_by={reduced_by!r}")


class GradIntake:
    """The gradient intake of one offload optimizer (``opt``: its slots, buckets, copy
    streams, step schedule and weights in flight), in the ``device_grads`` mode; ``reduced_by``
    says which parameters a reducer hands over during backward (else: those hooked here)."""

    def __init__(self, optimizer, device_grads: str, reduced_by: Callable[[Tensor], bool] | None) -> None:
        self.opt = optimizer
        self.mode = device_grads
        self.hooks = GradReadyHooks([], self.ready)
        self.handed_over = reduced_by or self.hooks.hooked  # whose gradients arrive during backward
        self.norms = DeviceGradNorms()  # the clipping norm's per-tensor norms, taken before gradients leave

    def add(self, offloaded: list[ParamSlot], buckets: list[HostBucket]) -> None:
        """Take in the gradients of new offloaded parameters, in their new buckets."""
        if self.opt.copies.needed and self.mode == "copy_in_backward":
            self.hooks.add(dict.fromkeys(s.param for s in offloaded))
        for b in buckets:
            self.reset(b)

    # ------------------------------------------------------------------ during backward
    def ready(self, param: Tensor, grad: Tensor | None = None, landing: Any = None) -> None:
        """``param``'s gradient is final (a backward hook, or a reducer): send it (``landing``:
        the event its copy into host memory recorded, see :meth:`reduced`)."""
        opt = self.opt
        opt._in_flight.wait_all()  # the weights' checks below read them: every copy first
        if opt.accumulating:
            return  # Lightning is accumulating: the gradient is not final yet
        g = param.grad if grad is None else grad
        for slot in opt.layout.pieces_of[param]:
            if landing is not None:
                slot.bucket.grads_ready.add(param, landing)
            first = not slot.grad_sent
            self._send(slot, g)
            if not first and slot.bucket.recorded:
                opt.schedule.grads_changed(slot.bucket)
            if not (first and slot.grad_sent):
                continue  # a second backward's gradient was added to the host copy, in line (FSDP's host shards: by FSDP)
            bucket = slot.bucket
            bucket.unsent -= 1
            if bucket.unsent <= 0 and not bucket.recorded:
                self._sent(bucket)
        self._free(param, g)

    def reduced(self, param: Tensor, grad: Tensor | None = None, landing: Any = None) -> None:
        """A reducer (``reduced_by``) hands over ``param``'s final gradient: ``grad``, or
        ``param.grad`` (the reduction landed there), taken as a backward hook takes one.
        ``landing`` (FSDP's host shards): an event its copy into host memory recorded, still
        on its way: the bucket's readers wait for it (``grads_ready``, :class:`CopiesElsewhere
        <lightning_fastopt.offload.copies.CopiesElsewhere>`), not the thread handing it over."""
        slot = self.opt.layout.slot_of[param]
        if landing is not None and (slot.bucket is None or not isinstance(slot.bucket.grads_ready, CopiesElsewhere)):
            raise ValueError(f"a gradient copy still on its way (landing) is awaited only for FSDP's host shards "
                             f"(host_shards=True), got one for {slot.name}")
        if slot.offloaded and self.opt.lands_during_backward:
            self.ready(param, grad, landing)

    def _send(self, slot: ParamSlot, g: Tensor | None) -> None:
        """Copy the slot's part of its parameter's gradient ``g`` to the host (see :meth:`_free`)."""
        if g is None or (slot.grad_sent and self.mode == "keep"):
            return
        if not self.opt.copies.needed:  # handed over in host memory (host_shards): the step reads it there
            slot.grad_sent = True
            return
        if g.layout is not torch.strided:
            raise ValueError(f"OffloadOptimizer does not support sparse gradients ({slot.name})")
        copies = self.opt.copies
        if slot.grad_sent:  # another backward before the step: torch would add to p.grad
            copies.add_grad_to_host(slot.of(g), slot.host_grad)
            if slot.leads:
                self.norms.added_on_host(slot)
        else:
            if slot.leads:
                self.norms.leaving(slot, g)  # the whole gradient's norm
            copies.grad_to_host(slot.of(g), slot.host_grad)
            slot.grad_sent = True

    def key_of(self, slot: ParamSlot) -> tuple[int, ...]:
        """The version counters of the tensors the step reads for ``slot``'s parameter (every
        piece's; ``p.grad`` where it stays): a write to any of them moves one."""
        if self.mode == "keep":
            g = slot.param.grad
            return () if g is None else (g._version,)
        grads = (self.grad_of(s) for s in self.opt.layout.pieces_of[slot.param])
        return tuple(-1 if g is None else g._version for g in grads)

    def _free(self, param: Tensor, g: Tensor | None) -> None:
        """Once every slot of ``param`` has sent its part of ``g``: the device no longer needs it."""
        if g is not None and self.opt.copies.needed and self.mode != "keep":
            param.grad = None

    def _sent(self, bucket: HostBucket) -> None:
        """All of the bucket's gradients are on their way to the host.  Its parameters are
        checked for writes from outside the optimizer on the same stream, so the answer
        lands with the gradients and the step need not wait for the rest of backward
        (user code cannot write them in between: gradients leave during backward only
        when no user code runs between backward and the step, see ``device_grads``)."""
        copies = self.opt.copies
        self.norms.bucket_sent(bucket)
        if bucket.written_flags is not None:  # (masters apart from the weights only)
            params, prints = [s.weight() for s in bucket.slots], [s.fingerprint for s in bucket.slots]
            copies.result_to_host(lambda: changed_flags(params, prints), bucket.written_flags)
        copies.mark_grads_sent(bucket.grads_ready)
        bucket.recorded = True
        self._note_norms_of(bucket)
        self.opt.schedule.grads_landed(bucket)

    def _note_norms_of(self, bucket: HostBucket) -> None:
        """The bucket's copies are all issued: the norms taken on the device as they left are
        of the host copies as they are now, for each parameter whose every piece's bucket
        is (host buffers are views of one buffer per bucket, sharing a version counter)."""
        pieces = self.opt.layout.pieces_of
        for s in bucket.slots:
            lead = pieces[s.param][0]
            if all(p.bucket.recorded for p in pieces[s.param]):
                self.norms.sent(lead, self.key_of(lead))

    # ------------------------------------------------------------------ at the step
    def send_pending(self) -> None:
        """At the step: the gradients no hook or reducer sent during backward."""
        if not self.opt.copies.needed:
            return
        sent: dict[Tensor, Tensor | None] = {}  # the parameters whose gradients go now (freed after every piece)
        for b in self.opt.layout.buckets:
            for s in b.slots:
                if not s.grad_sent:
                    g = sent.setdefault(s.param, s.param.grad)
                    self._send(s, g)
                elif self.mode == "copy_at_step":
                    s.param.grad = None  # handed over by the reducer; DDP wrote the same values there since
            if not b.recorded:
                self._sent(b)
        for param, g in sent.items():
            self._free(param, g)

    @staticmethod
    def grad_of(slot: ParamSlot) -> Tensor | None:
        """The gradient the step reads for ``slot`` (None: it has none this step; a piece
        without a host buffer: its range of ``p.grad``)."""
        if slot.host_grad is not None:
            return slot.host_grad if slot.grad_sent else None
        g = slot.param.grad
        return None if g is None else slot.of(g)

    def _whole(self, grads: dict[Tensor, Tensor]):
        """Where each parameter's whole gradient is, given :meth:`read`'s (``grads``, by
        parameter): there, or for a parameter split into pieces whose gradients are on the
        host, theirs put together (a copy, made when asked: for a norm taken on the host)."""
        def whole(slot: ParamSlot) -> Tensor:
            if slot.part is None or self.mode == "keep":  # (kept: p.grad, whole)
                return grads[slot.param]
            if slot.host_grad is None:  # (in p.grad, whole: a CPU run's, FSDP's host shards')
                return slot.param.grad
            pieces = [self.grad_of(s) for s in self.opt.layout.pieces_of[slot.param]]
            return torch.cat([g.reshape(-1) for g in pieces]).view(slot.param.shape)
        return whole

    def read(self) -> list[tuple[Tensor, Tensor]]:
        """Every gradient the next step will use, under its parameter, where the step will
        read it (offloaded ones in host memory, once landed; with ``"keep"`` every one in
        ``p.grad``, copied when the step starts).  A parameter split into pieces: each
        piece's host gradient, under the parameter (scaling them in place scales it)."""
        opt = self.opt
        opt._in_flight.wait_all()
        if self.mode == "keep":
            return [(s.param, s.param.grad) for s in opt.layout.slots if s.leads and s.param.grad is not None]
        opt.schedule.before_gradients_read()
        self.send_pending()
        for b in opt.layout.buckets:
            opt.copies.wait_on_host(b.grads_ready)
            self.apply_scales(b)
        return [(s.param, g) for s, g in ((s, self.grad_of(s)) for s in opt.layout.slots) if g is not None]

    def scale(self, coef: Tensor) -> None:
        """Multiply every gradient :meth:`read` gives by ``coef`` (a float32 tensor: clipping
        by norm), as ``torch._foreach_mul_`` multiplies them: those on the device now, a
        host bucket's when something first reads them (:meth:`apply_scales`), which is in
        the end the bucket's update itself, on the thread that runs it (the worker's, where
        the step ends before it): the kernels read our own host copies multiplied, in the
        update's one pass over them (``grad_factors``), and multiply ``p.grad`` in place
        (:meth:`ShareUpdates.run <lightning_fastopt.offload.share_updates.ShareUpdates.run>`).
        Each gradient is multiplied alone, so where and when does not change a bit.  With
        ``"keep"`` every one now (the step copies them from ``p.grad``)."""
        grads = self.read()  # (every gradient landed; the factors left before applied)
        if self.mode == "keep":
            scale_grads_([g for _, g in grads], coef)
            return
        now: list[Tensor] = []
        later: dict[HostBucket, None] = {}
        for s in self.opt.layout.slots:
            g = self.grad_of(s)
            if g is not None:
                if s.bucket is None:
                    now.append(g)
                else:
                    later[s.bucket] = None
        if later:
            host = coef.detach().to("cpu", torch.float32, copy=True)
            for b in later:
                b.scales.append(host)
        scale_grads_(now, coef)

    def apply_scales(self, bucket: HostBucket) -> None:
        """The bucket's gradients multiplied by the factors :meth:`scale` left, now."""
        scales, bucket.scales = bucket.scales, []
        grads = [g for g in (self.grad_of(s) for s in bucket.slots) if g is not None]
        for coef in scales:
            scale_grads_(grads, coef)

    def take_scales(self, slots: list[ParamSlot]) -> list[Tensor]:
        """The factors the host bucket of ``slots`` has still to multiply its gradients by,
        handed to the update about to read them (a plan: :meth:`ShareUpdates.plan
        <lightning_fastopt.offload.share_updates.ShareUpdates.plan>`), none left behind."""
        bucket = slots[0].bucket if slots else None
        if bucket is None:
            return []
        scales, bucket.scales = bucket.scales, []
        return scales

    def gradient_norm(self, grad_scale: float = 1.0) -> Tensor:
        """The clipping norm of the gradients the next step reads (:meth:`read`), unscaled
        by ``grad_scale``, as torch computes it (:mod:`~lightning_fastopt.offload.grad_norms`)."""
        grads = dict(self.read())  # (a split parameter's: one of its pieces')
        opt = self.opt
        return self.norms.total(opt.param_groups, opt.layout.slot_of, lambda s: s.param in grads, self._whole(grads),
                                self.key_of, grad_scale)

    def gradient_norms_by_param(self, grad_scale: float = 1.0) -> dict[Tensor, Tensor]:
        """The norm of each gradient the next step reads, taken as :meth:`gradient_norm`
        takes it (for optimizers that combine the norms over ranks)."""
        grads = dict(self.read())
        slots = [self.opt.layout.slot_of[p] for p in grads]
        norms = self.norms.of(slots, self._whole(grads), self.key_of, grad_scale)
        return {s.param: norms[s] for s in slots}

    def by_param(self) -> dict[Tensor, Tensor]:
        """:meth:`read`'s gradients, each under its parameter, whole (a split parameter's put
        together: a copy)."""
        grads = dict(self.read())
        whole = self._whole(grads)
        return {p: whole(self.opt.layout.slot_of[p]) for p in grads}

    # ------------------------------------------------------------------ between steps
    def renew(self) -> None:
        """Forget this step's gradients (the step ended, or ``zero_grad``)."""
        self.opt.schedule.end()
        self.norms.clear()
        self.hooks.refresh()  # parameters unfrozen since the last step get their hook
        for b in self.opt.layout.buckets:
            self.reset(b)

    def reset(self, bucket: HostBucket) -> None:
        """Forget the bucket's gradients; the hooks will send those of its hooked parameters
        (a frozen one has none: its bucket's gradients are awaited when the step starts)."""
        bucket.reset(expected=sum(self.handed_over(s.param) for s in bucket.slots))

    def remove(self) -> None:
        self.hooks.remove()

