"""A Lightning project changes one line and works as before (issue: drop-in for real
Lightning projects).  Each test runs a project pattern under a fastopt strategy and under
``Trainer()`` with the same model and data, and compares element by element: bit for bit
(``torch.equal``) everywhere here, since the optimizers the kernels do not cover run
torch's own ``step`` on the master weights, and the SGD kernels round as torch does.

Strategies: the accelerator code path on the CPU (``copy_on_cpu=True``, half offloaded
and all offloaded) and the plain CPU path (``offload_fraction=1.0``: offloaded masters are
the parameters themselves).  The test classes with a step of their own are named in
``per_parameter_optimizers`` (:data:`PER_PARAMETER`), so that each share runs their step;
not named, such a class runs as torch runs it."""

import copy
import pickle
from collections import Counter

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_fastopt  # noqa: F401  (registers the strategy names)
from lightning_fastopt import FastOptStrategy, OffloadOptimizer
from lightning_fastopt.optim import FusedSGD
from lightning_fastopt.optim.takeover import engine_of
from lightning_fastopt.optim.user_step import UserStepOptimizer
from tests.helpers import assert_modules_equal, counting_checkpoint_io, said_lines
from tests.references import GlobalNorm

# the test classes below with a step of their own that updates each parameter alone: named, they
# are stepped on the shares (each share's own step is what these tests check); not named, they
# would run as torch runs them (test_an_own_step_not_named_runs_as_torch_and_ends_where_trainer_ends)
PER_PARAMETER = ("LoggedSGD", "SignDescent", "NoGradAdamW", "DropsTheClosure", "PassesTheClosure", "RecordedSGD",
                 "ScaledSGD", "SAM")

STRATEGIES = {
    "part-offloaded-accelerator-path": lambda: FastOptStrategy(offload_fraction=0.2, bucket_size_mb=0.0002,
                                                               copy_on_cpu=True, per_parameter_optimizers=PER_PARAMETER),
    "offloaded-accelerator-path": lambda: FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True,
                                                          per_parameter_optimizers=PER_PARAMETER),
    "offload-cpu-path": lambda: FastOptStrategy(offload_fraction=1.0, per_parameter_optimizers=PER_PARAMETER),
}


def _data(n=32):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=8)


class Net(L.LightningModule):
    def __init__(self, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), scheduler=False):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.make_opt, self.scheduler = make_opt, scheduler

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch, _):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, _):
        return self(batch[0])

    def configure_optimizers(self):
        opt = self.make_opt(self.parameters())
        if not self.scheduler:
            return opt
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def _trainer(strategy, tmp_path=None, **kw):
    args = dict(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)
    if tmp_path is not None:
        args["default_root_dir"] = tmp_path
    args.update(kw)
    return L.Trainer(strategy=strategy, **args)


def test_the_part_offloaded_strategy_keeps_a_share_on_the_device():
    """Whole tensors are offloaded from the last ones: at 0.2 Net's last three (33 of its
    161 elements) go to the host and its first weight stays, so the tests here run both
    shares (at 0.5 the first weight would be taken too: everything)."""
    trainer = _trainer(STRATEGIES["part-offloaded-accelerator-path"](), max_epochs=1)
    model = Net()
    trainer.fit(model, _data())
    assert trainer.strategy.engines[0].offloaded_numel == 33 < sum(p.numel() for p in model.parameters()) == 161


# ---------------------------------------------------------------------------- entry points
ORDERS = {
    "fit-validate-test-predict": ("fit", "validate", "test", "predict"),
    "predict-test-validate-fit": ("predict", "test", "validate", "fit"),
    "validate-fit-predict-fit": ("validate", "fit", "predict", "fit"),
}


