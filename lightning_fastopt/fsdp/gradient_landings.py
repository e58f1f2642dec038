"""When FSDP has handed over each host shard's gradient, without a hook on the parameter.

Under ``CPUOffloadPolicy`` FSDP copies each unit's reduce-scattered gradients into host
memory after the unit's backward.  torch 2.13 copies them without blocking where the host
memory is pinned (an event recorded behind the copy, ``grad_offload_event``, which FSDP
itself waits for when backward ends), unless a post-accumulate-grad hook is registered on
the parameter: then the copy blocks the thread that runs backward until it has landed,
and the device has nothing queued meanwhile, so every unit's copy runs in series with
compute (``_fsdp_collectives.py``, ``foreach_reduce``).  A streamed step needs to know
when each gradient is there, so it does not use those hooks on the host shards: each
FSDP parameter group holding a watched parameter has its ``post_backward`` (where FSDP
reduces, copies and assigns the group's gradients) wrapped, and once it returns, each
watched parameter whose gradient it set or added to is handed to the listener with the
event its copy recorded (None where the copy blocked: a CPU run, unpinned memory,
gradients added to the last micro-batch's).  The listener's reader waits for that event
before reading the gradient, on its own thread
(:class:`~lightning_fastopt.offload.copies.CopiesElsewhere`).

The wrapper is an attribute of the group instance over torch's method (what FSDP calls,
from the autograd function it registers in forward and from the root's final callback);
:meth:`HostGradientLandings.remove` puts back what was there once no listener is left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_fastopt.fsdp.host_parameters import host_param_groups

__all__ = ["HostGradientLandings"]

_LISTENERS = "_fastopt_gradient_listeners"  # on a wrapped group: parameter -> listener
_BEFORE = "_fastopt_post_backward_before"  # on a wrapped group: its own post_backward before ours (None: torch's)

Listener = Callable[[Tensor, Any], None]  # (the parameter, the event its gradient's copy recorded, or None)


class HostGradientLandings:
    """The gradient landings of ``model``'s parameters in host memory (``CPUOffloadPolicy``)."""

    def __init__(self, model: nn.Module) -> None:
        self._groups = host_param_groups(model)
        self._watched: list[tuple[Any, Tensor]] = []

    def watch(self, params: Iterable[Tensor], on_landed: Listener) -> None:
        """Call ``on_landed(param, event)`` each time FSDP has handed over a gradient of one
        of ``params`` (those FSDP keeps in host memory; the others are not watched)."""
        wanted = set(params)
        for group in self._groups:
            mine = [fp.sharded_param for fp in group.fsdp_params if fp.sharded_param in wanted]
            if not mine:
                continue
            listeners = _listeners_of(group)
            for p in mine:
                listeners[p] = on_landed
                self._watched.append((group, p))

    def remove(self) -> None:
        """Stop watching; a group left without listeners gets back the ``post_backward`` it had."""
        for group, p in self._watched:
            listeners = getattr(group, _LISTENERS, None)
            if listeners is not None:
                listeners.pop(p, None)
                if not listeners:
                    _unwrap(group)
        self._watched = []


def _listeners_of(group: Any) -> dict[Tensor, Listener]:
    """The listeners of ``group``'s parameters, its ``post_backward`` wrapped the first time."""
    listeners = getattr(group, _LISTENERS, None)
    if listeners is not None:
        return listeners
    listeners = {}
    reduce_and_copy = group.post_backward  # torch's, bound to the group (or what wrapped it before us)

    def post_backward(*args: Any, **kwargs: Any) -> Any:
        before = {fp: _grad_and_version(fp.sharded_param) for fp in group.fsdp_params
                  if fp.sharded_param in listeners}
        result = reduce_and_copy(*args, **kwargs)
        for fp, (old, version) in before.items():
            grad = fp.sharded_param.grad
            if grad is not None and (grad is not old or _rows(grad)._version != version):
                listeners[fp.sharded_param](fp.sharded_param, getattr(fp, "grad_offload_event", None))
        return result

    setattr(group, _BEFORE, group.__dict__.get("post_backward"))
    group.post_backward = post_backward
    setattr(group, _LISTENERS, listeners)
    return listeners


def _unwrap(group: Any) -> None:
    before = group.__dict__.pop(_BEFORE, None)
    if before is None:
        del group.post_backward  # torch's method again
    else:
        group.post_backward = before
    delattr(group, _LISTENERS)


def _grad_and_version(param: Tensor) -> tuple[Tensor | None, int | None]:
    """``param``'s gradient (held, so that a new one cannot take its id) and its rows'
    version counter (FSDP adds a micro-batch's gradient to them in place)."""
    grad = param.grad
    return grad, None if grad is None else _rows(grad)._version


def _rows(grad: Tensor) -> Tensor:
    return grad._local_tensor if isinstance(grad, DTensor) else grad
