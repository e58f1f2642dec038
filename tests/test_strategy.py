"""Trainer(strategy="fastopt"): the same training as plain Lightning with torch.optim,
optimizer mapping, LR schedulers, clipping, accumulation, param groups, and clear errors."""

import re
import subprocess
import sys
import warnings

import lightning as L
import pytest
import torch
from torch import nn

import lightning_fastopt  # noqa: F401  (registers the strategy names)
from lightning_fastopt import ops
from lightning_fastopt import FastOptPrecision, FastOptStrategy, FusedAdam, FusedAdagrad, FusedSGD
from lightning_fastopt.core.cpu_threads import default_cpu_threads
from lightning_fastopt.offload import OffloadOptimizer
from tests.helpers import ACCELERATOR, ADAM_AS_TORCH
from tests.test_precision import _data



class Model(L.LightningModule):
    def __init__(self, make_opt, sched=True):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.make_opt = make_opt
        self.sched = sched

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        groups = [{"params": self.net[0].parameters()}, {"params": self.net[2].parameters(), "lr": 3e-3}]
        opt = self.make_opt(groups)
        if not self.sched:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(strategy, model, **kw):
    args = dict(accelerator=ACCELERATOR, devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, strategy=strategy)
    args.update(kw)
    trainer = L.Trainer(**args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _data())
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    return trainer


