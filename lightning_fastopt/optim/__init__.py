"""User-facing fused optimizers (honest torch.optim.Optimizer subclasses)."""

from lightning_fastopt.optim.adagrad import FusedAdagrad
from lightning_fastopt.optim.adam import CPUAdam, FusedAdam
from lightning_fastopt.optim.base import FusedOptimizer
from lightning_fastopt.optim.lamb import FusedLAMB
from lightning_fastopt.optim.lars import FusedLars
from lightning_fastopt.optim.lion import FusedLion
from lightning_fastopt.optim.sgd import FusedSGD

__all__ = ["CPUAdam", "FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedLars", "FusedLion", "FusedOptimizer",
           "FusedSGD"]
