"""The catalogue of third-party optimizers verified per parameter (issue 74,
:mod:`lightning_fastopt.plan.catalogue`): each entry's real package, offloaded at 0.5 and 1
with no argument, under ``bf16-true``, and resumed from a checkpoint, ends bit for bit where
``Trainer()`` ends (ZeRO stage 2 at two processes in the slow test); a subclass with its own
step, a version outside the range and a hyper-parameter that combines parameters run as torch
runs them, saying why."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastopt import FastOptStrategy
from lightning_fastopt.plan import catalogue
from lightning_fastopt.plan.runner import choose_runner
from tests.helpers import run_script

ENTRIES = {f"{e.package}:{e.name}": e for e in catalogue.CATALOGUE}
# how each entry is made in the tests (lr=0.01 where not said): transformers' Adafactor with its own
# recipe, the step size relative to each parameter's scale (no lr); bitsandbytes' with its 8-bit state
SETTINGS = {"transformers:Adafactor": dict(lr=None, relative_step=True, scale_parameter=True, warmup_init=True),
            # 8-bit state (quantized in blocks) from 64 elements, as a large model's parameters get it
            "bitsandbytes:AdamW8bit": dict(lr=0.01, min_8bit_size=64)}


def make_entry(key):
    """A function making the entry's optimizer over some parameters, as the tests use it."""
    cls, settings = _class(ENTRIES[key]), SETTINGS.get(key, dict(lr=0.01))
    return lambda ps: cls(ps, **settings)


def _class(entry):
    module = pytest.importorskip(entry.module)
    return getattr(module, entry.name)


class Net(L.LightningModule):
    def __init__(self, make):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.make = make

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.body(x).float(), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.body(x).float(), y))

    # schedule-free's recipe: the optimizer in train mode while training, in eval mode for
    # validation and at the end of each epoch (checkpoints hold the averaged weights)
    def on_train_epoch_start(self):
        _call(self.optimizers(), "train")

    def on_validation_epoch_start(self):
        _call(self.optimizers(), "eval")

    def on_validation_epoch_end(self):
        _call(self.optimizers(), "train")

    def on_train_epoch_end(self):
        _call(self.optimizers(), "eval")

    def configure_optimizers(self):
        return self.make(self.parameters())


def _call(optimizer, name):
    method = getattr(optimizer, name, None)
    if callable(method):
        method()


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=8)


def _fit(strategy, make, tmp_path=None, epochs=2, ckpt_path=None, validate=False, **kw):
    model = Net(make)
    kw.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(model, _data(), _data() if validate else None, ckpt_path=ckpt_path)
    return trainer, [p.detach().clone() for p in model.parameters()]


def _half_weights_reference(make, epochs=2):
    """``bf16-true`` as the strategies define it (docs/strategy.md): bfloat16 weights and
    gradients, float32 masters the optimizer steps, the bfloat16 copy written back; in torch."""
    model = Net(make).bfloat16()
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    optimizer = make(masters)

    def weights_from_masters():
        with torch.no_grad():
            for master, p in zip(masters, model.parameters()):
                p.copy_(master)

    for _ in range(epochs):
        _call(optimizer, "train")
        weights_from_masters()
        for x, y in _data():
            model.zero_grad()
            model.training_step((x.bfloat16(), y.bfloat16()), 0).backward()
            for master, p in zip(masters, model.parameters()):
                master.grad = p.grad.float()
            optimizer.step()
            weights_from_masters()
        _call(optimizer, "eval")
        weights_from_masters()
    return [p.detach().clone() for p in model.parameters()]


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _ours(fraction):
    return FastOptStrategy(offload_fraction=fraction, copy_on_cpu=True, bucket_size_mb=0.0002)


@pytest.mark.parametrize("key", sorted(ENTRIES))
def test_each_catalogued_class_is_offloaded_with_no_argument_and_ends_where_trainer_ends(key, tmp_path):
    make = make_entry(key)
    _, reference = _fit("auto", make)
    for fraction in (0.5, 1.0):
        trainer, ours = _fit(_ours(fraction), make)
        assert trainer.strategy.plan.optimizers[0].runner.runs == "own step", key
        assert trainer.strategy.engines[0].offloaded_numel > 0
        assert _equal(ours, reference), (key, fraction)
    _, half = _fit(_ours(0.5), make, precision="bf16-true")
    assert _equal(half, _half_weights_reference(make)), (key, "bf16-true")
    trainer, _ = _fit(_ours(0.5), make, epochs=1)
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    _, resumed = _fit(_ours(0.5), make, ckpt_path=str(tmp_path / "one.ckpt"))
    assert _equal(resumed, reference), (key, "resumed")


