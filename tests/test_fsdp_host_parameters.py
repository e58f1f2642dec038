"""Parameters in host memory under FSDP2 (issue 52): ``FastOptFSDPStrategy(offload_parameters=True)``
on torch's ``CPUOffloadPolicy``, the host shards the master weights, updated in place by the
CPU kernels (``lightning_fastopt/fsdp/host_parameters.py``).  Against Lightning's
``ModelParallelStrategy`` with the same model under ``CPUOffloadPolicy`` and torch's AdamW,
two gloo processes, clipping, gradient accumulation and an LR scheduler on
(``tests/scripts/fsdp_trainer_run.py host_params``)."""

import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_fastopt import FastOptFabricFSDPStrategy, FastOptFSDPStrategy
from lightning_fastopt.fsdp.host_parameters import (check_host_shards, host_shard_arguments, host_sharded,
                                                    materialize_on_the_host, move_all_but_fsdp_parameters)
from tests.helpers import assert_bfloat16_moments_followed, run_counts, run_script

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp_trainer_run.py"
slow = pytest.mark.slow


class Run(NamedTuple):
    results: list[dict]  # each rank's weights and optimizer state
    apart: list  # each rank's (masters kept apart from the weights, parameters)
    early: list  # each rank's (host bucket updates started during backward, of them kept by the steps)
    pieces: list  # each rank's (slots, parameters) of its local optimizer (more slots: split on disk)
    left: list  # each rank's (host bucket updates the steps left running,)
    landings: list  # each rank's (host shards with a post-accumulate-grad hook, FSDP groups telling of landings)
    log: str  # what rank 0 printed


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Each run's two ranks (a :class:`Run`), run once per module."""
    runs = {}

    def fit(strategy, *extra):
        key = (strategy, *extra)
        if key not in runs:
            out = tmp_path_factory.mktemp("host") / "run.pt"
            ranks = range(1 if "devices=1" in extra else 2)
            proc = run_script(SCRIPT, strategy, "adamw", out, *extra, ranks=len(ranks))
            runs[key] = Run([torch.load(f"{out}.rank{r}", weights_only=True) for r in ranks],
                            run_counts(out, "masters_apart", ranks), run_counts(out, "early_updates", ranks),
                            run_counts(out, "pieces", ranks), run_counts(out, "left_running", ranks),
                            run_counts(out, "landings", ranks), proc.stdout + proc.stderr)
        return runs[key]
    return fit


def _assert_same(ours, ref):
    for a, b in zip(ours, ref):
        assert a.keys() == b.keys() and int(a["global_step"]) == 6
        assert any(k.startswith("state/") for k in a)
        for key in b:
            assert torch.equal(a[key], b[key]), key


@slow
@pytest.mark.parametrize("form", ["fastopt-1", "fastopt-1-classes"], ids=["configure_model", "one-line"])
def test_host_shards_are_the_masters_and_end_where_model_parallel_strategy_ends(run, form):
    """The project's ``configure_model`` passing the policy, or the one-line form applying it:
    weights and AdamW state bit for bit ``ModelParallelStrategy``'s under the policy, and no
    float32 master kept apart from the weights (through ``copy_on_cpu=True`` too: the host
    shards are the masters on every machine)."""
    ours = run(form, "host_params")
    apart = ours.apart
    _assert_same(ours.results, run("reference", "host_params").results)
    assert all(a is not None and a[0] == 0 and a[1] > 0 for a in apart), apart
    kept_apart = run("fastopt-1").apart  # without the policy, the accelerator's path keeps masters apart
    assert all(a[0] == a[1] > 0 for a in kept_apart), kept_apart


@slow
@pytest.mark.parametrize("first", ["reference", "fastopt-1"])
def test_a_checkpoint_under_the_policy_resumes_as_under_model_parallel_strategy(run, first):
    """Half the steps under ``ModelParallelStrategy`` with the policy, or under ours, saved (a
    distributed checkpoint), resumed under ours to the end: where ``ModelParallelStrategy``'s
    own resume ends."""
    ours = run("fastopt-1", "host_params", f"resume:{first}").results
    _assert_same(ours, run("reference", "host_params", "resume:reference").results)


@slow
@pytest.mark.parametrize("checkpoint", [(), ("checkpoint=full",)], ids=["distributed", "full"])
def test_our_checkpoint_under_the_policy_resumes_under_model_parallel_strategy(run, checkpoint):
    """The other way: half the steps under ours with the host shards, saved (a distributed
    checkpoint, or one full file), resumed under ``ModelParallelStrategy`` with the policy
    and torch's AdamW: where its own run resumed from its own checkpoint ends."""
    ours = run("reference", "host_params", "resume:fastopt-1", *checkpoint).results
    _assert_same(ours, run("reference", "host_params", "resume:reference", *checkpoint).results)


@slow
@pytest.mark.parametrize("extra", [("precision=bf16-mixed",), ("resume:reference", "checkpoint=full"),
                                   ("resume:reference", "checkpoint=full", "empty_init"), ("nvme",),
                                   ("nvme", "model=wide")],
                         ids=["bf16-mixed", "full-checkpoint-resumed", "meta-model-read-from-a-full-checkpoint",
                              "state-on-disk", "state-on-disk-in-pieces"])
def test_what_users_combine_with_it(run, extra):
    """bf16-mixed (autocast over the float32 host shards), a full checkpoint (one file)
    written under ``ModelParallelStrategy`` with the policy, resumed under ours (into a model
    built on the meta device too: made in host memory, then each parameter read from the
    file into its host shards), and AdamW's state on disk (``offload_optimizer_device="nvme"``:
    the shards stay the masters, in host memory; with rows larger than a bucket, each piece's
    master its range of the shard): where the reference doing the same ends."""
    reference = [e for e in extra if e not in ("nvme", "empty_init")]
    ours = run("fastopt-1", "host_params", *extra)
    _assert_same(ours.results, run("reference", "host_params", *reference).results)
    if "model=wide" in extra:
        assert all(slots > params for slots, params in ours.pieces) and all(a[0] == 0 for a in ours.apart)


