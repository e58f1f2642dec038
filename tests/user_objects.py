"""Objects of a user's own that a checkpoint may hold (importable by the tests' child
processes): a config dataclass passed to ``save_hyperparameters``, a LightningModule
built from it, and an object whose pickle would run a shell command when loaded."""

from __future__ import annotations

import dataclasses
import os

import lightning as L
import torch
from torch import nn


@dataclasses.dataclass
class UserConfig:
    """A project's config class, as models take them."""

    width: int = 16
    lr: float = 1e-2


class ConfiguredModel(L.LightningModule):
    """Saves its config in its hyperparameters (``self.save_hyperparameters()``)."""

    def __init__(self, cfg: UserConfig) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, cfg.width), nn.Tanh(), nn.Linear(cfg.width, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.cfg.lr)


class RunsCommand:
    """Pickled, it becomes a call of ``os.system(command)`` when unpickled: what a crafted
    checkpoint does.  Loading it must run nothing unless the user opted in."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def touching(marker) -> RunsCommand:
    """An object whose unpickling creates the file ``marker``."""
    return RunsCommand(f"touch {os.fspath(marker)}")
