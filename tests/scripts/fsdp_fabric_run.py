"""One Fabric loop on two gloo processes under Fabric's ``ModelParallelStrategy`` (FSDP2)
or lightning_fastopt's ``FastOptFabricFSDPStrategy``: a model sharded by a
``parallelize_fn`` (each Linear, then the model; rows that do not divide evenly, one
that only rank 0 holds), clipping by norm and gradient accumulation.

    python tests/scripts/fsdp_fabric_run.py STRATEGY OUT [resume:FIRST] [checkpoint=full] [grads=free|stream]

STRATEGY: ``reference`` or ``fastopt-<fraction>`` (``copy_on_cpu=True``), or
``fastopt-<fraction>-classes`` (no ``parallelize_fn``: the strategy shards each Linear),
or ``single-<fraction>``: one process under ``FastOptFabricStrategy`` (nothing sharded),
each step's micro-batch both ranks' batches together.
Writes OUT.rank<r>: the full weights and optimizer state (gathered DTensors) after
:data:`STEPS` steps.  With ``resume:FIRST``: the loop under FIRST saves a checkpoint
(``fabric.save``) after half the steps and stops; a new Fabric under STRATEGY loads it
and runs the rest.  ``grads=free``: ``keep_gradients=False`` (the offloaded gradients leave
during backward); ``grads=stream``: and ``stream_cpu_step=True``.  ``optimizer=whole_norms``:
a user's optimizer whose step takes norms over whole parameters (``tests.references.WholeTensorNorms``)
instead of AdamW; ``optimizer=lamb``: ``FusedLAMB`` (trust ratios and clipping over whole parameters).  ``tp=2``: 2-way tensor parallelism (``parallelize_module`` in ``parallelize_fn``,
then FSDP over the one-way data-parallel dimension).  ``nvme``: ours with
``offload_optimizer_device="nvme"`` (a file per process).  ``host_params``: the shards in host memory
(the reference's ``parallelize_fn`` passes ``CPUOffloadPolicy``; ours ``offload_parameters=True``).
"""

import copy
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import finish_process  # noqa: E402
from tests.references import WholeTensorNorms  # noqa: E402
from lightning_fastopt import FastOptFabricFSDPStrategy, FastOptFabricStrategy, FusedLAMB  # noqa: E402

STEPS = 6
MICRO_BATCHES = 2
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    "whole_norms": lambda ps: WholeTensorNorms(ps, lr=1e-2),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=0.3),
}
OPTIMIZER = "adamw"  # optimizer=NAME
TENSOR_PARALLEL = 1  # with tp=2: 2-way tensor parallelism (even widths, the output summed)
HOST_PARAMS = False  # with host_params: the shards in host memory (CPUOffloadPolicy; ours: offload_parameters=True)


def _parallelize(model, mesh):
    # with host_params: torch's CPUOffloadPolicy (the shards and their gradients in host memory)
    policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if HOST_PARAMS else {}
    if TENSOR_PARALLEL > 1:  # the first Linear's rows, the second's columns, the last's rows split
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh["tensor_parallel"], {
            "0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(output_layouts=Replicate())})
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"], **policy)
    fully_shard(model, mesh=mesh["data_parallel"], **policy)
    return model


def _strategy(name, full, options):
    if name == "reference":
        return ModelParallelStrategy(_parallelize, data_parallel_size=2 // TENSOR_PARALLEL,
                                     tensor_parallel_size=TENSOR_PARALLEL,
                                     save_distributed_checkpoint=not full)
    kind, fraction, *form = name.split("-")
    if kind == "single":
        return FastOptFabricStrategy(offload_fraction=float(fraction), copy_on_cpu=True, bucket_size_mb=0.0005)
    if form:
        return FastOptFabricFSDPStrategy(offload_fraction=float(fraction), copy_on_cpu=True, bucket_size_mb=0.0005,
                                         auto_wrap_policy={nn.Linear}, save_distributed_checkpoint=not full,
                                         **options)
    return FastOptFabricFSDPStrategy(_parallelize, offload_fraction=float(fraction), copy_on_cpu=True,
                                     bucket_size_mb=0.0005, data_parallel_size=2 // TENSOR_PARALLEL,
                                     tensor_parallel_size=TENSOR_PARALLEL,
                                     save_distributed_checkpoint=not full, **options)


def _batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS * MICRO_BATCHES)]


