"""Checksums of every tensor our strategies save, checked at load (issue 67): a checkpoint
with 16 bytes flipped inside a weight or a moment (a single file, a ZeRO shard, an FSDP
distributed checkpoint's shard) is refused before anything is loaded, with an error naming
the tensor and the file, where plain Lightning loads it and trains on; consolidate says the
same; ``LIGHTNING_FASTOPT_CHECKSUMS=0`` turns the checking off; a load gives back what was
saved (the checksums are a record of the file that torch does not read)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_fastopt import FastOptStrategy
from lightning_fastopt.checkpoint import BrokenCheckpointError
from lightning_fastopt.checkpoint.__main__ import main as checkpoint_command
from lightning_fastopt.checkpoint.checksums import SWITCH, ChecksumMismatchError, digests, saved_checksums
from tests.test_precision import _data
from tests.test_strategy import Model

pytestmark = pytest.mark.usefixtures("no_process_group_left")  # (FSDP runs in this process)


def _trainer(strategy, steps):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _model():
    return Model(lambda ps: torch.optim.AdamW(ps), sched=False)


def _saved(path, strategy):
    trainer = _trainer(strategy, 2)
    model = _model()
    trainer.fit(model, _data())
    trainer.save_checkpoint(path)
    return model


def _flip(file, tensor: torch.Tensor) -> None:
    """16 bytes flipped inside ``tensor``'s bytes where ``file`` holds them."""
    data = bytearray(file.read_bytes())
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    at = data.find(raw[:32])
    assert at >= 0 and data.find(raw[:32], at + 1) < 0, "the tensor's bytes, once in the file"
    for i in range(at + 8, at + 24):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def test_a_single_file_with_flipped_bytes_in_a_weight_is_refused_naming_it(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    model = _saved(path, FastOptStrategy())
    assert set(saved_checksums(path)) >= {"state_dict/net.0.weight", "optimizer_states/0/state/net.0.weight/exp_avg"}
    assert "fastopt_checksums" not in str(list(torch.load(path, weights_only=True)))  # torch reads its own records
    _flip(path, model.net[0].weight)
    with pytest.raises(ChecksumMismatchError, match=rf"the checkpoint {path} is damaged: the tensor "
                                                    r"state_dict/net\.0\.weight \(\(16, 8\), float32\) does not hold "
                                                    r"the bytes it was saved with"):
        _trainer(FastOptStrategy(), 4).fit(_model(), _data(), ckpt_path=path)
    assert issubclass(ChecksumMismatchError, BrokenCheckpointError)
    plain = _trainer("auto", 4)  # plain Lightning has no checksum: it loads the damaged weight and trains on
    plain.fit(_model(), _data(), ckpt_path=path)
    assert plain.global_step == 4
    monkeypatch.setenv(SWITCH, "0")  # the switch: loaded unchecked
    ours = _trainer(FastOptStrategy(), 4)
    ours.fit(_model(), _data(), ckpt_path=path)
    assert ours.global_step == 4


def test_a_zero_shard_with_flipped_bytes_in_a_moment_is_refused_naming_it(tmp_path, capsys):
    path = tmp_path / "zero.ckpt"
    _saved(path, FastOptStrategy(zero_stage=2))
    shard = path / "optimizer_shard_00000.pt"
    moment = torch.load(shard, weights_only=True)[0]["state"]["net.2.weight"]["exp_avg_sq"]
    _flip(shard, moment)
    said = rf"the optimizer shard {shard} is damaged: the tensor 0/state/net\.2\.weight/exp_avg_sq"
    with pytest.raises(ChecksumMismatchError, match=said):
        _trainer(FastOptStrategy(zero_stage=2), 4).fit(_model(), _data(), ckpt_path=path)
    with pytest.raises(SystemExit):
        checkpoint_command(["consolidate", str(path), str(tmp_path / "one.ckpt")])
    assert "exp_avg_sq" in capsys.readouterr().err and not (tmp_path / "one.ckpt").exists()


def test_an_fsdp_distributed_checkpoint_with_flipped_bytes_is_refused_before_anything_is_loaded(tmp_path, capsys):
    from lightning_fastopt import FastOptFSDPStrategy

    path = tmp_path / "fsdp.ckpt"
    model = _saved(path, FastOptFSDPStrategy())
    assert (path / "fastopt_checksums.json").is_file()
    weight = model.net[0].weight.full_tensor() if hasattr(model.net[0].weight, "full_tensor") else model.net[0].weight
    _flip(path / "__0_0.distcp", weight)
    fresh = _model()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ChecksumMismatchError, match=r"__0_0\.distcp is damaged: the tensor state_dict\.net\.0\.weight"):
        _trainer(FastOptFSDPStrategy(), 4).fit(fresh, _data(), ckpt_path=path)
    after = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in fresh.state_dict().items()}
    assert all(torch.equal(after[k], before[k]) for k in before)  # nothing of the checkpoint loaded
    with pytest.raises(SystemExit):
        checkpoint_command(["consolidate", str(path), str(tmp_path / "one.ckpt")])
    assert "state_dict.net.0.weight" in capsys.readouterr().err


def test_fabric_loads_give_back_what_was_saved_and_refuse_a_damaged_file(tmp_path):
    fabric = L.Fabric(strategy="fastopt", accelerator="cpu", devices=1)
    model = torch.nn.Linear(4, 3)
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "step": 3})
    assert fabric.load(path).keys() == {"model", "step"}
    _flip(path, model.weight)
    with pytest.raises(ChecksumMismatchError, match=r"the tensor model/weight"):
        fabric.load(path, {"model": model})


def test_the_checksums_name_every_tensor_by_its_path():
    state = {"a": torch.ones(2), "b": [torch.zeros(1), {"c": torch.arange(3)}], "n": 3}
    assert set(digests(state)) == {"a", "b/0", "b/1/c"}
    assert digests({"x": torch.ones(2)}) == digests({"x": torch.ones(2)}) != digests({"x": torch.zeros(2)})
    assert digests({"x": torch.ones(2, dtype=torch.bfloat16)}) != digests({"x": torch.ones(2)})
    many = {f"t{i}": torch.randn(1000 + i) for i in range(40)}
    assert list(digests(many, threads=2).items()) == list(digests(many).items())  # one run, one result


def test_what_is_not_torchs_zip_archive_gets_no_checksums_and_loads_unchecked(tmp_path, monkeypatch):
    """A ``torch.save`` stood in for (Lightning's own tests do it) writes nothing: the save
    goes through without a record; a file in torch's legacy format loads unchecked."""
    from lightning_fastopt.checkpoint.atomic import save_atomically
    from lightning_fastopt.checkpoint.reading import read_checkpoint_file

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", lambda obj, f, **kw: None)
        save_atomically({"a": torch.ones(2)}, tmp_path / "nothing.ckpt")
    assert (tmp_path / "nothing.ckpt").read_bytes() == b""
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, legacy, _use_new_zipfile_serialization=False)
    assert saved_checksums(legacy) is None
    assert torch.equal(read_checkpoint_file(legacy, lambda p: torch.load(p, weights_only=True))["state_dict"]["w"],
                       torch.ones(2))
