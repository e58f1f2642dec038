"""The device mesh our FSDP strategies build when its sizes are left to them.

Lightning's ``ModelParallelStrategy`` (Trainer and Fabric) makes, by default, data
parallelism across nodes and tensor parallelism within each: on the devices of one node
its ``data_parallel`` dimension has one rank, so a ``configure_model`` that shards over
it, as docs and examples do, shards nothing (every rank holds every parameter and sees the
same batches), silently.  A user who names ZeRO-3 expects the parameters sharded over
every device: our strategies make every process data-parallel unless told otherwise, and
take the other size from the one given.  A mesh whose ``data_parallel`` dimension still
has one rank of several processes gets one line.
"""

from __future__ import annotations

from lightning.fabric.utilities.rank_zero import rank_zero_info


def resolved_mesh_sizes(data_parallel_size: int | str, tensor_parallel_size: int | str,
                        world_size: int) -> tuple[int | str, int | str]:
    """The mesh's sizes for ``world_size`` processes: both ``"auto"``, every process
    data-parallel; one of them ``"auto"``, what the other leaves (Lightning checks that
    their product is the number of processes)."""
    if data_parallel_size == "auto" and tensor_parallel_size == "auto":
        return world_size, 1
    if data_parallel_size == "auto":
        return max(1, world_size // tensor_parallel_size), tensor_parallel_size
    if tensor_parallel_size == "auto":
        return data_parallel_size, max(1, world_size // data_parallel_size)
    return data_parallel_size, tensor_parallel_size


def say_if_nothing_is_sharded(data_parallel_size: int, world_size: int) -> None:
    """One line where ``fully_shard`` over the mesh's ``data_parallel`` dimension would
    shard nothing: it has one rank, of several processes."""
    if data_parallel_size == 1 and world_size > 1:
        rank_zero_info(f"lightning_fastopt: the device mesh's data_parallel dimension has 1 of {world_size} "
                       "processes: fully_shard over it shards nothing (every rank holds whole each parameter that "
                       "tensor parallelism does not split, and sees the same batches); data_parallel_size="
                       f"{world_size} (the default) shards over every process")
