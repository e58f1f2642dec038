"""``FastOptFSDPStrategy`` (``fastopt_fsdp``, ZeRO stage 3 on Lightning's
``ModelParallelStrategy``) with two real processes (gloo), through the accelerator code
path on the CPU (``copy_on_cpu=True``): a model sharded by the LightningModule's
``configure_model`` ends bit for bit where ``ModelParallelStrategy`` with the same torch
optimizer ends (``torch.equal`` on the gathered weights and optimizer state), with
clipping by norm, gradient accumulation and an LR scheduler stepped every step, at
offload fractions 0, 0.5 and 1, for AdamW (SGD, Adagrad and RAdam, its own step, are
compared with torch on the shards in ``tests/test_fsdp_local_shards.py``), under
``bf16-mixed`` too; the one-line form (no ``configure_model``, tied embeddings included)
as well; tensor parallelism then FSDP, sequence and loss parallelism; two nodes under torchrun; distributed and full checkpoints resume across the two
strategies both ways, and at another number of processes; a save killed mid-write leaves
the previous checkpoint (``tests/scripts/fsdp_trainer_run.py``, ``fsdp_kill_run.py``).
And, in one process: the names it is registered under in both Lightning packages, and
its arguments checked when it is built."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_bfloat16_moments_followed, free_port, run_counts, run_script, subprocess_env

slow = pytest.mark.slow  # real processes: CI runs them (pytest -m slow)

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "fsdp_trainer_run.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Each run's two ranks, run once per module."""
    runs = {}

    def fit(strategy, optimizer="adamw", *extra):
        key = (strategy, optimizer, *extra)
        if key not in runs:
            out = tmp_path_factory.mktemp("fsdp") / "run.pt"
            devices = next((int(a.split("=")[1]) for a in extra if a.startswith("devices=")), 2)
            run_script(SCRIPT, strategy, optimizer, out, *extra, ranks=devices)  # (Lightning's launcher: see below)
            if "first-only" in extra:
                runs[key] = Path(f"{out}.checkpoint").read_text()
            else:
                ranks = (0, 1) if "devices=1" not in extra else (0,)  # a run on one process: rank 0's
                runs[key] = Ranks(torch.load(f"{out}.rank{r}", weights_only=True) for r in ranks)
                runs[key].early = run_counts(out, "early_updates", ranks)
                runs[key].pieces = run_counts(out, "pieces", ranks)
        return runs[key]
    return fit


class Ranks(list):
    """Each rank's weights and optimizer state; ``early``: each rank's (host bucket updates
    started during backward, of them kept by the steps), None where nothing is offloaded."""

    early: list
    pieces: list  # each rank's (slots, parameters) of its local optimizer


FRONT_ENDS = {"lightning.pytorch": "lightning_fastopt.trainer.lightning_pytorch",
              "pytorch_lightning": "lightning_fastopt.trainer.pytorch_lightning"}


def _assert_same(ours, ref):
    for a, b in zip(ours, ref):
        assert a.keys() == b.keys()
        assert any(k.startswith("state/") for k in a) and int(a["global_step"]) == 6
        for key in b:
            assert torch.equal(a[key], b[key]), key


@slow
@pytest.mark.parametrize("fraction", ["0", "0.5", "1"])
def test_fastopt_fsdp_ends_where_model_parallel_strategy_ends(run, fraction):
    _assert_same(run(f"fastopt-{fraction}"), run("reference"))


@slow
@pytest.mark.parametrize("option, fraction", [("stream_cpu_step", "1"), ("keep_gradients", "0.5")])
def test_the_cpu_step_streamed_into_backward_and_kept_gradients_end_there_too(run, option, fraction):
    """``stream_cpu_step=True``: each host bucket's update speculated as its gradients are
    reduce-scattered (clipping is on), checked at the step; ``keep_gradients=True``: the
    gradients stay in ``p.grad`` until the step (by default they leave during backward)."""
    _assert_same(run(f"fastopt-{fraction}", "adamw", option), run("reference"))


