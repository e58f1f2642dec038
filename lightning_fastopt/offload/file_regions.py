"""Where the disk tier keeps each bucket in its working file: a region per bucket, each of
the bucket's masters and state tensors at its place in it (one after the other, each on a
cache line), planned from what the bucket will hold; with ``speculate``, a spare region per
bucket where a speculated update is written, the last state kept where it was until the
step commits the update or discards it.

The file and the window it is read and written through are the disk tier's
(:class:`~lightning_fastopt.offload.state_tiers.DiskTier`,
:class:`~lightning_fastopt.offload.disk_window.DiskWindow`); this part only counts the file's
bytes (``end``), which the tier reserves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_fastopt.offload.slots import HostBucket, ParamSlot, one_per_element
from lightning_fastopt.runtime.direct_io import round_up

__all__ = ["Entry", "FileRegions", "Region", "actual_entries", "lay_out", "planned_bytes", "planned_entries"]

LINE = 64  # bytes: every tensor of a region starts on a cache line


@dataclass(eq=False)
class Entry:
    slot: ParamSlot
    key: str  # "" for the master, else the state key
    dtype: torch.dtype
    offset: int  # bytes into the region


@dataclass(eq=False)
class Region:
    offset: int  # bytes into the file
    size: int
    entries: list[Entry]


class FileRegions:
    """The buckets' regions (``of``), their spare regions (``spares``) and the regions a
    speculated update left, to go back to; ``end``: the file's bytes planned so far."""

    def __init__(self) -> None:
        self.of: dict[HostBucket, Region] = {}
        self.spares: dict[HostBucket, Region] = {}  # where a bucket's next speculative update is written
        self._before: dict[HostBucket, Region] = {}  # a bucket's region before its speculative update
        self.end = 0

    def plan(self, bucket: HostBucket, entries: list[tuple[ParamSlot, str, torch.dtype]]) -> Region:
        """A new region at the file's end for ``entries``, the bucket's from now on."""
        planned, size = lay_out(entries)
        region = self.of[bucket] = Region(self.end, round_up(max(size, 1)), planned)
        self.end += region.size
        return region

    def reserve_spares(self, buckets: Sequence[HostBucket]) -> None:
        """A spare region for each of ``buckets`` that has none."""
        for b in buckets:
            if b not in self.spares:
                self.spares[b] = self._spare(b, self.of[b])

    def speculated(self, bucket: HostBucket, before: Region) -> Region:
        """A speculated update of ``bucket`` is about to be written: into its spare region
        (unless its region just moved to a larger one), ``before`` kept to go back to."""
        if self.of[bucket] is before:
            self.of[bucket] = self._spare(bucket, before)
        self._before[bucket] = before
        return self.of[bucket]

    def commit(self, bucket: HostBucket) -> None:
        """The speculated update holds: the region before becomes the spare."""
        before = self._before.pop(bucket, None)
        if before is not None and before.size == self.of[bucket].size:
            self.spares[bucket] = before

    def discard(self, bucket: HostBucket) -> bool:
        """Undo the speculated update: the region before is the bucket's again, the one
        written the spare; False where there was nothing to undo."""
        before = self._before.pop(bucket, None)
        if before is None:
            return False
        speculated, self.of[bucket] = self.of[bucket], before
        if speculated.size == before.size:
            self.spares[bucket] = speculated
        return True

    def _spare(self, bucket: HostBucket, like: Region) -> Region:
        """The bucket's spare region, laid out as ``like`` (a new one at the file's end where
        it has none of that size yet)."""
        spare = self.spares.pop(bucket, None)
        if spare is None or spare.size != like.size:
            spare = Region(self.end, like.size, like.entries)
            self.end += like.size
        return Region(spare.offset, spare.size, like.entries)


def planned_bytes(bucket: HostBucket) -> int:
    """The bytes a bucket's masters and state take once its state exists (its region's size
    on disk, each tensor on a cache line): what keeping it in host memory costs."""
    return lay_out(planned_entries(bucket))[1]


def lay_out(entries: list[tuple[ParamSlot, str, torch.dtype]]) -> tuple[list[Entry], int]:
    """Each entry's place in a region, one after the other, each on a cache line, and the bytes they take."""
    planned, size = [], 0
    for slot, key, dtype in entries:
        size = round_up(size, LINE)
        planned.append(Entry(slot, key, dtype, size))
        size += slot.numel * torch.empty((), dtype=dtype).element_size()
    return planned, size


def planned_entries(bucket: HostBucket) -> list[tuple[ParamSlot, str, torch.dtype]]:
    """What a bucket's region holds: each slot's master where apart from its weight, then the
    state its inner optimizer keeps for it, in that state's dtype."""
    inner = bucket.inner
    moments, moment_dtype = getattr(inner, "state_keys", ()), getattr(inner, "state_dtype", torch.float32)
    out = []
    for s in bucket.slots:
        if s.separate_master:
            out.append((s, "", s.master.dtype))
        for key in inner._bucket_state_keys(inner.param_groups[s.group]):
            out.append((s, key, moment_dtype if key in moments else torch.float32))
    return out


def actual_entries(bucket: HostBucket) -> list[tuple[ParamSlot, str, torch.dtype]]:
    """What a bucket holds now: each slot's master where apart, and each of its state
    tensors of the master's shape (a scalar, such as the step count, stays in host memory)."""
    out = []
    for s in bucket.slots:
        if s.separate_master:
            out.append((s, "", s.master.dtype))
        for key, value in (bucket.inner.state.get(s.master) or {}).items():
            if one_per_element(value, s.numel):
                out.append((s, key, value.dtype))
    return out
