"""DeepSpeed's own engine (the reference, tests/test_deepspeed_checkpoints.py): a small model
trained 3 steps at ZeRO stage STAGE, saved with ``engine.save_checkpoint(OUT, tag="step3")``,
and what DeepSpeed held when it saved, read through its own API on every rank
(``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``), written by rank 0 to
OUT/expected.pt.  One process per rank (RANK = LOCAL_RANK on one machine; without
WORLD_SIZE, one process on PORT).

    python tests/scripts/deepspeed_save.py STAGE OUT [PORT]
"""

import os
import sys

import torch

stage, out = int(sys.argv[1]), sys.argv[2]
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ["RANK"] = os.environ["LOCAL_RANK"]
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
if len(sys.argv) > 3:
    os.environ.setdefault("MASTER_PORT", sys.argv[3])

import deepspeed  # noqa: E402

# DeepSpeed's shared-memory all-reduce (a speed path, same values) left out: its first build
# takes a minute of a 2-core machine
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(0)
# odd sizes: the partitions are padded at two ranks
model = torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.BatchNorm1d(15), torch.nn.Tanh(), torch.nn.Linear(15, 3))
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
g = torch.Generator().manual_seed(1 + rank)
for _ in range(3):
    loss = engine(torch.randn(4, 8, generator=g)).pow(2).mean()
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(out, tag="step3")
expected = {"masters": {}, "state": {}, "world_size": world, "stage": stage}
for name, p in model.named_parameters():
    expected["masters"][name] = safe_get_full_fp32_param(p).clone()
    expected["state"][name] = {k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}
expected["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
if rank == 0:
    torch.save(expected, os.path.join(out, "expected.pt"))
torch.distributed.barrier()
