"""One Trainer fit on two gloo processes under Lightning's ``ModelParallelStrategy`` (FSDP2)
or lightning_fastopt's ``FastOptFSDPStrategy``: a model the LightningModule shards in
``configure_model`` (each Linear, then the root; rows that do not divide evenly, one
that only rank 0 holds), clipping by norm, gradient accumulation and an LR scheduler
stepped every optimizer step.

    python tests/scripts/fsdp_trainer_run.py STRATEGY OPTIMIZER OUT [resume[:FIRST]] [precision=FLAG]
        [checkpoint=full] [first-only] [from=CHECKPOINT] [devices=N]

STRATEGY: ``reference`` (``ModelParallelStrategy``) or ``fastopt-<fraction>`` (through
the accelerator code path on the CPU, ``copy_on_cpu=True``; the fraction a number or
``auto``, the one each rank's local optimizer ends at written to OUT.fraction.rank<r>), ``fastopt-<fraction>-classes``
or ``fastopt-<fraction>-size`` (the one-line form: the LightningModule has no
``configure_model``, the strategy shards each Linear, or the modules of at least 200
parameters); OPTIMIZER: a name of
:data:`OPTIMIZERS`.  Writes OUT.rank<r>: the full weights and the full optimizer state
(gathered DTensors) after fit.  With ``resume``: a first fit (under the strategy
FIRST, by default STRATEGY) stops after half the steps (on two processes: the first of
two epochs) with a distributed checkpoint, which a second Trainer, under STRATEGY, resumes to the end.  ``precision``:
the Trainer's flag (default ``32-true``); ``checkpoint=full``: the resumed checkpoint is
one full file (``save_distributed_checkpoint=False``), not a directory of shards.
``first-only``: only the first fit of ``resume`` (its checkpoint's path in OUT.checkpoint);
``from=CHECKPOINT``: only the second, from that checkpoint; either on ``devices`` processes
(default 2: resuming at another world size).  ``stream_cpu_step``, ``keep_gradients``: those
options of ours, True (by default the offloaded gradients leave for the host as they are
reduce-scattered, nothing in the model reading them).  ``accelerator=cuda``: on GPUs (the
prepared GPU command runs it on one).  ``model=wide``: :class:`Net` 300 wide (each rank's rows of
its weights larger than the smallest piece a large tensor is split into on the disk tier,
``lightning_fastopt/offload/pieces.py``).  ``model=tied``: a model with tied input and output
embeddings (:class:`TiedNet`).  ``nodes=N``: the Trainer's ``num_nodes`` (launched by torchrun,
one process per node with ``devices=1``).  ``delayed``: ``delayed_update=True`` after 2
synchronous steps (the reference: torch's update delayed the same way,
``tests.references.DelayedTorchUpdate``).  ``checkpointing``: the (last) fit saves a
checkpoint at each epoch's end, as Lightning's default does.  ``host_state_dtype=bfloat16``:
that option of ours.  ``single-<fraction>``: ``FastOptStrategy`` in one process (no FSDP,
the one-line model), with ``devices=1``; ``no-distributed-sampler``: the Trainer's
``use_distributed_sampler=False`` (a one-rank FSDP run then sees the batches in the one
process's order: the two end on the same bits).  ``tp=N``: a mesh of N-way tensor parallelism
(the rest data-parallel) and the model :class:`TensorParallelNet` (``model=sequence_parallel``:
:class:`SequenceParallelNet`).  ``elementwise=NAME``: our
strategy's ``elementwise_optimizers=[NAME]``.  ``mesh=auto``: our strategy is given no mesh
sizes (its default: every process data-parallel).  ``in_place``: ``copy_on_cpu=False``
(the CPU's own code path, as the registered names run on a CPU).  ``host_params``: the parameter
shards in host memory (the reference's ``configure_model`` passes ``CPUOffloadPolicy`` to
``fully_shard``; ours ``offload_parameters=True``, which the one-line form applies itself);
OUT.masters_apart.rank<r> says how many of the local optimizer's parameters have float32
masters apart from the weights, of how many; OUT.pieces.rank<r> how many slots it has, of
how many parameters (more where large ones are split: the state on disk); OUT.early_updates.rank<r> how many host buckets'
CPU updates started during backward over the run (``stream_cpu_step``: streamed or
speculated), and how many of them the steps kept (streamed, or speculated and committed).
``clip=none`` or ``clip=VALUE``: no clipping, or ``gradient_clip_val=VALUE`` (0.5 by default).
``nvme``: ``offload_optimizer_device="nvme"`` (the masters and state in a file in a new
temporary directory, through a window of two buckets); ``host_state_gib=G``: G GiB of it in host memory.  ``empty_init``: the resumed run's
model is built on the meta device (``trainer.init_module(empty_init=True)``), its weights
read from the checkpoint.  ``activation_checkpointing``: :class:`Net`'s layers (and so
:class:`ShardedNet`'s) each run under
``torch.utils.checkpoint`` (non-reentrant), their activations recomputed in backward.
``forward_waits=module``: that option of ours; OUT.left_running.rank<r> says how many host
buckets' updates the steps left running over the run.  ``validate``: the (last) fit validates
at each epoch's end (:meth:`Net.validation_step`), the last validation loss in OUT.rank<r>.
With ``host_params``, OUT.landings.rank<r> says, at the last training batch's end, how many
host shards have a post-accumulate-grad hook (FSDP copies their gradients blocking) and how
many of FSDP's parameter groups tell our optimizer of their gradients' landing instead.
"""

