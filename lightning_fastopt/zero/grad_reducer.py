"""GradReducer: ZeRO stage 2's gradient path, reduced to the owning rank during backward.

Parameters are grouped into buckets of one owner and one dtype, in the order backward
produces their gradients (the reverse of registration), of about ``bucket_size_mb``.  A
post-accumulate-grad hook marks each parameter ready; when a bucket is complete, and every
bucket before it has been sent (all ranks send in the same order), its gradients are
flattened into one buffer and summed into the owner's with an asynchronous
``torch.distributed.reduce``.  Ranks that do not own the bucket free their gradients at
once, so a rank holds full gradients only for the bucket being filled, plus its own shard.

Each buffer ends with one element per parameter saying whether this rank had a gradient
for it: a parameter no rank computed a gradient for keeps ``grad = None`` on its owner
(and is not stepped, as in torch), instead of receiving zeros.

A reduction lands (the owner's averaged gradients are written into ``p.grad``, and every
rank lets go of the bucket's buffer) as soon as it has completed: each hook looks, without
waiting, at the reductions sent before, in order.  ``on_reduced`` then hears which of the
owner's gradients are final, during backward (ZeRO's offload optimizer copies them to the
host there, and may start their CPU update).

While Lightning accumulates gradients (``accumulating``) the hooks do nothing: gradients
add up locally and are communicated once per optimizer step.  :meth:`finish` sends what
is left (in order), waits for every reduction and lands it; it does nothing more until
the next backward or :meth:`reset` (the flag lives here, not in the optimizer, whose
attributes Lightning's ``LightningOptimizer`` copies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fastopt.runtime.distributed import global_rank
from lightning_fastopt.runtime.grad_hooks import GradReadyHooks
from lightning_fastopt.zero.partition import owner_buckets


@dataclass(eq=False)
class _CommBucket:
    owner: int
    params: list[Tensor]
    ready: set = field(default_factory=set)  # ids of the parameters whose gradient is final
    flat: Tensor | None = None
    work: object = None
    sent_by_hooks: bool = False  # sent once every gradient of it was computed here (none missing)

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


class GradReducer:
    def __init__(self, params: list[Tensor], owners: list[int], rank: int, world_size: int, bucket_bytes: int,
                 process_group=None, on_reduced: Callable[[list[Tensor]], None] | None = None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, process_group
        self.on_reduced = on_reduced  # told the parameters whose averaged gradient has just been written
        self.accumulating = False
        self.finished = False  # this backward's gradients have reached their owners
        self.bucket_bytes = bucket_bytes
        self.buckets: list[_CommBucket] = []
        self._bucket_of: dict[int, _CommBucket] = {}
        self._next = 0  # the first bucket not sent yet
        self._landed = 0  # the first bucket sent whose reduction has not landed yet
        self._hooks = GradReadyHooks([], self._on_grad_ready)  # frozen ones get theirs once trainable
        self.add_params(params, owners)

    def add_params(self, params: list[Tensor], owners: list[int]) -> None:
        """Reduce these parameters' gradients too (at construction, and for a parameter group
        added later: its buckets come last, in the same order on every rank)."""
        # backward's order: the last parameters' gradients come first
        new = [_CommBucket(owner, chunk) for owner, chunk in owner_buckets(params[::-1], owners[::-1],
                                                                           self.bucket_bytes)]
        self.buckets += new
        self._bucket_of.update((id(p), b) for b in new for p in b.params)
        self._hooks.add(params)

    def hooked(self, param: Tensor) -> bool:
        """Whether backward tells this reducer when ``param``'s gradient is final (it
        requires gradients: its hook is on)."""
        return self._hooks.hooked(param)

    # ------------------------------------------------------------------ backward
    def _on_grad_ready(self, param: Tensor) -> None:
        if self.accumulating:
            return
        self.finished = False  # a new backward
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        self._send_ready(by_hooks=True)
        while self._landed < self._next and self.buckets[self._landed].work.is_completed():
            self._land(self.buckets[self._landed])

    def _send_ready(self, by_hooks: bool = False) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._send(self.buckets[self._next], by_hooks)
            self._next += 1

    def _send(self, bucket: _CommBucket, by_hooks: bool) -> None:
        p0 = bucket.params[0]
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                 for p in bucket.params]
        had = torch.tensor([float(p.grad is not None) for p in bucket.params], dtype=p0.dtype, device=p0.device)
        bucket.flat = torch.cat(parts + [had])
        bucket.work = dist.reduce(bucket.flat, dst=global_rank(self.group, bucket.owner), op=dist.ReduceOp.SUM,
                                  group=self.group, async_op=True)
        bucket.sent_by_hooks = by_hooks
        if bucket.owner != self.rank:
            for p in bucket.params:
                p.grad = None  # the owner has it now

    # ------------------------------------------------------------------ step
    def finish(self) -> None:
        """Send the buckets backward did not complete (parameters without a gradient count
        as zeros), wait for every reduction, and write the owner's averaged gradients."""
        if self.finished:
            return
        for b in self.buckets[self._next:]:
            b.ready = {id(p) for p in b.params}
        self._send_ready()
        while self._landed < self._next:
            self._land(self.buckets[self._landed])
        self.reset()
        self.finished = True

    def _land(self, bucket: _CommBucket) -> None:
        """Wait for the bucket's reduction (the next one in order); on its owner, write the
        averaged gradients (a parameter no rank had a gradient for keeps None) and say so."""
        bucket.work.wait()
        if bucket.owner == self.rank:
            n = sum(p.numel() for p in bucket.params)
            values = bucket.flat[:n]
            # every gradient of a bucket the hooks sent was computed here; else one device sync per bucket
            had = [1.0] * len(bucket.params) if bucket.sent_by_hooks else bucket.flat[n:].tolist()
            offset, landed = 0, []
            for i, p in enumerate(bucket.params):
                k = p.numel()
                p.grad = values[offset:offset + k].view_as(p).div_(self.world_size) if had[i] > 0 else None
                offset += k
                if p.grad is not None:
                    landed.append(p)
            if landed and self.on_reduced is not None:
                self.on_reduced(landed)
        bucket.flat, bucket.work = None, None
        self._landed += 1

    def reset(self) -> None:
        """Forget the marks of this step (zero_grad, and after each step)."""
        for b in self.buckets:
            b.ready = set()
            b.flat, b.work = None, None
        self._next = self._landed = 0
        self.finished = False
        self._hooks.refresh()

    def close(self) -> None:
        self._hooks.remove()
