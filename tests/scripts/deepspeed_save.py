"""DeepSpeed's own engine (the reference, tests/test_deepspeed_checkpoints.py): a small model
trained 3 steps at ZeRO stage STAGE, saved with ``engine.save_checkpoint(OUT, tag="step3")``,
and what DeepSpeed held when it saved, read through its own API on every rank
(``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``), written by rank 0 to
OUT/expected.pt.  One process per rank (RANK = LOCAL_RANK on one machine; without
WORLD_SIZE, one process on PORT).

    python tests/scripts/deepspeed_save.py STAGE OUT [PORT] [--scheduler]

``--scheduler``: DeepSpeed's WarmupDecayLR from the config's scheduler section steps too;
``--bf16``: DeepSpeed's bf16 training (bfloat16 weights, float32 masters); ``--frozen``: the
first layer's weight frozen (``requires_grad=False``).
"""

import os
import sys

import torch

scheduled, bf16, frozen = "--scheduler" in sys.argv, "--bf16" in sys.argv, "--frozen" in sys.argv
argv = [a for a in sys.argv if a not in ("--scheduler", "--bf16", "--frozen")]
stage, out = int(argv[1]), argv[2]
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ["RANK"] = os.environ["LOCAL_RANK"]
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
if len(argv) > 3:
    os.environ.setdefault("MASTER_PORT", argv[3])

import deepspeed  # noqa: E402

# DeepSpeed's shared-memory all-reduce (a speed path, same values) left out: its first build
# takes a minute of a 2-core machine
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(0)
# odd sizes: the partitions are padded at two ranks
norm = torch.nn.Identity() if bf16 else torch.nn.BatchNorm1d(15)  # (DeepSpeed leaves BatchNorm's buffers float32)
model = torch.nn.Sequential(torch.nn.Linear(8, 15), norm, torch.nn.Tanh(), torch.nn.Linear(15, 3))
if frozen:
    model[0].weight.requires_grad_(False)
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}}}
SCHEDULE = {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                "warmup_num_steps": 4, "warmup_type": "linear"}}
if scheduled:
    config["scheduler"] = SCHEDULE
if bf16:
    config["bf16"] = {"enabled": True}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                       config=config)
g = torch.Generator().manual_seed(1 + rank)
for _ in range(3):
    x = torch.randn(4, 8, generator=g)
    loss = engine(x.bfloat16() if bf16 else x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(out, tag="step3")
expected = {"masters": {}, "state": {}, "world_size": world, "stage": stage}
for name, p in model.named_parameters():
    if not p.requires_grad:
        with deepspeed.zero.GatheredParameters([p]) if stage == 3 else torch.no_grad():
            expected["frozen"] = {name: p.detach().clone()}
        continue
    expected["masters"][name] = safe_get_full_fp32_param(p).clone()
    expected["state"][name] = {k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}
expected["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
if rank == 0:
    torch.save(expected, os.path.join(out, "expected.pt"))
torch.distributed.barrier()
