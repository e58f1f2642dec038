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


def _saved(tmp_path_factory, stage: int, ranks: int, *flags: str):
    """DeepSpeed's checkpoint of the run (made once per stage, world size and flags)."""
    if (stage, ranks, flags) not in _SAVED:
        out = tmp_path_factory.mktemp(f"deepspeed_s{stage}_w{ranks}")
        if ranks == 1:
            run_script("tests/scripts/deepspeed_save.py", stage, out, free_port(), *flags, timeout=900)
        else:
            run_script("tests/scripts/deepspeed_save.py", stage, out, *flags, timeout=900, ranks=ranks)
        _SAVED[(stage, ranks, flags)] = out
    return _SAVED[(stage, ranks, flags)]


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
    for name, weight in expected.get("frozen", {}).items():  # frozen: no master, the module's own
        assert name not in read.masters and torch.equal(read.module[name], weight), name


def test_a_stage_2_checkpoint_of_one_process(tmp_path_factory):
    _check_against_deepspeed(_saved(tmp_path_factory, 2, 1))


@pytest.mark.slow
@pytest.mark.parametrize("stage,ranks", [(1, 2), (2, 2), (3, 2)])
def test_every_stage_at_two_processes(tmp_path_factory, stage, ranks):
    """Two ranks: each parameter's pieces on both, the partitions padded (odd sizes); stage
    1 and 2 write the same layout, stage 3 another (and one process of stage 3 is Lightning's
    run below)."""
    _check_against_deepspeed(_saved(tmp_path_factory, stage, ranks))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_training_keeps_float32_masters_and_they_are_read(tmp_path_factory, stage):
    """DeepSpeed's bf16 training (bfloat16 weights, its optimizer files named bf16_...): the
    float32 masters and moments are read, not the rounded weights."""
    out = _saved(tmp_path_factory, stage, 2, "--bf16")
    _check_against_deepspeed(out)
    read = read_deepspeed_checkpoint(out)
    assert all(m.dtype == torch.float32 for m in read.masters.values())


@pytest.mark.slow
@pytest.mark.parametrize("stage,ranks", [(2, 1), (3, 2)])
def test_frozen_parameters_are_read_from_the_module(tmp_path_factory, stage, ranks):
    """A frozen weight has no master: stages 1 and 2 keep it whole in the module's state,
    stage 3 in pieces on every rank."""
    _check_against_deepspeed(_saved(tmp_path_factory, stage, ranks, "--frozen"))


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

    def forward(self, x):
        return self.net(x)

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


@pytest.mark.usefixtures("no_process_group_left")  # (FSDP runs in this process)
def test_fsdp_resumes_a_deepspeed_directory_as_it_resumes_the_consolidated_file(tmp_path_factory, tmp_path):
    """Under ``FastOptFSDPStrategy`` the directory is read whole and loaded into the shards as
    a full checkpoint: the run starts from DeepSpeed's masters and ends bit for bit where the
    same strategy ends resumed from ``consolidate``'s file."""
    from lightning_fastopt import FastOptFSDPStrategy

    out = _saved(tmp_path_factory, 2, 1)
    expected = torch.load(out / "expected.pt", weights_only=True)

    def fit(ckpt_path):
        return _fit(FastOptFSDPStrategy(offload_fraction=0.5, copy_on_cpu=True, auto_wrap_policy={nn.Linear}),
                    ckpt_path)

    ours = fit(out)
    for name, master in expected["masters"].items():
        assert torch.equal(ours.started[f"net.{name}"].full_tensor(), master), name
    run_script("-m", "lightning_fastopt.checkpoint", "consolidate", out, tmp_path / "one.ckpt", "--prefix", "net.")
    from_file = fit(tmp_path / "one.ckpt")
    assert all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(ours.parameters(), from_file.parameters()))


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
@pytest.mark.usefixtures("no_process_group_left")
def test_fabric_loads_a_deepspeed_directory_into_its_model_and_optimizer(tmp_path_factory, tmp_path, fsdp):
    """``fabric.load(DIR, {"model": ..., "optimizer": ...})``: the model starts from DeepSpeed's
    masters, the optimizer from its state (under FastOptFabricStrategy and the FSDP one), and
    four more steps end bit for bit where torch's AdamW ends from the consolidated file's
    state; a key the directory lacks is an error unless strict=False."""
    from lightning_fastopt import FastOptFabricFSDPStrategy, FastOptFabricStrategy

    out = _saved(tmp_path_factory, 2, 1)
    expected = torch.load(out / "expected.pt", weights_only=True)

    def steps(model, optimizer, fabric=None):
        data = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
        for x in data.split(4):
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            fabric.backward(loss) if fabric else loss.backward()
            optimizer.step()

    strategy = (FastOptFabricFSDPStrategy(offload_fraction=0.5, copy_on_cpu=True, keep_gradients=True,
                                          auto_wrap_policy={nn.Linear}) if fsdp
                else FastOptFabricStrategy(offload_fraction=0.5, copy_on_cpu=True, bucket_size_mb=0.0002))
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(Net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01))
    with pytest.raises(KeyError, match="fabric.load asked for 'epoch', which the DeepSpeed checkpoint"):
        fabric.load(out, {"model": model, "optimizer": optimizer, "epoch": 0})
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    fabric.load(out, state, strict=False)
    full = (lambda t: t.full_tensor()) if fsdp else (lambda t: t)
    for name, master in expected["masters"].items():
        assert torch.equal(full(dict(model.module.named_parameters())[f"net.{name}"]).detach(), master), name
    steps(model, optimizer, fabric)

    run_script("-m", "lightning_fastopt.checkpoint", "consolidate", out, tmp_path / "one.ckpt", "--prefix", "net.")
    one = torch.load(tmp_path / "one.ckpt", weights_only=True)
    torchs = Net()
    torchs.load_state_dict(one["state_dict"])
    adamw = torch.optim.AdamW(torchs.parameters(), lr=0.01, weight_decay=0.01)
    adamw.load_state_dict(one["optimizer_states"][0])
    steps(torchs, adamw)
    assert all(torch.equal(full(a).detach(), b.detach()) for a, b in zip(model.parameters(), torchs.parameters()))


