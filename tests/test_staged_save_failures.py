"""A distributed save that fails leaves what the path held, and says why.

A full disk during an FSDP strategy's save (torch's distributed checkpoint) said
``CheckpointException ... unexpected pos 704 vs 598`` until 2026-11-27: the system's error
was inside torch's exception (each failed rank's error in ``failures``), or gone (torch's
file writer, given a path as Lightning gives it ``meta.pt``, keeps no system error), and
the partial staging directory stayed on the full disk.  Now every rank raises an
``OSError`` naming the checkpoint's path, rank 0 removes the staging directory, and the
previous checkpoint is whole.  (Seen on a 64 kB tmpfs with two gloo processes: both
raised ``[Errno 28] No space left on device: the checkpoint was not saved ...``, nothing
left on the disk; these tests give the same failures without one.)"""

import errno
import os
from collections import namedtuple
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from lightning_fastopt.checkpoint import atomic

_Usage = namedtuple("_Usage", "total used free")


class _Ranks:
    """What ``save_staged`` needs of the processes saving together; ``others_wrote``: what
    the other ranks' writes did."""

    is_global_zero = True
    global_rank = 0

    def __init__(self, world_size=1, others_wrote=True):
        self.world_size = world_size
        self.others_wrote = others_wrote

    def broadcast(self, obj, src=0):
        return obj

    def barrier(self, name=None):
        pass

    def reduce_boolean_decision(self, decision, all=True):
        return decision and self.others_wrote


def _previous_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / "meta.pt").write_text("previous")
    return target


def _failing(error):
    def write(staging):
        os.makedirs(staging)
        Path(staging, "__0_0.distcp").write_text("part")
        raise error
    return write


def _assert_left_as_it_was(tmp_path, target):
    assert (target / "meta.pt").read_text() == "previous"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # no staging directory left


def test_a_full_disk_inside_torchs_checkpoint_exception_is_said_naming_the_checkpoint(tmp_path):
    target = _previous_checkpoint(tmp_path)
    full = OSError(errno.ENOSPC, "No space left on device")
    failure = CheckpointException("CheckpointException ranks:dict_keys([1])", {1: (full, None)})
    with pytest.raises(OSError, match=r"No space left on device: the checkpoint was not saved") as raised:
        atomic.save_staged(target, _failing(failure), _Ranks())
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    _assert_left_as_it_was(tmp_path, target)


def test_torchs_writer_failing_on_a_full_disk_is_said_as_a_full_disk(tmp_path, monkeypatch):
    target = _previous_checkpoint(tmp_path)
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda path: _Usage(2**30, 2**30 - 4096, 4096))
    with pytest.raises(OSError, match=r"No space left on device: the checkpoint was not saved") as raised:
        atomic.save_staged(target, _failing(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected "
                                                         "pos 704 vs 598")), _Ranks())
    assert raised.value.errno == errno.ENOSPC
    _assert_left_as_it_was(tmp_path, target)
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda path: _Usage(2**30, 2**29, 2**29))  # room left: not that
    with pytest.raises(RuntimeError, match="unexpected pos"):
        atomic.save_staged(target, _failing(RuntimeError("unexpected pos 704 vs 598")), _Ranks())
    _assert_left_as_it_was(tmp_path, target)


def test_another_error_is_raised_as_it_is_and_another_ranks_failure_is_said(tmp_path):
    target = _previous_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="not a tensor"):
        atomic.save_staged(target, _failing(ValueError("not a tensor")), _Ranks())
    _assert_left_as_it_was(tmp_path, target)
    with pytest.raises(RuntimeError, match=r"saving the checkpoint .*last.ckpt failed on another process"):
        atomic.save_staged(target, lambda staging: os.makedirs(staging), _Ranks(world_size=2, others_wrote=False))
    _assert_left_as_it_was(tmp_path, target)


def test_a_zero_sharded_save_that_fails_leaves_the_previous_checkpoint_and_says_why(tmp_path, monkeypatch):
    """ZeRO's sharded save goes the same way: a shard that cannot be written, or the
    manifest written last, fails on every rank alike (it failed on one, and the others
    waited at a barrier until the process group's timeout), the staging directory goes."""
    import torch

    from lightning_fastopt.checkpoint import sharded

    target = _previous_checkpoint(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    checkpoint = {"state_dict": {"w": torch.ones(2)}, "optimizer_states": [{}]}
    for where in ("write_shard", "write_synced"):  # a shard; the manifest
        with monkeypatch.context() as patched:
            patched.setattr(sharded, where, full)
            with pytest.raises(OSError, match="No space left on device: the checkpoint was not saved") as raised:
                sharded.save_sharded(checkpoint, target, _Ranks(), zero_stage=1, partitions=[{}])
        assert raised.value.filename == str(target)
        _assert_left_as_it_was(tmp_path, target)