@slow
@pytest.mark.parametrize("clip", ["none", "50"], ids=["streamed", "speculated"])
def test_updates_started_in_backward_take_the_learning_rate_the_scheduler_set(run, clip):
    """The LR scheduler moves the learning rate every second step, after the step: each
    host bucket's update started during backward takes the rate the user's groups hold then.
    Streamed (no clipping), the run ends where ``ModelParallelStrategy`` ends; speculated
    (clipping that never fires), every update is kept, none redone.  (Until 2026-11-28 the
    rows' optimizer took the user's rates when the step began: a streamed update used the
    last step's, 6 weights and 12 moments off; a speculated one was redone.)"""
    ours = run("fastopt-1", "adamw", "stream_cpu_step", f"clip={clip}")
    _assert_same(ours, run("reference", "adamw", f"clip={clip}"))
    assert all(started == kept >= 6 for started, kept in ours.early), ours.early


@slow
@pytest.mark.parametrize("extra", [("nvme",), ("nvme", "resume"), ("nvme", "delayed"),
                                   ("nvme", "host_state_gib=0.000002", "resume")],
                         ids=["uninterrupted", "resumed", "delayed", "split-resumed"])
def test_the_rows_masters_and_state_on_disk_end_there_too(run, extra):
    """``offload_optimizer_device="nvme"``: each rank's offloaded rows' masters and AdamW
    state in a file of its own, read and written bucket by bucket through a window of two;
    the run, and one resumed from a distributed checkpoint (the state read from the files
    as it is saved), end where ``ModelParallelStrategy`` ends; delayed (after 2 steps), where
    torch's update delayed the same way ends."""
    _assert_same(run("fastopt-1", "adamw", *extra), run("reference", "adamw", *[e for e in extra[1:]
                                                                               if "host_state_gib" not in e]))


@slow
@pytest.mark.parametrize("extra", [("nvme", "model=wide"), ("nvme", "model=wide", "stream_cpu_step"),
                                   ("nvme", "model=wide", "host_state_dtype=bfloat16", "resume")],
                         ids=["synchronous", "speculated", "bfloat16-moments-resumed"])
def test_rows_larger_than_a_bucket_split_into_pieces_on_disk_end_there_too(run, extra):
    """Each rank's rows of the wide weights (1200 and 2400 elements) are larger than a
    bucket (``bucket_size_mb=0.0005``): on disk they are split into pieces
    (``lightning_fastopt/offload/pieces.py``); the run ends where ``ModelParallelStrategy``
    ends, speculated with clipping too, and one with bfloat16 moments resumed from a
    distributed checkpoint ends where the same with them in host memory ends (no torch
    reference keeps bfloat16 moments)."""
    ours = run("fastopt-1", "adamw", *extra)
    assert all(slots > params for slots, params in ours.pieces), ours.pieces
    if "host_state_dtype=bfloat16" in extra:
        _assert_same(ours, run("fastopt-1", "adamw", *[e for e in extra if e != "nvme"]))
    else:
        _assert_same(ours, run("reference", "adamw", *[e for e in extra if e not in ("nvme", "stream_cpu_step")]))


@slow
def test_the_mesh_left_to_the_strategy_shards_over_every_process(run):
    """``FastOptFSDPStrategy()`` with a ``configure_model`` that shards over
    ``device_mesh["data_parallel"]``, the sizes left at ``"auto"``: every process is
    data-parallel, so the run ends where ``ModelParallelStrategy(data_parallel_size=2)``
    ends (each rank its half of the rows and of the batches).  Under Lightning's default
    (data parallelism across nodes, tensor parallelism within) the data_parallel dimension
    had one rank on one node: nothing was sharded, and both ranks saw the same batches."""
    _assert_same(run("fastopt-0.5", "adamw", "mesh=auto"), run("reference"))


@slow
def test_offload_fraction_auto_chooses_on_each_ranks_shards_and_ends_there_too(run, tmp_path_factory):
    """``offload_fraction="auto"``: five steps with every row offloaded, the last three
    timed, then each rank's local optimizer rebuilt at the fraction rank 0 chose (here 0:
    the step is exact, nothing runs beside the CPU update, no memory budget) for the last
    step; the run ends where ``ModelParallelStrategy``'s ends.  (This run's second process
    is started by Lightning's launcher, as ``python train.py`` starts it; the ``run``
    fixture's runs start both at once.)"""
    out = tmp_path_factory.mktemp("fsdp-auto") / "run.pt"
    proc = run_script(SCRIPT, "fastopt-auto", "adamw", out)
    assert "offload_fraction='auto' chose 0:" in proc.stderr
    assert [float(Path(f"{out}.fraction.rank{r}").read_text()) for r in (0, 1)] == [0.0, 0.0]
    _assert_same([torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)], run("reference"))