@pytest.mark.slow
def test_two_processes_resume_a_directory_two_processes_wrote_under_zero(tmp_path_factory, tmp_path):
    """At two processes, ZeRO stage 2 with half offloaded resumes the directory DeepSpeed's
    two ranks wrote (re-sharded by name for this run), and ends bit for bit where
    Lightning's own DDP ends resumed from the consolidated file."""
    out = _saved(tmp_path_factory, 2, 2)
    expected = torch.load(out / "expected.pt", weights_only=True)
    run_script("tests/scripts/deepspeed_resume.py", "zero2", out, tmp_path / "ours.pt", timeout=900)
    run_script("-m", "lightning_fastopt.checkpoint", "consolidate", out, tmp_path / "one.ckpt", "--prefix", "net.")
    run_script("tests/scripts/deepspeed_resume.py", "ddp", tmp_path / "one.ckpt", tmp_path / "ddp.pt", timeout=900)
    ours, ddp = (torch.load(tmp_path / f, weights_only=True) for f in ("ours.pt", "ddp.pt"))
    assert all(torch.equal(ours["started"][f"net.{n}"], m) for n, m in expected["masters"].items())
    assert all(torch.equal(ours["ended"][n], ddp["ended"][n]) for n in ddp["ended"])


def test_deepspeeds_own_schedule_goes_on_where_it_stopped(tmp_path):
    """The engine's WarmupDecayLR (its config's scheduler section) saved after 3 steps: resumed
    under our strategy with the same config, each later step's rate is the one DeepSpeed's
    scheduler gives from its fourth step on."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    out = tmp_path / "scheduled"
    run_script("tests/scripts/deepspeed_save.py", 2, out, free_port(), "--scheduler", timeout=900)
    schedule = {"total_num_steps": 10, "warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                "warmup_type": "linear"}
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01)
    theirs, rates = WarmupDecayLR(optimizer, **schedule), []
    for _ in range(10):
        rates.append(optimizer.param_groups[0]["lr"])
        theirs.step()

    class Records(Net):
        def on_train_batch_start(self, *args):
            self.seen = [*getattr(self, "seen", []), self.trainer.optimizers[0].param_groups[0]["lr"]]

    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
              "scheduler": {"type": "WarmupDecayLR", "params": schedule},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    model = Records()
    L.Trainer(strategy=FastOptStrategy(config=config, copy_on_cpu=True), accelerator="cpu", devices=1, max_steps=5,
              logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(model, _data(), ckpt_path=str(out))
    assert model.seen == rates[3:8]


def test_deepspeeds_fp16_loss_scale_carries_over(tmp_path_factory, tmp_path, monkeypatch):
    """A run DeepSpeed scaled dynamically (its own DynamicLossScaler, put through overflows,
    in the checkpoint's optimizer file as DeepSpeed writes it) resumes under our fp16 plugin
    with that scale and the hysteresis it has left; a run without loss scaling says none is
    carried."""
    from deepspeed.runtime.fp16 import loss_scaler as deepspeeds
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from lightning_fastopt import FastOptPrecision

    monkeypatch.setattr(deepspeeds.dist, "get_rank", lambda *a, **k: 0)  # its overflow message, without a group
    from lightning_fastopt.checkpoint.deepspeed_to_lightning import our_loss_scale

    scaler = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=4, min_scale=1.0, delayed_shift=2,
                               consecutive_hysteresis=False)
    for overflow in (False, True, True, False, True, False, False):  # 2**16 -> 2**15 -> (hysteresis 0 left) 2**14
        scaler.update_scale(overflow)
    copy = tmp_path / "fp16"
    shutil.copytree(_saved(tmp_path_factory, 2, 1), copy)
    optim = copy / "step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    saved = torch.load(optim, weights_only=False)
    saved["optimizer_state_dict"].update(loss_scaler=scaler, dynamic_loss_scale=True)
    torch.save(saved, optim)
    read = read_deepspeed_checkpoint(copy)
    expected = {"scale": scaler.cur_scale, "hysteresis_left": scaler.cur_hysteresis, "clean_steps": 2,
                "skipped_steps": 0}
    assert our_loss_scale(read) == expected and scaler.cur_scale == 2.0 ** 14

    class Scales(Net):
        def on_train_start(self):
            super().on_train_start()
            self.scale = self.trainer.precision_plugin.scaler.state_dict()

    model = Scales()
    L.Trainer(strategy=FastOptStrategy(copy_on_cpu=True), plugins=[FastOptPrecision("16-mixed")], accelerator="cpu",
              devices=1, max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(model, _data(), ckpt_path=str(copy))
    assert model.scale == expected
