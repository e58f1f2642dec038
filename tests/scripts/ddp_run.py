"""Train a small model with 2 CPU processes (gloo) and save rank 0's final weights.

    python tests/scripts/ddp_run.py STRATEGY OUT.pt [--inject-inf] [--fp16] [--lamb] [--global-norm] [--gpu]
                                    [--delayed-reference] [--no-clip]

STRATEGY: a registered name, ``zero1``/``zero2`` (``_offload``), ``zero2_speculate`` (all offloaded through
the accelerator code path, ``stream_cpu_step=True``: speculated, as clipping is on), ``ddp_speculate`` (the
same without ZeRO, half offloaded: DDP's buckets handed over as reduced) and ``zero1_speculate`` (ZeRO stage 1,
all offloaded, the same), ``delayed_offload``
(``fastopt_offload`` with ``delayed_update=True`` after 2 steps), or ``module_waits`` (half
offloaded through the accelerator code path, ``forward_waits="module"``), or ``module_streamed`` (all
offloaded through it, ``forward_waits="module"`` and ``stream_cpu_step=True``, DDP's buckets handed over as
reduced: each step ends before its CPU updates do); ``--no-clip``: no gradient clipping (the streamed step
then runs unspeculated); ``--delayed-reference``
delays torch's update the same way (``tests.references.DelayedTorchUpdate``).  ``--lamb``: FusedLAMB
instead of AdamW; ``--global-norm``: a user's optimizer whose step scales every update by the norm of all
gradients (``tests.references.GlobalNorm``), which runs as torch runs it.

Also runs under torchrun (Lightning then takes the ranks from the environment).

Lightning's default launcher re-runs this script for rank 1, so it must be a script."""

import math
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lightning_fastopt  # noqa: E402,F401  (registers "fastopt")
from lightning_fastopt import FastOptPrecision  # noqa: E402
from tests.helpers import SlowBackward, finish_process  # noqa: E402
from tests.references import DelayedTorchUpdate, GlobalNorm  # noqa: E402

DELAYED_WARMUP = 2


class Model(L.LightningModule):
    slow = False

    def __init__(self, inject, lamb=False, global_norm=False):
        super().__init__()
        self.lamb = lamb
        self.global_norm = global_norm
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.inject = inject

    def training_step(self, batch, _):
        x, y = batch
        if self.slow:  # the same math; DDP's later buckets reduce while the first layer's backward sleeps
            return nn.functional.mse_loss(self.net[1:](SlowBackward.apply(self.net[0](x))), y)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.global_norm:
            opt = GlobalNorm(self.parameters(), lr=1e-2)
        elif self.lamb:
            opt = lightning_fastopt.FusedLAMB(self.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.05)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
                                                   "interval": "step"}}


class InjectingModel(Model):
    """Writes an inf into a gradient.  Overriding on_after_backward keeps gradients in
    p.grad (ZeRO stage 2 then reduces as stage 1 does), as any hook that reads them."""

    def on_after_backward(self):
        # rank 1 only: DDP has already averaged the grads, so every rank sees the inf
        # (ZeRO 2: once a bucket is sent a rank that does not own it has no gradient left)
        grad = self.net[0].weight.grad
        if self.inject and self.global_step == 2 and self.global_rank == 1 and grad is not None:
            grad[0, 0] = math.inf


def _count_gradients_at_step(model, seen):
    """Record the gradient elements this rank holds when its ZeRO step reads them (stage 2:
    its own shard only), from inside the optimizer: a hook in the model would be a reader
    of gradients and change what is measured."""
    from lightning_fastopt.zero import ZeroOptimizer

    real = ZeroOptimizer.gradients

    def gradients(self):
        grads = real(self)
        seen["grad_numel"] = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
        return grads

    ZeroOptimizer.gradients = gradients


