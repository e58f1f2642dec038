"""Damaged checkpoints get one message naming the file and what is wrong: an empty,
truncated or foreign file, a torch file that holds no Lightning checkpoint, a sharded
directory without its manifest or with a malformed one, a damaged shard (resuming under
the strategy, and the consolidate command line)."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fastopt import FastOptStrategy
from lightning_fastopt.checkpoint import BrokenCheckpointError, read_manifest
from tests.helpers import run_script
from tests.test_precision import _data
from tests.test_strategy import Model

REPO = Path(__file__).resolve().parent.parent


def _good_checkpoint(tmp_path) -> Path:
    path = tmp_path / "good.ckpt"
    trainer = L.Trainer(strategy="fastopt", accelerator="cpu", devices=1, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(lambda ps: torch.optim.AdamW(ps), sched=False), _data())
    trainer.save_checkpoint(path)
    return path


def _damaged(tmp_path, kind) -> Path:
    path = tmp_path / f"{kind}.ckpt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        data = _good_checkpoint(tmp_path).read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "text":
        path.write_text("epoch=3 loss=0.1\n")
    else:  # a torch file, but no Lightning checkpoint
        torch.save(torch.randn(3), path)
    return path


_SAID = {
    "empty": r"the file is empty \(0 bytes\) \(EOFError",
    "truncated": r"the file \(\d+ bytes\) is cut short or damaged: an interrupted save or copy\?",
    "text": r"the file \(17 bytes\) is not a torch checkpoint",
    "a tensor": r"it holds a Tensor, not a Lightning checkpoint",
}


@pytest.mark.parametrize("kind", list(_SAID))
def test_resuming_from_a_damaged_file_names_it_and_what_is_wrong(tmp_path, kind):
    path = _damaged(tmp_path, kind)
    trainer = L.Trainer(strategy="fastopt", accelerator="cpu", devices=1, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(BrokenCheckpointError, match=rf"cannot read the checkpoint {path}: {_SAID[kind]}"):
        trainer.fit(Model(lambda ps: torch.optim.AdamW(ps), sched=False), _data(), ckpt_path=path)


def _sharded_dir(tmp_path) -> Path:
    """A sharded directory as the ZeRO strategies write it (one process, stage 1)."""
    path = tmp_path / "sharded.ckpt"
    trainer = L.Trainer(strategy=FastOptStrategy(zero_stage=1, offload_fraction=0.0), accelerator="cpu", devices=1,
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Model(lambda ps: torch.optim.AdamW(ps), sched=False), _data())
    trainer.save_checkpoint(path)
    assert (path / "manifest.json").is_file()
    return path


def test_a_sharded_directory_with_a_missing_or_malformed_manifest_is_named(tmp_path):
    path = _sharded_dir(tmp_path)
    assert read_manifest(path)["shards"]
    manifest = path / "manifest.json"
    good = manifest.read_text()
    manifest.write_text(good[: len(good) // 2])
    with pytest.raises(BrokenCheckpointError, match=rf"cannot read {manifest}: (Unterminated|Expecting)"):
        read_manifest(path)
    manifest.write_text(json.dumps({**json.loads(good), "shards": "optimizer_shard_00000.pt"}))
    with pytest.raises(BrokenCheckpointError, match=rf"{manifest} is malformed: it needs 'main' \(a file name\) and "
                                                    r"'shards' \(a list of file names\)"):
        read_manifest(path)
    manifest.write_text(good)
    shard = path / json.loads(good)["shards"][0]
    shard.write_bytes(shard.read_bytes()[:100])
    out = run_script("-m", "lightning_fastopt.checkpoint", "consolidate", path, tmp_path / "one.ckpt", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: cannot read the optimizer shard {shard}: the file (100 bytes) is cut short" in out.stderr
    manifest.unlink()
    trainer = L.Trainer(strategy=FastOptStrategy(zero_stage=1, offload_fraction=0.0), accelerator="cpu", devices=1,
                        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.raises(BrokenCheckpointError, match=rf"{path} is a directory without manifest.json: not a "
                                                    r"lightning_fastopt sharded checkpoint"):
        trainer.fit(Model(lambda ps: torch.optim.AdamW(ps), sched=False), _data(), ckpt_path=path)


def test_consolidate_says_what_it_takes_when_given_something_else(tmp_path, capsys):
    from lightning_fastopt.checkpoint.__main__ import main

    one = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, one)
    folder = tmp_path / "logs"
    folder.mkdir()
    for path, said in ((one, "is one file already: torch.load reads it"),
                       (folder, "is neither a sharded lightning_fastopt checkpoint (no manifest.json) nor a "
                                "distributed one written through Lightning (no .metadata and meta.pt)")):
        with pytest.raises(SystemExit):
            main(["consolidate", str(path), str(tmp_path / "out.ckpt")])
        assert said in capsys.readouterr().err
    assert not (tmp_path / "out.ckpt").exists()