def _both_ranks_batches():
    """One process's: each micro-batch both ranks' (the mean loss over both is the mean of theirs)."""
    return [tuple(torch.cat(pair) for pair in zip(*b)) for b in zip(_batches(0), _batches(1))]


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _run(name, full, first_step, last_step, load=None, save=None, options=None):
    single = name.startswith("single")
    fabric = L.Fabric(accelerator="cpu", devices=1 if single else 2, strategy=_strategy(name, full, options or {}))
    fabric.launch()
    torch.manual_seed(0)
    tp = TENSOR_PARALLEL > 1  # DTensor's matmul refuses an uneven split: 32 columns, 2 outputs summed
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 32 if tp else 33), nn.Tanh(), nn.Linear(32 if tp else 33, 16),
                                              nn.Tanh(), nn.Linear(16, 2 if tp else 1)))
    optimizer = fabric.setup_optimizers(OPTIMIZERS[OPTIMIZER](model.parameters()))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if load is not None:
        fabric.load(load, state)
    # a tensor-parallel group sees the same batches
    batches = _both_ranks_batches() if single else _batches(fabric.global_rank // TENSOR_PARALLEL)
    for step in range(first_step, last_step):
        for i in range(MICRO_BATCHES):
            x, y = batches[step * MICRO_BATCHES + i]
            with fabric.no_backward_sync(model, enabled=i < MICRO_BATCHES - 1):
                fabric.backward(nn.functional.mse_loss(model(x).sum(-1, keepdim=True), y) / MICRO_BATCHES)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    state["step"] = last_step
    if save is not None:
        fabric.save(save, state)
    return fabric, model, optimizer, state


def main():
    name, out = sys.argv[1:3]
    extra = sys.argv[3:]
    full = "checkpoint=full" in extra
    options = {"free": dict(keep_gradients=False),
               "stream": dict(keep_gradients=False, stream_cpu_step=True)}.get(next(
                   (a.partition("=")[2] for a in extra if a.startswith("grads=")), None), {})
    options.update(a.split("=", 1) for a in extra if a.startswith("host_state_dtype="))
    if "nvme" in extra and name != "reference":  # the offloaded rows' state in a file of this process's
        options.update(offload_optimizer_device="nvme", nvme_window_mb=0.02,
                       nvme_path=tempfile.mkdtemp(prefix="nvme-", dir=Path(out).parent))
    resume = next((a for a in extra if a.startswith("resume:")), None)
    global OPTIMIZER, TENSOR_PARALLEL, HOST_PARAMS
    HOST_PARAMS = "host_params" in extra
    if HOST_PARAMS:
        options["offload_parameters"] = True
    OPTIMIZER = next((a.partition("=")[2] for a in extra if a.startswith("optimizer=")), OPTIMIZER)
    TENSOR_PARALLEL = 2 if "tp=2" in extra else 1
    if resume:
        path = Path(f"{out}.ckpt")
        _run(resume.partition(":")[2], full, 0, STEPS // 2, save=path)
        fabric, model, optimizer, state = _run(name, full, STEPS // 2, STEPS, load=path, options=options)
        assert state["step"] == STEPS
    else:
        fabric, model, optimizer, state = _run(name, full, 0, STEPS, options=options)
    names = {p: n for n, p in model.named_parameters()}
    result = {f"weight/{n}": _full(p.detach()) for n, p in model.named_parameters()}
    held_by_torch = copy.copy(optimizer.optimizer)  # ours: as torch would hold it (the engine holds the state)
    for p in names:
        held = held_by_torch.state.get(p) or {}
        result.update({f"state/{names[p]}/{k}": torch.as_tensor(_full(v)) for k, v in held.items()})
    torch.save(result, f"{out}.rank{fabric.global_rank}")
    for engine in getattr(fabric.strategy, "_engines", {}).values():  # float32 masters kept apart from the weights
        apart = sum(s.separate_master for s in engine.local.layout.slots)
        Path(f"{out}.masters_apart.rank{fabric.global_rank}").write_text(f"{apart} {len(engine.local.layout.slots)}")
    finish_process()  # results written: leave without the interpreter's finalization (tests.helpers)


if __name__ == "__main__":
    main()
