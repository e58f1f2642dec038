"""Lightning Fabric with the fastopt strategies (lightning_fastopt.fabric), against Fabric's
own strategies with torch.optim.AdamW, element by element (Adam's float32 tolerances,
rtol 1.3e-6 / atol 1e-5) over 8 steps of a loop with two parameter groups, a scheduler,
accumulation with ``no_backward_sync`` and clipping by norm or by value:

- one process, at fractions 0, 0.5 and 1 through the accelerator code path on the CPU,
  gradients kept or copied during backward, and the ZeRO names;
- two gloo processes (Fabric's launcher): half offloaded with gradients copied during
  backward (copied at the step, after DDP's reduction), and ZeRO stage 2 freeing other
  ranks' gradients, against Fabric's ``ddp``;
- fp16 with an injected inf skips the step; ``fabric.save`` / ``fabric.load`` continue
  exactly, with the loss scaler;
- the names are in Fabric's registry; what Fabric cannot do yet is refused by name;
- optimizer state moves between Trainer and Fabric checkpoints;
- examples/fabric_gpt.py trains.
"""

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_fastopt  # noqa: F401  (registers the names)
from lightning_fastopt import FastOptFabricPrecision, FastOptFabricStrategy
from lightning_fastopt.offload import OffloadOptimizer
from tests.fabric_loop import train
from tests.helpers import subprocess_env

REPO = Path(__file__).resolve().parent.parent
ADAM_TOL = dict(rtol=1.3e-6, atol=1e-5)


def _fabric(strategy, **kw):
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, **kw)
    fabric.launch()
    return fabric


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip", [("norm", 0.5), ("value", 0.05)], ids=["norm", "value"])
@pytest.mark.parametrize("fraction,keep", [(0.0, True), (0.5, True), (1.0, True), (0.5, False), (1.0, False)])
def test_one_process_equals_fabric_with_torch_adamw(fraction, keep, clip):
    reference = _weights(train(_fabric("auto"), clip=clip))
    strategy = FastOptFabricStrategy(offload_fraction=fraction, keep_gradients=keep, copy_on_cpu=True,
                                     bucket_size_mb=0.0002)
    fabric = _fabric(strategy)
    ours = train(fabric, clip=clip)
    opt = strategy._wrappers[0]
    assert isinstance(opt, OffloadOptimizer) and opt.offload_fraction == fraction
    assert opt.device_grads == ("keep" if keep else "copy_in_backward")
    torch.testing.assert_close(_weights(ours), reference, **ADAM_TOL)


@pytest.mark.parametrize("name", ["fastopt", "fastopt_offload", "fastopt_zero1", "fastopt_zero2"])
def test_the_names_are_in_fabrics_registry_and_train_alike(name):
    reference = _weights(train(_fabric("auto")))
    fabric = _fabric(name)
    assert isinstance(fabric.strategy, FastOptFabricStrategy)
    torch.testing.assert_close(_weights(train(fabric)), reference, **ADAM_TOL)


def test_fp16_overflow_skips_the_step_and_save_load_continues_exactly(tmp_path):
    def fabric():
        return _fabric(FastOptFabricStrategy(copy_on_cpu=True, bucket_size_mb=0.0002),
                       plugins=[FastOptFabricPrecision("16-mixed", initial_scale_power=8, hysteresis=1)])

    straight_fabric = fabric()
    straight = train(straight_fabric, inject_at={2})
    assert straight_fabric.strategy.precision.skipped_steps == 1
    assert straight_fabric.strategy.precision.loss_scale == 2 ** 7  # halved once, 8 clean steps do not double it
    path = tmp_path / "mid.ckpt"
    train(fabric(), inject_at={2}, save_at=5, path=path)
    resumed_fabric = fabric()
    resumed = train(resumed_fabric, inject_at={2}, start=5, path=path)
    assert resumed_fabric.strategy.precision.loss_scale == 2 ** 7  # the scaler came back with the checkpoint
    for a, b in zip(_weights(straight), _weights(resumed)):
        assert torch.equal(a, b)
    saved = torch.load(path, weights_only=True)
    assert set(saved["optimizer"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # keyed by name


@pytest.mark.parametrize("kw,match", [
    (dict(offload_fraction="auto"), "offload_fraction='auto' is for the Trainer"),
    (dict(stream_cpu_step=True), "stream_cpu_step=True is for the Trainer"),
    (dict(offload_fraction=2.0), r"offload_fraction must be in \[0.0, 1.0\]"),
    (dict(bucket_size=8), r"unexpected keyword argument\(s\) 'bucket_size' \(did you mean 'bucket_size_mb'\?\)"),
])
def test_what_fabric_cannot_do_is_refused_by_name(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FastOptFabricStrategy(**kw)


def test_saving_zeros_shards_at_several_processes_is_refused(tmp_path, monkeypatch):
    fabric = _fabric("fastopt_zero1")
    model = train(fabric, steps=1)
    monkeypatch.setattr(FastOptFabricStrategy, "world_size", property(lambda self: 2))
    with pytest.raises(NotImplementedError, match="would keep rank 0's shard of the optimizer state only"):
        fabric.save(tmp_path / "x.ckpt", {"model": model})


def _two_processes(name, out):
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "fabric_run.py"), name, str(out)], cwd=REPO,
                          env=subprocess_env(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)]