STRATEGIES = {
    "fastopt": lambda: "fastopt",
    "fastopt_offload": lambda: "fastopt_offload",
    "part_offloaded": lambda: FastOptStrategy(offload_fraction=0.2, bucket_size_mb=0.0004),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("make_opt,fused_cls", [
    (lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01), FusedAdam),
    (lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.01, amsgrad=True), FusedAdam),
    (lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, nesterov=True), FusedSGD),
    (lambda g: torch.optim.Adagrad(g, lr=1e-2), FusedAdagrad),
], ids=["adamw", "adam-amsgrad", "sgd", "adagrad"])
def test_same_weights_as_plain_lightning(backend, make_opt, fused_cls, strategy):
    """Two param groups, a step-interval scheduler, accumulation over 2 batches and
    clipping by norm: 16 optimizer steps equal plain Lightning's with torch.optim, bit for
    bit."""
    if ACCELERATOR == "gpu" and backend is ops.torch_backend and strategy != "fastopt":
        pytest.skip("the pure-PyTorch backend updates the offloaded share in torch's CPU operations, within an ulp "
                    "a step of the GPU's (docs/kernels.md)")
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=0.1)
    ours, ref = Model(make_opt), Model(make_opt)
    trainer = _fit(STRATEGIES[strategy](), ours, **kw)
    ref_trainer = _fit("auto", ref, **kw)  # Trainer(): one device behaves like it
    opt = trainer.strategy.engines[0]
    assert isinstance(opt, OffloadOptimizer) and type(opt.optimizer) is fused_cls
    assert opt.offload_fraction == {"fastopt": 0.0, "fastopt_offload": 1.0, "part_offloaded": 0.2}[strategy]
    assert isinstance(trainer.strategy, FastOptStrategy)
    assert isinstance(trainer.precision_plugin, FastOptPrecision)
    # the scheduler moved the lr of the very groups our optimizer steps with
    assert opt.param_groups[1]["lr"] == ref_trainer.optimizers[0].param_groups[1]["lr"] < 3e-3
    assert trainer.global_step == ref_trainer.global_step == 8
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b), (a - b).abs().max().item()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_clip_by_value_and_our_own_optimizer(backend, strategy):
    make = lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01, **ADAM_AS_TORCH)  # noqa: E731
    ours, ref = Model(make, sched=False), Model(lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01),
                                                sched=False)
    trainer = _fit(STRATEGIES[strategy](), ours, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    _fit("auto", ref, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    assert type(trainer.strategy.engines[0].optimizer) is FusedAdam
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_precision_flags_map_to_our_plugin():
    s = FastOptStrategy(initial_scale_power=7)
    t = L.Trainer(accelerator="cpu", devices=1, strategy=s, precision="bf16-mixed", logger=False)
    assert isinstance(t.precision_plugin, FastOptPrecision) and t.precision_plugin.precision == "bf16-mixed"
    t = L.Trainer(accelerator="cpu", devices=1, strategy="fastopt", plugins=[FastOptPrecision("16-mixed")],
                  logger=False)
    assert t.precision_plugin.precision == "16-mixed"
    for flag in ("bf16-true", "16-true", "64-true"):
        t = L.Trainer(accelerator="cpu", devices=1, strategy="fastopt", precision=flag, logger=False)
        assert isinstance(t.precision_plugin, FastOptPrecision) and t.precision_plugin.precision == flag
        assert (t.precision_plugin.scaler is not None) == (flag == "16-true")

def test_a_precision_plugin_we_cannot_step_with_serves_evaluation_and_is_refused_by_fit():
    """It was refused when the Trainer was built, also for ``trainer.test()`` (issue 39:
    TransformerEnginePrecision): now it is kept for validate, test and predict, which run
    no step of ours, and refused by name when ``fit`` sets up the optimizers."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    def trainer(strategy, plugin):
        return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         max_steps=2)

    own = _OwnPrecision()
    ours, reference = trainer("fastopt", own), trainer("auto", _OwnPrecision())
    assert ours.precision_plugin is own
    torch.manual_seed(0)
    model = BoringModel()

    def seeded(run):  # BoringModel draws its data when asked for a loader
        torch.manual_seed(1)
        return run(model)

    assert seeded(lambda m: ours.test(m, verbose=False)) == seeded(lambda m: reference.test(m, verbose=False))
    predicted, expected = seeded(ours.predict), seeded(reference.predict)
    assert len(predicted) == len(expected) and all(torch.equal(a, b) for a, b in zip(predicted, expected))
    with pytest.raises(TypeError, match=r"support precision in \('16-mixed', 'bf16-mixed', '32-true', 'bf16-true', "
                                        r"'16-true', '64-true'\).*got _OwnPrecision\('32-true'\)"):
        trainer("fastopt", _OwnPrecision()).fit(BoringModel())


class _OwnPrecision(L.pytorch.plugins.precision.Precision):
    """A precision plugin of the user's own: the strategy cannot know what it does."""


def test_bad_loss_scale_knobs_fail_at_construction():
    with pytest.raises(ValueError, match="hysteresis must be an integer >= 1"):
        FastOptStrategy(hysteresis=0)
    with pytest.raises(ValueError, match="loss_scale_window must be an integer >= 1"):
        FastOptStrategy(loss_scale_window=0)


def test_registration_is_idempotent():
    from lightning.pytorch.strategies import StrategyRegistry

    lightning_fastopt._register_strategies()
    assert "fastopt" in StrategyRegistry.available_strategies()


def test_strategy_arguments_are_validated():
    with pytest.raises(ValueError, match=r"offload_fraction must be in \[0.0, 1.0\], got 1.5"):
        FastOptStrategy(offload_fraction=1.5)
    with pytest.raises(ValueError, match=r"bucket_size_mb must be in \(0.0, inf\), got 0"):
        FastOptStrategy(bucket_size_mb=0)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="cpu_threads must be a positive integer or None"):
            FastOptStrategy(cpu_threads=bad)
    with pytest.raises(TypeError, match="overlap must be True or False, got 'yes'"):
        FastOptStrategy(overlap="yes")
    with pytest.raises(ValueError, match="min_loss_scale"):
        FastOptStrategy(min_loss_scale=0)
    for bad in (3, -1, True, "1"):
        with pytest.raises(ValueError, match="zero_stage must be 0, 1 or 2"):
            FastOptStrategy(zero_stage=bad)
    for bad in ("half", None, [0.5]):
        with pytest.raises(TypeError, match=r"offload_fraction must be a number in \[0.0, 1.0\](,| or 'auto',) got "
                           + re.escape(repr(bad))):
            FastOptStrategy(offload_fraction=bad)
    with pytest.raises(TypeError, match="bucket_size_mb must be a number"):
        FastOptStrategy(bucket_size_mb="64MB")
    with pytest.raises(ValueError, match="at_min_loss_scale must be one of"):
        FastOptStrategy(at_min_loss_scale="ignore")


def test_a_misspelt_argument_is_refused_with_the_nearest_name():
    """**kwargs go to DDPStrategy and DistributedDataParallel, which one process never builds:
    an unknown name would be silently dropped there."""
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'offload_fractoin' \(did you mean "
                                        r"'offload_fraction'\?\)"):
        FastOptStrategy(offload_fractoin=0.5)
    with pytest.raises(TypeError, match=r"'nonsense'.*it accepts its own arguments, DDPStrategy's and "):
        FastOptStrategy(nonsense=1)
    strategy = FastOptStrategy(find_unused_parameters=True, static_graph=False, timeout=None)  # DDP's and DDPStrategy's
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "static_graph": False}


def test_registered_names_and_their_fractions():
    from lightning.pytorch.strategies import StrategyRegistry

    for name, fraction, stage in (("fastopt", 0.0, 0), ("fastopt_offload", 1.0, 0), ("fastopt_zero1", 0.0, 1),
                                  ("fastopt_zero2", 0.0, 2), ("fastopt_zero2_offload", 1.0, 2)):
        t = L.Trainer(accelerator="cpu", devices=1, strategy=name.upper(), logger=False)
        assert isinstance(t.strategy, FastOptStrategy) and t.strategy.offload_fraction == fraction
        assert t.strategy.zero_stage == stage
        assert name in StrategyRegistry.available_strategies()