import contextlib
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import finish_process  # noqa: E402
from tests.references import DelayedTorchUpdate, WholeTensorNorms  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from lightning_fastopt import FastOptFSDPStrategy, FastOptStrategy, FusedLAMB  # noqa: E402

STEPS = 6  # two epochs: 6 batches of 4 per rank, 2 per step
DELAYED_WARMUP = 2  # with delayed: the synchronous steps before each offloaded update is delayed
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "whole_norms": lambda ps: WholeTensorNorms(ps, lr=1e-2),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=0.3),
}


class Net(L.LightningModule):
    """No ``configure_model``: the one-line form."""

    def __init__(self, optimizer: str):
        super().__init__()
        self.optimizer = optimizer
        self.net = nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if not ACTIVATION_CHECKPOINTING:
            return nn.functional.mse_loss(self.net(x), y)
        for layer in self.net:  # each layer's activations recomputed in backward (FSDP gathers its weights again)
            x = checkpoint(layer, x, use_reentrant=False)
        return nn.functional.mse_loss(x, y)

    def validation_step(self, batch, batch_idx):  # (run where a validation loader is given: ``validate``)
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return _with_scheduler(OPTIMIZERS[self.optimizer](self.parameters()))


def _with_scheduler(optimizer):
    """The optimizer and an LR scheduler bound to it, stepped every optimizer step (the
    engine must follow the learning rate it writes into the user's groups)."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ShardedNet(Net):
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        # with host_params: torch's CPUOffloadPolicy (the shards and their gradients in host memory)
        policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if HOST_PARAMS else {}
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, **policy)
        fully_shard(self.net, mesh=mesh, **policy)


class TiedNet(L.LightningModule):
    """Tied input and output embeddings, ``training_step`` calling ``self(...)``; no
    ``configure_model`` (the one-line form shards the middle Linear, then the module itself)."""

    def __init__(self, optimizer: str):
        super().__init__()
        self.optimizer = optimizer
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Sequential(nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(self.mid(self.embed(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return _with_scheduler(OPTIMIZERS[self.optimizer](self.parameters()))


class ShardedTiedNet(TiedNet):
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.mid[1], mesh=mesh)
        fully_shard(self, mesh=mesh)


class TensorParallelNet(Net):
    """Tensor parallelism on the mesh's ``tensor_parallel`` dimension, then FSDP on its
    ``data_parallel`` one (each Linear, then the root): the first Linear's rows and the
    second's columns split (32 of them: DTensor's matmul refuses an uneven split there),
    the last one's two rows split, its output gathered and summed.  Every parameter is
    tensor-parallel: torch's clipping (``ModelParallelStrategy``'s) cannot stack the norms
    of DTensors on the 2-D mesh and on its data-parallel part."""

    def __init__(self, optimizer: str):
        super().__init__(optimizer)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).sum(-1, keepdim=True), y)

    def configure_model(self):
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(self.net, self.device_mesh["tensor_parallel"], {
            "0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(output_layouts=Replicate())})
        ShardedNet.configure_model(self)


class SequenceParallelNet(L.LightningModule):
    """Sequence and loss parallelism (torch's Llama recipe, one block): the embedding's
    output split along the sequence, LayerNorms under ``SequenceParallel`` (their weights
    replicated over the tensor-parallel ranks, each computing its part of the sequence),
    the MLP's Linears column- then row-wise split, the head's output split over the
    classes and the cross entropy taken on it under ``loss_parallel`` (forward and
    backward); then FSDP on the ``data_parallel`` dimension (each block, then the root),
    where it has more than one rank (as Lightning's tensor-parallel example applies it)."""

    def __init__(self, optimizer: str):
        super().__init__()
        self.optimizer = optimizer
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
        self.final_norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.mlp(self.norm(h))
        return self.head(self.final_norm(h))

    def training_step(self, batch, batch_idx):
        from torch.distributed.tensor.parallel import loss_parallel

        x, y = batch
        with loss_parallel():
            return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten(0, 1))

    def backward(self, loss, *args, **kwargs):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(loss, *args, **kwargs)

    def configure_optimizers(self):
        return _with_scheduler(OPTIMIZERS[self.optimizer](self.parameters()))

    def configure_model(self):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)

        parallelize_module(self, self.device_mesh["tensor_parallel"], {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
            "final_norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
        mesh = self.device_mesh["data_parallel"]
        if mesh.size() > 1:  # as Lightning's tensor-parallel example: a tensor-parallel-only mesh is not sharded
            fully_shard(self.mlp, mesh=mesh)
            fully_shard(self, mesh=mesh)


def _data(tied=False, sequences=False):
    g = torch.Generator().manual_seed(7)
    if sequences:  # 4 tokens each
        return torch.utils.data.TensorDataset(torch.randint(0, 16, (48, 4), generator=g),
                                              torch.randint(0, 16, (48, 4), generator=g))
    if tied:
        return torch.utils.data.TensorDataset(torch.randint(0, 16, (48,), generator=g),
                                              torch.randint(0, 16, (48,), generator=g))
    return torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))


