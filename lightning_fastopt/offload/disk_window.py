"""The disk tier's window: the slots of host memory its buckets pass through on their way to
and from the disk (``nvme_window_mb``), a part of :class:`~lightning_fastopt.offload.state_tiers.DiskTier`
beside its file and regions.

Each slot holds one bucket's region at a time.  The window is sized to what the regions need
(:meth:`DiskWindow.fit`: slots of the largest region, as many as the limit allows, two at
least, no more than there are buckets), hands a bucket the slot holding its region or the
one used longest ago (:meth:`DiskWindow.bring_in`), reads the next buckets ahead into spare
slots on a stager thread (:meth:`DiskWindow.prefetch`), and before a slot changes hands
waits for its last write and for the copies that read it (:meth:`DiskWindow.settle`).  What
a region holds, where it is in the file and which tensors point into a slot are the tier's:
it gives the window a function that reads a bucket's region into a buffer and one that
makes a bucket's tensors point at nothing.  The tier's lock is held around every call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_fastopt.offload.slots import HostBucket
from lightning_fastopt.runtime.byte_sizes import readable_bytes
from lightning_fastopt.runtime.direct_io import ALIGN, aligned_empty, round_up

__all__ = ["DEFAULT_WINDOW_MB", "DiskWindow", "WindowSlot"]

DEFAULT_WINDOW_MB = 512  # the most the disk tier's window takes where nvme_window_mb is None


@dataclass(eq=False)
class WindowSlot:
    buffer: Tensor  # aligned uint8 host memory
    bucket: HostBucket | None = None  # whose region the buffer holds (or is being read into)
    read: Future | None = None  # the region read into it
    written: Future | None = None  # the last write of it
    sent: Any = None  # an event after which the device no longer reads it
    in_use: bool = False
    last_used: int = 0


class DiskWindow:
    """Args:
        window_mb: the most host memory the slots take (``nvme_window_mb``; None:
            :data:`DEFAULT_WINDOW_MB`).
        pin: the slots in page-locked memory (new weights are copied to the device from them).
        copies: the optimizer's copy streams (to wait for the copies that read a slot).
        read_region: reads a bucket's region into a buffer, until it has landed (the tier's file).
        evict: makes a bucket's tensors point at nothing (its slot is given to another).
    """

    def __init__(self, window_mb: float | None, pin: bool, copies, read_region: Callable[[HostBucket, Tensor], None],
                 evict: Callable[[HostBucket], None]) -> None:
        self.window_mb = window_mb
        self.limit_bytes = round((DEFAULT_WINDOW_MB if window_mb is None else window_mb) * 2**20)
        self.pin = pin
        self.copies = copies
        self.slots: list[WindowSlot] = []
        self._read_region = read_region
        self._evict = evict
        self._uses = 0  # counts releases: which slot was used longest ago
        self._stager: ThreadPoolExecutor | None = None
        self.failed: list[BaseException] = []  # writes that failed, said at the step's end

    # ------------------------------------------------------------------ size
    def fit(self, region_bytes: int, regions: int, advice: Callable[[str], str]) -> None:
        """Slots that each hold ``region_bytes`` (the largest region, and no more: the window
        takes what the state needs), as many as the limit allows (two at least, where there
        are two buckets) and no more than there are ``regions``; a ValueError where two do
        not fit, with ``advice(need)`` (what to give, in the tier's words)."""
        if self.slots and self.slots[0].buffer.numel() >= region_bytes \
                and len(self.slots) >= min(self.limit_bytes // self.slots[0].buffer.numel(), regions):
            return
        count = min(self.limit_bytes // region_bytes, regions)
        if count < min(2, regions):
            need = f"nvme_window_mb={2 * region_bytes / 2**20:.4g} at least"
            given = f"nvme_window_mb={self.window_mb!r}" if self.window_mb is not None else \
                f"the window's default most ({DEFAULT_WINDOW_MB} MiB)"
            raise ValueError(f"{given} holds {count} of the host buckets' "
                             f"regions on disk ({region_bytes / 2**20:.3g} MiB each: a bucket's masters and optimizer "
                             f"state); it needs two at least (one updated while the next is read): {advice(need)}")
        for old in self.slots:
            self.settle(old)
            if old.bucket is not None:
                self._evict(old.bucket)
        size = round_up(region_bytes, ALIGN)
        self.slots = [WindowSlot(aligned_empty(size, self.pin)) for _ in range(count)]

    def grow(self, region_bytes: int, holding: WindowSlot) -> None:
        """Every slot made to hold ``region_bytes`` (a region that grew, in ``holding``,
        which is in use: its tensors were copied out and point back in afterwards), where
        the limit allows as many slots of that size as there are now; else a RuntimeError
        naming nvme_window_mb."""
        size = round_up(region_bytes, ALIGN)
        if size * len(self.slots) > self.limit_bytes or any(s.in_use for s in self.slots if s is not holding):
            raise RuntimeError(f"a host bucket's masters and state now take {region_bytes / 2**20:.3g} MiB (state its "
                               f"optimizer does not keep was loaded): {len(self.slots)} slots of the window would "
                               f"take {size * len(self.slots) / 2**20:.3g} MiB (or another bucket is in a slot "
                               f"now): give a larger nvme_window_mb (now {self.limit()})")
        for slot in self.slots:
            if slot is not holding:
                if slot.read is not None:  # a read ahead into it: landed before the buffer goes
                    with contextlib.suppress(BaseException):
                        slot.read.result()
                    slot.read = None
                self.settle(slot)
                if slot.bucket is not None:
                    self._evict(slot.bucket)
                slot.bucket = None
            slot.buffer = aligned_empty(size, self.pin)

    def describe(self) -> str:
        slot = self.slots[0].buffer.numel() if self.slots else 0
        return f"a window of {len(self.slots)} slot(s) of {readable_bytes(slot)} in host memory ({self.limit()})"

    def limit(self) -> str:
        """The most the window may take, in the words of the argument that set it."""
        if self.window_mb is not None:
            return f"nvme_window_mb={self.window_mb!r}"
        return f"nvme_window_mb=None: what the state needs, {DEFAULT_WINDOW_MB} MiB at most"

    # ------------------------------------------------------------------ slots handed out
    def holding(self, bucket: HostBucket) -> WindowSlot | None:
        return next((s for s in self.slots if s.bucket is bucket), None)

    def bring_in(self, bucket: HostBucket, read: bool) -> WindowSlot:
        """The slot holding (or made to hold) ``bucket``'s region, read (``read``) and settled."""
        slot = self.holding(bucket)
        if slot is None:
            slot = min((s for s in self.slots if not s.in_use), key=lambda s: s.last_used)
            if slot.read is not None:  # another bucket's read ahead, into it: done before the slot changes hands
                with contextlib.suppress(BaseException):
                    slot.read.result()
                slot.read = None
            slot.bucket = bucket
            if read:
                self._read_when_free(slot, bucket)
            else:
                self.settle(slot)
        if slot.read is not None:
            slot.read.result()
            slot.read = None
        self.settle(slot)  # a write of this region still in flight: done before it changes
        return slot

    def release(self, slot: WindowSlot) -> None:
        """The slot's bucket is done with for now; the slot used longest ago is the next to be
        given to another."""
        slot.in_use = False
        self._uses += 1
        slot.last_used = self._uses

    def prefetch(self, buckets: Sequence[HostBucket]) -> None:
        """Start reading the buckets' regions, in this order (the one about to be used
        first), each into the slot used longest ago that no bucket is using or being read
        into and that holds none of the buckets before it in ``buckets`` (wanted sooner),
        on the stager thread once that slot's last write has landed: with two slots, the
        next bucket's read follows the last one's write while this one updates."""
        sooner: set[HostBucket] = set()
        for bucket in buckets:
            if bucket in sooner:
                continue
            sooner.add(bucket)
            if self.holding(bucket) is not None:
                continue
            spare = [s for s in self.slots if not s.in_use and s.read is None and s.bucket not in sooner]
            if not spare:
                return
            slot = min(spare, key=lambda s: s.last_used)
            slot.bucket = bucket
            slot.read = self._stage().submit(self._read_when_free, slot, bucket)

    def _read_when_free(self, slot: WindowSlot, bucket: HostBucket) -> None:
        """Once the slot's last write has landed and nothing reads it, read ``bucket``'s region into it."""
        self.settle(slot)
        self._read_region(bucket, slot.buffer)

    def settle(self, slot: WindowSlot) -> None:
        """Wait for the slot's last write and the copies that read it."""
        if slot.written is not None:
            written, slot.written = slot.written, None
            try:
                written.result()
            except BaseException as e:
                self.failed.append(e)
                raise
        if slot.sent is not None:
            self.copies.wait_on_host(slot.sent)
            slot.sent = None

    def _stage(self) -> ThreadPoolExecutor:
        if self._stager is None:
            self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastopt-disk-stage")
        return self._stager

    def holds(self, value: Tensor) -> bool:
        """Whether ``value`` lives in a slot (a resident bucket's master or state)."""
        address = value.data_ptr()
        return any(s.buffer.data_ptr() <= address < s.buffer.data_ptr() + s.buffer.numel() for s in self.slots)

    # ------------------------------------------------------------------ steps and teardown
    def say_failed_writes(self) -> None:
        """A write that failed (it names the path) raised; the others go on."""
        for slot in self.slots:
            if slot.written is not None and slot.written.done() and slot.written.exception() is not None:
                self.settle(slot)
        if self.failed:
            raise self.failed[-1]

    def close(self) -> None:
        """Finish the reads and writes in flight."""
        for slot in self.slots:
            if slot.read is not None:
                with contextlib.suppress(BaseException):
                    slot.read.result()
            with contextlib.suppress(BaseException):
                self.settle(slot)
        if self._stager is not None:
            self._stager.shutdown(wait=True)
            self._stager = None
