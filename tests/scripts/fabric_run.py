"""Train a small model in a Fabric loop (tests/fabric_loop.py) in its own process and save
rank 0's weights.

    python tests/scripts/fabric_run.py STRATEGY OUT.pt [--devices 2] [--fp16]
        [--steps 6] [--save-at S --kill-at K --ckpt PATH] [--start S --ckpt PATH]

STRATEGY: "ddp" (Fabric's, torch AdamW), or a fastopt name (``fastopt``, ``fastopt_offload``,
``fastopt_zero1``, ``fastopt_zero2``), or ``half_offloaded`` (offload_fraction=0.5 with
the offloaded gradients copied during backward), or ``zero2_freeing`` (ZeRO stage 2 with
``keep_gradients=False``: each rank keeps its own shard of the gradients only), or
``half_copied`` (offload_fraction=0.5 through the accelerator code path on the CPU).  ``--fp16``: our 16-mixed precision with
an overflow injected at step 2.  ``--save-at S --kill-at K``: save after S steps, then die
by SIGKILL in step K; ``--start S``: continue from that checkpoint.  Fabric's launcher
re-runs this script for rank 1, so it must be a script.
"""

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lightning_fastopt  # noqa: E402,F401  (registers the names in Fabric's registry)
from tests.helpers import finish_process  # noqa: E402
from tests.fabric_loop import train  # noqa: E402

MADE = {"half_offloaded": dict(offload_fraction=0.5, keep_gradients=False, bucket_size_mb=0.0002),
        "zero2_freeing": dict(zero_stage=2, offload_fraction=0.0, keep_gradients=False, bucket_size_mb=0.0002),
        "half_copied": dict(offload_fraction=0.5, copy_on_cpu=True, bucket_size_mb=0.0002)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--ckpt")
    args = parser.parse_args()
    name = args.strategy
    strategy = lightning_fastopt.FastOptFabricStrategy(**MADE[name]) if name in MADE else name
    plugins = [lightning_fastopt.FastOptFabricPrecision("16-mixed", initial_scale_power=8, hysteresis=1)] \
        if args.fp16 else None
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy, plugins=plugins)
    fabric.launch()
    model = train(fabric, steps=args.steps, inject_at={2} if args.fp16 else (), save_at=args.save_at,
                  kill_at=args.kill_at, start=args.start, path=args.ckpt)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"weights": weights, "loss_scale": getattr(fabric.strategy.precision, "loss_scale", None)},
               f"{args.out}.rank{fabric.global_rank}")


if __name__ == "__main__":
    main()
    finish_process()
