"""Projects built on the standalone ``pytorch_lightning`` package (issue: drop-in for real
Lightning projects): ``import lightning_fastopt`` registers the strategy names with its
Trainer too, and :mod:`lightning_fastopt.trainer.pytorch_lightning` holds its strategy and
precision classes, the same code as for ``lightning.pytorch`` bound to that package's
classes.  Each run is compared with ``pytorch_lightning.Trainer()`` on the same model and
data, bit for bit (SGD and a user-step optimizer round as torch does)."""

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")

import lightning_fastopt  # noqa: E402
from lightning_fastopt.core.engines import STRATEGY_NAMES  # noqa: E402
from lightning_fastopt.trainer import pytorch_lightning as front_end  # noqa: E402
from tests.helpers import assert_modules_equal  # noqa: E402


def _data(n=32):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=8)


class Net(pl.LightningModule):
    def __init__(self, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.make_opt = make_opt

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch, _):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, _):
        return self(batch[0])

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


def _trainer(strategy="auto", **kw):
    args = dict(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)
    args.update(kw)
    return pl.Trainer(strategy=strategy, **args)


def test_every_name_is_registered_with_pytorch_lightning():
    for name, _, fraction, stage in STRATEGY_NAMES:
        strategy = _trainer(name).strategy  # one process: the single-device twin, this package's
        assert type(strategy) is front_end.FastOptSingleDeviceStrategy, name
        assert isinstance(strategy, front_end.FastOptStrategy)
        assert isinstance(strategy, pl.strategies.SingleDeviceStrategy)
        assert not isinstance(strategy, pl.strategies.DDPStrategy)
        assert (strategy.offload_fraction, strategy.zero_stage) == (fraction, stage)
        assert type(strategy.precision_plugin) is front_end.FastOptPrecision
    assert lightning_fastopt.FastOptStrategy is not front_end.FastOptStrategy  # lightning.pytorch's own


@pytest.mark.parametrize("trainer,strategy,use", [
    (lambda **kw: pl.Trainer(**kw), lambda: lightning_fastopt.FastOptStrategy(),
     "use lightning_fastopt.trainer.pytorch_lightning.FastOptStrategy"),
    (lambda **kw: __import__("lightning").Trainer(**kw), lambda: front_end.FastOptStrategy(),
     "use lightning_fastopt.FastOptStrategy"),
], ids=["lightning-class-to-pytorch_lightning", "pytorch_lightning-class-to-lightning"])
def test_the_other_packages_class_is_refused_naming_the_one_to_use(trainer, strategy, use):
    """Lightning's own message ("invalid strategy name") did not say that the class exists
    for the Trainer's package too (issue 39)."""
    with pytest.raises(ValueError, match=f"serves .* Trainers; this one is .*: {use}"):
        trainer(strategy=strategy(), accelerator="cpu", devices=1, logger=False)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "64-true"])
def test_precision_flags_become_this_packages_plugin(precision):
    plugin = _trainer(front_end.FastOptStrategy(copy_on_cpu=True), precision=precision).precision_plugin
    assert type(plugin) is front_end.FastOptPrecision
    assert isinstance(plugin, pl.plugins.precision.Precision)
    assert plugin.precision == precision


def test_an_unsupported_precision_plugin_is_refused_by_name():
    with pytest.raises(TypeError, match="support precision in .*got TransformerEnginePrecision"):
        front_end.FastOptPrecision.from_lightning(
            pl.plugins.precision.TransformerEnginePrecision.__new__(pl.plugins.precision.TransformerEnginePrecision))


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    lambda ps: torch.optim.RAdam(ps, lr=0.01),  # the user's own step on the masters
], ids=["sgd", "radam"])
@pytest.mark.parametrize("strategy", [
    lambda: front_end.FastOptStrategy(offload_fraction=0.2, bucket_size_mb=0.0002, copy_on_cpu=True),
    lambda: "fastopt_offload",
], ids=["part-offloaded-accelerator-path", "offload-cpu-path"])
def test_fit_validate_test_predict_end_where_pytorch_lightning_ends(strategy, make_opt):
    results = []
    for s in (strategy(), "auto"):
        model = Net(make_opt)
        trainer = _trainer(s, limit_val_batches=2)
        trainer.fit(model, _data(), _data(16))
        assert isinstance(trainer.optimizers[0], type(make_opt([nn.Parameter(torch.zeros(1))])))
        out = (trainer.validate(model, _data(16), verbose=False), trainer.test(model, _data(16), verbose=False),
               torch.cat(trainer.predict(model, _data(16))))
        results.append((model, out))
    (ours, ours_out), (ref, ref_out) = results
    assert_modules_equal(ours, ref)
    assert ours_out[0] == ref_out[0] and ours_out[1] == ref_out[1]
    assert torch.equal(ours_out[2], ref_out[2])


