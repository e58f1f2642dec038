"""ZeRO: optimizer state and master weights sharded across data-parallel ranks."""

from lightning_fastopt.zero.optimizer import ZeroOptimizer
from lightning_fastopt.zero.partition import assign_owners

__all__ = ["ZeroOptimizer", "assign_owners"]