def test_a_subclass_a_version_or_a_hyperparameter_outside_the_entry_runs_as_torch(monkeypatch):
    lion = _class(ENTRIES["lion-pytorch:Lion"])
    params = [nn.Parameter(torch.zeros(3))]

    class Tuned(lion):  # hyper-parameters only: still the class verified
        pass

    class OwnStep(lion):
        def step(self, closure=None):
            return super().step(closure)

    assert choose_runner(Tuned(params), shares="parameters").runs == "own step"
    own = choose_runner(OwnStep(params), shares="parameters")
    assert own.runs == "torch" and "OwnStep overrides the step of lion_pytorch.lion_pytorch.Lion" in own.why
    adan = _class(ENTRIES["pytorch-optimizer:Adan"])
    assert choose_runner(adan(params), shares="parameters").runs == "own step"
    clipped = choose_runner(adan(params, max_grad_norm=1.0), shares="parameters")
    assert clipped.runs == "torch" and clipped.why.startswith("max_grad_norm=1.0: it clips by the norm of every gradient")
    with pytest.raises(ValueError, match="Adan is named in per_parameter_optimizers .* combines parameters"):
        choose_runner(adan(params, max_grad_norm=1.0), shares="parameters", named=("Adan",))  # the claim checked
    entry = ENTRIES["lion-pytorch:Lion"]
    monkeypatch.setattr(catalogue, "CATALOGUE", (catalogue.Entry(entry.module, entry.name, entry.package, "<0.1"),))
    old = choose_runner(lion(params), shares="parameters")
    assert old.runs == "torch" and "lion-pytorch 0.2" in old.why and "outside the versions" in old.why
    assert choose_runner(lion(params), shares="rows").runs == "torch"  # rows: FSDP's, not catalogued yet


def test_a_steps_count_kept_in_its_groups_is_saved_and_resumed(tmp_path):
    """pytorch-optimizer's classes count their steps in each parameter group, not in the
    parameters' state: the engines save the count with the groups and give it back to every
    share, so a run resumes where it stopped, and plain Trainer() resumes our checkpoint."""
    adamp = _class(ENTRIES["pytorch-optimizer:AdamP"])
    make = lambda ps: adamp(ps, lr=0.01)  # noqa: E731
    _, reference = _fit("auto", make)
    trainer, _ = _fit(_ours(0.5), make, epochs=1)
    assert trainer.strategy.engines[0].state_dict()["param_groups"][0]["step"] == 6
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    _, plain = _fit("auto", make, ckpt_path=str(tmp_path / "one.ckpt"))
    assert _equal(plain, reference)


@pytest.mark.slow
def test_zero_2_at_two_processes_shards_each_catalogued_class_as_ddp_ends(tmp_path):
    """Every catalogued class whose package is installed, each trained under ZeRO stage 2 and
    under Lightning's DDP at two processes, one after another in the same two processes (24
    two-process launches took about 190 s on 2 cores, these two about 26 s); each class's
    weights compared, the ones that differ named."""
    installed = []
    for key in sorted(ENTRIES):
        try:
            __import__(ENTRIES[key].module)
            installed.append(key)
        except ImportError:
            pass
    if not installed:
        pytest.skip("no catalogued package is installed")
    for which in ("zero2", "ddp"):
        (tmp_path / which).mkdir()
        run_script("tests/scripts/catalogue_run.py", ",".join(installed), which, tmp_path / which, timeout=1800)
    differ = []
    for key in installed:
        name = key.replace(":", "_") + ".pt"
        ours, ddp = (torch.load(tmp_path / w / name, weights_only=True) for w in ("zero2", "ddp"))
        if ours["runs"] != "own step" or not _equal(ours["weights"], ddp["weights"]):
            differ.append(f"{key} ({ours['runs']})")
    assert not differ, f"not as DDP ends: {differ}"


