"""``precision="bf16-true"`` / ``"16-true"`` under the fastopt strategies: the model holds
half weights and gradients, the optimizer float32 masters, and each step writes the half
copy.  Checked against a plain-PyTorch reference of exactly that (half model, float32
master copies stepped by ``torch.optim`` with ``foreach=False``, copied back), on the
CPU, through the accelerator code path at fractions 0.5 and 1 and the plain path:
SGD and AdamW bit for bit.  fp16 (``"16-true"``) also gets the loss scaler; an overflow skips the step.  A
resumed run continues from the float32 masters the checkpoint holds, bit for bit."""

import lightning as L
import pytest
import torch

from lightning_fastopt import FastOptStrategy
from tests.helpers import ACCELERATOR
from tests.test_precision import _data
from tests.test_strategy import Model

DEVICE = "cuda" if ACCELERATOR == "gpu" else "cpu"

STRATEGIES = {
    "fastopt": lambda: "fastopt",
    "offload-accelerator-path": lambda: FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True),
    "part-offloaded-accelerator-path": lambda: FastOptStrategy(offload_fraction=0.2, bucket_size_mb=0.0002,
                                                               copy_on_cpu=True),
}
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=False),
}


def _reference(make_opt, dtype, epochs):
    """Half weights, float32 masters, torch.optim on the masters, the half copy written back."""
    model = Model(make_opt, sched=False).to(DEVICE, dtype)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    groups = [{"params": masters[:2]}, {"params": masters[2:], "lr": 3e-3}]  # Model's groups
    opt = make_opt(groups)
    for _ in range(epochs):
        for x, y in _data():
            x, y = x.to(DEVICE, dtype), y.to(DEVICE, dtype)
            for p in model.parameters():
                p.grad = None
            model.training_step((x, y), 0).backward()
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for m, p in zip(masters, model.parameters()):
                    p.copy_(m)
    return model


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bf16_true_trains_half_weights_from_float32_masters(strategy, name):
    ours = Model(OPTIMIZERS[name], sched=False)
    trainer = L.Trainer(strategy=STRATEGIES[strategy](), precision="bf16-true", accelerator=ACCELERATOR, devices=1,
                        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(ours, _data())
    ref = _reference(OPTIMIZERS[name], torch.bfloat16, epochs=2)
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        a, b = a.cpu(), b.cpu()
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b), n


class _Poisoned(Model):
    """Step 3's loss is inf: its fp16 gradients overflow."""

    def training_step(self, batch, i):
        loss = super().training_step(batch, i)
        return loss * float("inf") if self.global_step == 3 else loss


def test_16_true_scales_the_loss_and_skips_an_overflowing_step():
    ours = _Poisoned(OPTIMIZERS["sgd"], sched=False)
    trainer = L.Trainer(strategy=FastOptStrategy(offload_fraction=0.2, bucket_size_mb=0.0002, copy_on_cpu=True,
                                                 initial_scale_power=8),
                        precision="16-true", accelerator=ACCELERATOR, devices=1, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(ours, _data())
    plugin = trainer.precision_plugin
    assert all(p.dtype == torch.float16 for p in ours.parameters())
    assert plugin.skipped_steps == 1 and plugin.loss_scale == 2 ** 8  # hysteresis 2: one overflow keeps it
    assert all(torch.isfinite(p).all() for p in ours.parameters())


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_bf16_true_resumes_bit_for_bit(tmp_path, strategy):
    """The checkpoint holds each half weight's float32 master beside its optimizer state
    (the model's state dict has only the rounded weight): resuming from the end of the
    first epoch ends bit for bit where the uninterrupted run ends."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(epochs, ckpt_path=None, callbacks=()):
        model = Model(OPTIMIZERS["adamw"], sched=False)
        trainer = L.Trainer(strategy=STRATEGIES[strategy](), precision="bf16-true", accelerator=ACCELERATOR,
                            devices=1, max_epochs=epochs, logger=False, enable_checkpointing=bool(callbacks),
                            callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, _data(), ckpt_path=ckpt_path)
        return model

    straight = fit(2)
    fit(1, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="first")])
    saved = torch.load(tmp_path / "first.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    assert all(st["fp32_master"].dtype == torch.float32 for st in saved.values())
    resumed = fit(2, ckpt_path=tmp_path / "first.ckpt")
    for (n, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
