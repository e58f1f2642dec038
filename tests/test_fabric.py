"""Lightning Fabric with the fastopt strategies (lightning_fastopt.fabric), against Fabric's
own strategies with torch.optim.AdamW, bit for bit, over 8 steps of a loop with two
parameter groups, a scheduler, accumulation with ``no_backward_sync`` and clipping by norm
or by value:

- one process, at fractions 0, 0.5 and 1 through the accelerator code path on the CPU,
  gradients kept or copied during backward, and the ZeRO names;
- two gloo processes (Fabric's launcher, and torchrun): half offloaded with gradients copied during
  backward (copied at the step, after DDP's reduction), and ZeRO stage 2 freeing other
  ranks' gradients, against Fabric's ``ddp``;
- bf16-true trains half weights from float32 masters (against the Trainer's plain-PyTorch
  reference), 16-true scales the loss and skips an overflowing step;
- fp16 with an injected inf skips the step; ``fabric.save`` / ``fabric.load`` continue
  exactly, with the loss scaler, also in a new process after the saving one was killed
  with SIGKILL;
- bf16-mixed against Fabric's own (CPU, and GPU);
- on a GPU (marked ``cuda``): fractions 0, 0.5 and 1 with the CUDA kernels and side
  streams, and the fp16 skip with save/load;
- ZeRO at two processes saves a sharded directory (each rank its shard), which two new
  processes load to continue exactly;
- the names are in Fabric's registry; what Fabric cannot do yet is refused by name;
- a Trainer run continues under Fabric from its checkpoint, and a Fabric run (saved with
  the Trainer's keys) under the Trainer's ``ckpt_path``, bit for bit;
- examples/fabric_gpt.py trains.
"""

import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

import lightning_fastopt  # noqa: F401  (registers the names)
from lightning_fastopt import FastOptFabricPrecision, FastOptFabricStrategy
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.optim.takeover import engine_of
from tests.fabric_loop import make_model, make_optimizer, train
from tests.helpers import assert_params_equal, counting_checkpoint_io, free_port, run_script, said_lines

REPO = Path(__file__).resolve().parent.parent


def _fabric(strategy, accelerator="cpu", **kw):
    fabric = L.Fabric(accelerator=accelerator, devices=1, strategy=strategy, **kw)
    fabric.launch()
    return fabric


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip", [("norm", 0.5), ("value", 0.05)], ids=["norm", "value"])
@pytest.mark.parametrize("fraction,keep", [(0.0, True), (0.5, True), (1.0, True), (0.5, False), (1.0, False)])
def test_one_process_equals_fabric_with_torch_adamw(fraction, keep, clip):
    reference = _weights(train(_fabric("auto"), clip=clip))
    strategy = FastOptFabricStrategy(offload_fraction=fraction, keep_gradients=keep, copy_on_cpu=True,
                                     bucket_size_mb=0.0002)
    fabric = _fabric(strategy)
    ours = train(fabric, clip=clip)
    opt = strategy._wrappers[0]
    assert isinstance(opt, OffloadOptimizer) and opt.offload_fraction == fraction
    assert opt.device_grads == ("keep" if keep else "copy_in_backward")
    assert_params_equal(_weights(ours), reference)


@pytest.mark.cuda
@pytest.mark.parametrize("fraction,keep", [(0.0, True), (0.5, True), (1.0, True), (0.5, False), (1.0, False)])
def test_on_gpu_equals_fabric_with_torch_adamw(fraction, keep):
    """On the GPU: the device share runs the CUDA kernels, the host share the CPU kernels,
    gradients and weights cross on side streams."""
    reference = _weights(train(_fabric("auto", accelerator="cuda")))
    strategy = FastOptFabricStrategy(offload_fraction=fraction, keep_gradients=keep, bucket_size_mb=0.0002)
    ours = train(_fabric(strategy, accelerator="cuda"))
    assert strategy._wrappers[0].offload_fraction == fraction
    assert_params_equal(_weights(ours), reference)  # torch's CUDA foreach rounding, followed on both shares


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bf16_mixed_equals_fabrics_own(accelerator):
    reference = _weights(train(_fabric("auto", accelerator=accelerator, precision="bf16-mixed")))
    fabric = _fabric(FastOptFabricStrategy(offload_fraction=0.5, bucket_size_mb=0.0002,
                                           copy_on_cpu=accelerator == "cpu"), accelerator=accelerator,
                     precision="bf16-mixed")
    assert isinstance(fabric.strategy.precision, FastOptFabricPrecision)
    assert_params_equal(_weights(train(fabric)), reference)


