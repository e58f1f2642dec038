"""The speculative streamed step (``stream_cpu_step=True, speculate=True``): each host
bucket is updated during backward, then committed, redone or dropped at the step, ending
bit for bit where the synchronous step ends.

On the accelerator code path run on the CPU (``copy_on_cpu=True``), driven the way the
precision plugin drives a step (the loss scale announced before backward, the overflow
check, clipping by norm, the step), over many steps at fractions 0.5 and 1 with several
buckets: clipping that never, always and sometimes triggers, fp16 overflows (the first
step included) with the scale rule followed, both together, accumulation, a scheduler,
LAMB's global norm; and the counters say that each path ran.  Then under the Trainer
against ``Trainer()``, and resuming from a checkpoint in the middle.
"""

import math
import threading
from collections import Counter

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fastopt import FastOptPrecision, FastOptStrategy, FusedAdam, FusedLAMB, FusedSGD
from lightning_fastopt.core.precision import PrecisionCore
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.offload.forward_waits import ForwardWaits
from lightning_fastopt.offload.speculative import SpeculativeStep
from lightning_fastopt.optim.takeover import engine_of
from tests.helpers import ACCELERATOR, assert_modules_equal, on_disk_through_two_buckets
from tests.test_forward_waits import _HeldWorker, forward_waits_for_the_held_updates
from tests.test_precision import _data
from tests.test_streamed_step import _net, cpu_updates_and_backward_end
from tests.test_strategy import Model


class Driver(PrecisionCore):
    """The precision plugin's step without a Trainer: announce the scale, backward, check
    for overflow (skip), clip by norm, step."""

    def pre_backward(self, tensor, module):
        return tensor * self.scaler.scale if self.scaler is not None else tensor

    def train_step(self, opt, model, x, clip, micro_batches=1):
        self.announce_grad_scale(opt)
        opt.zero_grad()
        for i, chunk in enumerate(x.chunk(micro_batches)):
            opt.accumulating = i < micro_batches - 1
            self.pre_backward(model(chunk).square().mean(), model).backward()
        if self._check_overflow(opt):
            self._skip_step(opt)
            return
        if clip:
            self.clip_scaled_gradients(opt, clip)
        self._step(opt)


def _inputs(steps, overflow_at=(), seed=1):
    """Batches whose size alternates (so that the gradient norm does), an inf where asked."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for t in range(steps):
        x = torch.randn(16, 24, generator=g) * (4.0 if t % 3 == 0 else 0.25)
        if t in overflow_at:
            x[0, 0] = math.inf
        xs.append(x)
    return xs


def _offload(model, make_opt, speculate, fraction=1.0, always=True, **kw):
    """The optimizer the comparisons run: several small buckets on the accelerator path,
    speculative or synchronous; speculating at every step where ``always`` (the mechanism's
    tests: every path runs often), else as the schedule decides.  With
    ``forward_waits="module"`` each module's forward waits for its own weights."""
    opt = OffloadOptimizer(make_opt(model.parameters()), {p: n for n, p in model.named_parameters()},
                           offload_fraction=fraction, bucket_size_mb=0.002, copy_on_cpu=True,
                           stream_cpu_step=speculate, speculate=speculate, **kw)
    if speculate and always:
        opt.schedule.misses_allowed = opt.schedule.history
    if opt.settings.forward_waits == "module":
        opt.modules_wait_for(ForwardWaits(model, lambda: [opt]).covered)
    return opt


def _train(speculate, make_opt, fraction, *, clip=0.0, precision="32-true", overflow_at=(), steps=14,
           micro_batches=1, sched=False, always=True, **kw):
    model = _net()
    opt = _offload(model, make_opt, speculate, fraction, always, **kw)
    driver = Driver(precision, initial_scale_power=20, loss_scale_window=4, hysteresis=1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8) if sched else None
    for x in _inputs(steps, overflow_at):
        driver.train_step(opt, model, x, clip, micro_batches)
        if scheduler is not None:
            scheduler.step()
    states = [opt.state_of(p) for p in model.parameters()]
    totals = Counter(opt.schedule.totals) if isinstance(opt.schedule, SpeculativeStep) else Counter()
    opt.close()
    return model, states, totals, driver