STREAMED = {"streamed": ("clip=none",), "speculated-and-kept": ("clip=50",),
            "speculated-and-redone": (), "activation-checkpointing": ("clip=50", "activation_checkpointing"),
            "state-on-disk-kept": ("clip=50", "nvme"), "state-on-disk-redone": ("nvme",),
            "state-on-disk-in-pieces-redone": ("nvme", "model=wide")}


@slow
@pytest.mark.parametrize("extra", STREAMED.values(), ids=STREAMED.keys())
def test_each_buckets_update_runs_in_place_as_fsdp_hands_its_gradients_over(run, extra):
    """``stream_cpu_step=True`` (through ``copy_on_cpu=True``, the accelerator's path): each
    host bucket's CPU update starts during backward, in place on the host shards, once FSDP
    has handed over its last gradient, and the run ends where ``ModelParallelStrategy``
    ends.  Without clipping the updates are streamed; with clipping they are speculated and
    checked at the step: every one kept where the clipping never fires
    (``gradient_clip_val=50``; FSDP accumulating a unit's later gradient moves the version
    counter of the others, views of one reduce-scatter output: no redo for that), every
    one redone where it does (0.5: the first two steps, then held back); with activation
    checkpointing (FSDP gathers each unit again for its recomputation) as well; with AdamW's
    state on disk too (a speculated update's state written beside the last in the file, the
    shards updated in place kept aside in host memory until the step keeps or undoes it)."""
    ours = run("fastopt-1", "host_params", "stream_cpu_step", *extra)
    _assert_same(ours.results, run("reference", "host_params", *[e for e in extra if e != "nvme"]).results)
    assert all(a == (0, 6) for a in ours.apart), ours.apart  # the shards are still the masters
    assert all((slots > params) == ("model=wide" in extra) for slots, params in ours.pieces), ours.pieces
    started = [early for early, _ in ours.early]
    assert all(n >= 6 for n in started), ours.early  # (at least a bucket each step, on each rank)
    kept = [kept for _, kept in ours.early]
    assert kept == ([0, 0] if "clip=none" not in extra and "clip=50" not in extra else started), ours.early
    # told of each gradient by its FSDP group, not by post-accumulate-grad hooks (FSDP's copies would block)
    assert all(hooked == 0 and groups == 3 for hooked, groups in ours.landings), ours.landings  # (3 Linears)
    assert "handed over none" not in ours.log


ENDING_EARLY = {"streamed": ("stream_cpu_step", "clip=none"), "at-the-step": (),
                "speculated-and-redone": ("stream_cpu_step",),
                "bf16-mixed-streamed": ("stream_cpu_step", "clip=none", "precision=bf16-mixed"),
                "activation-checkpointing-speculated-and-kept": ("stream_cpu_step", "clip=50",
                                                                 "activation_checkpointing"),
                "validated-at-each-epochs-end": ("stream_cpu_step", "clip=none", "validate"),
                "state-on-disk-speculated-and-redone": ("stream_cpu_step", "nvme"),
                "state-on-disk-in-pieces-at-the-step": ("nvme", "model=wide")}


@slow
@pytest.mark.parametrize("extra", ENDING_EARLY.values(), ids=ENDING_EARLY.keys())
def test_steps_that_end_before_their_updates_each_unit_waiting_for_its_rows(run, extra):
    """``forward_waits="module"`` with the host shards: every step ends before the CPU
    updates it leaves (streamed, at the step, speculated and redone), each FSDP unit's
    forward waiting for its own rows' updates, and the run ends where
    ``ModelParallelStrategy`` ends (with activation checkpointing too: FSDP gathers each
    unit again for its recomputation; validated after each epoch's last step, whose updates
    the validation waits for: the same loss; AdamW's state on disk, read ahead in the order
    the worker takes the buckets, whole or in pieces).  Where every speculation is kept
    nothing is left; where updates stream into backward unchecked, what is left depends on
    how far the worker got before the step (every one, on a loaded machine: none left;
    ``-k ends_before_its_updates`` holds the worker to check it)."""
    ours = run("fastopt-1", "host_params", "forward_waits=module", *extra)
    _assert_same(ours.results, run("reference", "host_params",
                                   *[e for e in extra if e not in ("stream_cpu_step", "nvme")]).results)
    kept, streamed = "clip=50" in extra, "stream_cpu_step" in extra and "clip=none" in extra
    assert all(left == 0 if kept else (streamed or left > 0) for left, in ours.left), ours.left
    assert "each FSDP unit's forward waits only for its own rows' CPU updates" in ours.log


@slow
def test_a_checkpoint_saved_after_a_step_that_ended_early_holds_its_updates(run):
    """Half the steps under ours with every step ending before its updates (the last one's
    still running when the fit saves its checkpoint, which waits for them), resumed under
    ``ModelParallelStrategy`` with the policy: where its own resume ends."""
    ours = run("reference", "host_params", "resume:fastopt-1", "forward_waits=module", "stream_cpu_step").results
    _assert_same(ours, run("reference", "host_params", "resume:reference").results)


@slow
def test_with_the_shards_on_the_device_the_step_waits_for_its_updates_and_says_why(run):
    """``forward_waits="module"`` without the host shards: FSDP gathers the device shards on
    streams of its own, which wait for the whole step: not used, said in one line; the run
    ends where ``ModelParallelStrategy`` ends."""
    ours = run("fastopt-1", "forward_waits=module", "stream_cpu_step")
    _assert_same(ours.results, run("reference").results)
    assert all(left == 0 for left, in ours.left), ours.left
    assert "forward_waits='module' not used: FSDP keeps the parameter shards on the device" in ours.log


