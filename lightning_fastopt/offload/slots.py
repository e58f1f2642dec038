"""What the offload optimizer keeps for each parameter, and the host buckets that group
the offloaded ones."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.offload.weight_watch import changed_since, fingerprints
from lightning_fastopt.optim.base import FusedOptimizer

_ALIGN = 64  # bytes: every host view starts on a cache line


def master_dtype(param: Tensor) -> torch.dtype:
    """The dtype of a parameter's master: float32, or float64 for a float64 parameter
    (``precision="64-true"``, stepped by the user's optimizer class)."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


@dataclass(eq=False)
class ParamSlot:
    """One model parameter, or one piece of it (``part``).

    ``master`` is the tensor the optimizer updates, of :func:`master_dtype`: the parameter
    itself when it has that dtype and stays where it is (the device share, or any share
    on a CPU run), otherwise a copy (in pinned host memory for the offloaded share of an
    accelerator run).  ``host_grad`` receives the gradient from the device, ``host_copy``
    the model-dtype result of a half-precision parameter before it goes back.

    A piece (``part``: a range of the flattened parameter's elements; see
    :mod:`~lightning_fastopt.offload.pieces`) holds that range only: its master, state,
    gradient and half copy are flat, in a host bucket of their own (where the parameter is
    its own master, the piece's master is its range of the weight, a view:
    ``master_is_weight``); what concerns the parameter as a whole (its gradient's arrival,
    norm, name in a checkpoint) goes through the first piece (:attr:`leads`).
    """

    name: str
    param: Tensor
    index: int  # position among all parameters of the optimizer
    group: int
    offloaded: bool
    master: Tensor
    host_grad: Tensor | None = None
    spare_grad: Tensor | None = None  # a second gradient buffer (delayed update: the next step's gradients)
    host_copy: Tensor | None = None
    bucket: HostBucket | None = None  # the host bucket of an offloaded parameter
    grad_sent: bool = False
    seen: tuple[int, int] = (0, 0)  # the parameter's (data_ptr, version) after our last write
    fingerprint: Tensor | None = None  # of the parameter after our last write (separate masters only)
    listed: int = 1  # times the group lists it (torch updates a duplicate once per listing)
    part: tuple[int, int] | None = None  # a piece: [start, stop) of the flattened parameter's elements
    master_is_weight: bool = False  # a piece whose master is its range of the weight itself (a view)

    @property
    def separate_master(self) -> bool:
        return self.master is not self.param and not self.master_is_weight

    def follow_weight(self) -> None:
        """A piece whose master is a view of its weight: pointed at the weight's storage as it
        is now (were the parameter given new storage, the view would update the old one)."""
        if self.master_is_weight and self.master.data_ptr() != self.weight().data_ptr():
            self.master.set_(self.weight())

    @property
    def leads(self) -> bool:
        """Whether this slot speaks for its parameter (the whole one, or its first piece)."""
        return self.part is None or self.part[0] == 0

    @property
    def shape(self) -> torch.Size:
        """The shape of this slot's master, gradient and half copy (a piece's: flat)."""
        return self.param.shape if self.part is None else torch.Size([self.part[1] - self.part[0]])

    @property
    def numel(self) -> int:
        return self.param.numel() if self.part is None else self.part[1] - self.part[0]

    def of(self, tensor: Tensor) -> Tensor:
        """This slot's part of a tensor shaped like its parameter (its weight, its gradient, a
        state tensor): the tensor itself for a whole parameter, else a flat view of the range
        (a copy where ``tensor`` is not contiguous: read it only)."""
        if self.part is None:
            return tensor
        return tensor.reshape(-1)[self.part[0]:self.part[1]]

    def weight(self) -> Tensor:
        """The model weight this slot's master updates (``param.data``, or the piece of it):
        written through ``.data``, as a step writes, without moving the parameter's version."""
        return self.of(self.param.data)

    def swap_grad_buffers(self) -> None:
        """The next gradients go to the spare buffer (an update in flight reads this one)."""
        self.host_grad, self.spare_grad = self.spare_grad, self.host_grad

    def rebound_or_bumped(self) -> bool:
        """True when the parameter's storage was replaced or its version counter moved
        since we last wrote it (a write through ``.data`` does neither: see
        :mod:`~lightning_fastopt.offload.weight_watch`)."""
        return self.seen != (self.param.data_ptr(), self.param._version)


def one_per_element(value: Any, numel: int) -> bool:
    """Whether an optimizer state value holds one element per element of a tensor of
    ``numel`` (a moment), not a scalar (a step count)."""
    return isinstance(value, Tensor) and value.dim() > 0 and value.numel() == numel


def written_in_place(slot: ParamSlot) -> bool:
    """Whether an update of ``slot`` writes its new half-precision weight into the parameter
    itself (FSDP's half host shards, beside their float32 masters: nothing is copied to a
    device), not into a host copy that is sent to the device later."""
    return slot.param.dtype != slot.master.dtype and slot.host_copy is None


def remember_weights(slots: Sequence[ParamSlot]) -> None:
    """Note each parameter as we left it: its storage, version and (for a separate
    master) fingerprint, all fingerprints in one pass per device."""
    watched = [s for s in slots if s.separate_master]
    for s, f in zip(watched, fingerprints([s.weight() for s in watched])):
        s.fingerprint = f
    for s in slots:
        s.seen = (s.param.data_ptr(), s.param._version)
        if not s.separate_master:
            s.fingerprint = None


def written_in_bucket(bucket: HostBucket) -> list[ParamSlot]:
    """The bucket's slots with a master apart written by others: the fingerprint check that
    travelled with its gradients (``bucket.written_flags``, read once they have landed), or
    a moved storage or version counter (none where each parameter is its own master); where
    no check travelled (the weights are in host memory: FSDP's host shards), the check now."""
    if bucket.written_flags is None:
        return written_by_others(bucket.slots)
    flags = bucket.written_flags.tolist()
    return [s for s, flag in zip(bucket.slots, flags) if s.separate_master and (flag or s.rebound_or_bumped())]


def written_by_others(slots: Sequence[ParamSlot]) -> list[ParamSlot]:
    """The slots with a separate master whose parameter something other than the
    optimizer wrote since its last write (``load_state_dict``, a callback, ``.data``)."""
    moved, quiet = [], []
    for s in slots:
        if s.separate_master:
            (moved if s.rebound_or_bumped() else quiet).append(s)
    flags = changed_since([s.weight() for s in quiet], [s.fingerprint for s in quiet])
    return moved + [s for s, changed in zip(quiet, flags) if changed]


@dataclass(eq=False)
class HostBucket:
    """Offloaded parameters whose gradients travel, and whose CPU update runs, together."""

    slots: list[ParamSlot]
    inner: FusedOptimizer
    buffers: list[Tensor] = field(default_factory=list)  # the flat host memory the views live in
    grads_ready = None  # event: the gradient copies of this bucket have landed (or CopiesElsewhere)
    written_flags: Tensor | None = None  # host: which slots' parameters others wrote (lands with the gradients)
    params_sent = None  # event: the parameter copies of this bucket have been issued
    backward_done = None  # event: backward no longer reads this bucket's weights (a streamed step)
    unsent: int = 0  # gradients the hooks have still to copy this step
    recorded: bool = False  # grads_ready recorded this step
    # host float32 factors its gradients are still to be multiplied by, in order (clipping by norm:
    # GradIntake.scale); applied by their first reader, the bucket's update in the end
    scales: list[Tensor] = field(default_factory=list)

    def reset(self, expected: int) -> None:
        """A new step: ``expected`` gradients will arrive from backward hooks."""
        self.unsent = expected
        self.recorded = False
        self.scales = []
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