def _assert_same(a, b):
    model_a, states_a, _, driver_a = a
    model_b, states_b, _, driver_b = b
    for x, y in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(x, y)
    for sa, sb in zip(states_a, states_b):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert driver_a.loss_scale == driver_b.loss_scale and driver_a.skipped_steps == driver_b.skipped_steps


ADAMW = lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01)  # noqa: E731
SGD = lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9)  # noqa: E731


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("clip,expect", [(1e9, "committed only"), (1e-4, "redone only"), (0.06, "both")],
                         ids=["never", "always", "sometimes"])
@pytest.mark.parametrize("make_opt", [ADAMW, SGD], ids=["adamw", "sgd"])
def test_clipping_commits_or_redoes_and_ends_where_the_synchronous_step_ends(backend, make_opt, clip, expect,
                                                                              fraction):
    speculated = _train(True, make_opt, fraction, clip=clip)
    _assert_same(speculated, _train(False, make_opt, fraction, clip=clip))
    totals = speculated[2]
    assert totals["speculated"] >= 3 * 14 and totals["dropped"] == 0
    assert totals["speculated"] == totals["committed"] + totals["redone"]
    if expect == "committed only":
        assert totals["redone"] == 0
    elif expect == "redone only":
        assert totals["committed"] == 0
    else:
        assert totals["committed"] > 0 and totals["redone"] > 0


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("clip", [0.0, 0.06], ids=["fp16", "fp16-and-clipping"])
def test_fp16_overflows_drop_the_speculation_and_the_scale_rule_is_followed(backend, clip, fraction):
    """Overflows at the first step and later ones; the scale grows every 4 clean steps
    (the next step's speculation uses the announced scale: no redo for that)."""
    overflow_at = (0, 5, 6, 11)
    speculated = _train(True, ADAMW, fraction, clip=clip, precision="16-mixed", overflow_at=overflow_at, steps=16)
    plain = _train(False, ADAMW, fraction, clip=clip, precision="16-mixed", overflow_at=overflow_at, steps=16)
    _assert_same(speculated, plain)
    totals, driver = speculated[2], speculated[3]
    assert driver.skipped_steps == len(overflow_at)
    buckets = totals["speculated"] // 16
    assert totals["dropped"] == buckets * len(overflow_at)
    assert totals["committed"] > 0
    if not clip:  # the scale speculated with is always the one the step takes
        assert totals["redone"] == 0


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_accumulation_and_a_scheduler(backend, fraction):
    kw = dict(clip=0.06, micro_batches=2, sched=True)
    speculated = _train(True, ADAMW, fraction, **kw)
    _assert_same(speculated, _train(False, ADAMW, fraction, **kw))
    assert speculated[2]["committed"] > 0 and speculated[2]["redone"] > 0


@pytest.mark.parametrize("max_grad_norm", [1e9, 0.06, 0.0], ids=["never-clips", "sometimes", "no-clipping"])
def test_lamb_global_norm(backend, max_grad_norm):
    make = lambda ps: FusedLAMB(ps, lr=1e-2, max_grad_norm=max_grad_norm)  # noqa: E731
    speculated = _train(True, make, 0.5)
    _assert_same(speculated, _train(False, make, 0.5))
    totals = speculated[2]
    if max_grad_norm == 0.06:
        assert totals["committed"] > 0 and totals["redone"] > 0
    else:
        assert totals["redone"] == 0


