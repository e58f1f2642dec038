"""Where the host buckets' float32 masters and optimizer state live between updates: the
storage tier of an offload optimizer (``offload_optimizer_device``).

- :class:`HostMemoryTier` (``"cpu"``, the default): in host memory, always at hand.
- :class:`DiskTier` (``"nvme"``): in a working file on a fast disk (``nvme_path``;
  :class:`~lightning_fastopt.runtime.direct_io.DirectFile`), each bucket's masters (where
  the optimizer keeps its own: not where a parameter is its own master, as FSDP's host
  shards and a CPU run's float32 weights are) and state in a region of it.  Host memory
  holds a bounded window (``nvme_window_mb``) of slots, each holding one bucket's region:
  a bucket is read into a slot before anything touches its masters or state and written
  back after; the next bucket is read while one is updated and the last one is written.

Everything that reads or writes a host bucket's masters or state does it inside
``tier.resident(bucket)`` (the update, the norms LAMB and LARS read, a master refreshed
from its weight, a state loaded or saved).  The tensors keep their identity (the inner
optimizers key their state by the masters): on the disk tier each one is pointed into its
slot while the bucket is resident and at an empty tensor otherwise
(``Tensor.set_``), so a read outside ``resident`` fails loudly instead of reading stale bits.

[Note: the region of a bucket]  Planned when the bucket is made: each slot's master (where
apart from the weight), then each state tensor its inner optimizer keeps
(``_bucket_state_keys``), in the dtype it keeps it in, each on a cache line; the sizes
every bucket will need once its state exists, so the disk space is checked at set-up.
State the plan did not foresee (another optimizer's keys loaded from a checkpoint) moves
the bucket to a new region at the file's end, as large as it needs.

[Note: speculation on disk]  A speculated update (``stream_cpu_step`` where the step
checks the gradients first) must be undoable until the step: the tier's :meth:`snapshot`
keeps what it changes.  In host memory that is a copy of the masters and state
(:class:`~lightning_fastopt.offload.snapshot.BucketSnapshot`); on disk the file itself: the
update is written to the bucket's spare region (reserved at set-up), the last state stays
in its region until the step commits the new one (the regions swap) or discards it, and
only what lives in host memory is copied (:class:`DiskSnapshot`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_fastopt.offload.disk_window import DEFAULT_WINDOW_MB, DiskWindow, WindowSlot
from lightning_fastopt.offload.file_regions import Entry, FileRegions, Region, actual_entries, planned_entries
from lightning_fastopt.offload.slots import HostBucket, ParamSlot, one_per_element, written_in_place
from lightning_fastopt.offload.snapshot import BucketSnapshot, kept_beside, put_beside_back, put_state_back
from lightning_fastopt.runtime.byte_sizes import readable_bytes
from lightning_fastopt.runtime.direct_io import DirectFile, check_directory
from lightning_fastopt.runtime.mapped_copies import MappedCopies

__all__ = ["DEFAULT_WINDOW_MB", "DiskSnapshot", "DiskTier", "HostMemoryTier", "OFFLOAD_DEVICES",
           "check_device_and_window", "check_offload_device", "check_window_holds_two_buckets", "make_tier"]

OFFLOAD_DEVICES = ("cpu", "nvme")


class HostMemoryTier:
    """Masters and state in host memory (``offload_optimizer_device="cpu"``): always resident."""

    on_disk = False

    def add(self, buckets: Sequence[HostBucket]) -> None:
        """New buckets (their masters made, their state not yet)."""

    @contextlib.contextmanager
    def resident(self, bucket: HostBucket, sent=None, writes: bool = True, speculative: bool = False
                 ) -> Iterator[None]:
        """Inside: the bucket's masters and state are in host memory.  ``sent``: an event
        after which nothing reads them any more (copies to the device in flight);
        ``writes``: False where nothing inside changes them (nothing to write back);
        ``speculative``: what changes inside may be undone (the bucket's :meth:`snapshot`)."""
        yield

    def hand_out(self, value: Any, dtype: torch.dtype | None = None, copy: bool = False) -> Any:
        """A master or state value of a resident bucket as it leaves the tier (a state dict,
        the state given back after fit): here the tensor itself (``copy``: a copy), in
        ``dtype`` where given (a copy where that is another dtype)."""
        if not isinstance(value, Tensor):
            return value
        if dtype is not None and dtype != value.dtype:
            return value.to(dtype)
        return value.clone() if copy else value

    def blank(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """A new tensor that leaves the tier (a parameter's state put together from its pieces)."""
        return torch.empty(shape, dtype=dtype)

    def snapshot(self, bucket: HostBucket) -> BucketSnapshot:
        """What keeps a bucket's masters and state as they were before a speculative update
        (``take``, then ``commit`` or ``restore``): here copies of them in host memory."""
        return BucketSnapshot()

    def reserve_snapshots(self, buckets: Sequence[HostBucket]) -> bool:
        """Room for the snapshots of ``buckets``, said in one line; False where there is none
        (the updates then run at the step)."""
        from lightning_fastopt.offload.speculative import afford_speculation

        return afford_speculation(list(buckets))

    def prefetch(self, buckets: Sequence[HostBucket]) -> None:
        """Start bringing these buckets in, in this order (the next to be used first)."""

    def end_step(self) -> None:
        """A step has ended: any write that failed is said now."""

    def breakdown(self) -> dict[str, float]:
        """What the tier adds to ``last_step_times`` since the last call."""
        return {}

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class DiskTier:
    """Masters and state in a working file in ``directory`` (see the module's documentation).

    Args:
        directory: ``nvme_path``.
        window_mb: the most host memory the slots take (``nvme_window_mb``; None:
            :data:`DEFAULT_WINDOW_MB`): at least two buckets' regions.  The slots take what
            the regions need within it (:class:`~lightning_fastopt.offload.disk_window.DiskWindow`).
        pin: the window in page-locked memory (new weights are copied to the device from it).
        copies: the optimizer's copy streams (to wait for the copies that read a slot).
        clock: the step timer's clock (seconds; 0.0 while timing is off), for :meth:`breakdown`.
    """

    on_disk = True

    def __init__(self, directory, window_mb: float, pin: bool, copies, clock=lambda: 0.0) -> None:
        self.directory = directory
        self.file: DirectFile | None = None
        self._regions = FileRegions()  # where each bucket lives in the file, a part
        self.regions = self._regions.of
        self.spares = self._regions.spares
        self.slots = DiskWindow(window_mb, pin, copies, self._read_region, self._evict)  # the window, a part
        self._lock = threading.RLock()  # (held around every call of the window's)
        self._clock = clock
        self._counts = dict.fromkeys(("disk_wait", "disk_read_mb", "disk_written_mb"), 0.0)
        self._copies: MappedCopies | None = None  # what hand_out gives (made at its first use)
        self._closed = False  # (close: nothing writes the file any more)

    # ------------------------------------------------------------------ planning
    def add(self, buckets: Sequence[HostBucket]) -> None:
        """Plan the new buckets' regions, reserve them in the file (made at the first
        buckets, in ``directory``; its space checked then) and write each bucket's masters
        there (made in host memory by the layout; freed here)."""
        buckets = [b for b in buckets if b not in self.regions]
        if not buckets:
            return
        for b in buckets:
            self._regions.plan(b, planned_entries(b))
        first = self.file is None
        if first:
            self.file = DirectFile(self.directory, self._regions.end)
        else:
            self.file.grow(self._regions.end)
        self._fit_window(max(self.regions.values(), key=lambda r: r.size))
        if first:
            rank_zero_info(f"lightning_fastopt: {self.describe()}")
        for b in buckets:
            with self.resident(b, fresh=True):
                pass  # the release takes the masters in and writes the region

    def _fit_window(self, largest: Region) -> None:
        """The window's slots sized to hold the largest region (:meth:`DiskWindow.fit
        <lightning_fastopt.offload.disk_window.DiskWindow.fit>`); where two do not fit, the
        advice says what to give."""
        def advice(need: str) -> str:
            slots = {id(e.slot): e.slot for e in largest.entries}
            slot = next(iter(slots.values()), None)
            if len(slots) == 1 and slot.part is None:  # a tensor a bucket holds whole: a smaller bucket cannot help
                return (f"the largest is one tensor, {slot.name} ({slot.numel:,} elements), whose masters and state "
                        f"a bucket holds whole ({_whole_why(slot)}): give {need}")
            return f"give {need}, or a smaller bucket_size_mb"
        self.slots.fit(largest.size, len(self.regions), advice)

    @property
    def window(self) -> list[WindowSlot]:
        """The window's slots."""
        return self.slots.slots

    @property
    def window_mb(self) -> float | None:
        return self.slots.window_mb

    @property
    def window_bytes(self) -> int:
        """The most host memory the window may take."""
        return self.slots.limit_bytes

    def describe(self) -> str:
        """Where the state is: the file's directory and size, and the window in host memory."""
        return (f"the offloaded masters and optimizer state on disk: a working file of "
                f"{readable_bytes(self.disk_bytes())} in nvme_path={str(self.directory)!r} (unnamed: it goes with the "
                f"process), read and written through {self.slots.describe()}")

    def disk_bytes(self) -> int:
        return self.file.size if self.file is not None else self._regions.end

    # ------------------------------------------------------------------ residency
    @contextlib.contextmanager
    def resident(self, bucket: HostBucket, sent=None, writes: bool = True, speculative: bool = False,
                 fresh: bool = False) -> Iterator[None]:
        """Inside: the bucket's masters and state point into a window slot holding its
        region; on leaving, the ones made or replaced inside are taken into the slot, the
        region is written back (not with ``writes=False``: a reader's; with
        ``speculative``, into the bucket's spare region, the old one kept until
        :meth:`commit` or :meth:`discard`), and the tensors point at nothing until the next
        time.  ``fresh``: the region has never been written (the bucket was just made).
        Inside it again (a refresh inside an update), nothing more happens."""
        with self._lock:
            held = self.slots.holding(bucket)
            if held is not None and held.in_use:
                nested = True
            else:
                nested = False
                started = self._clock()
                slot = self.slots.bring_in(bucket, read=not fresh)
                self._counts["disk_wait"] += (self._clock() - started) * 1e3
                slot.in_use = True
        if nested:
            yield
            return
        try:
            if not fresh:
                self._point(bucket, slot)
            yield
        finally:
            with self._lock:
                try:
                    if writes:
                        before = self.regions[bucket]
                        self._take_in(bucket, slot)
                        if speculative:  # into its spare region, the last state kept
                            self._regions.speculated(bucket, before)
                            self.file.grow(self._regions.end)
                        slot.written = self.file.write_from(slot.buffer[:self.regions[bucket].size],
                                                            self.regions[bucket].offset)
                        self._counts["disk_written_mb"] += self.regions[bucket].size / 2**20
                    slot.sent = sent
                finally:
                    self._evict(bucket)
                    self.slots.release(slot)

    def prefetch(self, buckets: Sequence[HostBucket]) -> None:
        """Start reading the buckets' regions, in this order (:meth:`DiskWindow.prefetch
        <lightning_fastopt.offload.disk_window.DiskWindow.prefetch>`)."""
        with self._lock:
            self.slots.prefetch(buckets)

    def _read_region(self, bucket: HostBucket, buffer: Tensor) -> None:
        """Read ``bucket``'s region into ``buffer`` (a slot's), until it has landed."""
        region = self.regions[bucket]
        self.file.read_into(buffer[:region.size], region.offset).result()
        self._counts["disk_read_mb"] += region.size / 2**20

    def hand_out(self, value: Any, dtype: torch.dtype | None = None, copy: bool = True) -> Any:
        """A master or state value of a resident bucket as it leaves the tier, never in host
        memory (the state on disk may be larger than host memory, and a state dict holds all
        of it at once): while the optimizer runs, a copy (the tensor points at nothing once
        the bucket leaves the window, and the next step rewrites the file), in ``dtype``
        where given, in a file of its own in ``directory`` mapped into memory
        (:class:`~lightning_fastopt.runtime.mapped_copies.MappedCopies`); once the tier is
        closed (nothing writes the file any more: the state given back after fit), the
        tensor where the working file holds it, mapped from it (no copy, no more disk)."""
        if not isinstance(value, Tensor):
            return value
        if self._closed and dtype in (None, value.dtype):
            in_file = self._in_file(value)
            if in_file is not None:
                return in_file
        return self._mapped().copy(value, dtype)

    def blank(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """A new tensor that leaves the tier (a parameter's state put together from its pieces),
        never in host memory: in a file of its own in ``directory``, as :meth:`hand_out`'s copies."""
        return self._mapped().empty(shape, dtype)

    def _mapped(self) -> MappedCopies:
        if self._copies is None:
            self._copies = MappedCopies(self.directory)
        return self._copies

    def holds(self, value: Tensor) -> bool:
        """Whether ``value`` lives in a window slot (a resident bucket's master or state)."""
        return self.slots.holds(value)

    def _in_file(self, value: Tensor) -> Tensor | None:
        """``value`` (a tensor of a resident bucket, in its window slot) mapped from the same
        bytes of the file (a slot holds its bucket's region byte for byte); None for a tensor
        no slot holds (in host memory: step counts, masters that are their own weights)."""
        address, nbytes = value.data_ptr(), value.numel() * value.element_size()
        for slot in self.window:
            start = slot.buffer.data_ptr()
            if slot.in_use and slot.bucket is not None and start <= address < start + slot.buffer.numel():
                offset = address - start
                if offset + nbytes > self.regions[slot.bucket].size or not value.is_contiguous():
                    return None
                place = self.file.mapped(self.regions[slot.bucket].offset + offset, nbytes)
                return place.view(value.dtype).view(value.shape)
        return None

    # ------------------------------------------------------------------ speculation: the file keeps the old state
    def snapshot(self, bucket: HostBucket) -> DiskSnapshot:
        return DiskSnapshot(self, bucket)

    def reserve_snapshots(self, buckets: Sequence[HostBucket]) -> bool:
        """A spare region for each of ``buckets`` (a speculative update writes there, the
        old state staying where it was until the step commits or discards it): the
        file's space reserved now, said in one line."""
        with self._lock:
            self._regions.reserve_spares(buckets)
            self.file.grow(self._regions.end)
        rank_zero_info(f"lightning_fastopt: speculate=True writes each speculated bucket beside its last state in "
                       f"nvme_path, until the step keeps one: the file takes {self._regions.end / 2**30:.2f} GiB")
        return True

    def commit(self, bucket: HostBucket) -> None:
        """The speculative update of ``bucket`` holds: its region before becomes the spare."""
        with self._lock:
            self._regions.commit(bucket)

    def discard(self, bucket: HostBucket) -> None:
        """Undo the speculative update of ``bucket``: its region before is its region again
        (the slot holding the update's bytes gives them up once their write has landed)."""
        with self._lock:
            if not self._regions.discard(bucket):
                return
            held = self.slots.holding(bucket)
            if held is not None:
                held.bucket = None

    # ------------------------------------------------------------------ the tensors
    def _point(self, bucket: HostBucket, slot: WindowSlot) -> None:
        """Point the bucket's masters and existing state at their places in the slot."""
        for e in self.regions[bucket].entries:
            tensor = _tensor_of(bucket, e.slot, e.key)
            if tensor is not None:
                _point_into(tensor, slot.buffer, e, _shape(e))

    def _take_in(self, bucket: HostBucket, slot: WindowSlot) -> None:
        """The masters and state made or replaced while resident (a first step's state, a
        loaded one) copied into their places in the slot; state the region has no place
        for moves the bucket to a larger region (see the module's note)."""
        region = self.regions[bucket]
        planned = {(e.slot.index, e.key): e.dtype for e in region.entries}
        actual = actual_entries(bucket)
        if any(planned.get((s.index, k)) != dtype for s, k, dtype in actual):
            self._replan(bucket, slot, actual)
            region = self.regions[bucket]
        base = slot.buffer.data_ptr()
        for e in region.entries:
            tensor = _tensor_of(bucket, e.slot, e.key)
            if tensor is not None and tensor.data_ptr() != base + e.offset:
                _point_into(tensor, slot.buffer, e, _shape(e), copy=True)

    def _replan(self, bucket: HostBucket, slot: WindowSlot, actual) -> None:
        held = {(e.slot.index, e.key): e for e in self.regions[bucket].entries}
        kept = {}  # what the slot holds now, before a new plan moves the places
        for s, key, _ in actual:
            e = held.get((s.index, key))
            t = _tensor_of(bucket, s, key)
            if e is not None and t is not None and t.data_ptr() == slot.buffer.data_ptr() + e.offset:
                kept[(s.index, key)] = t.clone()
        self._regions.plan(bucket, actual)
        self.file.grow(self._regions.end)
        if self.regions[bucket].size > slot.buffer.numel():
            self.slots.grow(self.regions[bucket].size, slot)
        for (index, key), value in kept.items():
            s = next(x for x in bucket.slots if x.index == index)
            _tensor_of(bucket, s, key).set_(value)

    def _evict(self, bucket: HostBucket) -> None:
        """The bucket's masters and state point at nothing (its region stays in the slot until reused)."""
        for e in self.regions[bucket].entries:
            tensor = _tensor_of(bucket, e.slot, e.key)
            if tensor is not None:
                tensor.set_(torch.empty(0, dtype=tensor.dtype))

    # ------------------------------------------------------------------ steps and teardown
    def breakdown(self) -> dict[str, float]:
        """Since the last call: milliseconds waited for buckets to be brought in
        (``disk_wait``, timed while the step timer is on), MiB read and written."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0.0)
        return counts

    def end_step(self) -> None:
        """Say a write that failed (it names the path); the others go on."""
        with self._lock:
            self.slots.say_failed_writes()

    def close(self) -> None:
        """Finish the reads and writes in flight; nothing writes the file after.  The file
        stays while the tier does (it goes with the optimizer), and while any tensor
        :meth:`hand_out` mapped from it lives: a closed optimizer's state is still read from
        it (the Trainer gives the user's optimizer its state back after fit, and may save it)."""
        self._closed = True
        with self._lock:
            self.slots.close()


class DiskSnapshot:
    """What a speculative update of a bucket on disk may have to undo: its masters and
    state in the file stay where they were (the update is written to the bucket's spare
    region, :meth:`DiskTier.resident`), so only what lives in host memory is copied: a
    master that is its own weight (FSDP's host shards, updated in place), a half weight the
    update writes in place (FSDP's half host shards), the step counts; state the update
    creates is noted to be removed."""

    def __init__(self, tier: DiskTier, bucket: HostBucket) -> None:
        self.tier = tier
        self.bucket = bucket
        # each slot, what of it lives in host memory (its master or half weight where the
        # update writes it in place), its state in host memory and its state's keys
        self._saved: list[tuple[ParamSlot, Tensor | None, dict[str, Any] | None, set[str] | None]] = []
        self._beside: Any = None

    def take(self, inner, slots: Sequence[ParamSlot]) -> None:
        """Inside the bucket's speculative residency, before the update."""
        self._saved = []
        self._beside = kept_beside(inner)
        for s in slots:
            state = inner.state.get(s.master)
            kept = None if state is None else {
                k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in state.items()
                if not one_per_element(v, s.numel)}
            own = s.weight().clone() if not s.separate_master or written_in_place(s) else None
            self._saved.append((s, own, kept, None if state is None else set(state)))

    def commit(self) -> None:
        self.tier.commit(self.bucket)
        self._saved = []

    def restore(self, inner) -> None:
        """The file's region before the update is the bucket's again; the state in host
        memory as it was, state the update created removed."""
        self.tier.discard(self.bucket)
        with torch.no_grad():
            for s, own, kept, keys in self._saved:
                if own is not None:
                    s.weight().copy_(own)  # (the master itself, or a half weight beside a master in the file)
                put_state_back(inner, s.master, kept, keys)
        put_beside_back(inner, self._beside)
        self._saved = []

    @property
    def nbytes(self) -> int:
        """Host bytes kept: the masters that are their own weights and the half weights written in
        place (none where every master is in the file and every weight goes to a device)."""
        return sum(own.numel() * own.element_size() for _, own, _, _ in self._saved if own is not None)


def _tensor_of(bucket: HostBucket, slot: ParamSlot, key: str) -> Tensor | None:
    """The tensor of ``slot`` a region holds under ``key`` ("": the master), where it has one."""
    if key == "":
        return slot.master if slot.separate_master else None
    value = (bucket.inner.state.get(slot.master) or {}).get(key)
    return value if isinstance(value, Tensor) and value.dim() > 0 else None


def _shape(e: Entry) -> torch.Size:
    return e.slot.shape


def _whole_why(slot: ParamSlot) -> str:
    """Why a bucket holds ``slot``'s tensor whole (see :mod:`~lightning_fastopt.offload.pieces`)."""
    if not slot.param.is_contiguous():
        return "the parameter is not contiguous"
    return "its optimizer steps whole tensors"


def _point_into(tensor: Tensor, buffer: Tensor, e: Entry, shape: torch.Size, copy: bool = False) -> None:
    """``tensor`` made a view of its place in ``buffer`` (``copy``: its values moved there first)."""
    size = torch.empty((), dtype=e.dtype).element_size()
    start = buffer.storage_offset() + e.offset
    place = torch.empty(0, dtype=e.dtype).set_(buffer.untyped_storage(), start // size, shape)
    if copy:
        place.copy_(tensor.detach().reshape(shape))
    tensor.set_(place)


def check_offload_device(device: Any, nvme_path: Any, nvme_window_mb: Any) -> str:
    """Refuse a bad ``offload_optimizer_device`` or ``nvme_window_mb`` (one larger than this
    machine's memory too), or a ``nvme_path`` or ``nvme_window_mb`` that goes without it."""
    check_device_and_window(device, nvme_window_mb)
    if device == "nvme" and nvme_path is None:
        raise ValueError("offload_optimizer_device='nvme' keeps the offloaded masters and optimizer state in files "
                         "in nvme_path: give nvme_path, a directory on a fast disk")
    if device != "nvme" and nvme_path is not None:
        raise ValueError(f"nvme_path is for offload_optimizer_device='nvme', got offload_optimizer_device={device!r}")
    if nvme_window_mb is not None:
        check_window_fits(nvme_window_mb, host_memory_bytes())
    return device


def check_device_and_window(device: Any, nvme_window_mb: Any) -> None:
    """Refuse a bad ``offload_optimizer_device`` or ``nvme_window_mb``, or a window given
    without the disk tier (for what has no directory to check: ``estimate_memory``)."""
    if device not in OFFLOAD_DEVICES:
        raise ValueError(f"offload_optimizer_device must be one of {OFFLOAD_DEVICES} (where the offloaded masters "
                         f"and optimizer state live: host memory, or files in nvme_path), got {device!r}")
    if nvme_window_mb is None:
        return
    if device != "nvme":
        raise ValueError(f"nvme_window_mb is for offload_optimizer_device='nvme' (host memory for the buckets on "
                         f"their way to and from the disk), got offload_optimizer_device={device!r}")
    if isinstance(nvme_window_mb, bool) or not isinstance(nvme_window_mb, (int, float)) or not nvme_window_mb > 0:
        raise ValueError(f"nvme_window_mb must be a positive number of MiB (host memory for the buckets read from "
                         f"and written to disk) or None (what the state needs, {DEFAULT_WINDOW_MB} MiB at most), "
                         f"got {nvme_window_mb!r}")


def check_window_holds_two_buckets(nvme_window_mb: float, bucket_size_mb: float) -> None:
    """Refuse a window that cannot hold two buckets' masters (each bucket's region holds its
    masters and its state besides: one bucket is updated while the next is read), when the
    strategy is built; the exact need, with the optimizer's state, is checked at set-up."""
    if nvme_window_mb < 2 * bucket_size_mb:
        raise ValueError(f"nvme_window_mb={nvme_window_mb!r} cannot hold two host buckets of bucket_size_mb="
                         f"{bucket_size_mb!r} (one is updated while the next is read): give {2 * bucket_size_mb:.4g} "
                         f"at least (about {6 * bucket_size_mb:.4g} with Adam's two moments), a smaller "
                         f"bucket_size_mb, or None (what the state needs, {DEFAULT_WINDOW_MB} MiB at most)")


def host_memory_bytes() -> int | None:
    """This machine's physical memory, where the system says (None elsewhere)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_window_fits(nvme_window_mb: float, memory: int | None) -> None:
    """Refuse a window larger than the host's ``memory`` (bytes; None: unknown, not checked)."""
    if memory is not None and nvme_window_mb * 2**20 > memory:
        raise ValueError(f"nvme_window_mb={nvme_window_mb!r} ({readable_bytes(nvme_window_mb * 2**20)}) is more "
                         f"than this machine's memory ({readable_bytes(memory)}): the window is host memory for the "
                         f"buckets on their way to and from the disk; give less, or None (what the state needs, "
                         f"{DEFAULT_WINDOW_MB} MiB at most)")


def make_tier(device: str, nvme_path, nvme_window_mb: float, pin: bool, copies,
              clock=lambda: 0.0) -> HostMemoryTier | DiskTier:
    if device == "nvme":
        return DiskTier(check_directory(nvme_path), nvme_window_mb, pin, copies, clock)
    return HostMemoryTier()
