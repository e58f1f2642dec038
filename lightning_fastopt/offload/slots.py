"""What the offload optimizer keeps for each parameter, and the host buckets that group
the offloaded ones."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_fastopt.optim.base import FusedOptimizer

_ALIGN = 64  # bytes: every host view starts on a cache line


@dataclass(eq=False)
class ParamSlot:
    """One model parameter.

    ``master`` is the float32 tensor the optimizer updates: the parameter itself when it
    is float32 and stays where it is (the device share, or any share on a CPU run),
    otherwise a float32 copy (in pinned host memory for the offloaded share of an
    accelerator run).  ``host_grad`` receives the gradient from the device, ``host_copy``
    the model-dtype result of a half-precision parameter before it goes back.
    """

    name: str
    param: Tensor
    index: int  # position among all parameters of the optimizer
    group: int
    offloaded: bool
    master: Tensor
    host_grad: Tensor | None = None
    host_copy: Tensor | None = None
    bucket: HostBucket | None = None  # the host bucket of an offloaded parameter
    grad_sent: bool = False
    seen: tuple[int, int] = (0, 0)  # the parameter's (data_ptr, version) after our last write

    @property
    def separate_master(self) -> bool:
        return self.master is not self.param

    def remember_weights(self) -> None:
        self.seen = (self.param.data_ptr(), self.param._version)

    def weights_changed(self) -> bool:
        """True when the parameter was written by someone other than this optimizer
        (``load_state_dict``, a callback, ...) since we last wrote it."""
        return self.seen != (self.param.data_ptr(), self.param._version)


@dataclass(eq=False)
class HostBucket:
    """Offloaded parameters whose gradients travel, and whose CPU update runs, together."""

    slots: list[ParamSlot]
    inner: FusedOptimizer
    buffers: list[Tensor] = field(default_factory=list)  # the flat host memory the views live in
    grads_ready = None  # event: the gradient copies of this bucket have landed
    params_sent = None  # event: the parameter copies of this bucket have been issued
    unsent: int = 0  # gradients still to copy this step
    recorded: bool = False  # grads_ready recorded this step

    def reset(self) -> None:
        self.unsent = len(self.slots)
        self.recorded = False
        for slot in self.slots:
            slot.grad_sent = False


def carve(shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype], pin: bool) -> tuple[list[Tensor], list[Tensor]]:
    """Views of the given shapes and dtypes into one flat host buffer per dtype, each
    starting on a cache line.  Returns (views, buffers)."""
    offsets: list[int] = []
    totals: dict[torch.dtype, int] = {}
    for shape, dtype in zip(shapes, dtypes):
        per_line = max(1, _ALIGN // torch.empty((), dtype=dtype).element_size())
        start = totals.get(dtype, 0)
        offsets.append(start)
        n = torch.Size(shape).numel()
        totals[dtype] = start + -(-n // per_line) * per_line
    flats = {d: torch.empty(n, dtype=d, pin_memory=pin) for d, n in totals.items()}
    views = [flats[d][o:o + torch.Size(s).numel()].view(s) for s, d, o in zip(shapes, dtypes, offsets)]
    return views, list(flats.values())
