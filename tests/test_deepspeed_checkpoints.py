"""DeepSpeed's checkpoint directories read (issue 69, its third part), checked against
DeepSpeed itself: its engine trains a small model at ZeRO stages 1, 2 and 3 (one process at
stage 2, two at each), and saves (tests/scripts/deepspeed_save.py); every float32 master weight and Adam
moment read here is ``torch.equal`` to the value DeepSpeed held when it saved, read through
DeepSpeed's own API.  Bad directories are errors naming the file."""

from __future__ import annotations

import shutil

import pytest
import torch

from lightning_fastopt.checkpoint.deepspeed_reader import is_deepspeed_checkpoint, read_deepspeed_checkpoint
from lightning_fastopt.checkpoint.errors import BrokenCheckpointError
from tests.helpers import free_port, run_script

pytest.importorskip("deepspeed")

_SAVED: dict = {}


def _saved(tmp_path_factory, stage: int, ranks: int):
    """DeepSpeed's checkpoint of the run (made once per stage and world size)."""
    if (stage, ranks) not in _SAVED:
        out = tmp_path_factory.mktemp(f"deepspeed_s{stage}_w{ranks}")
        if ranks == 1:
            run_script("tests/scripts/deepspeed_save.py", stage, out, free_port(), timeout=900)
        else:
            run_script("tests/scripts/deepspeed_save.py", stage, out, timeout=900, ranks=ranks)
        _SAVED[(stage, ranks)] = out
    return _SAVED[(stage, ranks)]


def _check_against_deepspeed(out) -> None:
    expected = torch.load(out / "expected.pt", weights_only=True)
    read = read_deepspeed_checkpoint(out)
    assert (read.stage, read.world_size, read.tag) == (expected["stage"], expected["world_size"], "step3")
    assert set(read.masters) == set(expected["masters"])
    for name, master in expected["masters"].items():
        assert read.masters[name].dtype == torch.float32 and torch.equal(read.masters[name], master), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(read.state[name][k], expected["state"][name][k]), (name, k)
    assert int(read.step) == 3 and read.global_steps == 3
    assert [g["names"] for g in read.groups] == [list(expected["masters"])]
    assert read.groups[0]["lr"] == 0.01 and read.groups[0]["weight_decay"] == 0.01
    for name, buffer in expected["buffers"].items():
        assert torch.equal(read.module[name], buffer), name


def test_a_stage_2_checkpoint_of_one_process(tmp_path_factory):
    _check_against_deepspeed(_saved(tmp_path_factory, 2, 1))


@pytest.mark.slow
@pytest.mark.parametrize("stage,ranks", [(1, 2), (2, 2), (3, 2)])
def test_every_stage_at_two_processes(tmp_path_factory, stage, ranks):
    """Two ranks: each parameter's pieces on both, the partitions padded (odd sizes); stage
    1 and 2 write the same layout, stage 3 another (and one process of stage 3 is Lightning's
    run below)."""
    _check_against_deepspeed(_saved(tmp_path_factory, stage, ranks))