HALF = {"bf16-true": ("precision=bf16-true",), "16-true": ("precision=16-true",),
        "bf16-true-streamed": ("precision=bf16-true", "clip=none", "+stream_cpu_step"),
        "16-true-speculated-and-redone": ("precision=16-true", "+stream_cpu_step"),
        "16-true-speculated-and-kept": ("precision=16-true", "clip=50", "+stream_cpu_step"),
        "bf16-true-streamed-ending-early": ("precision=bf16-true", "clip=none", "+stream_cpu_step",
                                           "+forward_waits=module"),
        "16-true-speculated-and-redone-ending-early": ("precision=16-true", "+stream_cpu_step",
                                                      "+forward_waits=module")}


@slow
@pytest.mark.parametrize("extra", HALF.values(), ids=HALF.keys())
def test_half_host_shards_on_one_rank_end_where_fastopt_ends_in_one_process(run, extra):
    """``bf16-true`` and ``16-true`` (fp16 loss scaling, two overflows skipped) under the
    policy: the host shards are half, each with a float32 master beside it in host memory
    (which ``ModelParallelStrategy`` does not keep), so the reference is ours without FSDP:
    one rank ends on the bits of ``FastOptStrategy`` in one process (the batches in its
    order), synchronous, streamed, and speculated with the updates redone or kept (and with
    every step ending before its updates, ``forward_waits="module"``: the half shard each
    writes in place is what the next forward's units wait for).  Two
    causes this found: an update streamed into backward writes the half shard in place, and
    the check for weights others wrote (made at the step for the host shards) took that
    write for another's and rounded the masters to it; and a step skipped for an overflow
    undid the speculated updates only at ``zero_grad``, after Lightning's next forward had
    read the speculated shards (every later step overflowed)."""
    flags = ("devices=1", "no-distributed-sampler", *(e for e in extra if not e.startswith("+")))
    ours = run("fastopt-1", "host_params", *flags, *(e[1:] for e in extra if e.startswith("+")))
    _assert_same(ours.results, run("single-1", *flags).results)
    assert ours.apart[0][0] == ours.apart[0][1] > 0  # every half shard has its master apart
    if "+stream_cpu_step" in extra:
        started, kept = ours.early[0]
        assert started >= 6 * 2 and (kept > 0) == ("clip=none" in extra or "clip=50" in extra), ours.early
    assert (ours.left[0][0] > 0) == ("+forward_waits=module" in extra), ours.left  # steps that ended early


@slow
def test_bfloat16_moments_beside_the_host_shards(run):
    """``host_state_dtype="bfloat16"`` (12 bytes a parameter in host memory with AdamW): the
    moments stochastically rounded, so no exact reference: within 2% of a step each of the
    float32 run's weights after 6 steps of lr 1e-2, not equal to them, the state given
    back as float32."""
    ours = run("fastopt-1", "host_params", "host_state_dtype=bfloat16").results
    exact = run("fastopt-1", "host_params").results
    assert_bfloat16_moments_followed(ours, exact)


@slow
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL after the shards of a second save to the same path are written, before its
    metadata, with the shards in host memory: the path still holds the first save whole, and
    a new run resumes from it (``tests/scripts/fsdp_kill_run.py host_params``)."""
    script = SCRIPT.parent / "fsdp_kill_run.py"
    killed = run_script(script, "save", tmp_path, "host_params", check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    run_script(script, "resume", tmp_path, "host_params")
    saved, loaded = (torch.load(tmp_path / f, weights_only=True) for f in ("saved.pt", "resumed.pt"))
    assert loaded["global_step"] == saved["global_step"] == 3
    for name, weight in saved["weights"].items():
        assert torch.equal(loaded["weights"][name], weight), name


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["fastopt-1", "fastopt-1-classes"], ids=["configure_model", "one-line"])
def test_on_one_gpu_the_host_shards_end_where_model_parallel_strategy_ends(run, form):
    """On one GPU (NCCL): FSDP copies each unit's host shards up for forward and backward and
    the gradients down; our CPU kernels update the shards in place; against torch's AdamW
    stepping the same host DTensors under ``ModelParallelStrategy`` (benchmarks/gpu_session.sh
    rest).  The one-line form pins the host shards; the reference's policy does not."""
    gpu = ("accelerator=cuda", "devices=1")
    ours = run(form, "host_params", *gpu)
    _assert_same(ours.results, run("reference", "host_params", *gpu).results)
    assert ours.apart[0] is not None and ours.apart[0][0] == 0


FABRIC_SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp_fabric_run.py"


def _fabric_loop(tmp_path, strategy, *extra):
    out = tmp_path / f"{strategy}.pt"
    run_script(FABRIC_SCRIPT, strategy, out, *extra, ranks=2)
    apart = [Path(f"{out}.masters_apart.rank{r}") for r in (0, 1)]
    return ([torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)],
            [tuple(map(int, a.read_text().split())) if a.exists() else None for a in apart])


@slow
@pytest.mark.parametrize("form, extra", [("fastopt-1", ()), ("fastopt-1-classes", ()), ("fastopt-1", ("nvme",))],
                         ids=["parallelize_fn", "sharded-by-the-strategy", "state-on-disk"])
