"""The hybrid CPU/accelerator optimizer behind the ``fastopt_offload`` strategy."""

from lightning_fastopt.offload.optimizer import OffloadOptimizer
from lightning_fastopt.offload.partition import choose_offloaded, split_into_buckets

__all__ = ["OffloadOptimizer", "choose_offloaded", "split_into_buckets"]