def test_a_step_given_another_scale_or_learning_rate_redoes_the_update(backend):
    """What the speculation assumed is checked, whoever drives the step."""
    runs = []
    for speculate in (True, False):
        model = _net()
        opt = _offload(model, ADAMW, speculate)
        for t, x in enumerate(_inputs(4)):
            opt.expected_grad_scale = 8.0
            opt.zero_grad()
            (model(x).square().mean() * 8.0).backward()
            if t == 2:
                opt.param_groups[0]["lr"] = 3e-3  # after backward, before the step
            opt.step(grad_scale=16.0 if t == 1 else 8.0)
        runs.append((model, opt.schedule))
        opt.close()
    (a, schedule), (b, _) = runs
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    buckets = schedule.totals["speculated"] // 4
    assert schedule.totals["redone"] == 2 * buckets and schedule.totals["committed"] == 2 * buckets


def test_a_second_backward_onto_landed_gradients_redoes_the_update(backend):
    """Two backwards before a step (the second adds to gradients whose bucket's update was
    already speculated): the gradient intake says so (``grads_changed``), and the update is
    redone on the sum, as the synchronous step takes it.  The gradients' versions alone no
    longer say it: they are taken again when backward ends."""
    runs = []
    for speculate in (True, False):
        model = _net()
        opt = _offload(model, ADAMW, speculate)
        for x in _inputs(3):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward(retain_graph=True)
            (loss * 0.5).backward()
            opt.step(check_finite=True)
        runs.append((model, opt.schedule))
        opt.close()
    (a, schedule), (b, _) = runs
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert schedule.totals["speculated"] > 0 and schedule.totals["redone"] == schedule.totals["speculated"]


def test_speculation_is_held_back_while_more_than_one_of_the_last_8_steps_did_not_hold(backend):
    """Clipping fires at steps 3 and 5 to 7; step 10 overflows (fp16).  Speculation goes on
    past one miss (step 3), stops after the second (5), and the held-back steps update at
    the step while still checked: speculation resumes once at most one of the last 8
    counted steps would not have held (step 16; the skipped step 10 is not counted).  The
    weights are the synchronous step's, as speculating at every step gives them."""
    clipped, overflow_at, steps = {3, 5, 6, 7}, (10,), 18

    def train(speculate, always=False):
        model = _net()
        opt = _offload(model, ADAMW, speculate, always=always, wall_clock_breakdown=True)
        driver = Driver("16-mixed", initial_scale_power=20, loss_scale_window=4, hysteresis=1)
        labels = []
        for t, x in enumerate(_inputs(steps, overflow_at)):
            skipped = driver.skipped_steps
            driver.train_step(opt, model, x, 1e-4 if t in clipped else 1e9)
            times = opt.last_step_times
            labels.append("skipped" if driver.skipped_steps > skipped else
                          "/".join(k[len("buckets_"):] for k in ("buckets_committed", "buckets_redone",
                                                                 "buckets_held_back") if times.get(k)))
        opt.close()
        return model, labels

    model, labels = train(True)
    assert labels == ["committed"] * 3 + ["redone", "committed", "redone"] + ["held_back"] * 4 + ["skipped"] + \
        ["held_back"] * 5 + ["committed"] * 2
    for other, _ in (train(False), train(True, always=True)):
        assert_modules_equal(model, other)


def test_state_read_between_backward_and_the_step_is_the_state_before_it(backend):
    model = _net()
    opt = _offload(model, ADAMW, True)
    model(torch.randn(4, 24)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state_of(model[0].weight).items()}
    opt.zero_grad()
    model(torch.randn(4, 24)).sum().backward()
    now = opt.state_of(model[0].weight)  # the speculative update is undone: the step redoes it
    assert all(torch.equal(before[k], now[k]) for k in before)
    opt.step()
    assert opt.schedule.totals["dropped"] > 0 and not torch.equal(before["exp_avg"], opt.state_of(model[0].weight)["exp_avg"])
    opt.close()


