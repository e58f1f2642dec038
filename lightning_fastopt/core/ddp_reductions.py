"""DDPReductions: DDP's gradient buckets, handed over as each all-reduce completes.

DDP averages the gradients bucket by bucket during backward, but writes them into
``p.grad`` only when backward ends.  An offload optimizer that streams its CPU step into
backward wants each averaged gradient as soon as it exists: this class registers a DDP
communication hook that does what DDP does without one (the bucket scaled by
``1 / world_size`` as DDP scales it, then an asynchronous all-reduce sum: the same
bits in ``p.grad``), keeps each bucket's work, and, from the parameters' backward hooks,
looks (without waiting) at the buckets sent before, in order.  A completed one is handed
over as ``(parameter, averaged gradient)`` pairs, the gradients views of DDP's bucket,
read before DDP reuses it; buckets that complete after backward (and parameters DDP
marks unused at its end) are not: the step reads those from ``p.grad``, where DDP wrote
them (the list is cleared when backward ends).

Only where the user registered no communication hook of their own (the strategy checks),
and not during the micro-batches DDP does not synchronize (``no_sync``: it calls no hook).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable

from lightning_fastopt.runtime.grad_hooks import GradReadyHooks


@dataclass(eq=False)
class _Sent:
    params: list[Tensor]
    grads: list[Tensor]  # views of the bucket, in the order of params
    work: object


class DDPReductions:
    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel,
                 on_reduced: Callable[[list[tuple[Tensor, Tensor]]], None]) -> None:
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        self.on_reduced = on_reduced
        self._sent: list[_Sent] = []
        self._end_queued = False
        self.handed_over = 0  # gradients handed over during backward, over the run
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        self.params = {p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored}
        ddp.register_comm_hook(None, self._hook)
        self._hooks = GradReadyHooks(list(self.params), lambda _: self.poll())

    def reduces(self, param: Tensor) -> bool:
        """Whether DDP reduces ``param``'s gradient (it may be handed over during backward)."""
        return param in self.params

    def _hook(self, _state, bucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's own reduction, the work kept to be looked at (DDP checks the annotation)."""
        if not self._end_queued:  # after DDP's own end-of-backward callback, queued before the first bucket
            Variable._execution_engine.queue_callback(self._backward_ended)
            self._end_queued = True
        buffer = bucket.buffer()
        buffer.mul_(1.0 / self.world_size)  # as DDP scales a bucket it reduces without a hook
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self._sent.append(_Sent(list(bucket.parameters()), list(bucket.gradients()), work))
        return work.get_future().then(lambda fut: fut.value()[0])

    def _backward_ended(self) -> None:
        """What was not handed over is read from ``p.grad`` at the step (DDP wrote it)."""
        self._sent.clear()
        self._end_queued = False

    def poll(self) -> None:
        """Hand over the buckets whose reduction has completed, in the order sent."""
        while self._sent and self._sent[0].work.is_completed():
            sent = self._sent.pop(0)
            sent.work.wait()  # on an accelerator: later work on this stream after the reduction
            self.on_reduced(list(zip(sent.params, sent.grads)))
            self.handed_over += len(sent.params)

    def close(self) -> None:
        self._hooks.remove()