@slow
@pytest.mark.parametrize("mode", [(), ("checkpointing",), ("resume",)], ids=["uninterrupted", "saving", "resumed"])
def test_the_delayed_update_ends_where_torchs_update_delayed_the_same_way_ends(run, mode):
    """``delayed_update=True`` after 2 steps at fraction 1 (each update's weights reach the
    model at the next step): as ``ModelParallelStrategy`` with torch's AdamW delayed by a
    callback (``tests.references.DelayedTorchUpdate``), clipping, accumulation and the LR
    scheduler on.  A checkpoint holds the model with the pending update applied (torch's
    layout has no place for it): the run that saves (at each epoch's end) matches the
    reference that gives the model its masters there, and the run resumed from the first
    epoch's checkpoint (its warm-up counted from the saved step) matches the reference's
    resume."""
    first = ("resume:reference",) if mode == ("resume",) else mode
    _assert_same(run("fastopt-1", "adamw", "delayed", *mode), run("reference", "adamw", "delayed", *first))


@slow
def test_the_delayed_update_with_nothing_offloaded_delays_nothing(run):
    _assert_same(run("fastopt-0", "adamw", "delayed"), run("reference"))


@slow
def test_bfloat16_host_moments_follow_float32_and_are_given_back_as_float32(run):
    """``host_state_dtype="bfloat16"`` on each rank's offloaded rows: no exact reference
    exists (stochastic rounding of the moments, the noise a function of each element's
    place in its rank's rows), so the weights after 6 steps of lr 1e-2 are within 2% of a
    step each of the float32 run's, and not equal to them (the moments were rounded); the
    state given back after fit is float32, as torch holds it."""
    ours, exact = run("fastopt-1", "adamw", "host_state_dtype=bfloat16"), run("fastopt-1")
    assert_bfloat16_moments_followed(ours, exact)


@slow
def test_bf16_mixed_too(run):
    _assert_same(run("fastopt-0.5", "adamw", "precision=bf16-mixed"), run("reference", "adamw", "precision=bf16-mixed"))


@slow
@pytest.mark.parametrize("fraction, option, devices", [("0", "", 2), ("1", "stream_cpu_step", 2), ("0.5", "", 4)])
def test_tensor_parallel_then_fsdp_ends_where_model_parallel_strategy_ends(run, fraction, option, devices):
    """Tensor parallelism (torch's ``parallelize_module`` on the mesh's ``tensor_parallel``
    dimension, 2-way), then ``fully_shard`` on its ``data_parallel`` one (1-way on two
    processes, 2-way on four): each rank steps its local piece of every parameter. The
    clipping norm, once the offloaded rows' gradients have left for the host, reduces each
    row norm over the mesh dimensions its parameter is sharded on, as DTensor reduces
    torch's: summed over every rank, a parameter tensor parallelism replicates (a
    row-parallel Linear's bias) counted twice, 3e-4 off after 6 steps, at every fraction
    (gradients copied as they are reduced: the norm comes from the rows even at fraction 0)."""
    mesh = ("tp=2", f"devices={devices}")
    _assert_same(run(f"fastopt-{fraction}", "adamw", *mesh, *([option] if option else [])),
                 run("reference", "adamw", *mesh))


@slow
@pytest.mark.parametrize("fraction, option", [("0.5", "stream_cpu_step"), ("1", "keep_gradients")])
def test_sequence_and_loss_parallelism_on_a_tensor_parallel_mesh_end_where_model_parallel_strategy_ends(
        run, fraction, option):
    """torch's recipe for a transformer block (``tests/scripts/fsdp_trainer_run.py``'s
    ``SequenceParallelNet``), as Lightning's tensor-parallel example applies it: the
    embedding split by rows (``RowwiseParallel``), LayerNorms under ``SequenceParallel``
    (weights replicated over the tensor-parallel ranks), the MLP split column- then
    row-wise, the head's output split over the classes and its cross entropy under
    ``loss_parallel``; on two processes the mesh is tensor-parallel only, and FSDP, as in
    the example, is not applied.  Nothing then hands the gradients over in their
    parameters' placements: the embedding's comes back whole (``Replicate()``) on each
    rank, and crashed the step until 2026-11-27 (a gradient of twice its rows' size); the
    LayerNorms' come back partial sums (``Partial()``), which torch's step adds up after
    the clipping multiplied each rank's part (reduced first, they ended 3e-8 away).  The
    embedding's is redistributed to its rows (offloaded), the LayerNorms' are taken at the
    step (on the device).  (Until 2026-11-27 the thread count, too: the strategy set
    torch's in every process, where ``ModelParallelStrategy``'s second process keeps
    torch's default, and the LayerNorms' gradients on the CPU depend on it:
    ``core/cpu_threads.py``.)"""
    mesh = ("tp=2", "model=sequence_parallel")
    _assert_same(run(f"fastopt-{fraction}", "adamw", *mesh, option), run("reference", "adamw", *mesh))