@pytest.mark.cuda
def test_on_gpu_fp16_overflow_skips_the_step_and_save_load_continues_exactly(tmp_path):
    def fabric():
        return _fabric(FastOptFabricStrategy(offload_fraction=0.5, initial_scale_power=8, hysteresis=1,
                                             bucket_size_mb=0.0002), accelerator="cuda", precision="16-mixed")

    straight_fabric = fabric()
    straight = train(straight_fabric, inject_at={2})
    assert straight_fabric.strategy.precision.skipped_steps == 1
    train(fabric(), inject_at={2}, save_at=5, path=tmp_path / "mid.ckpt")
    resumed = train(fabric(), inject_at={2}, start=5, path=tmp_path / "mid.ckpt")
    for a, b in zip(_weights(straight), _weights(resumed)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["fastopt", "fastopt_offload", "fastopt_zero1", "fastopt_zero2"])
def test_the_names_are_in_fabrics_registry_and_train_alike(name):
    reference = _weights(train(_fabric("auto")))
    fabric = _fabric(name)
    assert isinstance(fabric.strategy, FastOptFabricStrategy)
    assert_params_equal(_weights(train(fabric)), reference)


def test_zero2_with_gradients_kept_says_why_it_reduces_as_stage_1(monkeypatch):
    """Fabric keeps gradients in p.grad by default, so ``fastopt_zero2`` reduces them as stage 1
    does: it logged ``ZeroOptimizer(stage 1, ...)`` without a word of why."""
    import lightning_fastopt.fabric.strategy as fabric_strategy
    import lightning_fastopt.plan.run_plan as run_plan

    said = said_lines(monkeypatch, fabric_strategy, run_plan)
    train(_fabric("fastopt_zero2"))
    why = [i for i, line in enumerate(said) if "(ZeRO stage 2 reduces them as stage 1 does), as in torch: the loop's "
           "code (keep_gradients=True, Fabric's default) can read them" in line]
    described = [i for i, line in enumerate(said) if line.startswith("lightning_fastopt: ZeroOptimizer(stage 1,")]
    assert len(why) == 1 and described and why[0] < described[0], said
    said.clear()
    train(_fabric(FastOptFabricStrategy(zero_stage=2, keep_gradients=False)))
    assert not [line for line in said if "as stage 1 does" in line], said
    assert [line for line in said if line.startswith("lightning_fastopt: ZeroOptimizer(stage 2,")], said