def _run(strategy, order, tmp_path):
    model = Net()
    trainer = _trainer(strategy, tmp_path, enable_checkpointing=True, limit_val_batches=2)
    results = []
    for stage in order:
        if stage == "fit":
            trainer.fit(model, _data(), _data(16))
            trainer.fit_loop.max_epochs += 1  # a second fit trains one epoch more
        elif stage == "predict":
            results.append(torch.cat(trainer.predict(model, _data(16))))
        else:
            out = getattr(trainer, stage)(model, _data(16), verbose=False)
            results.append(torch.tensor(list(out[0].values())))
    return model, results


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_entry_point_in_any_order(strategy, order, tmp_path):
    """fit, validate, test and predict on one Trainer, in several orders (validate, test
    and predict crashed at one process: DDP's set-up synchronised the module over a
    process group that one process does not start): the same numbers as ``Trainer()``."""
    ours, ours_out = _run(STRATEGIES[strategy](), ORDERS[order], tmp_path / "ours")
    ref, ref_out = _run("auto", ORDERS[order], tmp_path / "ref")
    assert_modules_equal(ours, ref)
    assert len(ours_out) == len(ref_out) == sum(s != "fit" for s in ORDERS[order])
    for a, b in zip(ours_out, ref_out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ckpt_path", ["best", "last", "path"])
def test_evaluation_from_a_checkpoint_after_fit(ckpt_path, tmp_path):
    """``trainer.test(ckpt_path="best"/"last"/a path)`` after fit reads the checkpoint our
    strategy wrote: the metrics equal ``Trainer()``'s."""
    def run(strategy, root):
        model = Net()
        checkpoint = ModelCheckpoint(dirpath=root, monitor="val_loss", save_last=True)
        trainer = _trainer(strategy, root, enable_checkpointing=True, callbacks=[checkpoint], limit_val_batches=2)
        trainer.fit(model, _data(), _data(16))
        path = checkpoint.best_model_path if ckpt_path == "path" else ckpt_path
        tested = trainer.test(model, _data(16), ckpt_path=path, verbose=False)
        predicted = torch.cat(trainer.predict(model, _data(16), ckpt_path=path))
        return tested[0]["test_loss"], predicted

    ours = run(STRATEGIES["part-offloaded-accelerator-path"](), tmp_path / "ours")
    ref = run("auto", tmp_path / "ref")
    assert ours[0] == ref[0] and torch.equal(ours[1], ref[1])


# ---------------------------------------------------------------------------- the user's optimizer
class _TypeDispatch(Callback):
    """Does something only for SGD optimizers (as callbacks that dispatch on the type do)."""

    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen.append((type(optimizer).__name__, type(optimizer) is torch.optim.SGD, optimizer))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_lightning_and_callbacks_see_the_users_optimizer(strategy, tmp_path):
    """``trainer.optimizers``, the optimizer hooks get and ``self.optimizers()`` are the
    user's object, of its very class (``type(optimizer) is torch.optim.SGD``: a class derived
    at run time made a callback that tests it skip its work, until 2026-11-27), its
    ``repr``, ``param_groups`` dicts and ``defaults``; LearningRateMonitor logs under the names it uses under ``Trainer()``:
    ``lr-SGD`` and ``lr-SGD-momentum``, once each with a scheduler (it counted a second
    optimizer, ``lr-FusedSGD``)."""
    made = {}

    def make(ps):
        made["opt"] = torch.optim.SGD(ps, lr=0.05, momentum=0.9)
        made["groups"] = list(made["opt"].param_groups)
        return made["opt"]

    class Model(Net):
        def on_train_batch_start(self, batch, batch_idx):
            assert self.optimizers().optimizer is made["opt"]

    model, dispatch = Model(make, scheduler=True), _TypeDispatch()
    monitor = LearningRateMonitor(log_momentum=True)
    trainer = _trainer(STRATEGIES[strategy](), tmp_path, logger=CSVLogger(tmp_path), callbacks=[monitor, dispatch])
    trainer.fit(model, _data())
    opt = made["opt"]
    assert trainer.optimizers == [opt] and type(opt) is torch.optim.SGD  # its own class again after fit
    assert {name for name, _, _ in dispatch.seen} == {"SGD"} and all(sgd for _, sgd, _ in dispatch.seen)
    assert all(o is opt for _, _, o in dispatch.seen)
    ref_monitor = LearningRateMonitor(log_momentum=True)
    _trainer("auto", tmp_path / "ref", logger=CSVLogger(tmp_path / "ref"), callbacks=[ref_monitor]).fit(
        Net(scheduler=True), _data())
    assert list(monitor.lrs) == list(ref_monitor.lrs) == ["lr-SGD"]
    assert list(monitor.last_momentum_values) == list(ref_monitor.last_momentum_values) == ["lr-SGD-momentum"]
    assert [g["lr"] for g in opt.param_groups] == [0.05 * 0.5 ** 2]
    assert opt.param_groups[0] is made["groups"][0]
    torch_keys = set(torch.optim.SGD([nn.Parameter(torch.zeros(1))]).param_groups[0]) | {"initial_lr"}  # StepLR's
    assert set(opt.param_groups[0]) == torch_keys  # none of ours added
    assert opt.state and all(set(st) == {"momentum_buffer"} for st in opt.state.values())  # handed back


def test_the_optimizer_reads_as_the_users_during_training(tmp_path):
    """While training, ``repr`` and the class name are the user's, and the offload
    optimizer behind it is ``engine_of(optimizer)``."""
    seen = {}

    class Model(Net):
        def on_train_batch_start(self, batch, batch_idx):
            opt = self.trainer.optimizers[0]
            seen.update(name=type(opt).__name__, repr=repr(opt), engine=engine_of(opt),
                        lightning=repr(self.optimizers()), adam=isinstance(opt, torch.optim.Adam))

    trainer = _trainer(STRATEGIES["offloaded-accelerator-path"](), tmp_path)
    trainer.fit(Model(lambda ps: torch.optim.Adam(ps, lr=1e-3)), _data())
    assert seen["name"] == "Adam" and seen["adam"] and seen["repr"].startswith("Adam (")
    assert seen["lightning"] == "Lightning" + seen["repr"]
    assert isinstance(seen["engine"], OffloadOptimizer) and seen["engine"] is trainer.strategy.engines[0]


class _CopiesTheOptimizer(Callback):
    """At the end of the first epoch: deep copies of the optimizer and of the callbacks
    (which reach the Trainer, its strategy and model, as ``deepcopy(trainer.callbacks)``
    in Lightning's own tests), and a pickled copy of the optimizer."""

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            opt = trainer.optimizers[0]
            self.copies = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
            self.callbacks = copy.deepcopy(trainer.callbacks)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_copy_of_the_optimizer_is_the_users_with_its_state(strategy):
    """``copy.deepcopy`` and pickling of the optimizer while it trains give an optimizer of
    the user's class holding the state as torch keeps it (equal to ``Trainer()``'s copy at
    the same point, bit for bit), and copying does not disturb the run."""
    ours_cb, ref_cb = _CopiesTheOptimizer(), _CopiesTheOptimizer()
    ours, ref = Net(), Net()
    _trainer(STRATEGIES[strategy](), callbacks=[ours_cb]).fit(ours, _data())
    _trainer("auto", callbacks=[ref_cb]).fit(ref, _data())
    assert_modules_equal(ours, ref)
    expected = ref_cb.copies[0]
    for copied in ours_cb.copies:
        assert type(copied) is torch.optim.SGD and len(copied.param_groups) == 1
        buffers = [copied.state[p]["momentum_buffer"] for p in copied.param_groups[0]["params"]]
        for mine, theirs in zip(buffers, [expected.state[p]["momentum_buffer"] for p in expected.param_groups[0]["params"]]):
            assert torch.equal(mine, theirs)
    assert len(ours_cb.callbacks) == len(ref_cb.callbacks)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_optimizer_given_back_counts_each_parameters_steps_apart(strategy):
    """The engines keep one Adam step count per group; given back after fit (and in copies,
    and in the torch-layout state ``fastopt_fsdp``'s checkpoints hold) every parameter got
    that one tensor, so the user's AdamW, stepping on, counted each parameter's step into
    it (a ``ModelParallelStrategy`` run resumed from such a checkpoint went astray).  Each
    parameter has its own count, and a plain step after fit lands where ``Trainer()``'s does."""
    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-2)

    ours, ref = Net(adamw), Net(adamw)
    ours_trainer, ref_trainer = _trainer(STRATEGIES[strategy]()), _trainer("auto")
    ours_trainer.fit(ours, _data())
    ref_trainer.fit(ref, _data())
    runs = []
    for trainer, model in ((ours_trainer, ours), (ref_trainer, ref)):
        opt = trainer.optimizers[0]
        steps = [opt.state[p]["step"] for p in model.parameters()]
        assert len({s.untyped_storage().data_ptr() for s in steps}) == len(steps)
        x, y = next(iter(_data()))
        opt.zero_grad()  # Lightning leaves the last gradients in p.grad; ours freed the offloaded ones
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        runs.append((model, [float(s) for s in steps]))
    assert runs[0][1] == runs[1][1] == [9.0] * 4
    assert_modules_equal(ours, ref)


