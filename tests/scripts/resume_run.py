"""One training run for the resume tests: 4 epochs of 8 steps, a checkpoint at the end
of every epoch, optionally killed with SIGKILL at a given step, optionally resumed.

    python tests/scripts/resume_run.py OUT --strategy fastopt_offload --fraction 0.5
        [--fp16] [--kill-at-step 20] [--resume CKPT] [--accelerator gpu] [--nvme DIR [--host-state-gib G]]

Writes OUT/final.pt (the model's weights, the loss scale and the step) when it finishes.
"""

import argparse
import os
import signal
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_fastopt import FastOptPrecision, FastOptStrategy


class Model(L.LightningModule):
    def __init__(self, width=16, prefix="net"):
        super().__init__()
        torch.manual_seed(0)
        setattr(self, prefix, nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                            nn.Linear(width, 1)))
        self.prefix = prefix

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(getattr(self, self.prefix)(x).float(), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class KillAt(L.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: as a node failure


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.sin(x @ torch.randn(8, 1, generator=g))
    # shuffled by epoch number (Lightning calls set_epoch), not by the global RNG: the order of
    # an epoch is the same in a resumed process, under Trainer() as under our strategies
    data = TensorDataset(x, y)
    return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--strategy", default="fastopt_offload", choices=["fastopt_offload", "plain"])
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--kill-at-step", type=int)
    ap.add_argument("--resume")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--prefix", default="net")
    ap.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--nvme", help="a directory: the offloaded state on disk there (offload_optimizer_device='nvme')")
    ap.add_argument("--host-state-gib", type=float, help="with --nvme: that much of the state in host memory")
    args = ap.parse_args()
    disk = dict(offload_optimizer_device="nvme", nvme_path=args.nvme, nvme_window_mb=0.01) if args.nvme else {}
    if args.host_state_gib is not None:
        disk["host_state_gib"] = args.host_state_gib
    strategy = (FastOptStrategy(offload_fraction=args.fraction, bucket_size_mb=0.0005, **disk)
                if args.strategy == "fastopt_offload" else "auto")  # plain: Trainer()
    plugins = [FastOptPrecision("16-mixed", initial_scale_power=12, loss_scale_window=5)] if args.fp16 else None
    callbacks = [ModelCheckpoint(dirpath=args.out / "ckpt", every_n_epochs=1, save_top_k=-1, save_last=True)]
    if args.kill_at_step is not None:
        callbacks.append(KillAt(args.kill_at_step))
    model = Model(args.width, args.prefix)
    if args.prefix != "net":
        model.strict_loading = False  # let the optimizer state meet the renamed model
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, max_epochs=4, strategy=strategy, plugins=plugins,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data(), ckpt_path=args.resume)
    weights = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.save({"weights": weights, "loss_scale": getattr(trainer.precision_plugin, "loss_scale", 1.0),
                "step": trainer.global_step}, args.out / "final.pt")


if __name__ == "__main__":
    main()