def test_in_a_fabric_loop_too(tmp_path, form, extra):
    """``FastOptFabricFSDPStrategy(offload_parameters=True)``: a Fabric loop with
    ``fabric.clip_gradients`` and accumulation ends where Fabric's ``ModelParallelStrategy``
    with the same policy and torch's AdamW ends, with no master kept apart (and with AdamW's
    state on disk, ``offload_optimizer_device="nvme"``)."""
    ours, apart = _fabric_loop(tmp_path, form, "host_params", "grads=free", *extra)
    ref, _ = _fabric_loop(tmp_path, "reference", "host_params")
    for a, b in zip(ours, ref):
        assert a.keys() == b.keys() and any(k.startswith("state/") for k in a)
        for key in b:
            assert torch.equal(a[key], b[key]), key
    assert all(a is not None and a[0] == 0 and a[1] > 0 for a in apart), apart


# ---------------------------------------------------------------------------- the arguments
def test_offload_parameters_takes_a_bool_with_everything_offloaded_and_no_delayed_update():
    assert FastOptFSDPStrategy(offload_parameters=True).options.offload_parameters
    assert not FastOptFSDPStrategy().options.offload_parameters
    assert FastOptFabricFSDPStrategy(offload_parameters=True).options.offload_parameters
    with pytest.raises(ValueError, match=r"offload_fraction must be 1.0, got 0.0"):
        FastOptFabricFSDPStrategy(offload_parameters=True, offload_fraction=0.0)
    with pytest.raises(TypeError, match="offload_parameters must be True or False, got 'yes'"):
        FastOptFSDPStrategy(offload_parameters="yes")
    with pytest.raises(ValueError, match=r"offload_parameters=True .* offload_fraction must be 1.0, got 0.5"):
        FastOptFSDPStrategy(offload_parameters=True, offload_fraction=0.5)
    with pytest.raises(ValueError, match=r"offload_fraction must be 1.0, got 'auto'"):
        FastOptFSDPStrategy(offload_parameters=True, offload_fraction="auto")
    with pytest.raises(ValueError, match="delayed_update=True .* cannot be used with it"):
        FastOptFSDPStrategy(offload_parameters=True, delayed_update=True)


def test_the_one_line_form_applies_torchs_policy_pinned_on_a_gpu_only():
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert host_shard_arguments(False, torch.device("cuda"), True) == {}
    on_gpu = host_shard_arguments(True, torch.device("cuda"), True)["offload_policy"]
    assert isinstance(on_gpu, CPUOffloadPolicy) and on_gpu.pin_memory
    assert not host_shard_arguments(True, torch.device("cpu"), True)["offload_policy"].pin_memory
    assert not host_shard_arguments(True, torch.device("cuda"), False)["offload_policy"].pin_memory


# ---------------------------------------------------------------------------- placement, in one process
@pytest.fixture
def one_process(tmp_path):
    """A gloo process group of one (fully_shard needs one)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_model_under_the_policy_in_part_or_not_at_all_is_said(one_process):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=False)
    whole = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    for layer in whole:
        fully_shard(layer, mesh=one_process, offload_policy=policy)
    assert host_sharded(whole) and check_host_shards(whole, True)
    plain = nn.Sequential(nn.Linear(4, 8))
    fully_shard(plain[0], mesh=one_process)
    assert not host_sharded(plain) and not check_host_shards(plain, False)
    with pytest.raises(ValueError, match=r"configure_model must pass offload_policy=CPUOffloadPolicy\(\) to each "
                                         r"fully_shard call"):
        check_host_shards(plain, True)
    mixed = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(mixed[0], mesh=one_process, offload_policy=policy)
    fully_shard(mixed[1], mesh=one_process)
    with pytest.raises(ValueError, match="2 of the 4 parameters fully_shard manages are in host memory"):
        host_sharded(mixed)


def test_moving_the_model_leaves_fsdps_parameters_where_it_put_them(one_process):
    """Buffers and parameters no fully_shard manages go to the device (here: the meta device,
    which any machine has), FSDP's stay; a parameter two modules hold moves once."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
    fully_shard(model[0], mesh=one_process, offload_policy=CPUOffloadPolicy(pin_memory=False))
    shared = nn.Parameter(torch.ones(3))
    model[1].extra, model[2].extra = shared, shared
    move_all_but_fsdp_parameters(model, torch.device("meta"))
    assert all(p.device.type == "cpu" for p in model[0].parameters())  # FSDP's DTensors, on the host
    assert model[1].running_mean.is_meta and model[2].weight.is_meta and model[1].weight.is_meta
    assert model[1].extra is model[2].extra and model[1].extra.is_meta


class _CopyInFlight:
    """Stands for FSDP's ``grad_offload_event``: the pinned copy of a gradient into host
    memory, still on its way when FSDP hands the gradient over.  Until it is waited for,
    the gradient's rows read NaN (what pinned memory holds meanwhile is anything); the
    first wait puts their values in.  Every wait is logged with its thread."""

    def __init__(self, log, param, rows):
        self.log, self.param, self.rows, self.values = log, param, rows, rows.clone()
        rows.fill_(float("nan"))
        log.append(("announced", param, threading.current_thread()))

    def synchronize(self):
        if self.values is not None:
            self.rows.copy_(self.values)
            self.values = None
        self.log.append(("waited", self.param, threading.current_thread()))


def _copies_in_flight(model, log):
    """Each FSDP group's gradient copies left in flight by its ``post_backward`` (as torch
    leaves them in pinned memory where no post-accumulate-grad hook is registered)."""
    from lightning_fastopt.fsdp.host_parameters import host_param_groups

    for group in host_param_groups(model):
        def post_backward(*args, group=group, torchs=group.post_backward):
            grads = {fp: fp.sharded_param.grad for fp in group.fsdp_params}
            out = torchs(*args)
            for fp, old in grads.items():
                grad = fp.sharded_param.grad
                if grad is not None and grad is not old:
                    fp.grad_offload_event = _CopyInFlight(log, fp.sharded_param, grad._local_tensor)
            return out
        group.post_backward = post_backward