def test_a_buckets_update_starts_before_backward_ends_with_clipping(compiled):
    driver = Driver("32-true")

    def clip_and_step(opt):
        driver.clip_scaled_gradients(opt, 1e9)
        driver._step(opt)

    started, backward_ended, opt = cpu_updates_and_backward_end(clip_and_step, speculate=True)
    assert min(started) < backward_ended
    assert opt.schedule.totals["committed"] > 0 and opt.schedule.totals["redone"] == 0
    opt.close()


def test_speculate_needs_stream_cpu_step():
    model = _net()
    with pytest.raises(ValueError, match="speculate=True .* needs stream_cpu_step=True"):
        OffloadOptimizer(SGD(model.parameters()), copy_on_cpu=True, speculate=True)


# ------------------------------------------------------------------ under the Trainer
class Clipped(Model):
    def __init__(self, make_opt):
        super().__init__(make_opt, sched=True)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.net(x * (6.0 if i % 3 == 0 else 1.0)), y)  # the norm varies

    def on_train_epoch_end(self):
        self.engine = engine_of(self.trainer.optimizers[0])


class _ClippedReadingNothing(Clipped):
    """No hook between steps: each module's forward may wait for its own weights."""

    on_train_epoch_end = L.LightningModule.on_train_epoch_end


def _fit(strategy, precision="32-true", make_opt=None, model_class=Clipped, **kw):
    model = model_class(make_opt or (lambda ps: torch.optim.AdamW(ps, lr=1e-2)))
    trainer = L.Trainer(strategy=strategy, accelerator=ACCELERATOR, devices=1, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision=precision, **kw)
    trainer.fit(model, _data())
    return model, trainer


def _ours(fraction=0.5, **kw):
    return FastOptStrategy(offload_fraction=fraction, bucket_size_mb=0.0002, copy_on_cpu=True, stream_cpu_step=True,
                           **kw)


@pytest.mark.parametrize("fraction,zero_stage,waits", [(0.5, 0, "step"), (1.0, 0, "step"), (1.0, 2, "step"),
                                                      (0.5, 0, "module"), (1.0, 0, "module")])