@pytest.fixture(scope="module")
def fabric_ddp(tmp_path_factory):
    """Fabric's ddp with torch AdamW, two processes: rank 0's weights."""
    return _two_processes("ddp", tmp_path_factory.mktemp("ddp") / "ddp.pt")[0]


@pytest.mark.parametrize("name", ["half_offloaded", "zero2_freeing"])
def test_two_processes_equal_fabrics_ddp(tmp_path, fabric_ddp, name):
    ours, ours_rank1 = _two_processes(name, tmp_path / "ours.pt")
    ref = fabric_ddp
    for k in ref:
        assert torch.equal(ours[k], ours_rank1[k])  # ranks stay in sync
        torch.testing.assert_close(ours[k], ref[k], **ADAM_TOL, msg=lambda m: f"{k}: {m}")


def test_the_fabric_example_trains(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    out = subprocess.run([sys.executable, "examples/fabric_gpt.py", "--epochs", "2", "--limit-batches", "4",
                          "--checkpoint", str(ckpt)], cwd=REPO, env=subprocess_env(REPO), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if "mean train loss" in line]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "OffloadOptimizer(FusedAdam, offload_fraction=1.0" in out.stderr + out.stdout
    saved = torch.load(ckpt, weights_only=True)
    names = {n for n, _ in saved["model"].items()}
    assert set(saved["optimizer"]["state"]) <= names and "tok.weight" in saved["optimizer"]["state"]


def test_optimizer_state_moves_between_the_trainer_and_fabric(tmp_path):
    """The Trainer's checkpoint (``optimizer_states``) loads into a Fabric run's optimizer
    and the Fabric run's (``fabric.save``) into the Trainer's: the same name-keyed form."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.test_precision import _data
    from tests.test_strategy import Model

    model = Model(lambda g: torch.optim.AdamW(g, lr=1e-2), sched=False)
    trainer = L.Trainer(strategy="fastopt_offload", accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="trainer")],
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _data())
    trainer_ckpt = torch.load(tmp_path / "trainer.ckpt", weights_only=True)

    fabric = _fabric(FastOptFabricStrategy(copy_on_cpu=True, bucket_size_mb=0.0002))
    fabric_model = Model(lambda g: torch.optim.AdamW(g, lr=1e-2), sched=False)
    fabric_model, opt = fabric.setup(fabric_model, fabric_model.configure_optimizers())
    fabric_model.load_state_dict(trainer_ckpt["state_dict"])
    opt.load_state_dict(trainer_ckpt["optimizer_states"][0])
    for p in fabric_model.parameters():  # the Trainer's moments, now in Fabric's optimizer
        name = fabric.strategy._wrappers[0]._slot_of[p].name
        assert torch.equal(fabric.strategy._wrappers[0].state_of(p)["exp_avg"],
                           trainer_ckpt["optimizer_states"][0]["state"][name]["exp_avg"])
    fabric.save(tmp_path / "fabric.ckpt", {"model": fabric_model, "optimizer": opt})
    fabric_ckpt = torch.load(tmp_path / "fabric.ckpt", weights_only=True)
    trainer.strategy.load_optimizer_state_dict({"optimizer_states": [fabric_ckpt["optimizer"]]})
    back = trainer.strategy.optimizers[0]
    for p in model.parameters():
        name = back._slot_of[p].name
        assert torch.equal(back.state_of(p)["exp_avg_sq"], fabric_ckpt["optimizer"]["state"][name]["exp_avg_sq"])
