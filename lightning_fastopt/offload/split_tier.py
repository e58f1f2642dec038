"""The offloaded state split between host memory and the disk (issue 72): a storage tier of
two parts, :class:`~lightning_fastopt.offload.state_tiers.HostMemoryTier` for some host
buckets and :class:`~lightning_fastopt.offload.state_tiers.DiskTier` for the others
(``offload_optimizer_device="nvme"`` with ``host_state_gib``).

Which buckets stay in host memory is decided when the buckets are made, whole buckets (a
bucket's masters with their state), up to ``host_state_gib`` GiB of them (``"auto"``: what
the host has available then, after the model, the gradients' and copies' buffers already
made, less the disk tier's window and a reserve: ``host_reserve_gib``, or a tenth of the
machine's memory, shared by the processes on the host).  They are spread evenly over the
order the updates take the buckets in, so that each bucket read from (or written to) the
disk overlaps the update of one held in host memory, not a run of disk buckets waiting on
the disk in a row.  Everything else is the two tiers' own: a bucket is resident, prefetched,
snapshotted and handed out by the tier that holds it.  The math is the same in either tier,
so a run ends, and its state dict is, as with all of it in host memory or all of it on disk.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_fastopt.offload.slots import HostBucket, carve
from lightning_fastopt.offload.snapshot import BucketSnapshot
from lightning_fastopt.offload.speculative import afford_speculation, available_host_bytes
from lightning_fastopt.offload.file_regions import planned_bytes
from lightning_fastopt.offload.state_tiers import DiskSnapshot, DiskTier, HostMemoryTier, host_memory_bytes, make_tier
from lightning_fastopt.runtime.byte_sizes import readable_bytes

__all__ = ["RESERVE_SHARE", "SplitTier", "check_host_state", "make_storage", "spread"]

RESERVE_SHARE = 0.1
"""``host_state_gib="auto"`` leaves this share of the machine's memory free, unless
``host_reserve_gib`` says how much."""


class SplitTier:
    """Args:
        disk: the disk tier for the buckets host memory does not keep.
        host_state_gib: the most GiB of buckets kept in host memory, or ``"auto"``.
        host_reserve_gib: with ``"auto"``: GiB left free (None: :data:`RESERVE_SHARE` of the machine).
        processes_per_host: processes sharing this host's memory (``"auto"`` takes its share).
        pin: host buckets' masters in page-locked memory (the device reads new weights from them).
    """

    on_disk = True  # (for the layout: masters made apart until placed, pieces sized to the window)

    def __init__(self, disk: DiskTier, host_state_gib: float | str, host_reserve_gib: float | None = None,
                 processes_per_host: int = 1, pin: bool = False, gradients_to_come: int = 0) -> None:
        self.disk = disk
        self.host = HostMemoryTier()
        self.host_state_gib = host_state_gib
        self.host_reserve_gib = host_reserve_gib
        self.processes_per_host = max(1, int(processes_per_host))
        self.pin = pin
        self.gradients_to_come = gradients_to_come  # host bytes of the model's gradients backward will make
        self.in_host: dict[HostBucket, int] = {}  # each bucket host memory keeps, with its bytes
        self.budget: int | None = None  # bytes, fixed when the first buckets are placed

    # ------------------------------------------------------------------ placing the buckets
    def add(self, buckets: Sequence[HostBucket]) -> None:
        """Place the new buckets: as many as the budget holds in host memory, spread over
        their order (:func:`spread`), the rest in the disk tier; said in one line."""
        new = [b for b in buckets if b not in self.in_host and b not in self.disk.regions]
        if not new:
            return
        sizes = [planned_bytes(b) for b in new]
        first = self.budget is None
        if first:
            self.budget = self._budget(_masters_bytes(new), _buffer_bytes(new))
        kept = spread(sizes, self.budget - sum(self.in_host.values()))
        for b, size, keep in zip(new, sizes, kept):
            if keep:
                self._keep_in_host(b)
                self.in_host[b] = size
        self.disk.add([b for b, keep in zip(new, kept) if not keep])
        if first:
            rank_zero_info(f"lightning_fastopt: {self.describe()}")

    def _budget(self, made: int, untouched: int) -> int:
        """The bytes host memory keeps: ``host_state_gib``'s, or with ``"auto"`` what is
        available now, and ``made`` (the new buckets' masters, made in host memory for the
        tier to place: those on disk are freed, those kept are counted in their sizes), less
        ``untouched`` (the buckets' gradient and half-copy buffers: made, but not in memory
        until the first step writes them, so not yet missing from what is available) and the
        model's gradients in host memory that backward has not made yet."""
        asked = self.host_state_gib
        if asked != "auto":
            return int(float(asked) * 2**30)
        available = available_host_bytes()
        total = host_memory_bytes()
        if available is None or total is None:
            raise RuntimeError("host_state_gib='auto' measures the host's available memory, which this system does "
                               "not say (/proc/meminfo): give host_state_gib in GiB")
        reserve = RESERVE_SHARE * total if self.host_reserve_gib is None else self.host_reserve_gib * 2**30
        left = available + made - untouched - self.gradients_to_come - reserve - self.disk.window_bytes
        return max(0, int(left // self.processes_per_host))

    def _keep_in_host(self, bucket: HostBucket) -> None:
        """The bucket's masters (made apart for the disk tier) moved into host buffers of their
        own (page-locked with ``pin``), where they stay."""
        slots = [s for s in bucket.slots if s.separate_master]
        if not slots:
            return
        views, buffers = carve([s.shape for s in slots], [s.master.dtype for s in slots], self.pin)
        for s, view in zip(slots, views):
            view.copy_(s.master)
            s.master.set_(view)
        bucket.buffers.extend(buffers)

    def describe(self) -> str:
        kept = sum(self.in_host.values())
        asked = "'auto'" if self.host_state_gib == "auto" else f"{float(self.host_state_gib):g}"
        if self.host_state_gib == "auto":
            reserve = (f"host_reserve_gib={self.host_reserve_gib:g}" if self.host_reserve_gib is not None
                       else f"a reserve of {RESERVE_SHARE:.0%} of the machine's memory")
            asked += (f": {readable_bytes(self.budget)} available after the model, its gradients and buffers, "
                      f"the window and {reserve}")
            if self.processes_per_host > 1:
                asked += f", shared by {self.processes_per_host} processes"
        return (f"the offloaded masters and optimizer state split by host_state_gib={asked}: "
                f"{len(self.in_host)} bucket(s), {readable_bytes(kept)}, in host memory and "
                f"{len(self.disk.regions)} bucket(s), {readable_bytes(self.disk.disk_bytes())}, on disk, spread over "
                "the step so that each disk transfer overlaps a host bucket's update")

    # ------------------------------------------------------------------ each bucket by the tier that holds it
    def _tier_of(self, bucket: HostBucket) -> HostMemoryTier | DiskTier:
        return self.host if bucket in self.in_host else self.disk

    @contextlib.contextmanager
    def resident(self, bucket: HostBucket, sent=None, writes: bool = True, speculative: bool = False
                 ) -> Iterator[None]:
        with self._tier_of(bucket).resident(bucket, sent=sent, writes=writes, speculative=speculative):
            yield

    def snapshot(self, bucket: HostBucket) -> BucketSnapshot | DiskSnapshot:
        return self._tier_of(bucket).snapshot(bucket)

    def reserve_snapshots(self, buckets: Sequence[HostBucket]) -> bool:
        in_host = [b for b in buckets if b in self.in_host]
        on_disk = [b for b in buckets if b not in self.in_host]
        return (not in_host or afford_speculation(in_host)) and (not on_disk or self.disk.reserve_snapshots(on_disk))

    def prefetch(self, buckets: Sequence[HostBucket]) -> None:
        self.disk.prefetch([b for b in buckets if b not in self.in_host])

    def hand_out(self, value: Any, dtype: torch.dtype | None = None, copy: bool = False) -> Any:
        """A host bucket's value as host memory gives it; a disk bucket's as the disk tier does."""
        if isinstance(value, Tensor) and self.disk.holds(value):
            return self.disk.hand_out(value, dtype)
        return self.host.hand_out(value, dtype, copy)

    def blank(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        return self.disk.blank(shape, dtype)

    def end_step(self) -> None:
        self.disk.end_step()

    def breakdown(self) -> dict[str, float]:
        return self.disk.breakdown()

    def disk_bytes(self) -> int:
        return self.disk.disk_bytes()

    def close(self) -> None:
        self.disk.close()


def _masters_bytes(buckets: Sequence[HostBucket]) -> int:
    """Host bytes of the buckets' masters made apart from their weights."""
    return sum(s.master.numel() * s.master.element_size() for b in buckets for s in b.slots if s.separate_master)


def _buffer_bytes(buckets: Sequence[HostBucket]) -> int:
    """Host bytes of the buckets' own buffers (gradients, spare gradients, half copies)."""
    return sum(b.numel() * b.element_size() for bucket in buckets for b in bucket.buffers)


def spread(sizes: Sequence[int], budget: int) -> list[bool]:
    """Which of buckets of ``sizes`` (in the order the step takes them) host memory keeps
    within ``budget`` bytes: evenly spaced, as many as the budget's share of the whole
    allows (each kept one between disk ones), then any that still fit, in order."""
    total = sum(sizes)
    if total == 0 or budget <= 0:
        return [False] * len(sizes)
    share = min(1.0, budget / total)
    kept, used = [False] * len(sizes), 0
    for i, size in enumerate(sizes):
        if math.floor((i + 1) * share + 1e-9) > math.floor(i * share + 1e-9) and used + size <= budget:
            kept[i], used = True, used + size
    for i, size in enumerate(sizes):
        if not kept[i] and used + size <= budget:
            kept[i], used = True, used + size
    return kept


def check_host_state(host_state_gib: Any, host_reserve_gib: Any, device: Any) -> None:
    """``host_state_gib`` and ``host_reserve_gib`` refused, naming them, where they cannot
    be: not a number of GiB (nor ``"auto"`` for the first), negative, more than this
    machine's memory, without the disk tier, or a reserve without ``"auto"``."""
    if host_state_gib is None:
        if host_reserve_gib is not None:
            raise ValueError(f"host_reserve_gib is for host_state_gib='auto', got "
                             f"host_reserve_gib={host_reserve_gib!r} without it")
        return
    if device != "nvme":
        raise ValueError(f"host_state_gib splits the offloaded state between host memory and the disk: it needs "
                         f"offload_optimizer_device='nvme' (with 'cpu' all of it is in host memory), got "
                         f"offload_optimizer_device={device!r}")
    memory = host_memory_bytes()
    if host_state_gib != "auto":
        _check_gib("host_state_gib", host_state_gib, memory, "or 'auto'")
        if host_reserve_gib is not None:
            raise ValueError(f"host_reserve_gib is for host_state_gib='auto', got host_state_gib={host_state_gib!r}")
        return
    if host_reserve_gib is not None:
        _check_gib("host_reserve_gib", host_reserve_gib, memory, "or None (a tenth of the machine's memory)")


def _check_gib(name: str, value: Any, memory: int | None, alternatives: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number of GiB, 0 or more, {alternatives}; got {value!r}")
    if memory is not None and value * 2**30 > memory:
        raise ValueError(f"{name}={value!r} is more than this machine's memory ({memory / 2**30:.1f} GiB)")


def make_storage(device: str, nvme_path, nvme_window_mb: float | None, pin: bool, copies, clock,
                 host_state_gib: float | str | None = None, host_reserve_gib: float | None = None,
                 processes_per_host: int = 1, params: Sequence[Tensor] = ()) -> HostMemoryTier | DiskTier | SplitTier:
    """The storage tier an offload optimizer's arguments ask for: host memory, the disk, or
    the disk with ``host_state_gib`` of it in host memory (``params``: the optimizer's, whose
    gradients in host memory backward has still to make count as taken)."""
    tier = make_tier(device, nvme_path, nvme_window_mb, pin, copies, clock)
    if host_state_gib is None:
        return tier
    to_come = sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu" and p.grad is None)
    return SplitTier(tier, host_state_gib, host_reserve_gib, processes_per_host, pin, to_come)
