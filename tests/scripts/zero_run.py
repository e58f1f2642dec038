"""A ZeRO training run for the sharded-checkpoint tests: 4 epochs over 64 samples with a
global batch of 8 (2 ranks x 4, or 1 x 8), a checkpoint at the end of every epoch.

    python tests/scripts/zero_run.py OUT --devices 2 [--resume CKPT] [--strategy zero1|ddp] [--stage 1|2]
        [--offload F] [--clip V] [--stream]

Lightning's default launcher re-runs this script for rank 1.  Writes OUT/final.pt on rank 0.
"""

import argparse
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_fastopt import FastOptStrategy  # noqa: E402
from tests.helpers import finish_process  # noqa: E402


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.7),
                                                   "interval": "step"}}


def _die_in_save(n):
    """Rank 1 writes half of its n-th optimizer shard, then gets SIGKILL."""
    import lightning_fastopt.checkpoint.sharded as sharded
    from lightning_fastopt.checkpoint import shard_file

    real, saves = sharded.write_shard, []

    def write_shard(staging, rank, states):
        saves.append(rank)
        if rank == 1 and len(saves) == n:
            with open(os.path.join(staging, shard_file(rank)), "wb") as f:
                f.write(b"PK\x03\x04 half a shard")
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(staging, rank, states)

    sharded.write_shard = write_shard


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--resume")
    ap.add_argument("--strategy", default="zero1", choices=["zero1", "ddp"])
    ap.add_argument("--offload", type=float, default=0.0)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--clip", type=float, default=0.0, help="gradient_clip_val")
    ap.add_argument("--stream", action="store_true", help="stream_cpu_step=True through the accelerator code path")
    ap.add_argument("--kill-rank1-at-save", type=int, help="rank 1 dies half-way through its n-th shard")
    ap.add_argument("--save-to", help="also save the final state here (over whatever is there)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.sin(x @ torch.randn(8, 1, generator=g))
    if args.kill_rank1_at_save:
        _die_in_save(args.kill_rank1_at_save)
    streamed = dict(copy_on_cpu=True, stream_cpu_step=True) if args.stream else {}
    strategy = (FastOptStrategy(zero_stage=args.stage, offload_fraction=args.offload, bucket_size_mb=0.0005,
                                timeout=timedelta(seconds=20), **streamed)
                if args.strategy == "zero1" else "ddp")
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=4, logger=False,
                        gradient_clip_val=args.clip or None,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[ModelCheckpoint(dirpath=args.out / "ckpt", every_n_epochs=1, save_top_k=-1,
                                                   save_last=True)])
    model = Model()
    # the same global batches at every world size (one process keeps the user's sampler, as Trainer() does)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, seed=0)
    trainer.fit(model, DataLoader(data, batch_size=8 // args.devices, sampler=sampler), ckpt_path=args.resume)
    if args.save_to:
        trainer.save_checkpoint(args.save_to)
    if trainer.is_global_zero:
        engine = trainer.strategy.engines[0] if hasattr(trainer.strategy, "engines") else None
        totals = getattr(getattr(getattr(engine, "local", None), "schedule", None), "totals", {})
        torch.save({"weights": model.state_dict(), "step": trainer.global_step, "buckets": dict(totals)},
                   args.out / "final.pt")


if __name__ == "__main__":
    main()
    finish_process()