def test_the_view_held_as_torch_steps_itself_not_the_engine():
    """``held_as_torch`` (what the FSDP strategies hand to torch's distributed state dicts,
    which step an optimizer without state to make its state): with an LR scheduler the
    user's optimizer carries the scheduler's wrapper around its own step, which stepped
    the engine instead and left the view empty (a resume then lost the optimizer state)."""
    from lightning_fastopt.optim.from_torch import to_fused_optimizer
    from lightning_fastopt.optim.takeover import give_back, held_as_torch, take_over

    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step
    engine = OffloadOptimizer(to_fused_optimizer(opt), offload_fraction=0.5, copy_on_cpu=True)
    take_over(opt, engine)
    view = held_as_torch(opt)
    assert type(view) is torch.optim.AdamW and "step" not in vars(view)
    assert view.param_groups is engine.param_groups
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    view.step()
    assert all(view.state[p] for p in model.parameters())
    assert not any(engine.state_of(p) for p in model.parameters())
    give_back(opt)  # after fit: the user's optimizer itself, its step still the scheduler's wrapper
    after = held_as_torch(opt)
    assert type(after) is torch.optim.AdamW and "step" not in vars(after) and "step" in vars(opt)


# ---------------------------------------------------------------------------- any optimizer
class MySGD(torch.optim.SGD):
    """A subclass that only adds an attribute: torch's SGD step, so the kernels run it."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.created_by = "the user"


class LoggedSGD(torch.optim.SGD):
    """A subclass with its own step: that step runs (on the masters)."""

    calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        type(self).calls += 1
        return super().step(closure)


def _loss_of(closure):
    """What torch's optimizers do with a closure: evaluate it with gradients enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SignDescent(torch.optim.Optimizer):
    """A third-party-style optimizer: a decaying sign step with a per-parameter counter."""

    def __init__(self, params, lr=1e-2, decay=0.9):
        super().__init__(params, dict(lr=lr, decay=decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _loss_of(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["k"] = st.get("k", 0) + 1
                p.add_(p.grad.sign(), alpha=-group["lr"] * group["decay"] ** st["k"])
        return loss


class NoGradAdamW(torch.optim.AdamW):
    """As some third-party AdamW classes: ``step`` under no_grad, with a required closure."""

    @torch.no_grad()
    def step(self, closure):
        if closure is not None:
            closure()
        return super().step()


OPTIMIZERS = {
    "RAdam": (lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.01), UserStepOptimizer),
    "RMSprop": (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5), UserStepOptimizer),
    "NAdam": (lambda ps: torch.optim.NAdam(ps, lr=1e-2), UserStepOptimizer),
    "Adamax": (lambda ps: torch.optim.Adamax(ps, lr=1e-2), UserStepOptimizer),
    "subclass-of-SGD": (lambda ps: MySGD(ps, lr=0.05, momentum=0.9), FusedSGD),
    "subclass-with-its-own-step": (lambda ps: LoggedSGD(ps, lr=0.05, momentum=0.9), UserStepOptimizer),
    "third-party": (lambda ps: SignDescent(ps), UserStepOptimizer),
    "step-requiring-a-closure": (lambda ps: NoGradAdamW(ps, lr=1e-2), UserStepOptimizer),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_any_optimizer_ends_where_trainer_ends(strategy, optimizer):
    """Optimizers the kernels do not cover run their own class's step on the masters
    where they live (one log line says so), with a scheduler: bit for bit ``Trainer()``."""
    make, runs_as = OPTIMIZERS[optimizer]
    LoggedSGD.calls = 0
    ours, ref = Net(make, scheduler=True), Net(make, scheduler=True)
    trainer = _trainer(STRATEGIES[strategy]())
    trainer.fit(ours, _data())
    calls = LoggedSGD.calls
    _trainer("auto").fit(ref, _data())
    assert_modules_equal(ours, ref)
    assert type(trainer.strategy.engines[0].optimizer) is runs_as
    assert type(trainer.optimizers[0]).__name__ == type(ref.optimizers().optimizer).__name__
    if optimizer == "subclass-with-its-own-step":  # its step ran: on each share (device, host buckets) every step
        assert calls >= LoggedSGD.calls - calls > 0
    if optimizer == "subclass-of-SGD":
        assert trainer.optimizers[0].created_by == "the user"


def _said(caplog, monkeypatch):
    """Capture Lightning's info lines (``lightning.pytorch`` does not propagate them to the
    root logger when that had no handler at import)."""
    import logging

    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    return caplog.at_level(logging.INFO)


def test_the_log_says_which_optimizers_are_fused(caplog, monkeypatch):
    with _said(caplog, monkeypatch):
        _trainer(STRATEGIES["part-offloaded-accelerator-path"](), max_epochs=1).fit(
            Net(lambda ps: torch.optim.RMSprop(ps, lr=1e-3)), _data())
        _trainer(STRATEGIES["part-offloaded-accelerator-path"](), max_epochs=1).fit(
            Net(lambda ps: LoggedSGD(ps, lr=1e-3)), _data())
    text = caplog.text
    assert "RMSprop runs its own step on the master weights, where they live (not fused: no kernel for its " \
           "algorithm)" in text
    assert "LoggedSGD runs its own step on the master weights, where they live (not fused: it has its own step " \
           "(not SGD's))" in text  # named in per_parameter_optimizers


def test_lbfgs_runs_as_torch_runs_it(caplog, monkeypatch):
    """LBFGS evaluates the closure again after changing the weights: it runs on the
    model's weights, not offloaded, and says so; bit for bit ``Trainer()``."""
    make = lambda ps: torch.optim.LBFGS(ps, lr=0.1, max_iter=3)  # noqa: E731
    ours, ref = Net(make), Net(make)
    with _said(caplog, monkeypatch):
        trainer = _trainer(STRATEGIES["offloaded-accelerator-path"]())
        trainer.fit(ours, _data())
    _trainer("auto").fit(ref, _data())
    assert_modules_equal(ours, ref)
    assert trainer.strategy.engines == []
    assert "LBFGS runs as torch runs it, on the model's weights, not offloaded" in caplog.text


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_an_own_step_not_named_runs_as_torch_and_ends_where_trainer_ends(caplog, monkeypatch, strategy):
    """A class with a step of its own that is not known to update each parameter alone
    (``GlobalNorm``: every update scaled by the norm of all gradients, as timm's Lamb
    clips) runs as torch runs it, on the model's weights, not offloaded, one line saying
    so: bit for bit ``Trainer()``.  Until 2026-11-27 it ran once per share, silently off
    (8e-3 at fraction 0.5 after 8 steps); named in ``per_parameter_optimizers`` (the user's
    word that it is per parameter) it ran on the shares and ended elsewhere until issue 74:
    the claim is checked at set-up, and refused."""
    make = lambda ps: GlobalNorm(ps, lr=1e-2)  # noqa: E731
    ours, ref, named = Net(make), Net(make), Net(make)
    with _said(caplog, monkeypatch):
        trainer = _trainer(FastOptStrategy(**{**CLOSURE_STRATEGIES[strategy], "per_parameter_optimizers": ()}))
        trainer.fit(ours, _data())
    _trainer("auto").fit(ref, _data())
    assert_modules_equal(ours, ref)
    assert trainer.strategy.engines == []
    assert ("GlobalNorm runs as torch runs it, on the model's weights, not offloaded: its step is not known to update "
            "each parameter from its own gradient and state alone") in caplog.text
    assert "per_parameter_optimizers=['GlobalNorm'] steps it on them" in caplog.text
    if strategy == "part-offloaded-accelerator-path":  # shares: the device's and host buckets
        before = named.head.weight.detach().clone()
        with pytest.raises(ValueError, match="GlobalNorm is named in per_parameter_optimizers .* combines parameters"):
            _trainer(FastOptStrategy(**{**CLOSURE_STRATEGIES[strategy], "per_parameter_optimizers": ["GlobalNorm"]})
                     ).fit(named, _data())
        assert torch.equal(named.head.weight, before)


def test_lbfgs_with_fp16_loss_scaling_is_refused_by_name():
    """As Lightning's own 16-mixed refuses LBFGS: its step evaluates the closure again on
    weights it changed, which a skipped (overflowing) step cannot undo."""
    from lightning_fastopt import FastOptPrecision

    trainer = _trainer(STRATEGIES["offloaded-accelerator-path"](), plugins=[FastOptPrecision("16-mixed")])
    with pytest.raises(TypeError, match="LBFGS evaluates the closure again after changing the weights: it cannot "
                                        "run with fp16 loss scaling"):
        trainer.fit(Net(lambda ps: torch.optim.LBFGS(ps, lr=0.1)), _data())


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization around plain SGD, as SAM-style optimizers step: the
    closure at the weights, a climb along the gradient to radius ``rho``, the closure again
    there, back down, and the step with the second gradients."""

    def __init__(self, params, lr=0.05, rho=0.05):
        super().__init__(params, dict(lr=lr, rho=rho))

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure()
        with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in with_grad]))
        climbs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    climb = p.grad * (group["rho"] / (norm + 1e-12))
                    p.add_(climb)
                    climbs.append((p, climb))
        with torch.enable_grad():
            closure()
        for p, climb in climbs:
            p.sub_(climb)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


CLOSURE_STRATEGIES = {  # STRATEGIES' set-ups, with the arguments given here
    "part-offloaded-accelerator-path": dict(offload_fraction=0.2, bucket_size_mb=0.0002, copy_on_cpu=True,
                                            per_parameter_optimizers=PER_PARAMETER),
    "offloaded-accelerator-path": dict(offload_fraction=1.0, copy_on_cpu=True, per_parameter_optimizers=PER_PARAMETER),
    "offload-cpu-path": dict(offload_fraction=1.0, per_parameter_optimizers=PER_PARAMETER),
}


@pytest.mark.parametrize("named", [["SAM"], [SAM], "SAM"], ids=["name", "class", "one-name"])
@pytest.mark.parametrize("strategy", list(CLOSURE_STRATEGIES))
def test_a_sam_style_optimizer_named_in_closure_optimizers_trains_as_trainer(caplog, monkeypatch, strategy, named):
    """Its step evaluates the closure again at the weights it climbed to: named in
    ``closure_optimizers`` it runs as torch runs it, on the model's weights, as LBFGS does
    (issue 39); bit for bit ``Trainer()``."""
    ours, ref = Net(SAM), Net(SAM)
    with _said(caplog, monkeypatch):
        trainer = _trainer(FastOptStrategy(closure_optimizers=named, **CLOSURE_STRATEGIES[strategy]))
        trainer.fit(ours, _data())
    _trainer("auto").fit(ref, _data())
    assert_modules_equal(ours, ref)
    assert not torch.equal(Net().head.weight, ours.head.weight.detach())
    assert trainer.strategy.engines == []
    assert "SAM runs as torch runs it, on the model's weights, not offloaded" in caplog.text


@pytest.mark.parametrize("strategy", list(CLOSURE_STRATEGIES))
def test_a_sam_style_optimizer_offloaded_stops_at_its_first_step_naming_closure_optimizers(strategy):
    """Offloaded, its second evaluation would run forward and backward on weights the
    share holds apart from the model: an error that says what to do, not a silent
    step on stale gradients."""
    from lightning_fastopt.optim.closure import ClosureEvaluatedAgain

    trainer = _trainer(FastOptStrategy(**CLOSURE_STRATEGIES[strategy]))
    with pytest.raises(ClosureEvaluatedAgain, match=r"SAM's step evaluates the closure again after changing the "
                                                    r"weights .*closure_optimizers=\['SAM'\] "
                                                    r"\(FastOptStrategy, FastOptFabricStrategy\)"):
        trainer.fit(Net(SAM), _data())


class DropsTheClosure(torch.optim.SGD):
    """A subclass whose step forgets to pass the closure on (Lightning's own test)."""

    def step(self, closure=None):
        return super().step()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_step_that_drops_the_closure_raises_as_lightning_does(strategy):
    """Under Lightning the closure then never runs and the loop raises; here the engine ran
    it when the step began, and the same error is raised (it once trained)."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    for name in ("auto", strategy):
        with pytest.raises(MisconfigurationException, match="The closure hasn't been executed"):
            _trainer(STRATEGIES[name]() if name in STRATEGIES else name).fit(
                Net(lambda ps: DropsTheClosure(ps, lr=0.1)), _data())


class PassesTheClosure(torch.optim.SGD):
    """A subclass that runs its own step and passes the closure on to torch's."""

    seen: list = []

    def step(self, closure=None):
        loss = super().step(closure)
        type(self).seen.append(loss)
        return loss


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_an_own_step_gets_the_closure_and_its_loss_on_every_share(strategy):
    """torch's step evaluates the closure at the top and returns its loss: each share's own
    step gets the loss the closure returned (it was None before issue 39)."""
    PassesTheClosure.seen = []
    ours, ref = Net(lambda ps: PassesTheClosure(ps, lr=0.1)), Net(lambda ps: PassesTheClosure(ps, lr=0.1))
    _trainer(STRATEGIES[strategy]()).fit(ours, _data())
    seen, PassesTheClosure.seen = PassesTheClosure.seen, []
    _trainer("auto").fit(ref, _data())
    assert_modules_equal(ours, ref)
    # first the per-parameter claim's steps at set-up, on synthetic tensors without a closure (issue 74)
    from lightning_fastopt.plan.claim_check import SHAPES, STEPS

    checked = STEPS * (1 + len(SHAPES))
    assert seen[:checked] == [None] * checked
    seen = seen[checked:]
    assert len(seen) >= len(PassesTheClosure.seen) == 8 and all(isinstance(v, torch.Tensor) for v in seen)
    assert {float(v) for v in seen} == {float(v) for v in PassesTheClosure.seen}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES) + ["auto"])
def test_the_closure_runs_inside_the_optimizers_step_as_under_lightning(strategy):
    """Lightning's plugin passes the closure to ``optimizer.step`` (``test_train_loop_system``):
    torch's step pre-hooks run before ``training_step``, as they run under ``Trainer()``."""
    calls = []

    class Recorded(Net):
        def training_step(self, batch, batch_idx):
            calls.append("training_step")
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            opt = super().configure_optimizers()
            opt.register_step_pre_hook(lambda *_: calls.append("step"))
            return opt

    _trainer(STRATEGIES[strategy]() if strategy in STRATEGIES else strategy, max_epochs=1).fit(Recorded(), _data())
    assert calls == ["step", "training_step"] * 4


class RecordedSGD(torch.optim.SGD):
    """The optimizer of Lightning's ``test_train_loop_system``: it records its step (and
    when that step ends) and its ``zero_grad``."""

    calls: list = []

    def step(self, closure=None):
        type(self).calls.append("step")
        loss = super().step(closure)
        type(self).calls.append("stepped")
        return loss

    def zero_grad(self, set_to_none=True):
        type(self).calls.append("zero_grad")
        return super().zero_grad(set_to_none)


class RecordedNet(Net):
    def training_step(self, batch, batch_idx):
        RecordedSGD.calls.append("training_step")
        return super().training_step(batch, batch_idx)

    def backward(self, loss, *args, **kwargs):
        RecordedSGD.calls.append("backward")
        return super().backward(loss, *args, **kwargs)


def _leading_steps_only(calls):
    """The calls without the steps of the shares after the first: those are given the
    closure already evaluated, so each ends without a call between its beginning and its
    end (under ``Trainer()`` the closure's ``training_step`` always lies between)."""
    out = []
    for c in calls:
        if c == "stepped" and out and out[-1] == "step":
            out.pop()
        else:
            out.append(c)
    return out


ORDER_STRATEGIES = {**STRATEGIES,  # and through ZeroOptimizer, whose local offload optimizer's share leads
                    "zero2-one-process": lambda: FastOptStrategy(zero_stage=2, offload_fraction=0.5, copy_on_cpu=True,
                                                                 per_parameter_optimizers=PER_PARAMETER),
                    # each module's forward waiting for its own weights: a step of its own is not left to the worker
                    "offloaded-accelerator-path-module-waits": lambda: FastOptStrategy(
                        offload_fraction=1.0, copy_on_cpu=True, forward_waits="module",
                        per_parameter_optimizers=PER_PARAMETER)}


@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("strategy", sorted(ORDER_STRATEGIES))
def test_an_own_step_is_entered_before_the_closure_runs_as_torch_enters_it(strategy, accumulate):

    """Lightning's ``test_train_loop_system``: ``optimizer.step`` first, then, from the
    closure it calls, ``training_step``, ``zero_grad`` and ``backward``.  The share updated
    first runs the user's step from its top before the closure is evaluated (it once saw
    ``training_step`` before ``step``); the other shares' steps come after it.  The calls
    are ``Trainer()``'s, one share's exactly, and the weights bit for bit."""
    from lightning_fastopt.plan.claim_check import SHAPES, STEPS

    def run(chosen):
        RecordedSGD.calls = []
        model = RecordedNet(lambda ps: RecordedSGD(ps, lr=0.05, momentum=0.9))
        _trainer(chosen, max_epochs=1, accumulate_grad_batches=accumulate).fit(model, _data())
        return model, RecordedSGD.calls

    ours, ours_calls = run(ORDER_STRATEGIES[strategy]())
    ref, ref_calls = run("auto")
    # the per-parameter claim checked at set-up steps the class on synthetic tensors first (issue 74)
    checked = 2 * STEPS * (1 + len(SHAPES))
    assert ours_calls[:checked] == ["step", "stepped"] * (checked // 2)
    ours_calls = ours_calls[checked:]
    assert_modules_equal(ours, ref)
    assert ref_calls[:5] == (["step", "training_step", "zero_grad", "backward", "stepped"] if accumulate == 1 else
                             ["training_step", "zero_grad", "backward", "training_step", "backward"])
    assert _leading_steps_only(ours_calls) == ref_calls
    if strategy != "part-offloaded-accelerator-path":  # one share
        assert ours_calls == ref_calls
    else:
        assert len(ours_calls) > len(ref_calls)


def _recording_engine(model, events):
    class Recording(torch.optim.SGD):
        def step(self, closure=None, before=None):
            events.append("step")
            if before == "raise":
                raise RuntimeError("the step failed before its closure")
            if before == "change":
                with torch.no_grad():
                    self.param_groups[0]["params"][0].add_(1.0)
            return super().step(closure)

    return OffloadOptimizer(UserStepOptimizer(Recording(model.parameters(), lr=0.1)),
                            {p: n for n, p in model.named_parameters()}, offload_fraction=1.0, copy_on_cpu=True)


def test_the_leading_shares_step_runs_first_and_ends_with_the_engines_step_whatever_happens():
    """The user's step on the leading share is entered before the closure runs (on a thread
    of its own, which waits there): a step that fails before calling the closure raises with
    the closure never run; a closure that raises leaves no step waiting; a skipped step
    (an inf gradient) lets the user's step go on without gradients, changing nothing; a
    step that changes its weights before calling the closure is refused by name."""
    import threading

    from lightning_fastopt.optim.closure import ClosureEvaluatedAgain

    model, events = Net(), []
    opt = _recording_engine(model, events)
    x, y = next(iter(_data()))

    def closure(scale=1.0):
        events.append("closure")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y) * scale
        loss.backward()
        return loss

    def waiting_steps():
        return [t for t in threading.enumerate() if t.name == "fastopt-leading-step" and t.is_alive()]

    before = [p.detach().clone() for p in model.parameters()]
    loss = opt.step(closure)
    assert events == ["step", "closure"] and isinstance(loss, torch.Tensor) and loss.grad_fn is not None
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    events.clear()
    with pytest.raises(RuntimeError, match="the step failed before its closure"):
        opt.step(closure, before="raise")
    assert events == ["step"]

    events.clear()
    with pytest.raises(ValueError, match="training_step failed"):
        opt.step(lambda: (events.append("closure"), (_ for _ in ()).throw(ValueError("training_step failed"))))
    assert events == ["step", "closure"] and waiting_steps() == []

    events.clear()
    now = [p.detach().clone() for p in model.parameters()]
    opt.step(lambda: closure(float("inf")), grad_scale=1.0, check_finite=True)
    assert events == ["step", "closure"] and opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(now, model.parameters()))

    with pytest.raises(ClosureEvaluatedAgain, match="Recording's step evaluates the closure again"):
        opt.step(closure, before="change")
    assert waiting_steps() == []
    opt.close()