def test_fp16_overflow_skips_the_step_and_save_load_continues_exactly(tmp_path):
    def fabric():
        return _fabric(FastOptFabricStrategy(copy_on_cpu=True, bucket_size_mb=0.0002),
                       plugins=[FastOptFabricPrecision("16-mixed", initial_scale_power=8, hysteresis=1)])

    straight_fabric = fabric()
    straight = train(straight_fabric, inject_at={2})
    assert straight_fabric.strategy.precision.skipped_steps == 1
    assert straight_fabric.strategy.precision.loss_scale == 2 ** 7  # halved once, 8 clean steps do not double it
    path = tmp_path / "mid.ckpt"
    train(fabric(), inject_at={2}, save_at=5, path=path)
    resumed_fabric = fabric()
    resumed = train(resumed_fabric, inject_at={2}, start=5, path=path)
    assert resumed_fabric.strategy.precision.loss_scale == 2 ** 7  # the scaler came back with the checkpoint
    for a, b in zip(_weights(straight), _weights(resumed)):
        assert torch.equal(a, b)
    saved = torch.load(path, weights_only=True)
    assert set(saved["optimizer"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # keyed by name


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_fp16_backward_scales_the_loss_and_the_step_takes_the_scale_out(fraction):
    """``fabric.backward(loss)`` under fp16 backpropagates the scaled loss (Fabric ignores
    what ``pre_backward`` returns: the scale goes in ``backward``), and the step divides
    it out: bit for bit a plain loop that does both by hand (a power of two, exact), with
    torch's SGD under the same autocast.  Before, the loss went unscaled and every update
    was divided by the scale."""
    scale = 2.0 ** 8

    def ours():
        fabric = _fabric(FastOptFabricStrategy(offload_fraction=fraction, bucket_size_mb=0.0002, copy_on_cpu=True),
                         plugins=[FastOptFabricPrecision("16-mixed", initial_scale_power=8)])
        model = make_model()
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
        return model, opt, fabric.backward, fabric

    model, opt, backward, fabric = ours()
    ref_model = make_model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        backward(nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref_model(x)
        (nn.functional.mse_loss(out.float(), y) * scale).backward()
        for p in ref_model.parameters():
            p.grad.div_(scale)
        ref_opt.step()
        ref_opt.zero_grad()
    assert fabric.strategy.precision.loss_scale == scale and fabric.strategy.precision.skipped_steps == 0
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


class _WithComplexBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.register_buffer("spectrum", torch.complex(torch.rand(4), torch.rand(4)), persistent=False)

    def forward(self, x):
        self.seen = x.dtype
        return self.net(x)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "64-true"])
def test_inputs_outputs_and_weights_as_with_fabrics_own_plugin(precision):
    """Fabric's own plugins convert floating inputs to the autocast or weight dtype and
    outputs back to float32 (a loss computed from them is float32), and ``64-true`` keeps
    complex buffers complex: so do ours, and SGD ends bit for bit where Fabric's own ends
    (Lightning's parity test, tests/parity_fabric, for a loop that computes its loss from
    the outputs)."""
    def run(strategy):
        fabric = _fabric(strategy, precision=precision)
        with fabric.init_module():
            model = _WithComplexBuffer()
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        g = torch.Generator().manual_seed(4)
        for _ in range(5):
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
            out = model(x)
            fabric.backward(nn.functional.mse_loss(out, y))
            opt.step()
            opt.zero_grad()
        return model, out.dtype

    (ours, ours_out), (ref, ref_out) = run(FastOptFabricStrategy(offload_fraction=0.5, bucket_size_mb=0.0002,
                                                                 copy_on_cpu=True)), run("auto")
    assert ours_out == ref_out and ours.seen == ref.seen
    assert ours.spectrum.dtype == ref.spectrum.dtype and torch.equal(ours.spectrum, ref.spectrum)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("precision,required", [("32-true", False), ("bf16-true", False), ("bf16-mixed", True),
                                                ("16-true", True)])
def test_loss_backward_is_allowed_where_fabrics_own_plugins_allow_it(precision, required):
    """Fabric refuses ``loss.backward()`` when the precision plugin has a backward of its
    own: as with Fabric's plugins at 32-true, bf16-true (allowed) and bf16-mixed (refused);
    16-true scales the loss here, so it asks for ``fabric.backward`` too."""
    fabric = _fabric(FastOptFabricStrategy(copy_on_cpu=True), precision=precision)
    model = fabric.setup(make_model())
    dtype = next(model.parameters()).dtype
    loss = model(torch.randn(4, 8, dtype=dtype)).float().sum()
    if required:
        with pytest.raises(RuntimeError, match=r"requires you to call `fabric.backward\(loss\)`"):
            loss.backward()
    else:
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())