def test_resume_from_a_checkpoint(tmp_path):
    """Two epochs, a checkpoint, two more from it: where four uninterrupted epochs end."""
    def strategy():
        return front_end.FastOptStrategy(offload_fraction=0.2, bucket_size_mb=0.0002, copy_on_cpu=True)

    first = Net()
    trainer = _trainer(strategy(), default_root_dir=tmp_path)
    trainer.fit(first, _data())
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    resumed = Net()
    _trainer(strategy(), max_epochs=4).fit(resumed, _data(), ckpt_path=tmp_path / "two.ckpt")
    straight = Net()
    _trainer(max_epochs=4).fit(straight, _data())
    assert_modules_equal(resumed, straight)


class _GradNorms(pl.Callback):
    """Reads every gradient before the step (this package's Callback hook)."""

    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.norms.append(torch.stack([p.grad.norm() for p in module.parameters()]))


def test_a_callback_that_reads_gradients_sees_them():
    """The hooks that read gradients are found on this package's classes: the gradients
    stay in ``p.grad`` until the step, as under ``pytorch_lightning.Trainer()``."""
    norms = []
    for s in (front_end.FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True), "auto"):
        callback = _GradNorms()
        _trainer(s, callbacks=[callback], max_epochs=1).fit(Net(), _data())
        norms.append(torch.stack(callback.norms))
    assert torch.equal(*norms)


def test_forward_waits_by_module_with_this_packages_callbacks(caplog, monkeypatch, tmp_path):
    """Lightning's own callbacks (here this package's ModelCheckpoint and progress bar)
    read no weights between steps: each module's forward waits only for its own weights."""
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    caplog.set_level(logging.INFO)
    ours = Net()
    _trainer(front_end.FastOptStrategy(copy_on_cpu=True, forward_waits="module"), enable_checkpointing=True,
             enable_progress_bar=True, default_root_dir=tmp_path).fit(ours, _data())
    assert "each module's forward waits only for its own new weights" in caplog.text
    ref = Net()
    _trainer().fit(ref, _data())
    assert_modules_equal(ours, ref)


def test_fp16_loss_scaling_on_the_cpu_through_the_plugin():
    """``plugins=[FastOptPrecision("16-mixed")]`` of this package: fp16 autocast and loss
    scaling on the CPU (where Lightning turns "16-mixed" into bf16)."""
    plugin = front_end.FastOptPrecision("16-mixed", initial_scale_power=40)  # overflows first
    model = Net()
    trainer = _trainer(front_end.FastOptStrategy(copy_on_cpu=True), plugins=[plugin], max_epochs=1)
    trainer.fit(model, _data())
    assert trainer.precision_plugin is plugin
    assert plugin.skipped_steps >= 1 and plugin.loss_scale < 2.0 ** 40
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("first", ["pytorch_lightning", "lightning.pytorch"])
def test_importing_lightning_fastopt_leaves_lightnings_messages_where_they_went(first):
    """Both Lightning packages share one rank-zero logger, pointed at its own by whichever
    is imported last; ``import lightning_fastopt`` imports both (to register its names) and
    must not move a project's messages to the other package's logger."""
    import subprocess
    import sys

    code = (f"import {first}, lightning_fastopt, lightning.fabric.utilities.rank_zero as r; "
            "print(r.rank_zero_module.log.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"{first}.utilities.rank_zero"]


class CLINet(Net):
    def __init__(self, lr: float = 0.05):
        super().__init__(lambda ps: torch.optim.SGD(ps, lr=lr))


@pytest.mark.parametrize("strategy", [
    ["--trainer.strategy=fastopt_offload"],
    ["--trainer.strategy=lightning_fastopt.trainer.pytorch_lightning.FastOptStrategy",
     "--trainer.strategy.offload_fraction=0.5", "--trainer.strategy.copy_on_cpu=true"],
], ids=["by-name", "by-class-path"])
def test_lightning_cli_of_pytorch_lightning(strategy, tmp_path):
    pytest.importorskip("jsonargparse")
    from pytorch_lightning.cli import LightningCLI

    cli = LightningCLI(CLINet, run=False, args=[*strategy, "--trainer.accelerator=cpu", "--trainer.devices=1",
                                                f"--trainer.default_root_dir={tmp_path}"])
    assert type(cli.trainer.strategy) is front_end.FastOptSingleDeviceStrategy
    assert cli.trainer.strategy.offload_fraction == (1.0 if len(strategy) == 1 else 0.5)