# ---------------------------------------------------------------------------- the per-parameter claim checked
def test_a_wrong_per_parameter_claim_is_refused_before_the_model_is_touched():
    """Prodigy estimates its step size over every parameter: named in per_parameter_optimizers
    it trained on with every weight differing from Trainer()'s; now the claim is checked when
    the optimizers are set up (its step on synthetic tensors, whole and each alone) and
    refused, naming the class and what differed, the model's weights untouched."""
    prodigy = pytest.importorskip("prodigyopt").Prodigy
    model = Net(lambda ps: prodigy(ps, lr=1.0))
    before = [p.detach().clone() for p in model.parameters()]
    trainer = L.Trainer(strategy=FastOptStrategy(copy_on_cpu=True, per_parameter_optimizers=["Prodigy"]),
                        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"Prodigy is named in per_parameter_optimizers as updating each parameter "
                                         r"from its own gradient and state alone, but after \d step\(s\) on synthetic "
                                         r"tensors .* differs from it stepped alone .* its step combines parameters"):
        trainer.fit(model, _data())
    assert _equal([p.detach() for p in model.parameters()], before)
    _, plain = _fit("auto", lambda ps: prodigy(ps, lr=1.0), epochs=1)  # not named: it runs as torch, as Trainer()
    _, ours = _fit(_ours(0.5), lambda ps: prodigy(ps, lr=1.0), epochs=1)
    assert _equal(ours, plain)


def test_the_check_passes_what_updates_each_parameter_alone_and_costs_milliseconds():
    import time

    from lightning_fastopt.plan.claim_check import combines_parameters
    from tests.references import GlobalNorm, WholeTensorNorms

    params = [nn.Parameter(torch.zeros(3))]
    start = time.perf_counter()
    for key in ENTRIES:
        assert combines_parameters(make_entry(key)(params), ENTRIES[key].ready) is None, key
    assert time.perf_counter() - start < 5.0  # (each a few milliseconds; a loaded 2-core machine is slow)
    assert combines_parameters(WholeTensorNorms(params, lr=0.1)) is None  # norms of one parameter: its own
    assert combines_parameters(torch.optim.AdamW(params)) is None
    assert "differs from it stepped alone" in combines_parameters(GlobalNorm(params, lr=0.1))


# ---------------------------------------------------------------------------- methods and state beside the parameters
def _schedule_free(ps):
    schedulefree = pytest.importorskip("schedulefree")
    return schedulefree.AdamWScheduleFree(ps, lr=0.01, warmup_steps=3)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_schedule_free_offloaded_through_a_validation_loop_and_resumed_ends_where_trainer_ends(fraction, tmp_path):
    """The module calls ``train()`` and ``eval()`` on its optimizer (the schedule-free recipe)
    around every validation loop: each reaches every share's instance, moves the masters
    there and then the model's weights, which validation reads; the group's counters
    (``k``, ``weight_sum``, ``lr_max``, ``train_mode``) count on every share as torch's run
    counts them, are seen in the user's groups and are saved; a run resumed mid-epoch (train
    mode) and at an epoch's end (eval mode) ends where Trainer() ends."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _, reference = _fit("auto", _schedule_free, epochs=3, validate=True)
    trainer, ours = _fit(_ours(fraction), _schedule_free, epochs=3, validate=True)
    assert trainer.strategy.engines[0].offloaded_numel > 0 and _equal(ours, reference)
    group = trainer.optimizers[0].param_groups[0]
    assert group["k"] == 18 and group["train_mode"] is False  # (given back: as torch's run leaves them)
    assert set(trainer.optimizers[0].state[trainer.model.body[0].weight]) == {"z", "exp_avg_sq"}
    # resumed at the end of an epoch (eval mode) and in the middle of one (train mode)
    trainer, _ = _fit(_ours(fraction), _schedule_free, epochs=1, validate=True)
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    saved = torch.load(tmp_path / "end.ckpt", weights_only=True)["optimizer_states"][0]["param_groups"][0]
    assert saved["k"] == 6 and saved["train_mode"] is False
    _, resumed = _fit(_ours(fraction), _schedule_free, epochs=3, validate=True, ckpt_path=str(tmp_path / "end.ckpt"))
    assert _equal(resumed, reference)
    every = ModelCheckpoint(dirpath=tmp_path / "mid", every_n_train_steps=4, save_top_k=-1, save_last=False)
    _fit(_ours(fraction), _schedule_free, epochs=1, validate=True, enable_checkpointing=True, callbacks=[every])
    mid = str(tmp_path / "mid" / "epoch=0-step=4.ckpt")
    # (Lightning resumes a plain DataLoader mid-epoch from the epoch's start: compared with Trainer() resumed)
    _, resumed = _fit(_ours(fraction), _schedule_free, epochs=3, validate=True, ckpt_path=mid)
    _, plain = _fit("auto", _schedule_free, epochs=3, validate=True, ckpt_path=mid)  # plain Lightning resumes ours
    assert _equal(resumed, plain)


def test_schedule_free_streamed_and_redone_by_clipping_ends_where_trainer_ends():
    """Streamed into backward and checked at the step (clipping), each host bucket's update is
    speculated and redone where clipping changed its gradients: the counters its step wrote
    in the groups are put back with its state before it is redone."""
    _, reference = _fit("auto", _schedule_free, epochs=2, gradient_clip_val=0.01)
    trainer, ours = _fit(FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True, bucket_size_mb=0.0002,
                                         stream_cpu_step=True), _schedule_free, epochs=2, gradient_clip_val=0.01)
    assert trainer.strategy.plan.optimizers[0].schedule.kind == "speculated"
    assert _equal(ours, reference)


def test_schedule_free_with_its_state_on_disk_ends_where_trainer_ends(tmp_path):
    _, reference = _fit("auto", _schedule_free, epochs=2, validate=True)
    _, ours = _fit(FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True, bucket_size_mb=0.0002,
                                   offload_optimizer_device="nvme", nvme_path=str(tmp_path)),
                   _schedule_free, epochs=2, validate=True)
    assert _equal(ours, reference)


def test_schedule_free_under_fabric_ends_where_fabrics_own_ends():
    """Fabric's optimizer wrapper reaches the methods too."""
    from lightning.fabric import Fabric

    from lightning_fastopt import FastOptFabricStrategy

    def run(strategy):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        optimizer = _schedule_free(model.parameters())
        model, optimizer = fabric.setup(model, optimizer)
        for _ in range(2):
            optimizer.train()
            for x, y in _data():
                optimizer.zero_grad()
                fabric.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
            optimizer.eval()
        return [p.detach().clone() for p in model.parameters()]

    reference = run("auto")
    assert _equal(run(FastOptFabricStrategy(offload_fraction=0.5, copy_on_cpu=True, bucket_size_mb=0.0002)), reference)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FastOptFabricStrategy(copy_on_cpu=True, offload_fraction=1))
    model = nn.Linear(8, 1)
    optimizer = fabric.setup_optimizers(_schedule_free(model.parameters()))  # before its model: refused
    with pytest.raises(RuntimeError, match=r"AdamWScheduleFree's eval\(\) and train\(\) must run on every share .* "
                                           r"set the model up first"):
        fabric.setup_module(model)
    assert isinstance(optimizer.optimizer, type(_schedule_free([nn.Parameter(torch.zeros(1))])))