TENSOR_PARALLEL = 1  # with tp=N: the mesh's tensor-parallel size (the model: TensorParallelNet)
MESH_AUTO = False  # with mesh=auto: our strategy is given no mesh sizes (the reference: every process data-parallel)
ACTIVATION_CHECKPOINTING = False  # with activation_checkpointing: Net's layers under torch.utils.checkpoint
HOST_PARAMS = False  # with host_params: the shards in host memory (CPUOffloadPolicy; ours: offload_parameters=True)


class _KeepsHostShards(ModelParallelStrategy):
    """The reference under ``CPUOffloadPolicy``, built the way FSDP accepts it: Lightning's
    strategy moves the whole model to the GPU after ``configure_model`` (the host shards too,
    which FSDP then refuses); here every module is sharded, so nothing is left to move."""

    def model_to_device(self) -> None:
        pass


def _strategy(name, full, devices, copy_on_cpu=True, **options):
    if name.startswith("single-"):  # one process, no FSDP: FastOptStrategy, the transitive reference
        return FastOptStrategy(offload_fraction=float(name.split("-")[1]), copy_on_cpu=copy_on_cpu,
                               bucket_size_mb=0.0005,
                               **options)
    if name == "reference":
        cls = _KeepsHostShards if HOST_PARAMS else ModelParallelStrategy
        return cls(data_parallel_size=devices // TENSOR_PARALLEL, tensor_parallel_size=TENSOR_PARALLEL,
                   save_distributed_checkpoint=not full)
    _, fraction, *form = name.split("-")
    fraction = fraction if fraction == "auto" else float(fraction)
    if form:  # the one-line form: the mesh sizes left to the strategy too
        policy = {"classes": dict(auto_wrap_policy={nn.Linear}), "size": dict(min_num_params=200)}[form[0]]
        return FastOptFSDPStrategy(offload_fraction=fraction, copy_on_cpu=copy_on_cpu, bucket_size_mb=0.0005,
                                   **policy, **options)
    mesh = {} if MESH_AUTO else dict(data_parallel_size=devices // TENSOR_PARALLEL,
                                     tensor_parallel_size=TENSOR_PARALLEL)
    return FastOptFSDPStrategy(offload_fraction=fraction, copy_on_cpu=copy_on_cpu, bucket_size_mb=0.0005,
                               save_distributed_checkpoint=not full, **mesh, **options)


def _model(name, optimizer, tied=False, sequence_parallel=False):
    one_line = name.count("-") == 2 or name.startswith("single-")
    if sequence_parallel:
        return SequenceParallelNet(optimizer)
    if TENSOR_PARALLEL > 1:
        return TensorParallelNet(optimizer)
    return ((TiedNet if one_line else ShardedTiedNet) if tied else (Net if one_line else ShardedNet))(optimizer)


