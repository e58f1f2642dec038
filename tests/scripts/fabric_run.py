"""Train a small model in a Fabric loop with 2 CPU processes (gloo) and save rank 0's weights.

    python tests/scripts/fabric_run.py STRATEGY OUT.pt

STRATEGY: "ddp" (Fabric's, torch AdamW), or a fastopt name (``fastopt``, ``fastopt_offload``,
``fastopt_zero1``, ``fastopt_zero2``), or ``half_offloaded`` (offload_fraction=0.5 with
the offloaded gradients copied during backward), or ``zero2_freeing`` (ZeRO stage 2 with
``keep_gradients=False``: each rank keeps its own shard of the gradients only).  Fabric's launcher re-runs this script
for rank 1, so it must be a script.
"""

import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lightning_fastopt  # noqa: E402,F401  (registers the names in Fabric's registry)
from tests.fabric_loop import train  # noqa: E402


def main():
    name, out = sys.argv[1], sys.argv[2]
    made = {"half_offloaded": dict(offload_fraction=0.5, keep_gradients=False, bucket_size_mb=0.0002),
            "zero2_freeing": dict(zero_stage=2, offload_fraction=0.0, keep_gradients=False, bucket_size_mb=0.0002)}
    strategy = lightning_fastopt.FastOptFabricStrategy(**made[name]) if name in made else name
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = train(fabric, steps=6)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}.rank{fabric.global_rank}")


if __name__ == "__main__":
    main()