def _host_sharded_steps(mesh, stream: bool, steps=4):
    """A model under the policy stepped by the rows' optimizer over its host shards, in
    place, streamed or not; each gradient copy left in flight when FSDP hands it over.
    Returns the model, the optimizer and the log of the copies and their waits."""
    from lightning_fastopt import FusedAdam
    from lightning_fastopt.fsdp import LocalShardOptimizer
    from lightning_fastopt.fsdp.gradient_landings import HostGradientLandings

    model = _host_sharded_model(mesh)
    log = []
    _copies_in_flight(model, log)
    opt = LocalShardOptimizer(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                              {p: n for n, p in model.named_parameters()}, device_grads="copy_when_reduced",
                              host_gradients=HostGradientLandings(model), host_shards=True,
                              bucket_size_mb=0.0002, stream_cpu_step=stream)
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # (FSDP's copies would block)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6, generator=g)).square().mean().backward()
        opt.step()
    return model, opt, log


def test_in_place_updates_start_in_backward_once_fsdps_gradient_copies_have_landed(one_process):
    """The rows' optimizer over host shards (``host_shards``), streamed, told of each gradient
    when its FSDP group's post-backward returns (no post-accumulate-grad hook: FSDP would
    copy the gradients into host memory blocking backward): each bucket's update starts
    during backward on the worker, which waits for FSDP's copy of each of its gradients
    first, and the result is the synchronous step's, bit for bit; nothing kept apart from
    the shards.  Stopping puts back the groups' post-backward as it was."""
    from lightning_fastopt.fsdp.host_parameters import host_param_groups

    streamed, opt, log = _host_sharded_steps(one_process, stream=True)
    assert opt.local.schedule.started >= 4 * 2 and len(opt.local.layout.buckets) >= 2
    announced = [(p, t) for what, p, t in log if what == "announced"]
    assert len(announced) == 4 * 4 and all(t is threading.main_thread() for _, t in announced)  # 4 tensors, 4 steps
    worker_waits = [p for what, p, t in log if what == "waited" and t is not threading.main_thread()]
    assert len(worker_waits) >= 4 * 4 and {id(p) for p in worker_waits} == {id(p) for p, _ in announced}
    assert not any(s.separate_master or s.host_grad is not None for s in opt.local.layout.slots)
    plain, plain_opt, _ = _host_sharded_steps(one_process, stream=False)
    assert plain_opt.local.schedule.name == "at the step"
    rows = lambda t: t.to_local() if isinstance(t, DTensor) else torch.as_tensor(t)  # noqa: E731
    for p, q in zip(streamed.parameters(), plain.parameters()):
        assert torch.equal(rows(p), rows(q))
        ours, theirs = opt.state_of(p), plain_opt.state_of(q)
        assert ours.keys() == theirs.keys() and all(torch.equal(rows(ours[k]), rows(theirs[k])) for k in ours)
    opt.close()
    plain_opt.close()
    for group in host_param_groups(streamed):  # the test's own wrapper again, ours gone
        assert group.post_backward.__name__ == "post_backward" and "grads" in group.post_backward.__code__.co_varnames
        assert not [k for k in vars(group) if k.startswith("_fastopt")]


def test_a_gradient_copy_still_on_its_way_is_refused_outside_host_shards():
    """Only FSDP's host shards' buckets wait for copies someone else made (``landing``)."""
    from lightning_fastopt import FusedAdam
    from lightning_fastopt.offload import OffloadOptimizer

    p = nn.Parameter(torch.ones(4))
    opt = OffloadOptimizer(FusedAdam([p]), copy_on_cpu=True, device_grads="copy_when_reduced",
                           reduced_by=lambda q: True)
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match="awaited only for FSDP's host shards"):
        opt.grad_reduced(p, landing=object())
    opt.close()


def test_where_fsdp_hands_over_no_gradient_in_backward_the_updates_run_at_the_step_said_once(one_process,
                                                                                          monkeypatch):
    """A torch whose FSDP no longer calls its groups' ``post_backward`` as we expect (stood
    in for: nothing watched): the streamed step's updates run at the step, the same bits
    as the synchronous step, and a warning says so once; none where the gradients landed."""
    from lightning_fastopt.fsdp.gradient_landings import HostGradientLandings

    def steps():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # (each one counted, not once per place)
            model, opt, _ = _host_sharded_steps(one_process, stream=True)
        opt.close()
        return model, opt, [w for w in caught if "handed over none" in str(w.message)]

    heard, _, said = steps()
    assert said == []
    monkeypatch.setattr(HostGradientLandings, "watch", lambda self, params, on_landed: None)
    unheard, opt, said = steps()
    assert len(said) == 1 and said[0].category is RuntimeWarning and "run at the step" in str(said[0].message)
    assert opt.local.schedule.started == 0
    plain, _, _ = _host_sharded_steps(one_process, stream=False)
    for p, q, r in zip(unheard.parameters(), plain.parameters(), heard.parameters()):
        assert torch.equal(p.to_local(), q.to_local()) and torch.equal(p.to_local(), r.to_local())