def test_one_process_needs_no_launch_as_fabrics_own():
    """With one process ``fabric.launch()`` is optional, as with Fabric's single-device
    strategy: the strategy is one to Fabric (an instance of its ``SingleDeviceStrategy``),
    the environment is set up at ``setup`` (the CPU threads), and the loop ends where
    Fabric's own ends."""
    from lightning.fabric.strategies import SingleDeviceStrategy

    reference = _weights(train(L.Fabric(accelerator="cpu", devices=1)))
    threads = torch.get_num_threads()
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FastOptFabricStrategy(offload_fraction=0.5,
                                                                                   copy_on_cpu=True, cpu_threads=1))
    assert isinstance(fabric.strategy, SingleDeviceStrategy) and isinstance(fabric.strategy, FastOptFabricStrategy)
    assert type(fabric.strategy).__name__ == "FastOptFabricStrategy"
    try:
        assert_params_equal(_weights(train(fabric)), reference)
        assert torch.get_num_threads() == 1
    finally:
        fabric.strategy.teardown()
    assert torch.get_num_threads() == threads


def test_one_process_keeps_the_loaders_sampler_and_an_optimizer_set_up_twice_keeps_its_engine():
    """As with Fabric's single-device strategy: ``setup_dataloaders`` keeps a shuffling
    loader's own sampler (the same batches in the same order; a DistributedSampler over one
    replica would shuffle in another order), and an optimizer set up a second time is
    the same object, stepped by the same engine."""
    from torch.utils.data import DataLoader, RandomSampler

    def batches(strategy):
        fabric = _fabric(strategy)
        torch.manual_seed(5)
        loader = fabric.setup_dataloaders(DataLoader(torch.arange(32.0), batch_size=4, shuffle=True))
        assert isinstance(loader.sampler, RandomSampler)
        return [b.clone() for b in loader]

    assert all(torch.equal(a, b) for a, b in zip(batches(FastOptFabricStrategy(copy_on_cpu=True)), batches("auto")))
    fabric = _fabric(FastOptFabricStrategy(copy_on_cpu=True))
    model = make_model()
    opt = make_optimizer(model)
    _, first = fabric.setup(model, opt)
    engine = engine_of(opt)
    _, second = fabric.setup(model, opt)
    assert first.optimizer is second.optimizer is opt and engine_of(opt) is engine
    assert isinstance(engine, OffloadOptimizer)


def _optimizer_first(strategy, steps=4):
    """Fabric allows setting up the optimizer before its model (Lightning's
    test_setup_optimizers does): ``setup_optimizers`` then ``setup_module``, then a loop."""
    from torch.utils.data import DataLoader

    from tests.fabric_loop import _data

    fabric = _fabric(strategy)
    model = make_model()
    opt = fabric.setup_optimizers(make_optimizer(model))
    model = fabric.setup_module(model)
    for (x, y), _ in zip(DataLoader(_data(), batch_size=8), range(steps)):
        fabric.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    return model


def test_an_optimizer_set_up_before_its_model_is_taken_over_with_the_model():
    strategy = FastOptFabricStrategy(offload_fraction=0.2, copy_on_cpu=True)
    ours = _optimizer_first(strategy)
    assert isinstance(strategy._wrappers[0], OffloadOptimizer) and not strategy._pending
    assert all(torch.equal(a, b) for a, b in zip(_weights(ours), _weights(_optimizer_first("auto"))))