@slow
def test_an_optimizer_whose_step_may_span_rows_runs_as_torch_on_the_dtensors(run, tmp_path_factory):
    """A user's optimizer whose step takes norms over whole parameters (LARS's rule in torch,
    ``WholeTensorNorms``) sees DTensors under ``ModelParallelStrategy``; stepped on each
    rank's rows, its norms spanned only those (3e-3 off after 6 steps before 2026-11-26).
    It now runs as torch runs it, on the DTensors, and ends on the reference's bits (named
    in ``elementwise_optimizers`` it is stepped on the rows, as asked, and ends 3e-3 away:
    checked by hand with the script's ``elementwise=WholeTensorNorms``)."""
    out = tmp_path_factory.mktemp("fsdp-whole-norms") / "run.pt"
    proc = run_script(SCRIPT, "fastopt-0.5", "whole_norms", out, ranks=2)
    assert "WholeTensorNorms runs as torch runs it, on the DTensor parameters, not offloaded" in proc.stderr
    _assert_same([torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)], run("reference", "whole_norms"))


@slow
@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_half_weights_on_one_rank_end_where_fastopt_ends_in_one_process(run, precision):
    """``16-true`` (fp16 loss scaling, two overflows skipped) and ``bf16-true``: float32
    masters of the half weights, which ``ModelParallelStrategy`` does not keep, so the
    reference is ours without FSDP: one rank of ``fastopt_fsdp`` ends on the bits of
    ``FastOptStrategy`` in one process (with the batches in the one process's order: a
    one-rank ``ModelParallelStrategy`` and ``Trainer()`` end on the same bits that way,
    checked by hand). The fp16 run's clipping norm passed float16's range, scaled, from its
    fourth step: before 2026-11-26 the FSDP run read it as inf and clipped every gradient
    to zero there."""
    flags = ("devices=1", "no-distributed-sampler", f"precision={precision}")
    _assert_same(run("fastopt-0.5", "adamw", *flags), run("single-0.5", "adamw", *flags))


@slow
def test_lamb_on_one_rank_ends_where_fastopt_ends_in_one_process(run, tmp_path_factory):
    """FusedLAMB, whose trust ratios and clipping norm span whole parameters: each rank's
    sums over its rows are added over the ranks (``tests/test_fsdp_local_shards.py`` has two
    ranks against the unsharded model, within a tolerance); on one rank they are the whole
    parameters', and the run ends on the bits of ``FastOptStrategy`` in one process
    (clipping by ``gradient_clip_val`` and LAMB's own ``max_grad_norm``, accumulation).
    ``stream_cpu_step=True`` is not used with it (the norms are summed when the step
    starts), as one log line says."""
    flags = ("devices=1", "no-distributed-sampler")
    out = tmp_path_factory.mktemp("fsdp-lamb") / "run.pt"
    proc = run_script(SCRIPT, "fastopt-0.5", "lamb", out, *flags, "stream_cpu_step", ranks=1)
    assert ("stream_cpu_step=True not used: FusedLAMB reads norms over whole parameters, summed over every rank's "
            "rows when the step starts") in proc.stderr
    _assert_same([torch.load(f"{out}.rank0", weights_only=True)], run("single-0.5", "lamb", *flags))


@slow
@pytest.mark.parametrize("form", ["1-size"])
def test_the_one_line_form_shards_the_model_itself_and_ends_there_too(run, form):
    """No ``configure_model``: ``FastOptFSDPStrategy(auto_wrap_policy={nn.Linear})``, or
    modules of at least ``min_num_params``, with the mesh sizes left to it."""
    _assert_same(run(f"fastopt-{form}"), run("reference"))


@slow
def test_the_one_line_form_shards_tied_embeddings_with_their_common_root(run):
    """Input and output embeddings sharing one parameter cannot each be a root: the
    LightningModule is, as a project's configure_model shards it (``fully_shard(self)``)."""
    _assert_same(run("fastopt-0.5-classes", "adamw", "model=tied"), run("reference", "adamw", "model=tied"))


