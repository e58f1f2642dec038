"""A checkpoint saved into a directory that holds other files keeps them.

Our checkpoint directories (torch's distributed checkpoint under the FSDP strategies, the
ZeRO sharded one) are written into a staging directory and moved over the target whole
(``lightning_fastopt.checkpoint.atomic``).  The move replaced the whole directory until
2026-11-27: a user's file beside the checkpoint was deleted, where Lightning, which writes
into the directory, keeps it (its ``test_save_checkpoint_path_exists`` failed with our
strategy swapped in).  Now the files that are not the checkpoint's stay, before, during
and after the move, and the files of the checkpoint replaced (a shard of a save at
another world size included) go."""

import os
from pathlib import Path
from unittest import mock

import pytest
import torch

from lightning_fastopt.checkpoint import atomic, sharded


class _OneRank:
    """What ``save_staged`` needs of the processes saving together, for one process."""

    is_global_zero = True
    global_rank = 0
    world_size = 1

    @staticmethod
    def broadcast(obj, src=0):
        return obj

    @staticmethod
    def barrier(name=None):
        pass


def _user_files(directory):
    (directory / "notes.txt").write_text("mine")
    (directory / "plots").mkdir()
    (directory / "plots" / "loss.png").write_bytes(b"\x89PNG")
    os.symlink("notes.txt", directory / "latest")
    return {"notes.txt": os.stat(directory / "notes.txt").st_ino}


def _assert_user_files_kept(directory, inodes):
    assert (directory / "notes.txt").read_text() == "mine"
    assert os.stat(directory / "notes.txt").st_ino == inodes["notes.txt"]  # the same file, not a copy
    assert (directory / "plots" / "loss.png").read_bytes() == b"\x89PNG"
    assert os.readlink(directory / "latest") == "notes.txt"


def _write_distributed(names):
    def write(staging):
        os.makedirs(staging, exist_ok=True)
        for name in names:
            Path(staging, name).write_text("new")
    return write


@pytest.mark.parametrize("existing", ["a directory of the user's", "a checkpoint with the user's files beside it"])
def test_a_distributed_checkpoint_keeps_the_other_files_of_its_directory(tmp_path, existing):
    target = tmp_path / "ckpt"
    target.mkdir()
    inodes = _user_files(target)
    if existing != "a directory of the user's":  # a save of two ranks before: its second shard is superseded
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"):
            (target / name).write_text("old")
    atomic.save_staged(target, _write_distributed([".metadata", "__0_0.distcp", "meta.pt"]), _OneRank(),
                       atomic.DISTRIBUTED_CHECKPOINT_FILES)
    _assert_user_files_kept(target, inodes)
    assert sorted(os.listdir(target)) == [".metadata", "__0_0.distcp", "latest", "meta.pt", "notes.txt", "plots"]
    assert {(target / n).read_text() for n in (".metadata", "__0_0.distcp", "meta.pt")} == {"new"}
    assert [e for e in os.listdir(tmp_path) if e != "ckpt"] == []  # no staging or old directory left


def test_a_save_killed_before_the_move_leaves_the_users_files_in_place(tmp_path):
    """Linked into the staging directory, not moved: a save killed before the move leaves
    them where they were (the next save removes the staging directory: its links only)."""
    target = tmp_path / "ckpt"
    target.mkdir()
    inodes = _user_files(target)
    (target / "meta.pt").write_text("old")

    def write_then_die(staging):
        _write_distributed(["meta.pt"])(staging)
        raise KeyboardInterrupt  # the process ends here

    with mock.patch.object(atomic, "replace_path", wraps=atomic.replace_path) as move, \
            pytest.raises(KeyboardInterrupt):
        atomic.save_staged(target, write_then_die, _OneRank(), atomic.DISTRIBUTED_CHECKPOINT_FILES)
    assert not move.called
    _assert_user_files_kept(target, inodes)
    assert (target / "meta.pt").read_text() == "old"


def test_the_fsdp_strategies_save_into_a_directory_as_lightning_does(tmp_path):
    """Lightning's ``test_save_checkpoint_path_exists`` (distributed checkpoints), under our
    Trainer and Fabric strategies: the file already in the directory stays; a file at the
    path is replaced by the checkpoint's directory.  (torch's writer mocked, as there; for
    Fabric, its whole save, which needs a sharded model: it writes ``meta.pt``.)"""
    from lightning_fastopt import FastOptFabricFSDPStrategy, FastOptFSDPStrategy

    def fabric_save(path, state, full_state_dict, rank, filter=None):
        path.mkdir(parents=True, exist_ok=True)
        torch.save({}, path / "meta.pt")

    for i, strategy in enumerate((FastOptFSDPStrategy(), FastOptFabricFSDPStrategy())):
        folder, file = tmp_path / f"not-empty-{i}", tmp_path / f"file-{i}.pt"
        folder.mkdir()
        (folder / "file").touch()
        file.touch()
        for path in (folder, file):
            with mock.patch("torch.distributed.checkpoint.save"), \
                    mock.patch("lightning.fabric.strategies.model_parallel._save_checkpoint", fabric_save), \
                    mock.patch.object(strategy, "broadcast", lambda obj, src=0: obj):
                if isinstance(strategy, FastOptFSDPStrategy):
                    strategy.save_checkpoint({"state_dict": {}, "optimizer_states": []}, filepath=path)
                else:
                    strategy.save_checkpoint(path, {})
        assert (folder / "file").exists() and (folder / "meta.pt").is_file()
        assert file.is_dir() and (file / "meta.pt").is_file()


def test_a_zero_sharded_checkpoint_keeps_the_other_files_of_its_directory(tmp_path):
    target = tmp_path / "zero"
    target.mkdir()
    inodes = _user_files(target)
    for name in ("checkpoint.pt", "optimizer_shard_00000.pt", "optimizer_shard_00001.pt", "manifest.json"):
        (target / name).write_text("old")  # a save of two ranks before
    sharded.save_sharded({"state_dict": {"w": torch.ones(2)}, "optimizer_states": [{}]}, target, _OneRank(),
                         zero_stage=1, partitions=[{}])
    _assert_user_files_kept(target, inodes)
    assert sorted(os.listdir(target)) == ["checkpoint.pt", "latest", "manifest.json", "notes.txt",
                                          "optimizer_shard_00000.pt", "plots"]
    assert sharded.is_sharded(target)
