"""ZeRO stage 3 on torch's FSDP2: the offloaded compiled step on each rank's local shards."""

from lightning_fastopt.fsdp.local_shards import LocalShardOptimizer, local_alias

__all__ = ["LocalShardOptimizer", "local_alias"]