@slow
@pytest.mark.parametrize("strategy, first, kind", [
    ("fastopt-0.5", "fastopt-0.5", "distributed"), ("fastopt-1", "reference", "distributed"),
    ("reference", "fastopt-0", "distributed"), ("fastopt-0.5", "fastopt-0.5", "full"),
    ("reference", "fastopt-1", "full")])
def test_a_checkpoint_resumes_as_under_model_parallel_strategy(run, strategy, first, kind):
    """Written and resumed by ours, written by ``ModelParallelStrategy`` and resumed by ours,
    and back, a directory of shards or one full file: each ends where
    ``ModelParallelStrategy``'s own resume ends.  (A full checkpoint of ours held one Adam
    step count for every parameter, the engine's per group: torch's AdamW resumed from it
    counted each parameter's step into it.)"""
    extra = ("checkpoint=full",) if kind == "full" else ()
    _assert_same(run(strategy, "adamw", f"resume:{first}", *extra), run("reference", "adamw", "resume:reference", *extra))


@slow
@pytest.mark.parametrize("first, then, devices", [("fastopt-0.5", "fastopt-1", (2, 1))])
def test_a_distributed_checkpoint_resumes_at_another_world_size(run, first, then, devices):
    """Written on two processes, resumed on one: ours ends where ``ModelParallelStrategy``
    resuming the same checkpoint ends (DCP re-shards it; the other way round, 1 to 2,
    was checked by hand, 2026-11-26)."""
    path = run(first, "adamw", "first-only", f"devices={devices[0]}")
    ours = run(then, "adamw", f"from={path}", f"devices={devices[1]}")
    ref = run("reference", "adamw", f"from={path}", f"devices={devices[1]}")
    assert len(ours) == len(ref) == devices[1]
    _assert_same(ours, ref)


@slow
def test_a_distributed_checkpoint_consolidates_into_one_file_that_resumes_as_the_directory_does(run, tmp_path):
    """``python -m lightning_fastopt.checkpoint consolidate DIR FILE`` on a directory of
    shards written by ours or by ``ModelParallelStrategy``: one file that
    ``torch.load(weights_only=True)`` reads, with a full checkpoint's layout (the optimizer
    states under ``optimizer_states``, every tensor whole), from which our strategy and
    ``ModelParallelStrategy`` resume to the bits of the resume from the directory.  (Until
    2026-11-27 our command said "not a sharded lightning_fastopt checkpoint"; Lightning's
    own fails with ``KeyError: 'model'``.)"""
    for writer in ("reference", "fastopt-0.5"):
        directory = run(writer, "adamw", "first-only", "devices=2")  # the world-size test's run, made once
        file = tmp_path / f"{writer}.ckpt"
        proc = run_script("-m", "lightning_fastopt.checkpoint", "consolidate", directory, file)
        assert f"wrote {file}: 1 optimizer state(s), 6 parameter state(s)" in proc.stdout
        checkpoint = torch.load(file, weights_only=True)
        assert int(checkpoint["global_step"]) == 3 and len(checkpoint["optimizer_states"]) == 1
        assert checkpoint["state_dict"]["net.0.weight"].shape == (33, 8)  # whole, not a rank's rows
    from_directory = run("fastopt-0.5", "adamw", f"from={directory}")  # ours
    for strategy in ("fastopt-0.5", "reference"):
        _assert_same(run(strategy, "adamw", f"from={file}"), from_directory)


def _two_nodes(strategy, out):
    """``strategy``'s run on two nodes of one process each, launched as a cluster would:
    torchrun once per node (``--nnodes 2 --node-rank i``) on this machine."""
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               str(SCRIPT), strategy, "adamw", str(out), "devices=1", "nodes=2"], cwd=REPO,
                              env=subprocess_env(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    for node in nodes:
        _, err = node.communicate(timeout=600)
        assert node.returncode == 0, err[-3000:]
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)]


@slow
def test_two_nodes_under_torchrun_end_where_model_parallel_strategy_ends(tmp_path):
    """Two nodes (torchrun ``--nnodes 2`` on localhost), one process each: bit for bit with
    the same launch under ``ModelParallelStrategy``."""
    _assert_same(_two_nodes("fastopt-0.5", tmp_path / "ours.pt"), _two_nodes("reference", tmp_path / "ref.pt"))