ACCELERATOR = "cpu"  # "cuda" with accelerator=cuda: one GPU per process


WIDTH = 33  # Net's hidden width; with model=wide: 300 (each rank's rows of a weight hold over 1024 elements)


NODES = 1  # with nodes=N: N nodes (torchrun --nnodes N), each running `devices` processes


CLIP = 0.5  # gradient_clip_val; with clip=none: no clipping (a streamed step need not be speculated)


def _trainer(name, root, precision, full=False, devices=2, options=None, **kw):
    return L.Trainer(accelerator=ACCELERATOR, devices=devices, num_nodes=NODES,
                     strategy=_strategy(name, full, devices * NODES, **(options or {})),
                     precision=precision,
                     gradient_clip_val=CLIP, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=root, **kw)


def _delayed(name, extra, options):
    """With ``delayed``: our strategy's options with the update delayed (after the warm-up)."""
    if "delayed" in extra and name != "reference":
        return dict(options, delayed_update=True, delayed_update_warmup=DELAYED_WARMUP)
    return options


class _HostShardLandings(L.Callback):
    """Writes OUT.landings.rank<r> (the module's docstring) at each training batch's end."""

    reads_weights_between_steps = False  # (FSDP's records only: steps may still end before their updates)

    def __init__(self, out):
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, *args):
        from lightning_fastopt.fsdp.gradient_landings import _LISTENERS
        from lightning_fastopt.fsdp.host_parameters import host_param_groups

        groups = host_param_groups(pl_module)
        hooked = sum(bool(fp.sharded_param._post_accumulate_grad_hooks) for g in groups for fp in g.fsdp_params)
        watched = sum(hasattr(g, _LISTENERS) for g in groups)
        Path(f"{self.out}.landings.rank{trainer.global_rank}").write_text(f"{hooked} {watched}")