def main():
    strategy, out = sys.argv[1], sys.argv[2]
    slow = strategy in ("ddp_speculate", "zero1_speculate")
    if slow:  # through the accelerator code path, DDP's buckets as reduced (host and DDP buckets one per tensor)
        strategy = lightning_fastopt.FastOptStrategy(offload_fraction=0.5 if strategy == "ddp_speculate" else 1.0,
                                                     zero_stage=int(strategy == "zero1_speculate"),
                                                     bucket_size_mb=0.00001, copy_on_cpu=True, stream_cpu_step=True,
                                                     bucket_cap_mb=0.00001)
    elif strategy == "zero2_speculate":  # offloaded through the accelerator code path, each update speculated
        strategy = lightning_fastopt.FastOptStrategy(zero_stage=2, bucket_size_mb=0.0002, offload_fraction=1.0,
                                                     copy_on_cpu=True, stream_cpu_step=True)
    elif strategy.startswith("zero"):  # ZeRO stage 1 or 2, the shards kept on the device or all offloaded
        strategy = lightning_fastopt.FastOptStrategy(zero_stage=int(strategy[4]), bucket_size_mb=0.0002,
                                                     offload_fraction=1.0 if "offload" in strategy else 0.0)
    elif strategy == "module_waits":
        strategy = lightning_fastopt.FastOptStrategy(offload_fraction=0.5, copy_on_cpu=True, forward_waits="module",
                                                     bucket_size_mb=0.0002)
    elif strategy == "module_streamed":
        strategy = lightning_fastopt.FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True, forward_waits="module",
                                                     stream_cpu_step=True, bucket_size_mb=0.00001,
                                                     bucket_cap_mb=0.00001)
    elif strategy == "delayed_offload":
        strategy = lightning_fastopt.FastOptStrategy(delayed_update=True, delayed_update_warmup=DELAYED_WARMUP,
                                                     bucket_size_mb=0.0002)
    inject = "--inject-inf" in sys.argv
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    fp16 = inject or "--fp16" in sys.argv
    plugins = [FastOptPrecision("16-mixed", initial_scale_power=8)] if fp16 else None
    accelerator = "gpu" if "--gpu" in sys.argv else "cpu"
    trainer = L.Trainer(accelerator=accelerator, devices=2, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=None if "--no-clip" in sys.argv else 0.5, accumulate_grad_batches=2,
                        plugins=plugins,
                        callbacks=[DelayedTorchUpdate(DELAYED_WARMUP)] if "--delayed-reference" in sys.argv else None)
    model = (InjectingModel if inject else Model)(inject, lamb="--lamb" in sys.argv,
                                                  global_norm="--global-norm" in sys.argv)
    model.slow = slow
    seen = {}
    _count_gradients_at_step(model, seen)
    handed = {}
    if slow:  # how many gradients DDP's hook handed over during backward (read before teardown forgets it)
        model.on_train_end = lambda: handed.update(n=trainer.strategy._ddp_reductions.handed_over)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if handed:
        state["handed_over_in_backward"] = torch.tensor(handed["n"])
    if inject:
        state["skipped_steps"] = torch.tensor(trainer.precision_plugin.skipped_steps)
    opt = (getattr(trainer.strategy, "engines", None) or trainer.optimizers)[0]
    settings = getattr(opt, "settings", None)  # an offload optimizer's (OffloadSettings)
    if getattr(settings, "forward_waits", None) == "module":  # the strategy did not fall back to waiting at the step
        state["waits_by_module"] = torch.tensor(True)
        if hasattr(getattr(opt, "schedule", None), "ends_early"):  # the streamed and speculative steps'
            state["steps_ended_early"] = torch.tensor(opt.schedule.ends_early)
    if hasattr(opt, "owned_numel"):  # ZeRO: how much each rank owns, and the bytes of its state
        state["owned_numel"] = torch.tensor(opt.owned_numel)
        state["grad_numel"] = torch.tensor(seen["grad_numel"])
        state["state_bytes"] = torch.tensor(sum(t.numel() * t.element_size() for p in model.parameters()
                                                for k, t in opt.state_of(p).items() if k != "step"))
    totals = getattr(getattr(getattr(opt, "local", opt), "schedule", None), "totals", None)
    if totals is not None:  # the speculative schedule's bucket counts
        state.update({f"buckets_{k}": torch.tensor(v) for k, v in totals.items()})
    torch.save(state, f"{out}.rank{trainer.global_rank}")


if __name__ == "__main__":
    main()
    finish_process()
