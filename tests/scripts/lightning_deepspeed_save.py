"""Lightning's own ``DeepSpeedStrategy`` on the CPU (the three overrides of
../shared/notes/deepspeed_on_cpu.md): tests/test_deepspeed_checkpoints.py's model trained
STEPS steps at ZeRO stage STAGE on DEVICES processes, saved with ``trainer.save_checkpoint(OUT)``
(a directory: DeepSpeed's files, Lightning's loops inside), and what DeepSpeed held when it
saved, read through its own API on every rank, written by rank 0 to OUT/expected.pt.

    python tests/scripts/lightning_deepspeed_save.py STAGE DEVICES STEPS OUT
"""

import os
import sys

import deepspeed
import lightning as L
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.strategies import deepspeed as lightnings_deepspeed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.test_deepspeed_checkpoints import Net, _data  # noqa: E402

# DeepSpeed's shared-memory all-reduce (a speed path, same values) left out: its first build
# takes a minute of a 2-core machine
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
stage, devices, steps, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lightnings_deepspeed._validate_device_index_selection = lambda *args, **kwargs: None


class DeepSpeedOnTheCPU(DeepSpeedStrategy):
    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # not DeepSpeedStrategy's check that the accelerator is CUDA

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", 0)  # DeepSpeed compares the device's index with 0


torch.manual_seed(0)
model = Net()
trainer = L.Trainer(strategy=DeepSpeedOnTheCPU(stage=stage, process_group_backend="gloo"), accelerator="cpu",
                    devices=devices, max_steps=steps, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, _data())
trainer.save_checkpoint(out)
expected = {"masters": {}, "state": {}, "global_step": trainer.global_step}
for name, p in trainer.strategy.model.module.named_parameters():
    name = name.removeprefix("_forward_module.")
    expected["masters"][name] = safe_get_full_fp32_param(p).clone()
    expected["state"][name] = {k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}
if trainer.global_rank == 0:
    torch.save(expected, os.path.join(out, "expected.pt"))