@pytest.mark.parametrize("make,match", [
    (lambda: FastOptStrategy(closure_optimizers=[3]), "closure_optimizers must be optimizer classes or class names"),
    (lambda: FastOptStrategy(closure_optimizers=None), "closure_optimizers must be"),
    (lambda: FastOptStrategy(closure_optimizers=[""]), "closure_optimizers must be"),
])
def test_bad_closure_optimizers_are_refused_by_name(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_no_optimizer_trains_nothing_as_in_lightning():
    """``configure_optimizers`` returning None: Lightning warns and steps nothing."""
    class NoOptimizer(Net):
        def configure_optimizers(self):
            return None

    model = NoOptimizer()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="`LightningModule.configure_optimizers` returned `None`"):
        _trainer(STRATEGIES["offloaded-accelerator-path"]()).fit(model, _data())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_64_true(strategy):
    """``precision="64-true"``: float64 weights, masters and state (AdamW's own step, the
    kernels being float32/half), as under Lightning's own strategy."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    ours, ref = Net(make), Net(make)
    trainer = _trainer(STRATEGIES[strategy](), precision="64-true")
    trainer.fit(ours, _data())
    _trainer("auto", precision="64-true").fit(ref, _data())
    assert ours.head.weight.dtype == torch.float64
    assert_modules_equal(ours, ref)
    assert all(st["exp_avg"].dtype == torch.float64 for st in trainer.optimizers[0].state.values())


# ---------------------------------------------------------------------------- param_groups replaced
class Finetuned(Net):
    def configure_optimizers(self):
        opt = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


def _finetuning():
    return BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda _: 1.0)


@pytest.mark.parametrize("strategy", ["part-offloaded-accelerator-path", "offloaded-accelerator-path",
                                      "zero1-one-process"])
def test_backbone_finetuning_resumed_from_its_checkpoint(strategy, tmp_path):
    """``BackboneFinetuning`` adds the backbone's group at epoch 1; resumed from a
    checkpoint of epoch 2 it assigns ``optimizer.param_groups = [...]`` with that group
    (the offload optimizer raised KeyError): the resumed run ends where the same resumed
    run under ``Trainer()`` ends (which is not where an uninterrupted one ends)."""
    make = {**STRATEGIES, "auto": lambda: "auto",
            "zero1-one-process": lambda: FastOptStrategy(zero_stage=1, offload_fraction=0.5, copy_on_cpu=True)}

    def resumed(name):
        root = tmp_path / name
        first = ModelCheckpoint(dirpath=root, save_last=True)
        _trainer(make[name](), root, max_epochs=2, enable_checkpointing=True, callbacks=[_finetuning(), first]).fit(
            Finetuned(), _data())
        model = Finetuned()
        trainer = _trainer(make[name](), root, max_epochs=4, callbacks=[_finetuning()])
        trainer.fit(model, _data(), ckpt_path=str(root / "last.ckpt"))
        assert len(trainer.optimizers[0].param_groups) == 2
        return model

    assert_modules_equal(resumed(strategy), resumed("auto"))


def test_param_groups_that_move_parameters_are_refused():
    engine = OffloadOptimizer(FusedSGD([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))], lr=0.1))
    a, b = engine.param_groups[0]["params"]
    with pytest.raises(ValueError, match=r"keep each of its 1 group\(s\) with the same parameters, in order"):
        engine.replace_param_groups([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.1}])


# ---------------------------------------------------------------------------- Fabric
@pytest.mark.parametrize("make", [lambda ps: torch.optim.RAdam(ps, lr=1e-2), lambda ps: MySGD(ps, lr=0.05, momentum=0.9)],
                         ids=["RAdam", "subclass-of-SGD"])
def test_fabric_keeps_the_users_optimizer(make):
    """Under Fabric too: ``fabric.setup`` hands back the user's optimizer (stepped by the
    offload optimizer), any optimizer runs, and the loop ends where Fabric's own ends.
    (Fabric's optimizer wrapper takes no keyword arguments in ``step``.)"""
    from lightning.fabric import Fabric

    from lightning_fastopt import FastOptFabricStrategy

    def loop(strategy):
        model = Net()
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        fabric.launch()
        opt = make(model.parameters())
        cls = type(opt)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        fmodel, fopt = fabric.setup(model, opt)
        assert fopt.optimizer is opt and isinstance(opt, cls) and type(opt).__name__ == cls.__name__
        for x, y in _data():
            fopt.zero_grad()
            fabric.backward(nn.functional.mse_loss(fmodel(x), y))
            fopt.step()
            scheduler.step()
        fabric.strategy.teardown()
        return model, opt

    ours, opt = loop(FastOptFabricStrategy(offload_fraction=0.5, bucket_size_mb=0.0002, copy_on_cpu=True))
    ref, _ = loop("auto")
    assert_modules_equal(ours, ref)
    assert type(opt) is type(make([nn.Parameter(torch.zeros(1))])) and opt.state  # given back, with its state


def test_a_checkpoint_saved_after_fit_holds_the_engines_state(tmp_path):
    """``trainer.save_checkpoint`` after fit (the optimizer given back to its class) saves
    what a checkpoint at the last step held: the offload optimizer's state, by name."""
    last = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = _trainer(STRATEGIES["part-offloaded-accelerator-path"](), tmp_path, enable_checkpointing=True,
                       callbacks=[last])
    trainer.fit(Net(lambda ps: torch.optim.AdamW(ps, lr=1e-2)), _data())
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    during = torch.load(tmp_path / "last.ckpt", weights_only=True)["optimizer_states"][0]
    after = torch.load(tmp_path / "after.ckpt", weights_only=True)["optimizer_states"][0]
    assert set(after["state"]) == {n for n, _ in Net().named_parameters()}
    for name, st in during["state"].items():
        assert all(torch.equal(v, after["state"][name][k]) for k, v in st.items())


def test_half_parameters_under_32_true_say_they_get_float32_masters(monkeypatch):
    """float16 parameters under ``precision="32-true"`` train through float32 masters (plain
    Lightning updates them in float16): one line says so (issue: sharp edges), for the
    Trainer and for Fabric; a float32 model says nothing.  The lines counted are the calls
    the code made, not the records a logging set-up captured (pytest 9 captures each
    twice)."""
    import lightning_fastopt.core.engines as engines
    import lightning_fastopt.plan.run_plan as run_plan

    said = said_lines(monkeypatch, engines, run_plan)

    class Half(Net):
        def __init__(self):
            super().__init__()
            self.head.half()  # a float16 layer in a float32 model, as some projects load one

        def forward(self, x):
            return self.head(self.backbone(x).half()).float()

    _trainer(FastOptStrategy(copy_on_cpu=True), max_epochs=1).fit(Half(), _data())
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="fastopt_offload")
    fabric.launch()
    model = Net()
    model.head.half()
    fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    halves = [s for s in said if "float32 master weights" in s]
    assert len(halves) == 2 and all("float16 parameters under precision '32-true'" in s for s in halves), said
    said.clear()
    _trainer(FastOptStrategy(copy_on_cpu=True), max_epochs=1).fit(Net(), _data())
    assert said and not [s for s in said if "float32 master weights" in s]  # it said other things, not this


