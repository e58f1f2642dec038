"""A run under a fastopt strategy ends where the same run under ``Trainer()`` ends, bit for
bit (issue: bit for bit with the user's optimizer): Adam, AdamW (amsgrad too) and SGD in
the kernels, which round as torch's default CPU step does, and any optimizer that runs
its own step (RAdam here), with
gradient clipping by norm and by value, gradient accumulation and a per-step LR
scheduler, at offload fractions 0, 0.5 and 1 through the accelerator code path
(``copy_on_cpu``) and on the plain CPU path."""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastopt import FastOptStrategy
from tests.helpers import assert_modules_equal

STRATEGIES = {
    "fraction-0": lambda: FastOptStrategy(offload_fraction=0.0, copy_on_cpu=True),
    "fraction-0.5": lambda: FastOptStrategy(offload_fraction=0.5, copy_on_cpu=True, bucket_size_mb=0.002),
    "fraction-1": lambda: FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True, bucket_size_mb=0.002),
    "cpu-path": lambda: "fastopt_offload",
}
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05),
    "adam-l2-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    # torch rounds 1 - dampening from the double (1 - float32(0.9) is another float32)
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.9, maximize=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01, weight_decay=0.01),
}
FUSED_ON_THE_CPU = {  # torch's CPU fused kernels: the biases of 1 and 7 elements are their scalar loop's
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05, fused=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, fused=True),
}


class Net(L.LightningModule):
    def __init__(self, optimizer):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 7), nn.Tanh(), nn.Linear(7, 1))
        self.optimizer = optimizer

    def training_step(self, batch, _):
        return nn.functional.mse_loss(self.body(batch[0]), batch[1])

    def configure_optimizers(self):
        opt = {**OPTIMIZERS, **FUSED_ON_THE_CPU}[self.optimizer](self.parameters())
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=8)


def _fit(strategy, optimizer, **clipping):
    model = Net(optimizer)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
              **clipping).fit(model, _data())
    return model


CLIPPING = {  # thresholds under the gradients' sizes: every step clips
    "by-norm": {"gradient_clip_val": 0.05},
    "by-value": {"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value"},
}


@pytest.mark.parametrize("clipping", list(CLIPPING))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_clipped_accumulated_scheduled_run_ends_where_trainer_ends(strategy, optimizer, clipping):
    ours = _fit(STRATEGIES[strategy](), optimizer, **CLIPPING[clipping])
    ref = _fit("auto", optimizer, **CLIPPING[clipping])
    unclipped = _fit("auto", optimizer)
    assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), unclipped.parameters()))  # it clipped
    assert_modules_equal(ours, ref)


@pytest.mark.parametrize("optimizer", list(FUSED_ON_THE_CPU))
@pytest.mark.parametrize("strategy", ["fraction-0.5", "cpu-path"])
def test_torchs_cpu_fused_kernels_end_where_trainer_ends(strategy, optimizer):
    """``fused=True`` on the CPU: its own rounding (each tensor's last numel % 8 elements
    otherwise), followed through the offloaded and the device share."""
    ours = _fit(STRATEGIES[strategy](), optimizer, **CLIPPING["by-norm"])
    ref = _fit("auto", optimizer, **CLIPPING["by-norm"])
    assert_modules_equal(ours, ref)
