"""A Fabric training loop as users write it, shared by the Fabric tests and the two-process
script (tests/scripts/fabric_run.py): two parameter groups, an LR scheduler, accumulation
with ``no_backward_sync``, clipping, a distributed sampler through
``setup_dataloaders``; optionally an injected inf, a save and load in the middle, and a
SIGKILL of the process in the middle of a step."""

import math
import os
import signal

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(model):
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-3}]
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(128, 1, generator=g))


def _forever(loader):
    while True:
        yield from loader


def train(fabric, steps=8, accumulate=2, clip=("norm", 0.5), inject_at=(), save_at=None, path=None,
          model=None, optimizer=None, start=0, kill_at=None):
    """``steps`` optimizer steps; returns the (set-up) model.  ``save_at``: save to ``path``
    after that many steps and stop (with ``kill_at``: go on, and kill the process with
    SIGKILL between backward and the step of step ``kill_at``); ``start``: continue from a
    checkpoint at ``path`` saved after that many steps."""
    model = model or make_model()
    opt = optimizer or make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=8, shuffle=False))
    if start:
        state = {"model": model, "optimizer": opt, "scheduler": sched}
        fabric.load(path, state)
    batches = _forever(loader)
    for _ in range(start * accumulate):  # where the saving run was in the data
        next(batches)
    for step in range(start, steps):
        for micro in range(accumulate):
            x, y = next(batches)
            last = micro == accumulate - 1
            with fabric.no_backward_sync(model, enabled=not last):
                loss = nn.functional.mse_loss(model(x).float(), y) / accumulate
                fabric.backward(loss)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step in inject_at:  # an overflow (gradients stay in p.grad with keep_gradients=True)
            model.module[0].weight.grad[0, 0] = math.inf
        if clip and clip[0] == "norm":
            fabric.clip_gradients(model, opt, max_norm=clip[1], error_if_nonfinite=False)
        elif clip:
            fabric.clip_gradients(model, opt, clip_val=clip[1])
        opt.step()
        opt.zero_grad()
        sched.step()
        if save_at is not None and step + 1 == save_at:
            fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched})
            if kill_at is None:
                break
    return model
