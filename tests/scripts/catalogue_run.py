"""tests/test_catalogue.py's model trained on two processes with each of the catalogue's
ENTRIES ("package:Class,...", each made as that test makes it), one after the other in the
same two processes (a process start costs more than a fit here), under STRATEGY ("zero2":
FastOptStrategy at ZeRO stage 2, half offloaded, no argument naming the class; "ddp":
Lightning's own); rank 0 writes each entry's weights and what ran its optimizer to
OUT_DIR/<package>_<Class>.pt.

    python tests/scripts/catalogue_run.py ENTRIES STRATEGY OUT_DIR
"""

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lightning_fastopt import FastOptStrategy  # noqa: E402
from tests.test_catalogue import Net, _data, make_entry  # noqa: E402

keys, which, out = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
for key in keys:
    strategy = (FastOptStrategy(zero_stage=2, offload_fraction=0.5, copy_on_cpu=True, bucket_size_mb=0.0002)
                if which == "zero2" else "ddp")
    model = Net(make_entry(key))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _data())
    if trainer.global_rank == 0:
        plan = getattr(trainer.strategy, "plan", None)
        torch.save({"weights": [p.detach().clone() for p in model.parameters()],
                    "runs": plan.optimizers[0].runner.runs if plan else "torch"},
                   os.path.join(out, key.replace(":", "_") + ".pt"))
