"""Where each parameter of an offload optimizer lives: one slot per parameter (its master,
its host gradient buffer and half copy when offloaded), the host buckets that hold the
offloaded ones with an inner optimizer each, and the device share with its own; built
when the optimizer is, and for each group added later.  Also where a parameter's
optimizer state goes: to the inner optimizer that owns the parameter, beside its master.

Which parameters are offloaded is :func:`~lightning_fastopt.offload.partition.choose_offloaded`'s
choice; the slots and buckets themselves are :mod:`~lightning_fastopt.offload.slots`.  With
the state on disk a parameter larger than a bucket is split into pieces, a slot each
(:mod:`~lightning_fastopt.offload.pieces`): ``pieces_of`` lists a parameter's slots,
``slot_of`` gives the first (the one that speaks for the parameter).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.offload.copies import CopiesElsewhere
from lightning_fastopt.offload.partition import choose_offloaded, split_into_buckets
from lightning_fastopt.offload.pieces import piece_elements, piece_of_state, piece_ranges, splits
from lightning_fastopt.offload.slots import HostBucket, ParamSlot, carve, master_dtype, remember_weights
from lightning_fastopt.offload.state_tiers import DiskTier, HostMemoryTier
from lightning_fastopt.optim.base import FusedOptimizer, hyperparameters


class ShareLayout:
    """The slots and shares of one offload optimizer (``opt``: its groups, offload
    fraction, copy streams, step schedule and gradient intake).

    Args:
        optimizer: the fused optimizer the offload optimizer wraps (its class makes the
            inner optimizers, ``sibling``).
        param_names: a name for each parameter (else ``param<i>``).
        bucket_bytes: about how many bytes of float32 masters a host bucket holds.
        pin: page-locked host buffers.
        host_state_dtype: the host buckets' Adam moments' dtype (None: float32).
        tier: where the host buckets' masters and state live between updates
            (:mod:`~lightning_fastopt.offload.state_tiers`): anything reading or writing
            them does it inside ``tier.resident(bucket)`` (:meth:`in_residence`).
    """

    def __init__(self, opt, optimizer: FusedOptimizer, param_names: Mapping[Tensor, str], bucket_bytes: int,
                 pin: bool, host_state_dtype: torch.dtype | None, tier: HostMemoryTier | DiskTier) -> None:
        self.opt = opt
        self.tier = tier
        self.optimizer = optimizer
        self.param_names = param_names  # read again for groups added later
        self.bucket_bytes = bucket_bytes
        self.pin = pin
        self.host_state_dtype = host_state_dtype
        self.slots: list[ParamSlot] = []
        self.slot_of: dict[Tensor, ParamSlot] = {}  # a parameter's slot (its first piece's)
        self.pieces_of: dict[Tensor, list[ParamSlot]] = {}  # a parameter's slots (one unless split)
        self._params = 0  # parameters taken over so far
        self.buckets: list[HostBucket] = []
        self.device_slots: list[ParamSlot] = []
        self.device_inner = optimizer.sibling([[] for _ in optimizer.param_groups])
        if host_state_dtype is not None and opt.device.type == "cpu":  # a CPU run: the same kernels
            self.device_inner.state_dtype = host_state_dtype

    def in_residence(self, slots: list[ParamSlot], writes: bool = True) -> Iterator[list[ParamSlot]]:
        """``slots`` by share (each host bucket's, then the device's), each bucket's masters
        and state resident while its slots are handled (a disk tier holds a few at a time;
        ``writes=False``: only read, nothing written back)."""
        shares: dict[HostBucket | None, list[ParamSlot]] = {}
        for s in slots:
            shares.setdefault(s.bucket, []).append(s)
        for bucket, members in shares.items():
            with self.tier.resident(bucket, writes=writes) if bucket is not None else contextlib.nullcontext():
                yield members

    def inner_of(self, slot: ParamSlot) -> FusedOptimizer:
        return slot.bucket.inner if slot.bucket is not None else self.device_inner

    def inners(self) -> list[FusedOptimizer]:
        return [self.device_inner] + [b.inner for b in self.buckets]

    # ------------------------------------------------------------------ parameters taken over
    def add(self, params: list[Tensor]) -> None:
        """Take over parameters (at construction, or those of a group added later):
        ``offload_fraction`` of them go to new host buckets, the rest to the device share."""
        unique = list(dict.fromkeys(params))  # torch warns about a parameter listed twice in a group
        new = self._make_slots(unique, choose_offloaded(unique, self.opt.offload_fraction, self.opt.settings.stays_on_device))
        if len(unique) < len(params):
            listed = Counter(params)
            for s in new:
                s.listed = listed[s.param]
        self.slots += new
        for s in new:
            self.pieces_of.setdefault(s.param, []).append(s)
            if s.leads:
                self.slot_of[s.param] = s
        for s in new:
            if not s.offloaded:
                self.device_slots.append(s)
                self.device_inner.param_groups[s.group]["params"] += [s.master] * s.listed
        # the order backward produces them (a split parameter's pieces in their own order)
        offloaded = [s for p in reversed(unique) for s in self.pieces_of[p] if s.offloaded]
        buckets = [self._make_bucket(chunk) for chunk in
                   split_into_buckets(offloaded, [4 * s.numel for s in offloaded], self.bucket_bytes)]
        self.opt._intake.add(offloaded, buckets)
        self.tier.add(buckets)
        self.buckets += buckets

    def adopt_group(self, group: dict[str, Any]) -> None:
        """A group added to the wrapped optimizer: every inner optimizer keeps one group per
        user group (with its own keys), and the group's parameters are taken over."""
        for inner in self.inners():
            inner.param_groups.append(dict(self.optimizer.inner_defaults, **hyperparameters(group), params=[]))
        self.add(list(group["params"]))

    def _make_slots(self, params: list[Tensor], chosen: list[bool]) -> list[ParamSlot]:
        group_of = {p: gi for gi, g in enumerate(self.opt.param_groups) for p in g["params"]}
        limit = self.piece_limit()
        slots: list[ParamSlot] = []
        for i, (p, off) in enumerate(zip(params, chosen), start=self._params):
            name = self.param_names.get(p, f"param{i}")
            pinned = off and self.opt.copies.needed
            apart = pinned or p.dtype != master_dtype(p)
            parts = piece_ranges(p.numel(), limit) if off and splits(p, limit) else [None]
            for part in parts:
                slot = ParamSlot(name, p, len(self.slots) + len(slots), group_of[p], off, p, part=part)
                if pinned:
                    slot.master = torch.empty(0)  # a pinned view, carved per bucket
                elif apart:
                    slot.master = slot.of(p.detach()).to(master_dtype(p), copy=True)
                elif part is not None:  # its own master: the piece's master is its range of the weight
                    slot.master, slot.master_is_weight = slot.weight(), True
                slots.append(slot)
        self._params += len(params)
        seen = {s.name for s in self.slots}
        for s in slots:
            if s.leads and s.name in seen:
                raise ValueError(f"two parameters are both named {s.name!r}")
            seen.add(s.name)
        remember_weights(slots)
        return slots

    def piece_limit(self) -> int | None:
        """The most elements a host bucket holds of one parameter: a bucket's worth where the
        state is on disk and the optimizer steps pieces alike (:mod:`~lightning_fastopt.offload.pieces`);
        None (whole tensors) elsewhere."""
        if self.tier.on_disk and self.optimizer.steps_pieces:
            return piece_elements(self.bucket_bytes)
        return None

    def _make_bucket(self, slots: list[ParamSlot]) -> HostBucket:
        copies = self.opt.copies
        buffers: list[Tensor] = []
        if copies.needed:
            buffers = self._carve_host_buffers(slots)
        bucket = HostBucket(slots, self.optimizer.sibling(self._per_group(slots)), buffers)
        if self.host_state_dtype is not None:
            bucket.inner.state_dtype = self.host_state_dtype
        if copies.needed:
            bucket.written_flags = torch.zeros(len(slots), dtype=torch.bool, pin_memory=self.pin)
        # (FSDP's host shards: FSDP copies the gradients into host memory, we wait for its copies)
        bucket.grads_ready = CopiesElsewhere() if self.opt.settings.host_shards else copies.new_event()
        bucket.params_sent = copies.new_event()
        bucket.backward_done = copies.new_event()
        for s in slots:
            s.bucket = bucket
        return bucket

    def _carve_host_buffers(self, slots: list[ParamSlot]) -> list[Tensor]:
        """The bucket's host buffers, each slot's views into them: masters (copied from the
        weights), gradients (and spare ones where the schedule needs them), half copies."""
        shapes = [s.shape for s in slots]
        if self.tier.on_disk:  # host memory for the masters only until the tier has them (ShareLayout.add)
            masters, bufs = [torch.empty(s.shape, dtype=master_dtype(s.param)) for s in slots], []
        else:
            masters, bufs = carve(shapes, [master_dtype(s.param) for s in slots], self.pin)
        grads, gbufs = carve(shapes, [s.param.dtype for s in slots], self.pin)
        if self.opt.schedule.needs_spare_grads:  # the next step's gradients land here while an update reads the others
            spares, sbufs = carve(shapes, [s.param.dtype for s in slots], self.pin)
            gbufs += sbufs
            for s, spare in zip(slots, spares):
                s.spare_grad = spare
        half = [s for s in slots if s.param.dtype != master_dtype(s.param)]
        copies, cbufs = carve([s.shape for s in half], [s.param.dtype for s in half], self.pin)
        for s, m, g in zip(slots, masters, grads):
            m.copy_(s.weight())
            s.master, s.host_grad = m, g
        for s, c in zip(half, copies):
            s.host_copy = c
        return bufs + gbufs + cbufs

    def _per_group(self, slots: list[ParamSlot]) -> list[list[Tensor]]:
        lists: list[list[Tensor]] = [[] for _ in self.optimizer.param_groups]
        for s in sorted(slots, key=lambda s: s.index):
            lists[s.group] += [s.master] * s.listed
        return lists

    # ------------------------------------------------------------------ optimizer state
    def set_state(self, slot: ParamSlot, state: dict[str, Any]) -> None:
        """Give a parameter's state (taken over or loaded) to the inner optimizer that owns it,
        as float32 tensors beside its master (the moments in the inner optimizer's ``state_dtype``;
        a piece: its range of them)."""
        state = piece_of_state(slot, state)
        inner = self.inner_of(slot)
        moments, dtype = getattr(inner, "state_keys", ()), getattr(inner, "state_dtype", torch.float32)
        inner.state[slot.master] = {k: _to_like(v, slot.master).to(dtype) if k in moments else _to_like(v, slot.master)
                                    for k, v in state.items()}

    def take_state(self, optimizer: FusedOptimizer) -> None:
        """Move state the wrapped optimizer already had (a resumed torch optimizer)."""
        held = {p: optimizer.state[p] for p in self.pieces_of if optimizer.state.get(p)}
        for members in self.in_residence([s for s in self.slots if s.param in held]):
            for s in members:
                self.set_state(s, held[s.param])
        optimizer.state.clear()


def _to_like(value: Any, master: Tensor) -> Any:
    """A saved state value ready for a master tensor: floating tensors of the master's dtype
    on its device (a ``step`` stays a float32 scalar on the CPU), others in their own dtype
    there (bitsandbytes' quantized moments, uint8: as its own ``load_state_dict`` keeps them),
    anything else as it is."""
    if not isinstance(value, Tensor):
        return value
    if value.dim() == 0 and value.is_floating_point():
        return value.detach().to("cpu", torch.float32).clone()
    dtype = master.dtype if value.is_floating_point() else value.dtype
    return value.detach().to(master.device, dtype, copy=True).contiguous()