def test_state_kept_under_a_key_that_is_not_a_parameter_is_saved_and_resumed(tmp_path):
    """pytorch-optimizer's MADGRAD counts its steps in ``self.state["k"]``: every share counts
    alike, the state dict holds it under ``"k"`` as torch's does, and a run resumes from it
    (ours from ours and from plain Trainer()'s, plain Trainer() from ours)."""
    madgrad = _class(ENTRIES["pytorch-optimizer:MADGRAD"])
    make = lambda ps: madgrad(ps, lr=0.01)  # noqa: E731
    _, reference = _fit("auto", make)
    trainer, _ = _fit(_ours(0.5), make, epochs=1)
    assert torch.equal(trainer.strategy.engines[0].state_dict()["state"]["k"], torch.tensor([6]))
    trainer.save_checkpoint(tmp_path / "ours.ckpt")
    assert torch.equal(trainer.optimizers[0].state["k"], torch.tensor([6]))  # given back at the end of fit
    plain, _ = _fit("auto", make, epochs=1)
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    for ckpt, strategy in (("ours", _ours(0.5)), ("ours", "auto"), ("plain", _ours(1.0))):
        _, resumed = _fit(strategy, make, ckpt_path=str(tmp_path / f"{ckpt}.ckpt"))
        assert _equal(resumed, reference), (ckpt, strategy)


def test_the_methods_run_on_every_share_are_those_the_class_adds_that_take_no_argument():
    from lightning_fastopt.optim.user_step import shared_methods

    schedulefree = pytest.importorskip("schedulefree")
    assert shared_methods(schedulefree.SGDScheduleFree) == ("eval", "train")
    assert shared_methods(_class(ENTRIES["pytorch-optimizer:SOAP"])) == ()  # (its helpers take arguments)
    assert shared_methods(torch.optim.RAdam) == ()
    trainer, _ = _fit(_ours(0.5), _schedule_free, epochs=1)
    with pytest.raises(AttributeError, match="'reset' is not a method that UserStepOptimizer runs on every share "
                                             r"\(those: eval, train\)"):
        trainer.strategy.engines[0].run_method("reset")
