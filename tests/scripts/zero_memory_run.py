"""What each rank of a two-process ZeRO run allocates, for tests/test_memory.py.

    python tests/scripts/zero_memory_run.py OUT STAGE FRACTION

Two gloo processes (a file store in OUT) build ZeroOptimizer(FusedAdam(amsgrad=True)) at
STAGE with FRACTION of each shard offloaded through the accelerator's code path
(copy_on_cpu), run a step and write OUT/rank{R}.json: the bytes its optimizer allocated
(and the padding allowance), its owned and offloaded element counts, and which parameters
still held a gradient when backward had ended and after the step.  STAGE 3: the model
sharded by ``fully_shard`` (each Linear, then the model) and a LocalShardOptimizer; the
elements of the rank's rows of the parameters and of their gradients are written too.
STAGE ``3tp``: four processes, a (2, 2) mesh as Lightning's ``ModelParallelStrategy``
makes it (data-parallel, tensor-parallel), :func:`tp_model` parallelized with
:data:`TP_PLAN`, then sharded by ``fully_shard`` over the data-parallel dimension.  STAGE
``3host``: as 3 with the shards in host memory (``CPUOffloadPolicy``: the rows their own
masters, the LocalShardOptimizer on the CPU's path, as ``offload_parameters=True`` runs it).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_fastopt import FusedAdam  # noqa: E402
from lightning_fastopt.fsdp import LocalShardOptimizer  # noqa: E402
from lightning_fastopt.zero import ZeroOptimizer  # noqa: E402
from tests.helpers import allocated_bytes, finish_process, memory_model  # noqa: E402


def tp_model() -> torch.nn.Sequential:
    """An embedding of 17 rows, a LayerNorm, a Linear 8 -> 32 and one 32 -> 9 (seed 0)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(17, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 32),
                               torch.nn.Linear(32, 9))


def tp_plan() -> dict:
    """What ``configure_model`` would give ``parallelize_module`` for :func:`tp_model`: the
    embedding's rows, the first Linear's rows and the second's columns split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": RowwiseParallel(), "2": ColwiseParallel(), "3": RowwiseParallel()}


def run(rank: int, out: str, stage, fraction: float) -> None:
    tp, host = stage == "3tp", stage == "3host"
    stage = 3 if host else stage
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=4 if tp else 2)
    if tp:
        stage, model = 3, _tensor_parallel(tp_model())
    else:
        model = memory_model(layers=4) if stage < 3 else _sharded(memory_model(layers=4, rows=(33, 32, 1)), host)
    if stage < 3:
        opt = ZeroOptimizer(FusedAdam(model.parameters(), amsgrad=True), stage=stage, offload_fraction=fraction,
                            bucket_size_mb=0.001, copy_on_cpu=True)
    else:
        opt = LocalShardOptimizer(FusedAdam(model.parameters(), amsgrad=True), offload_fraction=fraction,
                                  bucket_size_mb=0.001, copy_on_cpu=not host)  # host shards: their own masters
    torch.manual_seed(1)  # the same batch on both ranks: no DDP wrapper needed at stage 1
    batch = torch.randint(0, 17, (4, 5)) if tp else torch.randn(4, 32)
    _full(model(batch)).sum().backward()
    kept_grads = [p.grad is not None for p in model.parameters()]
    opt.step()
    kept_after_step = [p.grad is not None for p in model.parameters()]
    allocated, padding = allocated_bytes(opt.local)
    facts = dict(allocated=allocated, padding=padding, offloaded=opt.local.offloaded_numel, kept_grads=kept_grads,
                 kept_after_step=kept_after_step)
    if stage < 3:
        facts["owned"] = opt.owned_numel
    else:
        facts.update(owned=opt.held_numel, rows=sum(_local(p).numel() for p in model.parameters()),
                     grad_rows=sum(_local(p.grad).numel() for p in model.parameters() if p.grad is not None))
    Path(out, f"rank{rank}.json").write_text(json.dumps(facts))
    opt.close()
    finish_process()  # results written: leave without the interpreter's finalization (tests.helpers)


def _sharded(model, host=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (2,))
    policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if host else {}
    for layer in model:
        fully_shard(layer, mesh=mesh, **policy)
    return fully_shard(model, mesh=mesh, **policy)


def _tensor_parallel(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    parallelize_module(model, mesh["tensor_parallel"], tp_plan())
    for layer in model:
        fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def _local(tensor):
    return getattr(tensor, "_local_tensor", tensor)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


if __name__ == "__main__":
    out, stage, fraction = sys.argv[1], sys.argv[2], float(sys.argv[3])
    stage = stage if stage in ("3tp", "3host") else int(stage)
    mp.spawn(run, args=(out, stage, fraction), nprocs=4 if stage == "3tp" else 2)