def test_bad_directories_are_errors_naming_the_file(tmp_path_factory, tmp_path):
    out = _saved(tmp_path_factory, 2, 1)
    assert is_deepspeed_checkpoint(out) and is_deepspeed_checkpoint(out / "step3")
    assert not is_deepspeed_checkpoint(tmp_path) and not is_deepspeed_checkpoint(out / "expected.pt")
    assert read_deepspeed_checkpoint(out / "step3").tag == "step3"  # a tag's directory as it is
    with pytest.raises(FileNotFoundError, match="has no tag 'step9'"):
        read_deepspeed_checkpoint(out, tag="step9")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "latest").write_text("gone")
    with pytest.raises(BrokenCheckpointError, match="names the tag 'gone', which has no directory"):
        read_deepspeed_checkpoint(copy)
    (copy / "latest").unlink()
    with pytest.raises(BrokenCheckpointError, match="has no 'latest' file naming its tag"):
        read_deepspeed_checkpoint(copy)
    optim = copy / "step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:1000])
    with pytest.raises(BrokenCheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        read_deepspeed_checkpoint(copy, tag="step3")
    shutil.copy(out / "step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                copy / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    shutil.copy(out / "step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", optim)
    with pytest.raises(BrokenCheckpointError, match=r"has 2 optimizer file\(s\) but its metadata .* partitioned "
                                                    r"\[1\] ways"):
        read_deepspeed_checkpoint(copy, tag="step3")
    (copy / "step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(BrokenCheckpointError, match=r"lacks the optimizer files of rank\(s\) \[0\]"):
        read_deepspeed_checkpoint(copy, tag="step3")


# ---------------------------------------------------------------------------- resumed under our strategies
import lightning as L  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_fastopt import FastOptStrategy  # noqa: E402


class Net(L.LightningModule):
    """DeepSpeed's script's model held as an attribute: its names under ``net.``."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 15), nn.BatchNorm1d(15), nn.Tanh(), nn.Linear(15, 3))
        self.started = None

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def on_train_start(self):  # what the run starts from
        self.started = {n: p.detach().clone() for n, p in self.named_parameters()}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)


def _data():
    return DataLoader(TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(5))), batch_size=4)


def _fit(strategy, ckpt_path):
    model = Net()
    L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(model, _data(), ckpt_path=str(ckpt_path))
    return model


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_deepspeed_directory_resumes_under_our_strategy_and_its_consolidated_file_under_trainer(
        tmp_path_factory, tmp_path, fraction):
    """``fit(ckpt_path=DIR)`` starts from DeepSpeed's masters and Adam state (its names found
    under the module's attribute), trains on, and ends bit for bit where plain ``Trainer()``
    ends resumed from ``consolidate DIR OUT``'s file (read with weights_only=True)."""
    out = _saved(tmp_path_factory, 2, 1)
    expected = torch.load(out / "expected.pt", weights_only=True)
    ours = _fit(FastOptStrategy(offload_fraction=fraction, copy_on_cpu=True, bucket_size_mb=0.0002), out)
    for name, master in expected["masters"].items():
        assert torch.equal(ours.started[f"net.{name}"], master), name
    run_script("-m", "lightning_fastopt.checkpoint", "consolidate", out, tmp_path / "one.ckpt", "--prefix", "net.")
    one = torch.load(tmp_path / "one.ckpt", weights_only=True)
    assert torch.equal(one["optimizer_states"][0]["state"]["net.0.weight"]["exp_avg"],
                       expected["state"]["0.weight"]["exp_avg"])
    plain = _fit("auto", tmp_path / "one.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), plain.parameters()))
    assert not torch.equal(ours.net[0].weight, expected["masters"]["0.weight"])  # it trained on


def test_a_directory_of_another_model_is_refused_before_anything_is_loaded(tmp_path_factory):
    from lightning_fastopt.checkpoint.named_state import CheckpointMismatchError

    out = _saved(tmp_path_factory, 2, 1)

    class Other(Net):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 3))

    model = Other()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = L.Trainer(strategy=FastOptStrategy(copy_on_cpu=True), accelerator="cpu", devices=1, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(CheckpointMismatchError, match=r"the DeepSpeed checkpoint .*step3 holds the parameters of "
                                                      r"another model"):
        trainer.fit(model, _data(), ckpt_path=str(out))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# ---------------------------------------------------------------------------- Lightning's DeepSpeedStrategy's
_LIGHTNINGS: dict = {}


def _lightnings(tmp_path_factory, stage: int, devices: int):
    """The directory Lightning's DeepSpeedStrategy saved after 4 steps (made once)."""
    if (stage, devices) not in _LIGHTNINGS:
        out = tmp_path_factory.mktemp(f"lightning_deepspeed_s{stage}_d{devices}") / "saved"
        run_script("tests/scripts/lightning_deepspeed_save.py", stage, devices, 4, out, timeout=900)
        _LIGHTNINGS[(stage, devices)] = out
    return _LIGHTNINGS[(stage, devices)]


@pytest.mark.slow
@pytest.mark.parametrize("stage,devices", [(2, 1), (3, 2)])
def test_lightnings_deepspeed_directory_resumes_with_its_loops(tmp_path_factory, tmp_path, stage, devices):
    """A directory Lightning's DeepSpeedStrategy wrote (its loops inside DeepSpeed's model
    states) resumes under our strategy from DeepSpeed's masters at its global step, and ends
    where plain Trainer() ends resumed from the consolidated file."""
    out = _lightnings(tmp_path_factory, stage, devices)
    expected = torch.load(out / "expected.pt", weights_only=True)
    read = read_deepspeed_checkpoint(out)
    assert (read.stage, read.world_size, read.client["global_step"]) == (stage, devices, 4)
    for name, master in expected["masters"].items():
        assert torch.equal(read.masters[name], master), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(read.state[name][k], expected["state"][name][k]), (name, k)

    def fit(strategy, ckpt_path):
        model = Net()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=8, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, _data(), ckpt_path=str(ckpt_path))
        return model, trainer

    ours, trainer = fit(FastOptStrategy(offload_fraction=0.5, copy_on_cpu=True, bucket_size_mb=0.0002), out)
    assert all(torch.equal(ours.started[n], m) for n, m in expected["masters"].items())
    assert trainer.global_step == 8  # 4 restored, 4 more
    run_script("-m", "lightning_fastopt.checkpoint", "consolidate", out, tmp_path / "one.ckpt")
    plain, plain_trainer = fit("auto", tmp_path / "one.ckpt")
    assert plain_trainer.global_step == 8
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), plain.parameters()))


def test_strategies_that_do_not_resume_a_directory_yet_say_how(tmp_path_factory):
    from lightning_fastopt import FastOptFabricStrategy, FastOptFSDPStrategy

    out = _saved(tmp_path_factory, 2, 1)
    with pytest.raises(ValueError, match=r"is a checkpoint directory DeepSpeed wrote: FastOptFSDPStrategy does not "
                                         r"resume one yet. `python -m lightning_fastopt.checkpoint consolidate"):
        FastOptFSDPStrategy().load_checkpoint(out)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FastOptFabricStrategy())
    with pytest.raises(ValueError, match="FastOptFabricStrategy does not resume one yet"):
        fabric.load(out, {})
