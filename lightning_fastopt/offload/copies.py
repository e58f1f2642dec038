"""Device-to-host gradient copies and host-to-device parameter copies on side streams.

On a CUDA run with ``overlap=True`` gradients go to the host on one side stream while
backward keeps computing, and updated parameters come back on another while the CPU
updates the next bucket; events order everything, the host blocks only where it reads
a gradient buffer.  With ``overlap=False`` the copies run on the current stream and
block.  On a CPU run there is nothing to copy: :attr:`needed` is False.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor


class CopyStreams:
    """``copy_on_cpu=True`` makes a CPU run copy as an accelerator run would (into
    separate host buffers, in line), so that code path is exercised without a GPU."""

    def __init__(self, device: torch.device, overlap: bool = True, copy_on_cpu: bool = False) -> None:
        self.device = device
        self.needed = device.type != "cpu" or copy_on_cpu
        self.is_cuda = device.type == "cuda"
        use_streams = self.is_cuda and overlap
        self.d2h = torch.cuda.Stream(device) if use_streams else None
        self.h2d = torch.cuda.Stream(device) if use_streams else None

    def new_event(self):
        return torch.cuda.Event() if self.d2h is not None else None

    def _current(self):
        return torch.cuda.current_stream(self.device)

    # ------------------------------------------------------------------ gradients to the host
    def grad_to_host(self, grad: Tensor, host: Tensor) -> None:
        """Start copying ``grad`` into the pinned ``host`` buffer (after the work that
        produced it); ``grad`` may be freed by the caller right after."""
        if self.d2h is None:
            host.copy_(grad)
            return
        self.d2h.wait_stream(self._current())
        with torch.cuda.stream(self.d2h):
            host.copy_(grad, non_blocking=True)
        grad.record_stream(self.d2h)  # its memory is not reused before the copy has run

    def add_grad_to_host(self, grad: Tensor, host: Tensor) -> None:
        """Add ``grad`` to the gradient already copied into ``host`` (a second backward
        before the step); blocks until both are on the host."""
        if self.d2h is not None:
            self.d2h.synchronize()  # the first copy has landed
        host.add_(grad.to(host.device))

    def result_to_host(self, compute: Callable[[], Tensor], host: Tensor) -> None:
        """Evaluate ``compute`` (a small device tensor) on the gradient stream, after
        everything the compute stream has queued so far, and copy it into ``host``: it
        lands with the gradients (the next :meth:`mark_grads_sent` covers it)."""
        if self.d2h is None:
            host.copy_(compute())
            return
        self.d2h.wait_stream(self._current())
        with torch.cuda.stream(self.d2h):
            host.copy_(compute(), non_blocking=True)

    def mark_grads_sent(self, event) -> None:
        """Record ``event`` after the gradient copies issued so far (on a side stream: with
        none, they have landed; :class:`CopiesElsewhere` records nothing)."""
        if event is not None and self.d2h is not None:
            event.record(self.d2h)

    @staticmethod
    def wait_on_host(event) -> None:
        """Block the host until ``event`` has passed (a bucket's gradients have landed):
        a CUDA event, or :class:`CopiesElsewhere`."""
        if event is not None:
            event.synchronize()

    # ------------------------------------------------------------------ parameters back
    def mark_compute_done(self, event) -> None:
        """Record ``event`` on the compute stream: parameter copies wait for it, so they
        never overwrite a weight that backward may still read."""
        if event is not None:
            event.record(self._current())

    def params_to_device(self, pairs: Iterable[tuple[Tensor, Tensor]], after, event,
                         then: Callable[[], None] | None = None) -> None:
        """Copy each host tensor into its device tensor (``(device, host)`` pairs) once
        ``after`` has passed, then run ``then`` (device work that must see the copied
        weights: it is queued behind the copies), and record ``event`` after both: what
        waits for ``event`` waits for the copies and for ``then``'s work."""
        if self.h2d is None:  # in line (copy_on_cpu): the profiler range is the timeline's "copy in line" lane
            with torch.profiler.record_function("fastopt::copy_in_line"):
                for dst, src in pairs:
                    dst.copy_(src)
                if then is not None:
                    then()
            return
        self.h2d.wait_event(after)
        with torch.cuda.stream(self.h2d):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            if then is not None:
                then()
        event.record(self.h2d)

    def compute_waits_for(self, event) -> None:
        """Make later work on the compute stream (the next forward) wait for ``event``,
        without blocking the host."""
        if event is not None:
            self._current().wait_event(event)

    def synchronize(self) -> None:
        """Wait for every copy (timing and teardown)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


class CopiesElsewhere:
    """A host bucket's ``grads_ready`` where someone else copies its gradients into host
    memory (FSDP's host shards): the event each gradient's copy recorded (the last one of
    each parameter: earlier steps' have passed), waited for together, on the thread that
    reads them.  Nothing to wait for where every copy blocked until it landed (a CPU run)."""

    def __init__(self) -> None:
        self._events: dict[Tensor, object] = {}

    def add(self, param: Tensor, event) -> None:
        """``param``'s gradient is on its way: ``event`` passes when it has landed."""
        self._events[param] = event

    def synchronize(self) -> None:
        for event in list(self._events.values()):
            event.synchronize()
