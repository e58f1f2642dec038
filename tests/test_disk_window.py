"""The disk tier's window on its own (``lightning_fastopt/offload/disk_window.py``): slots
sized to the largest region within the limit, two at least; a bucket gets the slot holding
its region or the one used longest ago (the other bucket's tensors evicted); reads ahead go
to spare slots in the order asked, each after the slot's last write; a failed write is
said at the step's end."""

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from lightning_fastopt.offload.disk_window import DiskWindow


class _Copies:
    def wait_on_host(self, event):
        event.waited = True


def _window(limit_mb, reads, evicted):
    def read_region(bucket, buffer):
        reads.append(bucket.name)
        buffer[:1] = len(reads)

    return DiskWindow(limit_mb, False, _Copies(), read_region, lambda b: evicted.append(b.name))


class _Bucket:
    def __init__(self, name):
        self.name = name


def _buckets(*names):
    return [_Bucket(n) for n in names]


def test_slots_hold_the_largest_region_as_many_as_the_limit_allows_and_two_at_least():
    reads, evicted = [], []
    window = _window(1.0, reads, evicted)
    window.fit(300_000, regions=5, advice=lambda need: f"give {need}")
    assert len(window.slots) == 3 and all(s.buffer.numel() >= 300_000 for s in window.slots)
    window.fit(200_000, regions=5, advice=str)  # smaller: the slots already hold it
    assert len(window.slots) == 3
    few = _window(1.0, reads, evicted)
    few.fit(100_000, regions=2, advice=str)
    assert len(few.slots) == 2  # no more than there are buckets
    with pytest.raises(ValueError, match=r"nvme_window_mb=1.0 holds 1 of the host buckets' regions .* it needs two "
                                         r"at least .*: give nvme_window_mb=1.144 at least"):
        _window(1.0, reads, evicted).fit(600_000, regions=3, advice=lambda need: f"give {need}")
    assert "a window of 3 slot(s) of" in window.describe() and "nvme_window_mb=1.0" in window.describe()


def test_a_bucket_gets_its_slot_or_the_one_used_longest_ago_and_reads_ahead_follow_the_order():
    reads, evicted = [], []
    window = _window(1.0, reads, evicted)
    window.fit(400_000, regions=4, advice=str)
    a, b, c, d = _buckets("a", "b", "c", "d")
    first = window.bring_in(a, read=True)
    window.release(first)
    second = window.bring_in(b, read=True)
    window.release(second)
    assert reads == ["a", "b"] and first is not second
    assert window.bring_in(a, read=True) is first and reads == ["a", "b"]  # held already: not read again
    window.release(first)
    third = window.bring_in(c, read=False)  # (a fresh region: nothing to read)
    assert third is second and reads == ["a", "b"]  # b's slot was used longest ago
    window.release(third)
    window.prefetch([d, a])  # d into the slot used longest ago (a's), then a into the other (c's)
    for slot in window.slots:
        slot.read.result()
    assert reads == ["a", "b", "d", "a"] and window.holding(d) is first and window.holding(a) is second
    assert window.holds(window.holding(d).buffer[10:]) and not window.holds(torch.zeros(3))
    window.close()


def test_a_write_that_failed_is_said_at_the_steps_end():
    reads, evicted = [], []
    window = _window(1.0, reads, evicted)
    window.fit(400_000, regions=2, advice=str)
    failed = Future()
    failed.set_exception(OSError(28, "No space left on device: /nvme/file"))
    window.slots[0].written = failed
    with pytest.raises(OSError, match="No space left on device"):
        window.say_failed_writes()
    done = Future()
    done.set_result(None)
    event = SimpleNamespace(waited=False)
    window.slots[1].written, window.slots[1].sent = done, event
    window.settle(window.slots[1])
    assert event.waited and window.slots[1].written is None