@slow
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL after the shards of a second save to the same path are written, before its
    metadata: the path still holds the first save whole (saved in place, as Lightning
    saves, it held the new shards beside the old metadata), and a new run resumes from it."""
    script = REPO / "tests" / "scripts" / "fsdp_kill_run.py"
    killed = run_script(script, "save", tmp_path, check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    staging = [p.name for p in tmp_path.glob(".last.ckpt.*.tmp")]  # the killed save's
    run_script(script, "resume", tmp_path)
    saved, loaded = (torch.load(tmp_path / f, weights_only=True) for f in ("saved.pt", "resumed.pt"))
    assert loaded["global_step"] == saved["global_step"] == 3
    for name, weight in saved["weights"].items():
        assert torch.equal(loaded["weights"][name], weight), name
    assert len(staging) == 1  # what the killed save left beside it (the next save to the path removes it)


@pytest.mark.cuda
@pytest.mark.parametrize("fraction, option", [("1", "keep_gradients"), ("1", "stream_cpu_step"), ("0.5", "")])
def test_on_one_gpu_fastopt_fsdp_ends_where_model_parallel_strategy_ends(run, fraction, option):
    """On one GPU (FSDP over one rank, NCCL): our CUDA and CPU kernels on the shards, the
    copies on their streams, against torch's AdamW stepping the DTensors (its foreach
    step on CUDA), with clipping and accumulation (benchmarks/gpu_session.sh rest)."""
    gpu = ("accelerator=cuda", "devices=1")
    _assert_same(run(f"fastopt-{fraction}", "adamw", *gpu, *([option] if option else [])),
                 run("reference", "adamw", *gpu))


@slow
def test_lamb_at_the_fraction_auto_chooses_keeps_the_whole_parameters_norms(run):
    """``offload_fraction="auto"`` rebuilds each rank's local optimizer at the chosen
    fraction for the last step: the rebuilt one sums the rows' norms over the ranks too
    (it did not at first: 3e-5 off), so the run ends on the bits of a fixed fraction's
    (the fraction does not change LAMB's bits here: 0 and 0.5 end alike)."""
    _assert_same(run("fastopt-auto", "lamb"), run("fastopt-0.5", "lamb"))


@pytest.mark.cuda
def test_lamb_on_one_gpu_ends_near_fastopt_in_one_process(run):
    """FusedLAMB on one GPU: the device rows' updates take the norms summed over the ranks
    (here one; LAMB's update norms from the pure-PyTorch path, given to the CUDA kernels,
    which round them to float32), against the CUDA kernels' own norms in one process: no
    exact reference, within 1e-5 after 6 steps of lr 1e-2 (not yet run on a GPU: planned
    in ``benchmarks/gpu_session.sh rest``)."""
    flags = ("accelerator=cuda", "devices=1", "no-distributed-sampler")
    for a, b in zip(run("fastopt-0.5", "lamb", *flags), run("single-0.5", "lamb", *flags)):
        for key in (k for k in b if k.startswith("weight/")):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_registered_as_fastopt_fsdp_and_fastopt_fsdp_offload_in_both_packages(package):
    import importlib

    import lightning_fastopt

    pl = importlib.import_module(package)
    front = importlib.import_module(FRONT_ENDS[package])
    registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
    for name, fraction in (("fastopt_fsdp", 0.0), ("fastopt_fsdp_offload", 1.0)):
        strategy = registry.get(name)
        assert isinstance(strategy, front.FastOptFSDPStrategy)
        assert isinstance(strategy, pl.strategies.ModelParallelStrategy)
        assert strategy.offload_fraction == fraction
    assert lightning_fastopt.FastOptFSDPStrategy is importlib.import_module(
        "lightning_fastopt.trainer.lightning_pytorch").FastOptFSDPStrategy


def test_bad_arguments_are_refused_when_built_naming_them():
    from lightning_fastopt import FastOptFSDPStrategy

    with pytest.raises(TypeError, match=r"'data_paralel_size' \(did you mean 'data_parallel_size'\?\).*"
                                        r"ModelParallelStrategy's"):
        FastOptFSDPStrategy(data_paralel_size=2)
    with pytest.raises(ValueError, match="offload_fraction must be in"):
        FastOptFSDPStrategy(offload_fraction=1.5)
    with pytest.raises(ValueError, match="gpu_memory_budget_gb is for offload_fraction='auto'"):
        FastOptFSDPStrategy(offload_fraction=0.5, gpu_memory_budget_gb=10)
    auto = FastOptFSDPStrategy(offload_fraction="auto")
    assert auto.options.auto_fraction and auto.offload_fraction == 1.0  # the probe starts with every row offloaded
    with pytest.raises(TypeError, match="copy_on_cpu must be True or False"):
        FastOptFSDPStrategy(copy_on_cpu="yes")
    # FastOptStrategy's arguments that FSDP does not take, each with its reason
    with pytest.raises(ValueError, match=r"forward_waits must be one of \('step', 'module'\), got 'unit'"):
        FastOptFSDPStrategy(forward_waits="unit")
    assert FastOptFSDPStrategy(forward_waits="module", offload_parameters=True).options.forward_waits == "module"
    with pytest.raises(ValueError, match=r"does not take zero_stage \(zero_stage=2\): FSDP shards .* itself"):
        FastOptFSDPStrategy(zero_stage=2)
    strategy = FastOptFSDPStrategy(offload_fraction=0.25, data_parallel_size=2, tensor_parallel_size=1,
                                   save_distributed_checkpoint=False)
    assert strategy.offload_fraction == 0.25 and strategy._data_parallel_size == 2
    assert strategy._save_distributed_checkpoint is False
    with pytest.raises(TypeError, match="auto_wrap_policy must be a set of torch.nn.Module classes"):
        FastOptFSDPStrategy(auto_wrap_policy=lambda module: True)
    with pytest.raises(ValueError, match="min_num_params must be a positive integer"):
        FastOptFSDPStrategy(min_num_params=0)
    with pytest.raises(TypeError, match=r"elementwise_optimizers must be optimizer classes or class names.*got 3"):
        FastOptFSDPStrategy(elementwise_optimizers=3)
    assert FastOptFSDPStrategy(elementwise_optimizers=torch.optim.Adafactor).options.elementwise_optimizers == (
        "Adafactor",)
    assert FastOptFSDPStrategy(auto_wrap_policy=torch.nn.Linear)._auto_wrap_classes == (torch.nn.Linear,)


def test_a_full_checkpoint_does_not_replace_a_directory_that_is_not_a_checkpoint(tmp_path, monkeypatch):
    """As ``ModelParallelStrategy`` (and Fabric's) refuse it: the staged save would have
    moved the directory, and what it held, out of the way (Lightning's
    ``test_save_checkpoint_path_exists`` with our strategy swapped in)."""
    from lightning_fastopt import FastOptFabricFSDPStrategy, FastOptFSDPStrategy

    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for strategy in (FastOptFSDPStrategy(save_distributed_checkpoint=False),
                     FastOptFabricFSDPStrategy(save_distributed_checkpoint=False)):
        monkeypatch.setattr(strategy, "broadcast", lambda obj, src=0: obj)
        with pytest.raises(IsADirectoryError, match="The checkpoint path exists and is a directory"):
            if isinstance(strategy, FastOptFSDPStrategy):
                strategy.save_checkpoint({}, folder)
            else:
                strategy.save_checkpoint(folder, {})
    assert (folder / "notes.txt").read_text() == "mine"


def test_mesh_sizes_left_to_the_strategy_and_a_mesh_that_shards_nothing_said(caplog):
    import logging

    from lightning_fastopt.fsdp.mesh_sizes import resolved_mesh_sizes, say_if_nothing_is_sharded

    assert resolved_mesh_sizes("auto", "auto", 8) == (8, 1)
    assert resolved_mesh_sizes("auto", 2, 8) == (4, 2)
    assert resolved_mesh_sizes(2, "auto", 8) == (2, 4)
    assert resolved_mesh_sizes(1, 8, 8) == (1, 8)
    with caplog.at_level(logging.INFO):
        say_if_nothing_is_sharded(4, 8)
        say_if_nothing_is_sharded(1, 1)
        assert not caplog.records
        say_if_nothing_is_sharded(1, 8)
    assert "data_parallel dimension has 1 of 8 processes: fully_shard over it shards nothing" in caplog.text


def test_a_module_with_parameters_of_its_own_is_left_to_configure_model():
    from lightning_fastopt.fsdp.auto_shard import shard_model

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1))
            self.body = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"Holder holds parameters of its own \(scale\).*configure_model"):
        shard_model(Holder(), mesh=None, classes=(), min_num_params=1)