def _callbacks(name, extra, saves, out=None):
    """With ``delayed``, the reference's: torch's update delayed as ours is, and where the
    fit saves a checkpoint at each epoch's end (``saves``), the model given the masters
    there first (as our strategy applies a pending update to the checkpoint it saves).
    With ``host_params`` (given ``out``): :class:`_HostShardLandings`."""
    callbacks = [_HostShardLandings(out)] if HOST_PARAMS and out is not None else []
    if "delayed" not in extra or name != "reference":
        return callbacks
    return [*callbacks, DelayedTorchUpdate(DELAYED_WARMUP, sync_at_epoch_end=saves)]


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def main():
    name, optimizer, out = sys.argv[1:4]
    extra = dict(a.partition("=")[::2] if "=" in a else (a, a) for a in sys.argv[4:])
    resume = next((a for a in sys.argv[4:] if a.startswith("resume")), None)
    precision = extra.get("precision", "32-true")
    global ACCELERATOR, NODES, TENSOR_PARALLEL, MESH_AUTO, HOST_PARAMS, CLIP, ACTIVATION_CHECKPOINTING, WIDTH
    MESH_AUTO = extra.get("mesh") == "auto"
    HOST_PARAMS = "host_params" in extra
    ACTIVATION_CHECKPOINTING = "activation_checkpointing" in extra
    CLIP = None if extra.get("clip") == "none" else float(extra.get("clip", CLIP))
    ACCELERATOR = extra.get("accelerator", ACCELERATOR)
    NODES = int(extra.get("nodes", NODES))
    TENSOR_PARALLEL = int(extra.get("tp", TENSOR_PARALLEL))
    tied, sequence_parallel = extra.get("model") == "tied", extra.get("model") == "sequence_parallel"
    WIDTH = 300 if extra.get("model") == "wide" else WIDTH
    torch.manual_seed(0)
    model = _model(name, optimizer, tied, sequence_parallel)
    root = Path(out).parent / f"{Path(out).name}.root"
    data = torch.utils.data.DataLoader(_data(tied, sequence_parallel), batch_size=4)
    path, devices = extra.get("from"), int(extra.get("devices", 2))
    options = {k: True for k in ("stream_cpu_step", "keep_gradients") if k in extra}
    if "in_place" in extra:  # the CPU's own code path: the weights are the masters, nothing copied
        options["copy_on_cpu"] = False
    if "host_state_dtype" in extra:
        options["host_state_dtype"] = extra["host_state_dtype"]
    if "forward_waits" in extra:
        options["forward_waits"] = extra["forward_waits"]
    if "nvme" in extra:  # the offloaded masters and state in a file of a directory of this process's
        options.update(offload_optimizer_device="nvme", nvme_path=tempfile.mkdtemp(prefix="nvme-", dir=Path(out).parent),
                       nvme_window_mb=0.05 if WIDTH > 33 else 0.02)  # (wide: two pieces of 1024 elements' regions)
        if "host_state_gib" in extra:  # part of it in host memory (issue 72)
            options["host_state_gib"] = float(extra["host_state_gib"])
    if "elementwise" in extra:
        options["elementwise_optimizers"] = [extra["elementwise"]]
    if HOST_PARAMS:
        options["offload_parameters"] = True
    if resume or "first-only" in extra:
        first_name = resume.partition(":")[2] or name if resume else name
        first = _trainer(first_name, root, precision, extra.get("checkpoint") == "full", devices,
                         options=_delayed(first_name, extra, options), max_steps=STEPS // 2,
                         enable_checkpointing=True, callbacks=_callbacks(first_name, extra, saves=True))
        first.fit(model, data)
        path = first.checkpoint_callback.best_model_path
        if "first-only" in extra:
            Path(f"{out}.checkpoint").write_text(path)
            finish_process()  # (as below: a return into the interpreter's finalization aborted now and then)
    trainer = _trainer(name, root, precision, devices=devices, options=_delayed(name, extra, options),
                       max_steps=STEPS, enable_checkpointing="checkpointing" in extra,
                       callbacks=_callbacks(name, extra, saves="checkpointing" in extra, out=out),
                       use_distributed_sampler="no-distributed-sampler" not in extra)
    if path is not None:
        torch.manual_seed(1)  # the second run's weights come from the checkpoint
        with trainer.init_module(empty_init=True) if "empty_init" in extra else contextlib.nullcontext():
            model = _model(name, optimizer, tied, sequence_parallel)
        assert "empty_init" not in extra or all(p.is_meta for p in model.parameters())
    validation = torch.utils.data.DataLoader(_data(), batch_size=8) if "validate" in extra else None
    trainer.fit(model, data, validation, ckpt_path=path)
    opt = trainer.optimizers[0]
    names = {p: n for n, p in model.named_parameters()}
    result = {f"weight/{n}": _full(p.detach()) for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        result.update({f"state/{names[p]}/{k}": torch.as_tensor(_full(v)) for k, v in state.items()})
    result["global_step"] = torch.tensor(trainer.global_step)
    if validation is not None:  # the last validation's loss (after the first epoch's last step, and the second's)
        result["val_loss"] = trainer.callback_metrics["val_loss"].detach().clone()
    torch.save(result, f"{out}.rank{trainer.global_rank}")
    for engine in getattr(trainer.strategy, "engines", []):  # the offload fraction each local optimizer ended at
        local = getattr(engine, "local", engine)  # FastOptStrategy's engine is the offload optimizer itself
        Path(f"{out}.fraction.rank{trainer.global_rank}").write_text(str(local.offload_fraction))
        # the float32 masters kept apart from the model's weights (none where the host shards are the masters)
        apart = sum(s.separate_master for s in local.layout.slots if s.leads)
        params = len(local.layout.pieces_of)
        Path(f"{out}.masters_apart.rank{trainer.global_rank}").write_text(f"{apart} {params}")
        # slots, of parameters: more where a parameter is split into pieces (the state on disk)
        Path(f"{out}.pieces.rank{trainer.global_rank}").write_text(f"{len(local.layout.slots)} {params}")
        # host buckets whose CPU update started during backward (streamed, or speculated), over the run
        schedule = local.schedule
        totals = getattr(schedule, "totals", {})  # the speculative schedule's
        started = getattr(schedule, "started", 0)  # the streamed one's
        early, kept = started + totals.get("speculated", 0), started + totals.get("committed", 0)
        Path(f"{out}.early_updates.rank{trainer.global_rank}").write_text(f"{early} {kept}")
        # host buckets whose update a step left running (forward_waits=module: the step ended before it)
        Path(f"{out}.left_running.rank{trainer.global_rank}").write_text(str(schedule.updates_left_running))
    finish_process()  # results written: leave without the interpreter's finalization (tests.helpers)


if __name__ == "__main__":
    main()