def test_an_optimizer_whose_model_is_never_set_up_is_refused_at_its_step():
    fabric = _fabric(FastOptFabricStrategy(copy_on_cpu=True))
    model = make_model()
    opt = fabric.setup_optimizers(make_optimizer(model))
    model(torch.ones(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match=r"the AdamW given to fabric.setup_optimizers has no model set up .*"
                                           r"fabric.setup_module\(model\)"):
        opt.step()


def _closure_loop(strategy, make_opt, steps=4):
    """A Fabric loop that hands a closure to ``optimizer.step`` (LBFGS, SAM)."""
    from torch.utils.data import DataLoader

    from tests.fabric_loop import _data

    fabric = _fabric(strategy)
    model = fabric.setup_module(make_model())
    opt = fabric.setup_optimizers(make_opt(model.parameters()))
    for (x, y), _ in zip(DataLoader(_data(), batch_size=8), range(steps)):
        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            return loss
        opt.step(closure)
    return model


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_closure_optimizers_run_as_torch_runs_them_as_with_fabrics_own(fraction):
    """An optimizer whose step evaluates the closure again after changing the weights (LBFGS;
    SAM named in ``closure_optimizers``) is not taken over: bit for bit Fabric's own."""
    from tests.test_drop_in import SAM

    for make in (lambda ps: torch.optim.LBFGS(ps, lr=0.1, max_iter=3), lambda ps: SAM(ps, lr=0.05)):
        strategy = FastOptFabricStrategy(offload_fraction=fraction, copy_on_cpu=True, closure_optimizers=["SAM"])
        ours = _closure_loop(strategy, make)
        assert strategy._wrappers == []
        assert all(torch.equal(a, b) for a, b in zip(_weights(ours), _weights(_closure_loop("auto", make))))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_an_own_step_not_named_runs_as_torch_and_named_is_refused(monkeypatch, fraction):
    """A user's optimizer whose step scales every update by the norm of all gradients
    (``GlobalNorm``) is not known to update each parameter alone: not taken over, bit for
    bit Fabric's own, one line saying so; named in ``per_parameter_optimizers`` the claim is
    checked when it is set up and refused (it was stepped on each share, where its norm was
    one share's, and trained on with other numbers: issue 74)."""
    import lightning_fastopt.plan.run_plan as run_plan
    from tests.references import GlobalNorm

    said = said_lines(monkeypatch, run_plan)
    make = lambda ps: GlobalNorm(ps, lr=0.05)  # noqa: E731
    ref = _weights(_closure_loop("auto", make))
    strategy = FastOptFabricStrategy(offload_fraction=fraction, copy_on_cpu=True, bucket_size_mb=0.0002)
    ours = _closure_loop(strategy, make)
    assert strategy._wrappers == [] and all(torch.equal(a, b) for a, b in zip(_weights(ours), ref))
    assert any("GlobalNorm runs as torch runs it, on the model's weights" in line for line in said), said
    named = FastOptFabricStrategy(offload_fraction=fraction, copy_on_cpu=True, bucket_size_mb=0.0002,
                                  per_parameter_optimizers=[GlobalNorm])
    with pytest.raises(ValueError, match="GlobalNorm is named in per_parameter_optimizers .* its step combines "
                                         "parameters"):
        _closure_loop(named, make)
    assert named._wrappers == []


@pytest.mark.parametrize("clip", [("norm", 0.05), ("value", 0.01)], ids=["norm", "value"])
@pytest.mark.parametrize("strategy", ["fabric", "half_offloaded", "offloaded"])
def test_fp16_clip_gradients_leaves_them_unscaled_as_fabrics_own_plugin(strategy, clip):
    """Fabric's own fp16 plugin unscales the gradients in ``p.grad`` before it clips, so the
    loop reads them unscaled after ``fabric.clip_gradients``; ours does too (they stayed
    multiplied by the loss scale before 2026-11-27): the gradients read after the clip and
    the final weights bit for bit ``MixedPrecision("16-mixed", "cpu")`` with the same
    initial scale (one that never overflows here: where a step does, the scale rules
    differ)."""
    from lightning.fabric.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    from tests.fabric_loop import _data

    def run(strategy_arg, plugin):
        fabric = _fabric(strategy_arg, plugins=[plugin])
        model = fabric.setup_module(make_model())
        opt = fabric.setup_optimizers(make_optimizer(model.module))
        seen = []
        for x, y in DataLoader(_data(), batch_size=8):
            fabric.backward(nn.functional.mse_loss(model(x).float(), y))
            if clip[0] == "norm":
                fabric.clip_gradients(model, opt, max_norm=clip[1])
            else:
                fabric.clip_gradients(model, opt, clip_val=clip[1])
            seen.append([p.grad.detach().clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        return model, seen

    chosen = {"fabric": "auto", "half_offloaded": FastOptFabricStrategy(offload_fraction=0.5, copy_on_cpu=True,
                                                                         bucket_size_mb=0.0002),
              "offloaded": FastOptFabricStrategy(offload_fraction=1.0, copy_on_cpu=True)}[strategy]
    ours, ours_seen = run(chosen, FastOptFabricPrecision("16-mixed", initial_scale_power=10))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    ref, ref_seen = run("auto", MixedPrecision("16-mixed", "cpu", scaler))
    assert scaler.get_scale() == 2.0 ** 10 and len(ours_seen) == len(ref_seen) == 16
    for a, b in zip(ours_seen, ref_seen):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(a, b) for a, b in zip(_weights(ours), _weights(ref)))


def _half_fabric_run(strategy, precision, make_opt, epochs=2, poison_at=None):
    """The Trainer's half-weight tests' model and data (tests/test_half_weights.py) in a
    Fabric loop: inputs cast to the weights' dtype, one step per batch."""
    from tests.test_precision import _data
    from tests.test_strategy import Model

    fabric = _fabric(strategy, precision=precision)
    model, opt = fabric.setup(*(lambda m: (m, m.configure_optimizers()))(Model(make_opt, sched=False)))
    dtype = next(model.parameters()).dtype
    step = 0
    for _ in range(epochs):
        for x, y in _data():
            loss = model.training_step((x.to(dtype), y.to(dtype)), 0)
            fabric.backward(loss * float("inf") if step == poison_at else loss)
            opt.step()
            opt.zero_grad()
            step += 1
    return model, fabric


@pytest.mark.parametrize("strategy", ["fastopt", "half_offloaded"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_bf16_true_trains_half_weights_from_float32_masters(strategy, name):
    """Against the plain-PyTorch reference of the Trainer's test (half model, float32
    masters stepped by torch.optim, copied back): bit for bit."""
    from tests.test_half_weights import OPTIMIZERS, _reference

    made = FastOptFabricStrategy(offload_fraction=0.5, bucket_size_mb=0.0002, copy_on_cpu=True) \
        if strategy == "half_offloaded" else strategy
    ours, _ = _half_fabric_run(made, "bf16-true", OPTIMIZERS[name])
    ref = _reference(OPTIMIZERS[name], torch.bfloat16, epochs=2)
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b), n


def test_16_true_scales_the_loss_and_skips_an_overflowing_step():
    from tests.test_half_weights import OPTIMIZERS

    strategy = FastOptFabricStrategy(offload_fraction=0.5, bucket_size_mb=0.0002, copy_on_cpu=True,
                                     initial_scale_power=8)
    model, fabric = _half_fabric_run(strategy, "16-true", OPTIMIZERS["sgd"], epochs=1, poison_at=3)
    precision = fabric.strategy.precision
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert precision.skipped_steps == 1 and precision.loss_scale == 2 ** 8  # hysteresis 2: one overflow keeps it
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("kw,match", [
    (dict(offload_fraction="auto"), "offload_fraction='auto' is for the Trainer"),
    (dict(stream_cpu_step=True), "stream_cpu_step=True is for the Trainer"),
    (dict(delayed_update=True), "delayed_update=True is for the Trainer"),
    (dict(offload_fraction=2.0), r"offload_fraction must be in \[0.0, 1.0\]"),
    (dict(bucket_size=8), r"unexpected keyword argument\(s\) 'bucket_size' \(did you mean 'bucket_size_mb'\?\)"),
])
def test_what_fabric_cannot_do_is_refused_by_name(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FastOptFabricStrategy(**kw)


def _process(name, out, *args, devices=2, killed=False):
    """The script on ``devices`` processes, the second started by Fabric's launcher."""
    proc = run_script(REPO / "tests" / "scripts" / "fabric_run.py", name, out, "--devices", devices, *args,
                      check=False)
    if killed:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        return None
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(devices)]


def _two_processes(name, out):
    return [saved["weights"] for saved in _process(name, out)]


@pytest.fixture(scope="module")
def fabric_ddp(tmp_path_factory):
    """Fabric's ddp with torch AdamW, two processes: rank 0's weights."""
    return _two_processes("ddp", tmp_path_factory.mktemp("ddp") / "ddp.pt")[0]


@pytest.fixture(scope="module")
def zero2_freeing(tmp_path_factory):
    """ZeRO stage 2 freeing other ranks' gradients, two processes, 6 steps: both ranks' weights."""
    return _two_processes("zero2_freeing", tmp_path_factory.mktemp("zero2") / "zero2.pt")


@pytest.mark.parametrize("name", ["half_offloaded", "zero2_freeing"])
def test_two_processes_equal_fabrics_ddp(tmp_path, fabric_ddp, zero2_freeing, name):
    ours, ours_rank1 = zero2_freeing if name == "zero2_freeing" else _two_processes(name, tmp_path / "ours.pt")
    ref = fabric_ddp
    for k in ref:
        assert torch.equal(ours[k], ours_rank1[k])  # ranks stay in sync
        assert torch.equal(ours[k], ref[k]), k


def test_under_torchrun_equals_fabrics_ddp(tmp_path, fabric_ddp):
    """torchrun starts the two processes; Fabric takes the ranks from its environment."""
    out = tmp_path / "torchrun.pt"
    run_script("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
               REPO / "tests" / "scripts" / "fabric_run.py", "half_offloaded", out)
    ours, rank1 = (torch.load(f"{out}.rank{r}", weights_only=True)["weights"] for r in (0, 1))
    for k in fabric_ddp:
        assert torch.equal(ours[k], rank1[k])
        assert torch.equal(ours[k], fabric_ddp[k]), k


def test_zero_at_two_processes_saves_a_sharded_directory_that_loads_and_continues_exactly(tmp_path, zero2_freeing):
    """Each rank writes its own shard of the optimizer state (stage 2, gradients sharded
    too); two new processes load the directory after 3 steps and end bit for bit where
    the uninterrupted run ends; the directory loads as one merged checkpoint anywhere, and
    into one process without ZeRO."""
    import json

    from lightning_fastopt.checkpoint.sharded import load_sharded

    ckpt = tmp_path / "zero.ckpt"
    _process("zero2_freeing", tmp_path / "saved.pt", "--save-at", "3", "--ckpt", str(ckpt))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["zero_stage"] == 2
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint.pt", "manifest.json", "optimizer_shard_00000.pt",
                                                      "optimizer_shard_00001.pt"]
    merged = load_sharded(ckpt)
    assert set(merged["optimizer"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # every rank's part
    assert "optimizer_states" not in merged and "scheduler" in merged and "model" in merged
    fabric = _fabric(FastOptFabricStrategy(copy_on_cpu=True, bucket_size_mb=0.0002))  # one process, no ZeRO
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model))
    rest = fabric.load(ckpt, {"model": model, "optimizer": opt})
    assert set(rest) == {"scheduler"}
    ours = fabric.strategy._wrappers[0]
    for name, p in model.module.named_parameters():
        assert torch.equal(ours.state_of(p)["exp_avg_sq"], merged["optimizer"]["state"][name]["exp_avg_sq"])
    resumed = [saved["weights"] for saved in _process("zero2_freeing", tmp_path / "resumed.pt", "--start", "3",
                                                      "--ckpt", str(ckpt))]
    for straight, again in zip(zero2_freeing, resumed):
        for k in straight:
            assert torch.equal(straight[k], again[k]), k


def test_sigkill_after_a_save_then_load_continues_exactly(tmp_path):
    """fp16 (an overflow at step 2), half offloaded through the accelerator code path: a
    process saved after 4 steps and killed with SIGKILL in the middle of step 6, then a
    new process loading that file ends bit for bit where an uninterrupted process ends."""
    common = ("--fp16", "--steps", "8")
    straight, = _process("half_copied", tmp_path / "straight.pt", *common, devices=1)
    ckpt = tmp_path / "run.ckpt"
    _process("half_copied", tmp_path / "killed.pt", *common, "--save-at", "4", "--kill-at", "6", "--ckpt", str(ckpt),
             devices=1, killed=True)
    resumed, = _process("half_copied", tmp_path / "resumed.pt", *common, "--start", "4", "--ckpt", str(ckpt),
                        devices=1)
    assert straight["loss_scale"] == resumed["loss_scale"] == 2 ** 7  # the scaler came back too
    for k in straight["weights"]:
        assert torch.equal(straight["weights"][k], resumed["weights"][k]), k


def test_the_fabric_example_trains(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    out = run_script("examples/fabric_gpt.py", "--epochs", "2", "--limit-batches", "4", "--checkpoint", ckpt)
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if "mean train loss" in line]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "OffloadOptimizer(FusedAdam, offload_fraction=1.0" in out.stderr + out.stdout
    saved = torch.load(ckpt, weights_only=True)
    names = {n for n, _ in saved["model"].items()}
    assert set(saved["optimizer"]["state"]) <= names and "tok.weight" in saved["optimizer"]["state"]


def _trainer(epochs, **kw):
    from lightning_fastopt import FastOptStrategy

    return L.Trainer(strategy=FastOptStrategy(copy_on_cpu=True, bucket_size_mb=0.0002), accelerator="cpu", devices=1,
                     max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False, **kw)


def _fabric_epoch(model, load=None, save=None):
    """One epoch of the Trainer's loop written for Fabric with the LightningModule's own
    ``training_step`` and ``configure_optimizers`` (a step-interval scheduler); ``load``:
    continue from a Trainer checkpoint; ``save``: write one in the Trainer's layout."""
    from tests.test_precision import _data

    fabric = _fabric(FastOptFabricStrategy(copy_on_cpu=True, bucket_size_mb=0.0002))
    configured = model.configure_optimizers()
    opt, sched = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    model, opt = fabric.setup(model, opt)
    if load:
        saved = fabric.load(load)  # what is not given as state comes back as a plain dict
        model.load_state_dict(saved["state_dict"])
        opt.load_state_dict(saved["optimizer_states"][0])
        sched.load_state_dict(saved["lr_schedulers"][0])
    for i, batch in enumerate(_data()):
        fabric.backward(model.training_step(batch, i))
        opt.step()
        opt.zero_grad()
        sched.step()
    if save:
        fabric.save(save, {"state_dict": model, "optimizer_states": [opt.state_dict()],
                           "lr_schedulers": [sched.state_dict()], "pytorch-lightning_version": L.__version__})
    return model


def test_a_trainer_run_continues_in_fabric_and_a_fabric_run_in_the_trainer(tmp_path):
    """Two epochs under the Trainer, against one epoch under the Trainer then one under
    Fabric from its checkpoint, and against one under Fabric (saved with the Trainer's
    keys) then one under the Trainer's ``ckpt_path``: bit for bit, both ways (the same
    name-keyed optimizer state, scheduler state and weights)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.test_precision import _data
    from tests.test_strategy import Model

    def model():
        return Model(lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01))

    reference = model()
    _trainer(2, enable_checkpointing=False).fit(reference, _data())
    first = model()
    _trainer(1, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="trainer")]).fit(first, _data())
    assert not any(torch.equal(a, b) for a, b in zip(first.parameters(), reference.parameters()))
    in_fabric = _fabric_epoch(model(), load=tmp_path / "trainer.ckpt")

    _fabric_epoch(model(), save=tmp_path / "fabric.ckpt")
    in_trainer = model()  # no ``loops`` entry in the file: the Trainer counts epochs from 0 again
    _trainer(1, enable_checkpointing=False).fit(in_trainer, _data(), ckpt_path=tmp_path / "fabric.ckpt")
    for ref, a, b in zip(reference.parameters(), in_fabric.parameters(), in_trainer.parameters()):
        assert torch.equal(a, ref) and torch.equal(b, ref)


def test_a_checkpoint_plugin_given_through_plugins_is_taken(tmp_path):
    """It was refused ("checkpoint_io set through both strategy class and plugins"): the
    strategy filled in its atomic writer when built; now, as Fabric's own, when first asked."""
    from lightning_fastopt.core.checkpoint_io import AtomicCheckpointIO

    counting = counting_checkpoint_io()
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FastOptFabricStrategy(copy_on_cpu=True), plugins=[counting])
    fabric.save(tmp_path / "state.ckpt", {"step": 1})
    assert fabric.strategy.checkpoint_io is counting and counting.saves == 1
    plain = L.Fabric(accelerator="cpu", devices=1, strategy=FastOptFabricStrategy(copy_on_cpu=True))
    assert isinstance(plain.strategy.checkpoint_io, AtomicCheckpointIO)