def _host_sharded_model(mesh, prefetch=False):
    """Two Linears and the root, each a unit under the policy (with ``prefetch``: the first
    unit gathers the second ahead, ``set_modules_to_forward_prefetch``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    if prefetch:
        model[0].set_modules_to_forward_prefetch([model[2]])
    return model


def _train_over_host_shards(mesh, waits, prefetch, clip, **kw):
    """Four steps of the rows' optimizer over the host shards (one bucket per tensor), each
    unit's forward waiting for its own rows' updates (``waits="module"``,
    :class:`~lightning_fastopt.fsdp.unit_waits.UnitWaits`) or the step for all of them; with
    ``clip`` every gradient multiplied by 0.5 after backward (a speculated update redone).
    With ``"module"`` the worker is held over the second and third steps, and what it
    shows is checked.  Returns each parameter's rows and state after the run."""
    from lightning_fastopt import FusedAdam
    from lightning_fastopt.fsdp import LocalShardOptimizer
    from lightning_fastopt.fsdp.unit_waits import UnitWaits
    from tests.test_forward_waits import _HeldWorker, forward_waits_for_the_held_updates

    model = _host_sharded_model(mesh, prefetch)
    opt = LocalShardOptimizer(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                              {p: n for n, p in model.named_parameters()}, device_grads="copy_when_reduced",
                              host_shards=True, bucket_size_mb=0.0002, forward_waits=waits, **kw)
    early = waits == "module"
    unit_waits = UnitWaits(model, lambda: [opt]) if early else None
    if early:
        opt.modules_wait_for(unit_waits.covered)
        assert opt.local.schedule.ends_early
    speculated = kw.get("speculate", False)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 6, generator=g) for _ in range(5)]
    rows = lambda: [p.to_local().clone() for p in model.parameters()]  # noqa: E731

    def step(x, hold=False, zero_grad=lambda: opt.zero_grad()):
        """One step; ``hold``: the worker held from before backward (streamed, at the step)
        or from before the step (speculated: once its speculative updates have run)."""
        held = None
        zero_grad()
        if hold and not speculated:
            held = _HeldWorker(opt, model)
        model(x).square().mean().backward()
        if clip:
            opt.scale_gradients(torch.tensor(0.5))
        if hold and speculated:
            held = _HeldWorker(opt, model)
        before, left = rows(), opt.local.schedule.updates_left_running
        opt.step()  # with the worker held: returns, every update left to it
        if held is not None:
            buckets = len(opt.local.layout.buckets)
            assert opt.local.schedule.updates_left_running - left == buckets >= 3
            assert speculated or all(torch.equal(a, b) for a, b in zip(before, rows()))  # (not written yet)
        return held

    step(xs[0])
    held = step(xs[1], hold=early)
    if early:  # the next forward stops at the first unit's pre-hook until the worker has updated its rows
        asked, wait_for = [], opt.wait_for_weights
        opt.wait_for_weights = lambda params=None: (asked.append(set(params)), wait_for(params))
        seen = forward_waits_for_the_held_updates(model, opt, held, xs[4])
        assert held.order == sorted(held.order) and set(held.order) == {0, 2}, held.order  # the first unit's first
        first_units = (model[0], model[2]) if prefetch else (model[0],)  # (and the one FSDP gathers ahead of it)
        assert asked[0] == {p for m in first_units for p in m.parameters()}
    else:
        seen = model(xs[4])
    held = step(xs[2], hold=early)

    def zero_grad_in_place():
        """``zero_grad(set_to_none=False)`` with the last step's updates still to run: it
        waits for them (they read the gradients it zeroes), releasing the worker first."""
        if held is None:
            return opt.zero_grad(set_to_none=False)
        wait = opt.local.schedule.wait
        opt.local.schedule.wait = lambda: (held.release(), wait())
        opt.zero_grad(set_to_none=False)
        held.release()  # (where zero_grad did not wait, the updates read zeroed gradients from here)
        del opt.local.schedule.wait

    step(xs[3], zero_grad=zero_grad_in_place)
    opt.wait_for_weights()
    result = [(p.to_local().clone(), {k: v.to_local() if isinstance(v, DTensor) else v
                                      for k, v in opt.state_of(p).items()}) for p in model.parameters()]
    opt.close()
    if unit_waits is not None:
        unit_waits.remove()
    return seen.detach(), result


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetching"])
@pytest.mark.parametrize("kw", [{"stream_cpu_step": True}, {}, {"stream_cpu_step": True, "speculate": True}],
                         ids=["streamed", "at-the-step", "speculated-and-redone"])
def test_a_step_over_host_shards_ends_before_its_updates_and_each_unit_waits_for_its_rows(one_process, kw,
                                                                                         prefetch):
    """``forward_waits="module"`` over FSDP's host shards (updated in place, nothing copied:
    FSDP gathers them): with the worker held, ``step()`` returns with every bucket's update
    left to it (the shards not written yet, unless speculated); the next forward stops at
    the first unit's pre-hook (before FSDP gathers its rows, with the second unit's where it
    prefetches them) until the worker is released, which updates the first unit's rows
    first; ``zero_grad(set_to_none=False)`` waits for the updates that read the gradients
    it zeroes.  The run ends where waiting at the step ends, bit for bit, and the forward
    that waited computes what it computes there (clipped, every speculated update redone
    on the worker, too)."""
    clip = "speculate" in kw
    seen, ours = _train_over_host_shards(one_process, "module", prefetch, clip, **kw)
    ref_seen, ref = _train_over_host_shards(one_process, "step", prefetch, clip, **kw)
    assert torch.equal(seen, ref_seen)  # (the forward that waited saw every new weight)
    for (rows, state), (ref_rows, ref_state) in zip(ours, ref):
        assert torch.equal(rows, ref_rows)
        assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)