def test_under_the_trainer_clipping_speculates_and_ends_where_trainer_ends(caplog, monkeypatch, fraction, zero_stage,
                                                                          waits):
    """(ZeRO stage 2 with one process: its offload optimizer watches the gradients itself.)
    With ``forward_waits="module"`` the steps end before their redone updates."""
    import logging

    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    with caplog.at_level(logging.INFO):
        ours, trainer = _fit(_ours(fraction, zero_stage=zero_stage, forward_waits=waits), gradient_clip_val=5.0,
                             model_class=Clipped if waits == "step" else _ClippedReadingNothing)
    assert "speculated during backward, once its gradients have landed, and checked at the step " \
           "(gradient clipping)" in caplog.text
    engine = trainer.strategy.engines[0]
    totals = getattr(engine, "local", engine).schedule.totals
    assert totals["committed"] > 0 and totals["redone"] > 0  # the norm is over 5 on some steps only
    assert (totals["left_running"] == totals["redone"] + totals["held_back"]) == (waits == "module")
    ref, _ = _fit("auto", gradient_clip_val=5.0)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_under_the_trainer_fp16_and_clipping_end_where_the_synchronous_step_ends():
    """fp16 on the CPU (our precision plugin; Lightning's own turns 16-mixed into bf16 on
    the CPU): the speculative schedule against our synchronous one."""
    runs = []
    for stream in (True, False):
        strategy = FastOptStrategy(offload_fraction=0.5, bucket_size_mb=0.0002, copy_on_cpu=True,
                                   stream_cpu_step=stream)
        model = Clipped(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        trainer = L.Trainer(strategy=strategy, plugins=[FastOptPrecision("16-mixed", initial_scale_power=30,
                                                                         loss_scale_window=3)],
                            accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=5.0)
        trainer.fit(model, _data())
        runs.append((model, trainer.precision_plugin))
    (a, pa), (b, pb) = runs
    assert pa.skipped_steps == pb.skipped_steps > 0  # 2**30 overflows fp16 at first
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_the_memory_kept_aside_is_said_and_speculation_falls_back_without_it(caplog, monkeypatch):
    import logging

    from lightning_fastopt.offload import speculative

    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    model = _net()
    names = {p: n for n, p in model.named_parameters()}
    with caplog.at_level(logging.INFO):
        opt = OffloadOptimizer(SGD(model.parameters()), names, copy_on_cpu=True, stream_cpu_step=True, speculate=True)
    assert "speculate=True keeps the offloaded masters and optimizer state aside: 0.00 GiB more host memory" \
        in caplog.text and isinstance(opt.schedule, SpeculativeStep)
    opt.close()
    monkeypatch.setattr(speculative, "available_host_bytes", lambda: 1000)
    with caplog.at_level(logging.INFO):
        opt = OffloadOptimizer(SGD(model.parameters()), names, copy_on_cpu=True, stream_cpu_step=True, speculate=True)
    assert "speculate=True not used: keeping the offloaded masters and optimizer state aside takes 0.00 GiB of " \
           "host memory, 0.00 GiB is available; the CPU step runs at the step" in caplog.text
    assert opt.schedule.name == "at the step"
    opt.close()


def test_the_breakdown_counts_the_buckets_and_the_redo_time(backend):
    model = _net()
    opt = _offload(model, ADAMW, True, wall_clock_breakdown=True)
    buckets = len(opt.layout.buckets)
    for scale in (4.0, 8.0):  # the second step is given another scale than announced: every bucket is redone
        opt.expected_grad_scale = 4.0
        opt.zero_grad()
        (model(torch.randn(4, 24)).sum() * 4.0).backward()
        opt.step(grad_scale=scale)
        times = opt.last_step_times
        assert times["buckets_speculated"] == buckets and times["buckets_dropped"] == 0
        redone = scale == 8.0
        assert times["buckets_redone"] == (buckets if redone else 0)
        assert times["buckets_committed"] == (0 if redone else buckets)
        assert (times["redo"] > 0) == redone
    opt.close()


def test_resuming_in_the_middle_ends_where_trainer_ends(tmp_path):
    def trainer(epochs, strategy):
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         gradient_clip_val=5.0)

    first = Clipped(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    t = trainer(1, _ours())
    t.fit(first, _data())
    t.save_checkpoint(tmp_path / "half.ckpt")
    resumed = Clipped(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    trainer(3, _ours()).fit(resumed, _data(), ckpt_path=tmp_path / "half.ckpt")
    ref = Clipped(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    trainer(3, "auto").fit(ref, _data())
    assert resumed.engine.schedule.totals["redone"] > 0
    for a, b in zip(resumed.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_clipping_by_value_redoes_only_the_buckets_it_changed(backend):
    """Clamping writes only the host gradients that exceed the bound: the other buckets commit."""
    runs = []
    for speculate in (True, False):
        model = _net()
        opt = _offload(model, ADAMW, speculate)
        driver = Driver("32-true")
        for x in _inputs(10):
            driver.announce_grad_scale(opt)
            opt.zero_grad()
            model(x).square().mean().backward()
            driver.clip_scaled_gradients(opt, 0.01, by_value=True)
            driver._step(opt)
        runs.append((model, opt.schedule))
        opt.close()
    (a, schedule), (b, _) = runs
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert schedule.totals["committed"] > 0 and schedule.totals["redone"] > 0


# ---------------------------------------------------------------------- a step that ends before its updates
@pytest.mark.parametrize("disk", [False, True], ids=["", "state-on-disk"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("case", [
    dict(clip=0.06), dict(clip=1e-4, always=False), dict(clip=0.06, precision="16-mixed", overflow_at=(0, 5)),
    dict(clip=0.06, micro_batches=2, sched=True)], ids=["redone", "held-back", "fp16", "accumulation-scheduler"])
def test_a_step_that_ends_before_its_redone_and_held_back_updates_ends_where_the_synchronous_step_ends(
        backend, fraction, case, disk, tmp_path):
    """With ``forward_waits="module"`` the redone and held-back buckets' updates are left
    running when the step returns (each forward waits for its own): bit for bit the
    synchronous step, loss scale and skipped steps included; with the state on disk too
    (a redone bucket's speculative region discarded on the worker, the window read ahead
    in the worker's order)."""
    tier = {}
    if disk:
        tier = on_disk_through_two_buckets(tmp_path, lambda **kw: _offload(_net(), ADAMW, True, **kw))
    ended_early = _train(True, ADAMW, fraction, forward_waits="module", **case, **tier)
    _assert_same(ended_early, _train(False, ADAMW, fraction, **case))
    totals = ended_early[2]
    assert totals["left_running"] > 0
    assert totals["left_running"] == totals["redone"] + totals["held_back"]


def _step_ending_early(model, opt, driver, x, clip, hold):
    """One step the Driver's way, the worker held (``hold``: after clipping, so that the
    speculations ran) while the step returns, then the next forward waiting for it; the
    updates the worker ran, by layer."""
    driver.announce_grad_scale(opt)
    opt.zero_grad()
    model(x).square().mean().backward()
    driver.clip_scaled_gradients(opt, clip)
    held = hold()
    driver._step(opt)  # returns with every update left
    forward_waits_for_the_held_updates(model, opt, held, x)
    return list(held.order)


@pytest.mark.parametrize("speculating", [True, False], ids=["redone", "held-back"])
def test_the_updates_a_step_leaves_run_the_next_forwards_first_layer_first(speculating):
    """Clipping at every step: each speculation redone, or (speculation held back) each
    bucket updated after the step.  ``step()`` returns with every update queued, the next
    forward's first layer waits for its own, the worker takes the buckets in forward order,
    and the run ends where the synchronous step ends."""
    x = _inputs(1)[0]

    def run(speculate, waits):
        model = _net()
        opt = _offload(model, ADAMW, speculate, forward_waits=waits)
        if speculate and not speculating:
            opt.schedule.misses_allowed = -1  # never speculate
        driver = Driver("32-true")
        driver.train_step(opt, model, x, 1e-4)
        opt.wait_for_weights()  # (the first step's updates, left running, have ended)
        order = None
        if waits == "module":
            order = _step_ending_early(model, opt, driver, x, 1e-4, lambda: _HeldWorker(opt, model))
            assert opt.schedule.totals["left_running"] == 2 * len(opt.layout.buckets)
        else:
            driver.train_step(opt, model, x, 1e-4)
        driver.train_step(opt, model, x, 1e-4)
        opt.close()
        return order, model

    order, model = run(True, "module")
    opt = _offload(model, ADAMW, False)
    layer = {p: i for i, m in enumerate(model) for p in m.parameters()}
    landed = [layer[b.slots[0].param] for b in opt.layout.buckets]  # (buckets in the order backward lands them)
    opt.close()
    assert landed[0] > landed[-1] and order == landed[::-1]  # forward order: the first layers first
    assert_modules_equal(model, run(False, "step")[1])


def test_an_update_left_running_keeps_the_steps_loss_scale_where_its_tensor_changes_after():
    """A ``grad_scale`` tensor written in place once the step has returned (a scaler
    updating its scale) does not reach the updates that step left."""
    x = _inputs(1)[0]

    def run(waits):
        model = _net()
        opt = _offload(model, ADAMW, True, forward_waits=waits)
        opt.schedule.misses_allowed = -1  # held back: every bucket updated after the step
        for _ in range(2):
            held = _HeldWorker(opt, model) if waits == "module" else None
            scale = torch.tensor(8.0)
            opt.zero_grad()
            (model(x).square().mean() * 8.0).backward()
            opt.step(grad_scale=scale)
            scale.mul_(4.0)
            if held is not None:
                held.release()
            opt.wait_for_weights()
        opt.close()
        return model

    assert_modules_equal(run("module"), run("step"))


# ---------------------------------------------------------------------- clipping applied in each bucket's update
def test_what_reads_the_gradients_after_clipping_reads_them_clipped(backend):
    """Clipping leaves a host bucket's multiplication to its update; a reader before it
    (``gradients()``) gets them multiplied, each as ``torch._foreach_mul_`` multiplies it."""
    model = _net()
    opt = _offload(model, ADAMW, False, fraction=0.5)
    model(_inputs(1)[0]).square().mean().backward()
    before = [g.clone() for g in opt.gradients()]
    coef = torch.tensor(0.37)
    opt.scale_gradients(coef)
    host = [s.host_grad for b in opt.layout.buckets for s in b.slots]
    assert host and all(b.scales for b in opt.layout.buckets)  # the host buckets' multiplications left for later
    assert all(torch.equal(g, b) for g, b in zip(opt.gradients(), torch._foreach_mul(before, coef)))
    assert not any(b.scales for b in opt.layout.buckets)
    opt.close()


def test_clipping_multiplies_a_host_buckets_gradients_in_its_update_on_the_thread_that_runs_it(monkeypatch):
    """A step that ends before its updates: the host gradients are unclipped when it returns,
    and stay so: the worker's update of each bucket reads them multiplied by the clipping
    coefficient (``grad_factors``: in the kernels' one pass over them, no pass of its own),
    and the run ends where the synchronous step ends."""
    from lightning_fastopt.offload import share_updates
    from lightning_fastopt.optim import adam

    calls = []
    real = adam.fused_adam_

    def noted(*args, grad_factors=(), **kwargs):
        if grad_factors:
            calls.append((threading.current_thread().name, tuple(grad_factors)))
        return real(*args, grad_factors=grad_factors, **kwargs)

    monkeypatch.setattr(adam, "fused_adam_", noted)
    monkeypatch.setattr(share_updates, "scale_grads_", lambda *args: pytest.fail("a pass of its own"))
    x = _inputs(1)[0]

    def run(speculate, waits):
        model = _net()
        opt = _offload(model, ADAMW, speculate, forward_waits=waits)
        driver = Driver("32-true")
        if speculate:
            opt.schedule.misses_allowed = -1  # held back: every bucket updated after the step
        driver.train_step(opt, model, x, 1e-4)
        opt.wait_for_weights()
        held = _HeldWorker(opt, model) if speculate else None
        calls.clear()
        driver.announce_grad_scale(opt)
        opt.zero_grad()
        model(x).square().mean().backward()
        landed = [s.host_grad.clone() for b in opt.layout.buckets for s in b.slots]
        driver.clip_scaled_gradients(opt, 1e-4)
        driver._step(opt)
        now = [s.host_grad for b in opt.layout.buckets for s in b.slots]
        if held is not None:
            assert all(torch.equal(a, b) for a, b in zip(landed, now))  # none updated yet
            held.release()
            opt.wait_for_weights()
        assert all(torch.equal(a, b) for a, b in zip(landed, now))  # read multiplied, left as they landed
        assert all(len(factors) == 1 for _, factors in calls)
        multiplied_on = [thread for thread, _ in calls]
        driver.train_step(opt, model, x, 1e-4)
        opt.close()
        return model, multiplied_on, len(opt.layout.buckets)

    ours, multiplied_on, buckets = run(True, "module")
    assert len(multiplied_on) == buckets and all(t.startswith("fastopt-cpu-step") for t in multiplied_on)
    ref, on_main, _ = run(False, "step")
    assert len(on_main) == buckets and all(t == threading.main_thread().name for t in on_main)
    assert_modules_equal(ours, ref)
