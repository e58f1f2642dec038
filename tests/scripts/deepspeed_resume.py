"""tests/test_deepspeed_checkpoints.py's model resumed from CKPT (a DeepSpeed directory or a
consolidated file) under STRATEGY ("zero2": FastOptStrategy at ZeRO stage 2 with half
offloaded, or "ddp": Lightning's own) on two processes for 4 more steps; rank 0 writes the
weights it started from and ended with to OUT.

    python tests/scripts/deepspeed_resume.py STRATEGY CKPT OUT
"""

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lightning_fastopt import FastOptStrategy  # noqa: E402
from tests.test_deepspeed_checkpoints import Net, _data  # noqa: E402

which, ckpt, out = sys.argv[1:4]
strategy = (FastOptStrategy(zero_stage=2, offload_fraction=0.5, copy_on_cpu=True, bucket_size_mb=0.0002)
            if which == "zero2" else "ddp")
model = Net()
trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=4, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, _data(), ckpt_path=ckpt)
if trainer.global_rank == 0:
    torch.save({"started": model.started, "ended": {n: p.detach().clone() for n, p in model.named_parameters()}}, out)