class _Recorder(L.pytorch.loggers.Logger):
    name, version, experiment = "recorder", 0, None

    def __init__(self):
        super().__init__()
        self.metrics = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


class _ThreadProbe(L.Callback):
    def on_train_batch_start(self, *args):
        self.threads = torch.get_num_threads()


def test_wall_clock_breakdown_and_cpu_threads(backend):
    logger, probe = _Recorder(), _ThreadProbe()
    before = torch.get_num_threads()
    strategy = FastOptStrategy(offload_fraction=0.5, wall_clock_breakdown=True, cpu_threads=1)
    _fit(strategy, Model(lambda g: torch.optim.AdamW(g, lr=1e-2)), logger=logger, callbacks=[probe],
         plugins=[FastOptPrecision("16-mixed")])
    steps = [m for _, m in logger.metrics if "fastopt/loss_scale" in m]
    assert len(steps) == 16
    for m in steps:
        assert m["fastopt/loss_scale"] > 0
        for phase in ("grad_d2h", "gpu_step", "cpu_step", "param_h2d"):
            assert m.get(f"fastopt/{phase}_ms", 0.0) >= 0.0
    assert sum(m.get("fastopt/cpu_step_ms", 0.0) for m in steps) > 0
    assert probe.threads == 1 and torch.get_num_threads() == before  # restored at teardown


def test_split_cores_gives_the_step_the_first_cores_of_each_share_and_the_launcher_the_rest():
    from lightning_fastopt.core.cpu_threads import split_cores

    sixteen = list(range(16))
    assert split_cores(sixteen, 1, 0, 14) == (list(range(14)), [14, 15])
    assert split_cores(sixteen, 2, 1, 6) == (list(range(8, 14)), [14, 15])  # the second process's eight
    assert split_cores(sixteen, 1, 0, 16) == (list(range(15)), [15])  # one core left at least
    assert split_cores([0, 1], 1, 0, 2) == ([0], [1])
    assert split_cores([2, 5, 7], 1, 0, 1) == ([2], [5, 7])


class _Placement(L.Callback):
    """Where the main thread and the engine's worker thread run during training."""

    def on_train_batch_start(self, trainer, *args):
        import os

        self.main = os.sched_getaffinity(0)
        engine = trainer.strategy.engines[0]
        engine = getattr(engine, "local", engine)  # (FSDP's rank's offload optimizer)
        self.worker = engine.updates.submit(lambda: os.sched_getaffinity(0)).result()


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="binding needs two cores")
@pytest.mark.parametrize("kind", ["fastopt", "fastopt_fsdp"])
def test_bound_threads_run_apart_and_end_on_the_same_bits(kind):
    """bind_cpu_threads=True (issue 66): the main thread, which launches an accelerator's work,
    on the last core of the process's share, the worker thread of the streamed updates on the
    others; the cores given back at teardown, and the bits those of the same run unbound."""
    import os

    from lightning_fastopt import FastOptFSDPStrategy

    strategy = FastOptStrategy if kind == "fastopt" else FastOptFSDPStrategy
    with pytest.raises(ValueError, match="bind_cpu_threads=True puts the worker thread .* give one of them"):
        strategy(bind_cpu_threads=True)  # nothing runs on the worker at the step
    with pytest.MonkeyPatch.context() as patch:  # a system without sched_setaffinity (not Linux)
        patch.delattr(os, "sched_setaffinity")
        with pytest.raises(ValueError, match="bind_cpu_threads=True binds threads to cores through the system's "
                                             "sched_setaffinity"):
            strategy(bind_cpu_threads=True, stream_cpu_step=True)
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    placement = _Placement()
    bound = Model(lambda g: torch.optim.AdamW(g, lr=1e-2))
    _fit(strategy(bind_cpu_threads=True, cpu_threads=1, copy_on_cpu=True, stream_cpu_step=True), bound,
         callbacks=[placement], accelerator="cpu")
    assert placement.worker == {cores[0]} and placement.main == set(cores[1:])
    assert os.sched_getaffinity(0) == before  # given back
    free = Model(lambda g: torch.optim.AdamW(g, lr=1e-2))
    _fit(strategy(cpu_threads=1, copy_on_cpu=True, stream_cpu_step=True), free, accelerator="cpu")
    assert all(torch.equal(a, b) for a, b in zip(bound.parameters(), free.parameters()))
    # the same bound run again with another process keeping a core busy: the same bits
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        again = Model(lambda g: torch.optim.AdamW(g, lr=1e-2))
        _fit(strategy(bind_cpu_threads=True, cpu_threads=1, copy_on_cpu=True, stream_cpu_step=True), again,
             accelerator="cpu")
    finally:
        spinner.kill()
        spinner.wait()
    assert all(torch.equal(a, b) for a, b in zip(bound.parameters(), again.parameters()))