# ---------------------------------------------------------------------------- keyword arguments of step
class ScaledSGD(torch.optim.Optimizer):
    """A third-party-style optimizer whose step takes a keyword argument of its own."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None, scale=1.0):
        loss = _loss_of(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)
        return loss


class ScaledSteps(Net):
    """Manual optimization passing ``opt.step(closure, scale=...)`` on odd batches (Lightning
    hands keyword arguments of ``LightningOptimizer.step`` to the optimizer's step)."""

    def __init__(self, make_opt=ScaledSGD, scales=True):
        super().__init__(make_opt)
        self.automatic_optimization = False
        self.scales = scales

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()

        def closure():
            self.manual_backward(super(ScaledSteps, self).training_step(batch, batch_idx))

        kwargs = dict(scale=0.5) if self.scales and batch_idx % 2 else {}
        opt.step(closure, **kwargs)
        opt.zero_grad()


@pytest.mark.parametrize("strategy", [*STRATEGIES, "zero2-accelerator-path"])
def test_step_keyword_arguments_reach_the_users_own_step(strategy):
    """``opt.step(closure, scale=0.5)`` reaches an optimizer that runs its own step, on every
    share of the parameters (device, host buckets; ZeRO's shard), as under ``Trainer()``;
    bit for bit, and the argument changed the result."""
    make = STRATEGIES.get(strategy, lambda: FastOptStrategy(zero_stage=2, offload_fraction=0.5,
                                                            bucket_size_mb=0.0002, copy_on_cpu=True,
                                                            per_parameter_optimizers=PER_PARAMETER))
    ours, ref, unscaled = ScaledSteps(), ScaledSteps(), ScaledSteps(scales=False)
    _trainer(make()).fit(ours, _data())
    _trainer("auto").fit(ref, _data())
    _trainer("auto").fit(unscaled, _data())
    assert_modules_equal(ours, ref)
    assert not torch.equal(ours.head.weight, unscaled.head.weight)


def test_step_keyword_arguments_to_a_fused_optimizer_are_a_type_error_as_in_torch():
    """torch's SGD takes no keyword argument beyond the closure (a TypeError under
    ``Trainer()``); run by the kernels it is the same error, naming the argument."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale'"):
        _trainer("auto").fit(ScaledSteps(lambda ps: torch.optim.SGD(ps, lr=0.05)), _data())
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'scale'.*FusedSGD"):
        _trainer(STRATEGIES["part-offloaded-accelerator-path"]()).fit(
            ScaledSteps(lambda ps: torch.optim.SGD(ps, lr=0.05)), _data())


def _scaled_offload(model, **kw):
    return OffloadOptimizer(UserStepOptimizer(ScaledSGD(model.parameters())),
                            {p: n for n, p in model.named_parameters()}, offload_fraction=1.0,
                            bucket_size_mb=0.0002, copy_on_cpu=True, **kw)


SCHEDULES = {
    "synchronous": dict(),
    "delayed": dict(delayed_update=True, delayed_update_warmup=2),
    "speculative": dict(stream_cpu_step=True, speculate=True),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_step_keyword_arguments_reach_every_cpu_step_schedule(schedule):
    """The keyword arguments of a step reach the user's step on the host buckets whenever
    their update runs: at the step, delayed into the next step, or speculated during
    backward (then redone: the speculation ran without them).  Checked against the same
    schedule given the equivalent learning rate instead (``lr * scale``: exact for 0.5)."""
    def train(with_kwargs):
        model = Net()
        opt = _scaled_offload(model, **SCHEDULES[schedule])
        for t, (x, y) in enumerate(_data()):
            for _ in range(2):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                scale = 0.5 if t % 2 else 1.0
                if with_kwargs:
                    opt.step(scale=scale) if scale != 1.0 else opt.step()
                else:
                    opt.param_groups[0]["lr"] = 0.05 * scale
                    opt.step()
        totals = Counter(getattr(opt.schedule, "totals", {}))
        opt.close()
        return model, totals

    (ours, totals), (ref, _) = train(True), train(False)
    assert_modules_equal(ours, ref)
    if schedule == "speculative":  # 8 steps, 4 of them with keyword arguments; several buckets each
        assert totals["redone"] == totals["committed"] > 0 and totals["speculated"] == 2 * totals["redone"]


def test_the_streamed_step_refuses_keyword_arguments_it_could_not_pass():
    """Without speculation a bucket's update runs during backward, before the step's
    keyword arguments exist: such a step is an error, as any step that needs every
    gradient first."""
    model = Net()
    opt = _scaled_offload(model, stream_cpu_step=True)
    x, y = next(iter(_data()))
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="keyword arguments to the optimizer's own step"):
        opt.step(scale=0.5)
    opt.close()


# ---------------------------------------------------------------------------- closures run outside the step
class RunsTheClosureItself(Net):
    """Lightning's documented pattern: the closure run in ``optimizer_step``, then a step
    without one (Lightning passes its do-nothing closure down)."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer_closure()
        optimizer.step()


class SometimesNoLoss(Net):
    """``training_step`` returns None on every other batch: Lightning warns, skips backward,
    and its plugin (without a loss scaler) steps whatever gradients there are."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_step_after_the_closure_ran_outside_trains_as_lightning_does(name, precision):
    """It never changed a weight, silently: the do-nothing closure's None was read as
    "training_step returned None" and the step skipped (issue 39)."""
    ref, ours = RunsTheClosureItself(), RunsTheClosureItself()
    start = copy.deepcopy(ref.state_dict())
    _trainer("auto", precision=precision).fit(ref, _data())
    _trainer(STRATEGIES[name](), precision=precision).fit(ours, _data())
    assert not torch.equal(start["head.weight"], ours.head.weight.detach())
    assert_modules_equal(ours, ref)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_training_step_returning_none_steps_what_lightning_steps(name):
    """With gradient accumulation the batch without a loss still steps the gradients the one
    before it left, as Lightning's plugin does (torch's step on whatever ``.grad`` holds)."""
    ref, ours = SometimesNoLoss(), SometimesNoLoss()
    _trainer("auto", accumulate_grad_batches=3).fit(ref, _data(48))
    _trainer(STRATEGIES[name](), accumulate_grad_batches=3).fit(ours, _data(48))
    assert_modules_equal(ours, ref)


def test_with_fp16_loss_scaling_the_closure_run_outside_trains_and_a_missing_loss_skips():
    """With a loss scaler a None from automatic optimization's closure skips the step (as
    Lightning's GradScaler path does); the do-nothing closure of ``optimizer.step()`` is not
    that: the pattern trains as ``optimizer.step(closure)`` would."""
    from lightning_fastopt.trainer.lightning_pytorch import FastOptPrecision

    def fit(model):
        _trainer(FastOptStrategy(copy_on_cpu=True), plugins=[FastOptPrecision("16-mixed")]).fit(model, _data())
        return model

    outside, plain = fit(RunsTheClosureItself()), fit(Net())
    assert not torch.equal(Net().head.weight, outside.head.weight.detach())
    assert_modules_equal(outside, plain)
    untouched = Net()

    class NoLoss(Net):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)
            return None

    assert_modules_equal(fit(NoLoss()), untouched)


# ---------------------------------------------------------------------------- checkpoint plugins
def test_a_checkpoint_plugin_given_through_plugins_is_taken_and_async_wraps_the_atomic_writer(tmp_path):
    """``plugins=[AsyncCheckpointIO()]`` (or any CheckpointIO) was refused: "checkpoint_io set
    through both strategy class and plugins" (issue 39).  Taken as Lightning's strategies
    take it; the asynchronous plugin writes through our atomic writer, and its checkpoints
    hold what ``Trainer()`` with the same plugin saves."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_fastopt.core.checkpoint_io import AtomicCheckpointIO

    def fit(strategy, plugin, root):
        model = Net()
        trainer = _trainer(strategy, root, plugins=[plugin], max_epochs=2, enable_checkpointing=True)
        trainer.fit(model, _data())
        # Not any *.ckpt under root: Lightning's AsyncCheckpointIO may finish writing epoch 0's
        # file after ModelCheckpoint removed it (a race of Lightning's own), leaving two.
        path = trainer.checkpoint_callback.best_model_path
        assert "epoch=1" in path, path
        return trainer, torch.load(path, weights_only=False)

    ours, saved = fit(FastOptStrategy(copy_on_cpu=True), AsyncCheckpointIO(), tmp_path / "ours")
    assert isinstance(ours.strategy.checkpoint_io, AsyncCheckpointIO)
    assert isinstance(ours.strategy.checkpoint_io.checkpoint_io, AtomicCheckpointIO)
    _, reference = fit("auto", AsyncCheckpointIO(), tmp_path / "ref")
    for name, tensor in reference["state_dict"].items():
        assert torch.equal(saved["state_dict"][name], tensor), name
    def hyperparameters(checkpoint):  # ours also names the parameters
        return [{k: v for k, v in group.items() if k not in ("params", "param_names")}
                for group in checkpoint["optimizer_states"][0]["param_groups"]]

    assert hyperparameters(saved) == hyperparameters(reference)

    counting = counting_checkpoint_io()
    trainer, _ = fit(FastOptStrategy(copy_on_cpu=True), counting, tmp_path / "counting")
    assert trainer.strategy.checkpoint_io is counting and counting.saves >= 1
    assert isinstance(_trainer(FastOptStrategy(copy_on_cpu=True)).strategy.checkpoint_io, AtomicCheckpointIO)