def test_fsdps_host_gradients_are_clipped_in_place_as_torch_leaves_them(one_process):
    """Clipping over FSDP's host shards: their gradients are FSDP's ``p.grad``, which the
    user may read after the step, so each bucket's update multiplies them in place first
    (the kernels are given no factors: tests/test_grad_factors.py), and after the step they
    read as torch's clipping leaves them."""
    from lightning_fastopt import FusedAdam
    from lightning_fastopt.fsdp import LocalShardOptimizer

    model = _host_sharded_model(one_process)
    opt = LocalShardOptimizer(FusedAdam(model.parameters(), lr=1e-2), {p: n for n, p in model.named_parameters()},
                              device_grads="copy_when_reduced", host_shards=True, bucket_size_mb=0.0002)
    given = []
    for b in opt.local.layout.buckets:
        take = b.inner._take_step
        b.inner._take_step = lambda *a, _take=take, _inner=b.inner: (given.append(_inner.grad_factors), _take(*a))[1]
    model(torch.randn(8, 6)).square().mean().backward()
    before = [p.grad.to_local().clone() for p in model.parameters()]
    coef = torch.tensor(0.37)
    opt.scale_gradients(coef)
    opt.step()
    assert len(given) == len(opt.local.layout.buckets) >= 3 and not any(given)
    after = [p.grad.to_local() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, torch._foreach_mul(before, coef)))
    opt.close()


def test_lambs_steps_over_host_shards_wait_for_their_updates_and_say_why(one_process, caplog, monkeypatch):
    """LAMB's trust ratios read norms over whole parameters, summed over every rank's rows
    when the step starts (``before_updates``): its steps wait for their updates whatever
    ``forward_waits`` says, and the strategy says so in one line; AdamW's end early."""
    import logging

    from lightning_fastopt import FusedAdam, FusedLAMB
    from lightning_fastopt.fsdp import LocalShardOptimizer
    from lightning_fastopt.trainer.fsdp_strategy import _say_if_its_steps_wait

    model = _host_sharded_model(one_process)
    names = {p: n for n, p in model.named_parameters()}
    for make, early in ((lambda ps: FusedLAMB(ps, lr=1e-2), False), (lambda ps: FusedAdam(ps, lr=1e-2), True)):
        opt = LocalShardOptimizer(make(model.parameters()), names, host_shards=True, forward_waits="module")
        assert opt.local.schedule.ends_early == early
        caplog.clear()
        monkeypatch.setattr(logging.getLogger("lightning.fabric"), "propagate", True)
        with caplog.at_level(logging.INFO):
            _say_if_its_steps_wait(opt)
        said = "the steps of FusedLAMB wait for their CPU updates (forward_waits='module' not used for it): its " \
               "updates read norms over whole parameters"
        assert (said in caplog.text) == (not early), caplog.text
        opt.close()


def test_host_shards_are_their_own_masters_in_host_memory():
    from lightning_fastopt import FusedSGD
    from lightning_fastopt.offload import OffloadOptimizer

    params = [nn.Parameter(torch.ones(4))]
    with pytest.raises(TypeError, match="host_shards must be True or False, got 'yes'"):
        OffloadOptimizer(FusedSGD(params, lr=0.1), host_shards="yes")
    with pytest.raises(ValueError, match=r"host_shards=True: .* got parameters on cpu and copy_on_cpu=True"):
        OffloadOptimizer(FusedSGD(params, lr=0.1), host_shards=True, copy_on_cpu=True)


def test_a_model_built_on_the_meta_device_is_made_in_host_memory():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    torch.manual_seed(0)
    materialize_on_the_host(model)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    assert all(p.device.type == "cpu" and torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))

    class NoReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(2, device="meta"))

    with pytest.raises(TypeError, match="NoReset was built on the meta device and has no reset_parameters"):
        materialize_on_the_host(NoReset())


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning", "lightning.fabric"])
def test_registered_as_fastopt_fsdp_offload_parameters(package):
    import importlib

    import lightning_fastopt  # noqa: F401  (registers the names)

    if package == "lightning.fabric":
        from lightning.fabric.strategies import STRATEGY_REGISTRY as registry
    else:
        registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
    strategy = registry.get("fastopt_fsdp_offload_parameters")
    assert strategy.options.offload_parameters and strategy.offload_fraction == 1.0
    assert not registry.get("fastopt_fsdp_offload").options.offload_parameters


@slow
def test_the_memory_estimate_is_what_each_rank_holds_in_host_memory(tmp_path):
    """Two gloo processes, the shards under ``CPUOffloadPolicy``: each rank's rows, their
    gradients and the optimizer's state (AdamW with amsgrad: three tensors) are its estimate
    (``estimate_memory(..., zero_stage=3, offload_parameters=True)``), the optimizer allocating
    nothing else (no master, no buffer), and nothing on the accelerator."""
    import json

    from lightning_fastopt import estimate_memory
    from tests.helpers import memory_model

    run_script(Path(__file__).resolve().parent / "scripts" / "zero_memory_run.py", tmp_path, "3host", "1.0",
               timeout=300)
    model = memory_model(layers=4, rows=(33, 32, 1))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        est = estimate_memory(model, optimizer="adam", amsgrad=True, zero_stage=3, world_size=2, rank=rank,
                              offload_parameters=True)
        assert est.gpu_total == 0 and est.cpu["master_weights"] == 0
        assert est.cpu["params"] == 4 * got["rows"] and est.cpu["grads"] == 4 * got["grad_rows"]
        assert 0 <= got["allocated"] - est.cpu["optimizer_state"] <= got["padding"]
        assert est.cpu_total == 4 * got["rows"] * (1 + 1 + 3)  # 20 bytes an element with amsgrad, 16 without


def test_the_estimate_of_host_parameters_refuses_what_the_strategy_refuses():
    from lightning_fastopt import estimate_memory

    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="offload_parameters=True is FSDP's .* got zero_stage=0"):
        estimate_memory(model, offload_parameters=True)
    with pytest.raises(ValueError, match="offload_fraction=0.5"):
        estimate_memory(model, zero_stage=3, offload_fraction=0.5, offload_parameters=True)
    with pytest.raises(TypeError, match="offload_parameters must be True or False"):
        estimate_memory(model, zero_stage=3, offload_parameters=1)