def test_wall_clock_breakdown_is_logged_under_fastopt_fsdp_too():
    """The FSDP strategy logs each step's phases as the DDP one does (it timed them and
    logged nothing before)."""
    from lightning_fastopt import FastOptFSDPStrategy

    logger = _Recorder()
    _fit(FastOptFSDPStrategy(offload_fraction=0.5, wall_clock_breakdown=True), Model(lambda g: torch.optim.AdamW(g)),
         logger=logger, accelerator="cpu")
    steps = [m for _, m in logger.metrics if "fastopt/loss_scale" in m]
    assert len(steps) == 16 and all(m["fastopt/loss_scale"] == 1.0 for m in steps)
    assert sum(m.get("fastopt/cpu_step_ms", 0.0) for m in steps) > 0


def test_a_model_on_the_cpu_keeps_torchs_thread_count_unless_cpu_threads_is_given(backend):
    """The count is torch's for the whole process: the model's too on the CPU, where the
    bits of a reduction can depend on it (a LayerNorm's gradient under sequence parallelism
    ended 1e-9 away from ``ModelParallelStrategy``'s, whose second process keeps torch's
    default, until 2026-11-27).  Without ``cpu_threads`` the run keeps the count Lightning
    left (with it, the step and torch get that many: ``test_wall_clock_breakdown_and_cpu_threads``)."""
    probe, before = _ThreadProbe(), torch.get_num_threads()
    kept = 1 if default_cpu_threads(1) > 1 else 2  # a count the strategy's default would change
    torch.set_num_threads(kept)
    try:
        _fit(FastOptStrategy(offload_fraction=0.5, copy_on_cpu=True), Model(lambda g: torch.optim.AdamW(g, lr=1e-2)),
             callbacks=[probe], accelerator="cpu")
        assert probe.threads == kept and torch.get_num_threads() == kept
    finally:
        torch.set_num_threads(before)


def test_default_cpu_threads_share_the_cores():
    import os

    cores = len(os.sched_getaffinity(0))
    assert default_cpu_threads(1) == cores
    assert default_cpu_threads(cores * 4) == 1
    # on an accelerator, two of a share of eight or more left to the launching thread and the copies
    assert default_cpu_threads(1, accelerator=True, cores=16) == 14
    assert default_cpu_threads(2, accelerator=True, cores=16) == 6
    assert default_cpu_threads(1, accelerator=True, cores=8) == 6
    assert default_cpu_threads(2, accelerator=True, cores=8) == 4
    assert default_cpu_threads(1, accelerator=False, cores=16) == 16
    assert default_cpu_threads(32, accelerator=True, cores=16) == 1


def test_on_an_accelerator_the_step_gets_the_accelerators_default():
    """No accelerator is touched: the count is set from the device's type alone."""
    from lightning_fastopt.core.cpu_threads import TorchThreads

    before, threads = torch.get_num_threads(), TorchThreads()
    try:
        threads.set(None, 1, torch.device("cuda", 0))
        assert torch.get_num_threads() == default_cpu_threads(1, accelerator=True)
    finally:
        threads.restore()
    assert torch.get_num_threads() == before


class _WithOddParameter(L.LightningModule):
    def __init__(self, odd: str):
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.emb = nn.Embedding(10, 8, sparse=odd == "sparse")
        self.phase = nn.Parameter(torch.randn(4, dtype={"complex": torch.complex64, "float64": torch.float64}.get(
            odd, torch.float32)))
        self.steps = 0

    def training_step(self, batch, _):
        self.steps += 1
        x, y = batch
        return nn.functional.mse_loss(self.net(x + self.emb(torch.zeros(len(x), dtype=torch.long))), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("odd,error,match", [
    ("complex", TypeError, r"parameter 'phase' is complex \(torch.complex64\): the fastopt strategies step float64 "
                           r"\(with the optimizer's own step\) and float32"),
    ("sparse", ValueError, r"parameter 'emb.weight' gets sparse gradients \(Embedding\(sparse=True\)\)"),
])
def test_parameters_the_kernels_cannot_step_are_refused_at_set_up(odd, error, match):
    model = _WithOddParameter(odd)
    trainer = L.Trainer(strategy="fastopt", accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(error, match=match):
        trainer.fit(model, _data())
    assert model.steps == 0  # before any training step