def test_a_checkpoint_without_optimizer_state_resumes_as_lightning_resumes_it_with_a_warning(tmp_path):
    """Our strategy refused it (a ValueError: 0 optimizer states for 1 optimizer) where
    Lightning loads nothing and trains on from fresh optimizer state (issue 39)."""
    first = _trainer("auto", tmp_path, max_epochs=1, enable_checkpointing=True)
    first.fit(Net(), _data())
    path = next(tmp_path.rglob("*.ckpt"))
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["optimizer_states"] = []
    bare = tmp_path / "bare.ckpt"
    torch.save(checkpoint, bare)

    def resume(strategy):
        model = Net()
        _trainer(strategy, max_epochs=2).fit(model, _data(), ckpt_path=bare)
        return model

    ref = resume("auto")
    with pytest.warns(UserWarning, match="the checkpoint holds no optimizer state; the 1 optimizer"):
        ours = resume(FastOptStrategy(copy_on_cpu=True))
    assert_modules_equal(ours, ref)


class _DiscardsThenSteps(Net):
    """Manual optimization through ``self.optimizers()`` (Lightning's ``LightningOptimizer``):
    each batch's first backward is thrown away by ``zero_grad``, the second is stepped; the
    state dict read through it is the optimizer's."""

    def __init__(self):
        super().__init__(lambda ps: torch.optim.Adam(ps, lr=1e-2))
        self.automatic_optimization = False
        self.state_sizes = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x) * 3, y))
        opt.zero_grad()  # thrown away: the engine must forget its copies of these gradients too
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        opt.step()
        opt.zero_grad()
        self.state_sizes.append(len(opt.state_dict()["state"]))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_what_lightning_hands_to_manual_optimization_reaches_the_engine(strategy):
    """``self.optimizers()`` is Lightning's wrapper, of a class made from the optimizer's own:
    ``zero_grad`` and ``state_dict`` through it are the engine's, ending where ``Trainer()``
    ends.  (Once the optimizer kept its class, the wrapper found the class's methods first:
    its ``state_dict`` was empty, and its ``zero_grad`` did not reach the engine, harmless
    here only because manual optimization keeps gradients in ``p.grad`` until the step.)"""
    ours, ref = _DiscardsThenSteps(), _DiscardsThenSteps()
    _trainer(STRATEGIES[strategy]()).fit(ours, _data())
    _trainer("auto").fit(ref, _data())
    assert ours.state_sizes == ref.state_sizes == [4] * 8
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)