PEAK_SCRIPT = Path(__file__).resolve().parent / "scripts" / "host_parameters_peak.py"


def _peak_run(tmp_path, accelerator):
    import json

    out = tmp_path / "peak.json"
    run_script(PEAK_SCRIPT, out, accelerator, ranks=1)
    return json.loads(out.read_text())


@slow
def test_the_peak_script_trains_and_estimates_on_a_cpu(tmp_path):
    """The script the GPU check below runs: on a CPU it trains its 16-block GPT with the
    weights in host memory and gives the estimate (nothing to measure on a CPU)."""
    got = _peak_run(tmp_path, "cpu")
    assert got["steps"] == 3 and got["peak"] is None
    assert 0 < got["estimate_gpu"] < got["param_bytes"] / 2 and got["estimate_host"] == 4 * got["param_bytes"]


@pytest.mark.cuda
def test_on_a_gpu_the_model_is_never_all_on_it_and_the_estimate_says_so(tmp_path):
    """On one GPU, a 16-block GPT with its weights in host memory: the GPU never holds all
    its weights at once (FSDP gathers the units it works on); its peak against the
    estimate's units in flight is printed for the results (the estimate counts no
    activations and none of FSDP's copy buffers)."""
    got = _peak_run(tmp_path, "cuda")
    print(f"host-parameters peak: {got['peak'] / 2**20:.1f} MiB of {got['param_bytes'] / 2**20:.1f} MiB of weights; "
          f"estimate {got['estimate_gpu'] / 2**20:.1f} MiB (peak/estimate {got['peak'] / got['estimate_gpu']:.2f})")
    assert got["steps"] == 3 and got["peak"] < got["param_bytes"] * 0.75


def _half_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)


def _half_host_shards(model, mesh, **options):
    """``model`` (bfloat16) sharded under the policy in one process, and the rows'
    optimizer (AdamW) over its host shards with ``options``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from lightning_fastopt import FusedAdam
    from lightning_fastopt.fsdp import LocalShardOptimizer

    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return LocalShardOptimizer(FusedAdam(model.parameters(), lr=1e-2), {p: n for n, p in model.named_parameters()},
                               device_grads="copy_when_reduced", host_shards=True, bucket_size_mb=0.0002, **options)


@pytest.mark.parametrize("stream", [False, True], ids=["at-the-step", "streamed"])
def test_a_half_host_shard_others_wrote_gives_its_master_the_write(one_process, stream):
    """bfloat16 host shards with float32 masters apart: a shard written between steps
    (``load_state_dict``, a callback) is found before its bucket's update (not at the step,
    where the streamed update may already have written it in place) and its master takes
    the write; the shards the updates wrote themselves keep their masters' low bits."""
    model = _half_model()
    opt = _half_host_shards(model, one_process, stream_cpu_step=stream)
    g = torch.Generator().manual_seed(1)

    def step():
        opt.zero_grad()
        model(torch.randn(8, 6, generator=g).to(torch.bfloat16)).float().square().mean().backward()
        opt.step()
    step()
    step()
    slots = opt.local.layout.slots
    assert all(s.separate_master for s in slots)
    kept = [s.master.clone() for s in slots]
    assert any(not torch.equal(m, s.param.float()) for m, s in zip(kept, slots))  # low bits the shard lacks
    written = model[2].weight.to_local()
    with torch.no_grad():
        written.fill_(0.5)  # others write one shard
    for group in opt.param_groups:
        group["lr"] = 0.0  # the next update moves nothing: each master is what the step started from
    step()
    for s, before in zip(slots, kept):
        if s.param.data_ptr() == written.data_ptr():
            assert torch.all(s.master == 0.5) and torch.all(s.param == 0.5)
        else:
            assert torch.equal(s.master, before), s.name  # (decoupled weight decay is 0 here)
    opt.close()


def test_the_estimate_of_half_host_shards_is_what_the_rows_optimizer_holds(one_process):
    """bfloat16 host shards (``bf16-true`` under the policy): the rows, their gradients, a
    float32 master apart for each and AdamW's two moments, as ``estimate_memory`` gives them
    (16 bytes an element), speculation's copies too."""
    from lightning_fastopt import estimate_memory

    model = _half_model()
    est = estimate_memory(model, zero_stage=3, offload_parameters=True, precision="bf16-true")
    spec = estimate_memory(model, zero_stage=3, offload_parameters=True, precision="bf16-true", speculate=True)
    opt = _half_host_shards(model, one_process, stream_cpu_step=True, speculate=True)
    for _ in range(2):  # (the second speculation keeps the state the first made)
        opt.zero_grad()
        model(torch.randn(8, 6).to(torch.bfloat16)).float().square().mean().backward()
        grads = sum(p.grad.to_local().numel() * 2 for p in model.parameters())
        opt.step()
    local = opt.local
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert est.cpu["params"] == nbytes(s.param for s in local.layout.slots) and est.cpu["grads"] == grads
    assert est.cpu["master_weights"] == nbytes(s.master for s in local.layout.slots if s.separate_master) > 0
    state = [v for b in local.layout.buckets for st in b.inner.state.values() for k, v in st.items() if k != "step"]
    assert est.cpu["optimizer_state"] == nbytes(state) and est.cpu_total == 16 * est.total_params
    snapshots = local.schedule.snapshots.values()
    kept = sum(s.nbytes for s in snapshots)  # (and each slot's step count, a float32 scalar, not estimated)
    assert spec.cpu["speculation"] > 0 and kept - spec.cpu["speculation"] == 4 * len(local.layout.slots)
    opt.close()
