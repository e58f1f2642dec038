"""A ``fastopt_fsdp`` save killed (SIGKILL) mid-write, then a resume from the same path.

    python tests/scripts/fsdp_kill_run.py save OUT [host_params]    # exits killed
    python tests/scripts/fsdp_kill_run.py resume OUT [host_params]

``save`` (one process): fits 3 steps, saves a distributed checkpoint to OUT/last.ckpt and
records the weights (OUT/saved.pt), changes every weight and saves to the same path again,
killing itself with SIGKILL once the shards are written, before the metadata file (the
moment a save in place leaves new shards beside the old metadata).  ``resume``: a new
Trainer resumes from OUT/last.ckpt and writes what it loaded (OUT/resumed.pt: the
weights and the global step at the start of training).  ``host_params``: the shards in host
memory (``CPUOffloadPolicy``, ``offload_parameters=True`` at fraction 1).
"""

import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fsdp_trainer_run  # noqa: E402
from fsdp_trainer_run import ShardedNet, _data, _full  # noqa: E402

from tests.helpers import finish_process  # noqa: E402

from lightning_fastopt import FastOptFSDPStrategy  # noqa: E402


def _trainer(out, max_steps, callbacks=()):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, default_root_dir=out,
                     strategy=FastOptFSDPStrategy(offload_fraction=1.0 if HOST else 0.5, copy_on_cpu=True,
                                                  offload_parameters=HOST, data_parallel_size=1,
                                                  tensor_parallel_size=1), callbacks=list(callbacks))


HOST = "host_params" in sys.argv[3:]
fsdp_trainer_run.HOST_PARAMS = HOST  # ShardedNet's configure_model passes CPUOffloadPolicy


def _weights(model):
    return {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


class _Loaded(L.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        torch.save({"weights": _weights(pl_module), "global_step": trainer.global_step},
                   os.path.join(self.out, "resumed.pt"))


def main():
    mode, out = sys.argv[1:3]
    path = os.path.join(out, "last.ckpt")
    data = torch.utils.data.DataLoader(_data(), batch_size=4)
    torch.manual_seed(0)
    model = ShardedNet("adamw")
    if mode == "resume":
        _trainer(out, 6, [_Loaded(out)]).fit(model, data, ckpt_path=path)
        finish_process()  # results written: leave without the interpreter's finalization (tests.helpers)
    trainer = _trainer(out, 3)
    trainer.fit(model, data)
    trainer.save_checkpoint(path)
    torch.save({"weights": _weights(model), "global_step": trainer.global_step}, os.path.join(out, "saved.pt"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    save = torch.save

    def killed_before_the_metadata(obj, f, *args, **kwargs):
        if str(f).endswith("meta.pt"):
            os.kill(os.getpid(), signal.SIGKILL)
        return save(obj, f, *args, **kwargs)

    torch.save = killed_before_the_metadata
    trainer.save_checkpoint(path)
    raise AssertionError("the save was to be killed")


if __name__ == "__main__":
    main()
