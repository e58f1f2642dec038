"""Forward waits per bucket (``forward_waits="module"``), on the accelerator code path run
on the CPU (``copy_on_cpu=True``).  The copies there are in line, so the order of events is
what is checked: where the compute stream would wait for each bucket's weights (recorded
by fake events and a fake compute stream), against where each module's forward starts.

- half offloaded: the device share's modules run before any wait, each offloaded module
  after the wait for its bucket; with ``"step"`` every wait comes before the forward;
- the delayed update sends its buckets in forward order and each module waits for its
  own just before it runs;
- a bucket holding a parameter of the root module (read by ``training_step`` directly)
  is waited for when the step ends; everything the optimizer reads itself, and
  ``wait_for_weights()``, waits for every copy;
- results are those of ``"step"``, bit for bit (exact, streamed and delayed steps; the
  plain CPU path, where nothing is ever in flight), and under ``Trainer()`` the strategy
  ends where ``Trainer()`` ends;
- the strategy falls back to ``"step"`` with one line naming the callback or hook that
  can read weights between steps (Lightning's quiet callbacks do not count), or for a
  compiled model; checkpoints and validation wait for every weight; bad arguments are
  refused by name;
- each weight the optimizer wrote is fingerprinted behind its copy (a fake copy stream
  logs where), never while on its way (exact, streamed and delayed steps);
- on a GPU (marked ``cuda``): with layers wide enough for an unwaited forward to overtake
  the copies, the results are still those of ``"step"``, bit for bit, float32 and
  bfloat16 weights, and no weight of ours is taken for another's write.
"""

import contextlib
import logging
import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fastopt import FastOptFabricStrategy, FastOptStrategy, FusedAdam, FusedSGD
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.offload import slots as slots_module
from lightning_fastopt.offload import weight_watch
from lightning_fastopt.offload.copies import CopyStreams
from lightning_fastopt.offload.forward_waits import ForwardWaits
from tests.helpers import ACCELERATOR, on_disk_through_two_buckets
from tests.test_precision import _data
from tests.test_strategy import Model


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _Log:
    """What the compute stream is asked to wait for, and where each module's forward starts."""

    def __init__(self, monkeypatch):
        self.entries = []
        log = self

        class Stream:
            def wait_event(self, event):
                log.entries.append(("wait", event))

        monkeypatch.setattr(CopyStreams, "new_event", lambda self: _Event())
        monkeypatch.setattr(CopyStreams, "_current", lambda self: Stream())

    def watch(self, model):
        for name, module in model.named_children():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(lambda m, a, name=name: self.entries.append(("forward", name)))

    def since(self, mark):
        return self.entries[mark:]


def _net(depth=4, width=16):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _optimizer(model, mode, fraction, **kw):
    """Buckets of one 16x16 layer each (1,088 bytes of 1,101)."""
    opt = OffloadOptimizer(FusedSGD(model.parameters(), lr=0.1, momentum=0.9),
                           {p: n for n, p in model.named_parameters()}, offload_fraction=fraction,
                           bucket_size_mb=0.00105, copy_on_cpu=True, forward_waits=mode, **kw)
    waits = ForwardWaits(model, lambda: [opt])
    opt.modules_wait_for(waits.covered)
    return opt, waits


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _named(entries, opt, model):
    """("wait", event) as ("wait", the name of the module whose bucket it is)."""
    module_of = {p: name for name, m in model.named_children() for p in m.parameters()}
    bucket_of = {b.params_sent: module_of[b.slots[0].param] for b in opt.layout.buckets}
    return [(kind, bucket_of.get(what, "?") if kind == "wait" else what) for kind, what in entries]


def test_half_offloaded_the_device_share_runs_before_any_wait(monkeypatch):
    log = _Log(monkeypatch)
    model = _net()
    opt, _ = _optimizer(model, "module", 0.5)
    assert [len(b.slots) for b in opt.layout.buckets] == [2, 2]  # layers 3 then 2 (the order backward produces them)
    log.watch(model)
    x = torch.randn(8, 16)
    _step(model, opt, x)
    mark = len(log.entries)
    model(x)
    # the step ended before its host updates (left to the worker, layer 2's first): each
    # offloaded layer waits for its own update and copy just before it runs
    assert opt.schedule.ends_early
    assert _named(log.since(mark), opt, model) == [("forward", "0"), ("forward", "1"), ("wait", "2"),
                                                    ("forward", "2"), ("wait", "3"), ("forward", "3")]
    opt.close()


def test_with_step_every_wait_comes_before_the_forward(monkeypatch):
    log = _Log(monkeypatch)
    model = _net()
    opt, _ = _optimizer(model, "step", 0.5)
    log.watch(model)
    x = torch.randn(8, 16)
    _step(model, opt, x)
    forward_at = len(log.entries)
    model(x)
    assert all(kind == "forward" for kind, _ in log.since(forward_at))
    assert ("wait", "2") in _named(log.entries[:forward_at], opt, model)  # the last bucket sent, at the step's end
    opt.close()


def test_the_delayed_update_sends_in_forward_order_and_each_module_waits_for_its_own(monkeypatch):
    log = _Log(monkeypatch)
    model = _net()
    opt, _ = _optimizer(model, "module", 1.0, delayed_update=True, delayed_update_warmup=1)
    log.watch(model)
    x = torch.randn(8, 16)
    for _ in range(3):  # the warm-up step, the first delayed one, then one that sends its weights
        _step(model, opt, x)
    mark = len(log.entries)
    model(x)
    assert _named(log.since(mark), opt, model) == [
        ("wait", "0"), ("forward", "0"), ("wait", "1"), ("forward", "1"),
        ("wait", "2"), ("forward", "2"), ("wait", "3"), ("forward", "3")]
    opt.close()


class _WithRootParameter(nn.Module):
    """A parameter of the root module itself, read directly (as ``training_step`` would)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(16))
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

    def forward(self, x):
        return self.body(x * self.scale)


def test_a_bucket_with_a_parameter_no_module_waits_for_is_waited_for_at_the_steps_end(monkeypatch):
    log = _Log(monkeypatch)
    model = _WithRootParameter()
    opt, waits = _optimizer(model, "module", 1.0)
    assert model.scale not in waits.covered
    root_bucket = opt.layout.slot_of[model.scale].bucket
    assert root_bucket is opt.layout.buckets[-1]  # registered first: its gradient comes last
    x = torch.randn(8, 16)
    _step(model, opt, x)
    assert ("wait", root_bucket.params_sent) in log.entries  # at the step's end (its update first)
    assert root_bucket not in opt._in_flight._sent  # (the others' updates may still run: each module waits)
    opt.close()


def test_what_reads_weights_outside_a_forward_waits_for_every_copy(monkeypatch):
    _Log(monkeypatch)
    model = _net()
    opt, _ = _optimizer(model, "module", 1.0)
    x = torch.randn(8, 16)
    _step(model, opt, x)
    assert opt._in_flight  # nothing has waited yet: every module is covered
    opt.wait_for_weights()
    assert not opt._in_flight
    for reader in (lambda: opt.refresh_master_weights(), lambda: opt.load_state_dict(opt.state_dict()),
                   lambda: opt.gradients(), lambda: opt.add_param_group({"params": [nn.Parameter(torch.ones(3))]}),
                   lambda: (model[0].weight * 1).sum().backward()):  # a backward's first gradient
        opt.zero_grad()
        _step(model, opt, x)
        assert opt._in_flight
        reader()
        assert not opt._in_flight
    opt.close()


class _CopyStreamLog(_Log):
    """As :class:`_Log`, and a fake copy stream: the weights go through ``params_to_device``'s
    stream branch, which logs where its copies are issued and its event recorded; and every
    fingerprint taken of a weight is logged.  On a GPU a weight whose copy was recorded but
    not yet waited for by the compute stream is still on its way."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        log = self

        class Event(_Event):
            def record(self, stream=None):
                log.entries.append(("record", self))

        class CopyStream:
            def wait_event(self, event):
                pass

        @contextlib.contextmanager
        def on_stream(stream):
            log.entries.append(("on copy stream", stream))
            yield
            log.entries.append(("off copy stream", stream))

        def logged(real):
            def fingerprints(tensors):
                log.entries.append(("fingerprint", [t.data_ptr() for t in tensors]))
                return real(tensors)
            return fingerprints

        monkeypatch.setattr(CopyStreams, "new_event", lambda self: Event())
        monkeypatch.setattr(torch.cuda, "stream", on_stream)
        monkeypatch.setattr(weight_watch, "fingerprints", logged(weight_watch.fingerprints))
        monkeypatch.setattr(slots_module, "fingerprints", logged(slots_module.fingerprints))
        self.copy_stream = CopyStream()

    def streams_for(self, opt):
        opt.copies.h2d = self.copy_stream

    def fingerprints_of_weights_on_their_way(self, opt):
        """Each fingerprint that read a weight whose copy was recorded and not yet waited
        for (waiting for a copy waits for those recorded before it: one copy stream): (the
        entry's index, the bucket's index)."""
        bucket_of_event = {b.params_sent: i for i, b in enumerate(opt.layout.buckets)}
        weights = {i: {s.weight().data_ptr() for s in b.slots} for i, b in enumerate(opt.layout.buckets)}
        on_way, found = [], []  # buckets in the order their copies were recorded
        for at, (kind, what) in enumerate(self.entries):
            if kind == "record" and what in bucket_of_event:
                on_way = [b for b in on_way if b != bucket_of_event[what]] + [bucket_of_event[what]]
            elif kind == "wait" and what in bucket_of_event and bucket_of_event[what] in on_way:
                del on_way[:on_way.index(bucket_of_event[what]) + 1]
            elif kind == "fingerprint":
                found += [(at, b) for b in sorted(on_way) if weights[b] & set(what)]
        return found


@pytest.mark.parametrize("kw", [{}, {"stream_cpu_step": True}, {"delayed_update": True, "delayed_update_warmup": 1}],
                         ids=["exact", "streamed", "delayed"])
@pytest.mark.parametrize("mode", ["module", "step"])
def test_a_weight_is_fingerprinted_behind_its_copy_never_while_on_its_way(monkeypatch, mode, kw):
    """The optimizer notes each weight it wrote (a fingerprint, to find writes by others
    before the next step) behind that weight's copy on the copy stream, before the event
    the forward waits for.  Until 2026-11-28 it took them when the step ended, on the
    compute stream, which with ``"module"`` had not waited for the copies: on a GPU the
    fingerprint could read a weight still on its way, and the next step took the weight
    for one written by others and refreshed its master from it (a half weight's master
    lost the bits the weight lacks)."""
    log = _CopyStreamLog(monkeypatch)
    model = _net()
    opt, _ = _optimizer(model, mode, 1.0, **kw)
    log.streams_for(opt)
    x = torch.randn(8, 16)
    for _ in range(4):
        _step(model, opt, x)
    model(x)
    assert sum(kind == "record" for kind, _ in log.entries) >= 8  # the stream branch ran: weights went out
    assert log.fingerprints_of_weights_on_their_way(opt) == []
    assert not opt.masters._said  # no weight of ours taken for another's write
    opt.close()


def _train(mode, fraction, make_opt, steps=10, copy_on_cpu=True, **kw):
    model = _net(depth=5)
    opt = OffloadOptimizer(make_opt(model.parameters()), {p: n for n, p in model.named_parameters()},
                           offload_fraction=fraction, bucket_size_mb=0.001, copy_on_cpu=copy_on_cpu,
                           forward_waits=mode, **kw)
    waits = ForwardWaits(model, lambda: [opt])
    opt.modules_wait_for(waits.covered)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        _step(model, opt, torch.randn(8, 16, generator=g))
    opt.close()
    waits.remove()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kw", [{}, {"stream_cpu_step": True}, {"delayed_update": True, "delayed_update_warmup": 3}],
                         ids=["exact", "streamed", "delayed"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_the_same_results_as_waiting_at_the_step_bit_for_bit(compiled, fraction, kw):
    def make(ps):
        return FusedAdam(ps, lr=1e-2, weight_decay=0.01)

    for a, b in zip(_train("module", fraction, make, **kw), _train("step", fraction, make, **kw)):
        assert torch.equal(a, b)


TIMEOUT = 300  # seconds a test waits for an event it expects before failing (never a time it relies on)


class _HeldWorker:
    """Holds the optimizer's worker thread (a task of its own, ahead of any update) until
    :meth:`release`; :attr:`order` lists the updates it ran, by layer."""

    def __init__(self, opt, model):
        self.order = []
        self._release = threading.Event()
        engine = getattr(opt, "local", opt)  # a wrapper's offload optimizer (FSDP's: over aliases of the rows)
        alias = getattr(opt, "alias_of", lambda p: p)
        run = engine.updates.run
        layer = {alias(p): i for i, m in enumerate(model) for p in m.parameters()}

        def recorded(inner, plan, *args):
            if inner is not engine.layout.device_inner:
                self.order.append(layer[plan[0][0].param])
            return run(inner, plan, *args)

        engine.updates.run = recorded
        engine.updates.pool().submit(self._release.wait, TIMEOUT)

    def release(self):
        self._release.set()


def forward_waits_for_the_held_updates(model, opt, held, x):
    """After a step that returned with every update held (``held``: a :class:`_HeldWorker`):
    the next forward, in a thread of its own, waits for the first module's weights until
    the worker is released, then runs, every update and copy waited for.  Returns its output."""
    in_flight = getattr(opt, "local", opt)._in_flight  # (a wrapper's: its offload optimizer's)
    assert held.order == [] and in_flight
    waiting, forward = threading.Event(), []
    wait_for = opt.wait_for_weights

    def noted(params=None):
        waiting.set()
        wait_for(params)

    opt.wait_for_weights = noted
    runner = threading.Thread(target=lambda: forward.append(model(x)))
    runner.start()
    assert waiting.wait(timeout=TIMEOUT)  # the forward waits for the first module's weights...
    assert not forward and held.order == []
    held.release()  # ...until its update has ended
    runner.join(timeout=TIMEOUT)
    assert forward and not in_flight
    del opt.wait_for_weights
    return forward[0]


def _streamed(model, mode="module", lr=1e-2, stream=True, **kw):
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=lr), {p: n for n, p in model.named_parameters()},
                           bucket_size_mb=0.00105, copy_on_cpu=True, forward_waits=mode, stream_cpu_step=stream, **kw)
    waits = ForwardWaits(model, lambda: [opt])
    opt.modules_wait_for(waits.covered)
    return opt


@pytest.mark.parametrize("disk", [False, True], ids=["", "state-on-disk"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "at-the-step"])
def test_a_step_ends_before_its_updates_and_each_forward_waits_for_its_own(stream, disk, tmp_path, monkeypatch):
    """The worker held, every bucket's update is still queued when ``step()`` returns
    (streamed: queued as its gradients landed; at the step: all left then); the next
    forward's first module waits for its bucket's update (on the host), then for its copy;
    the run ends where waiting at the step ends.  With the masters and state on disk
    (a window of two buckets' regions) too: the tier reads the buckets ahead in the order
    the worker takes them, each region at most once."""
    disk_kw = {}
    if disk:
        disk_kw = on_disk_through_two_buckets(tmp_path, lambda **kw: _streamed(_net(), stream=stream, **kw))
    reads = []
    if disk:
        from lightning_fastopt.runtime.direct_io import DirectFile

        read_into = DirectFile.read_into
        monkeypatch.setattr(DirectFile, "read_into", lambda f, buffer, offset: (reads.append(offset),
                                                                                 read_into(f, buffer, offset))[1])
    model = _net()
    opt = _streamed(model, stream=stream, **disk_kw)
    assert opt.schedule.ends_early and opt.layout.tier.on_disk == disk
    x = torch.randn(8, 16)
    _step(model, opt, x)
    opt.wait_for_weights()  # (the first step's updates, left running, have ended)
    held = _HeldWorker(opt, model)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()  # returns, nothing updated yet
    if disk:  # what the tier read ahead before (the next backward's first region, after the first step) has
        for slot in opt.layout.tier.window:  # landed: on a loaded machine it could be read after the clear
            read = slot.read
            if read is not None:
                read.result()
    reads.clear()
    forward_waits_for_the_held_updates(model, opt, held, x)
    assert held.order == [0, 1, 2, 3]  # the next forward's first layer first
    if disk:  # each region read at most once, in the worker's order (some may be in the window already)
        regions = {b: opt.layout.tier.regions[b].offset for b in opt.layout.buckets}
        order = [regions[b] for b in reversed(opt.layout.buckets)]
        assert reads == [r for r in order if r in reads] and len(reads) >= 2, (reads, order)
    for _ in range(2):
        _step(model, opt, x)
    opt.close()
    ref = _net()
    ref_opt = _streamed(ref, mode="step", stream=stream)
    for _ in range(4):
        _step(ref, ref_opt, x)
    ref_opt.close()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "at-the-step"])
def test_the_updates_left_at_the_step_keep_the_steps_hyperparameters(stream):
    """The worker held until the step has returned and an LR scheduler has moved the
    learning rate: each update still takes the rate of the step that left it, as waiting
    at the step does."""
    x = torch.randn(8, 16)

    def run(mode):
        model = _net(depth=5)
        opt = _streamed(model, mode, stream=stream)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        _step(model, opt, x)
        scheduler.step()
        opt.wait_for_weights()  # (the first step's updates, left running, have ended)
        held = _HeldWorker(opt, model) if mode == "module" else None  # (a step that waits would wait for it)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        left = None if held is None else list(held.order)
        scheduler.step()  # (module: before any of this step's updates ran)
        if held is not None:
            held.release()
        opt.wait_for_weights()
        _step(model, opt, x)
        opt.close()
        return left, [p.detach().clone() for p in model.parameters()]

    left, ours = run("module")
    assert left == []  # none had run when the scheduler moved the rate
    for a, b in zip(ours, run("step")[1]):
        assert torch.equal(a, b)


def test_on_the_plain_cpu_path_there_is_nothing_to_wait_for(compiled, monkeypatch):
    """A CPU run without copies updates the weights in place: nothing is ever in flight,
    and the results are those of "step"."""
    log = _Log(monkeypatch)
    model = _net()
    opt = OffloadOptimizer(FusedSGD(model.parameters(), lr=0.1), offload_fraction=0.5, forward_waits="module")
    waits = ForwardWaits(model, lambda: [opt])
    opt.modules_wait_for(waits.covered)
    for _ in range(3):
        _step(model, opt, torch.randn(8, 16))
        assert not opt._in_flight
    assert not [e for e in log.entries if e[0] == "wait"]
    opt.close()

    def make(ps):
        return FusedAdam(ps, lr=1e-2, weight_decay=0.01)

    for a, b in zip(_train("module", 0.5, make, copy_on_cpu=False), _train("step", 0.5, make, copy_on_cpu=False)):
        assert torch.equal(a, b)


class _Validated(Model):
    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))


def _fit(strategy, callbacks=(), checkpoints=None):
    model = _Validated(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01), sched=True)
    if checkpoints is not None:
        callbacks = [*callbacks, ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=3)]
    trainer = L.Trainer(strategy=strategy, accelerator=ACCELERATOR, devices=1, max_epochs=2, logger=False,
                        enable_checkpointing=checkpoints is not None, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(model, _data(), _data(16))
    return model, trainer


class _ReadsWeights(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass


@pytest.fixture
def info(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog


@pytest.mark.parametrize("kw", [{}, {"stream_cpu_step": True}, {"delayed_update": True, "delayed_update_warmup": 2}],
                         ids=["exact", "streamed", "delayed"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_under_the_trainer_it_ends_where_the_step_waiting_run_ends(info, tmp_path, fraction, kw):
    """With checkpoints every 3 steps and validation every epoch (which wait for every
    weight) and Lightning's default callbacks, which do not count as readers."""
    def strategy(mode):
        return FastOptStrategy(offload_fraction=fraction, bucket_size_mb=0.0002, copy_on_cpu=True, forward_waits=mode,
                               **kw)

    ours, trainer = _fit(strategy("module"), checkpoints=tmp_path)
    assert "each module's forward waits only for its own new weights" in info.text
    assert trainer.strategy.engines[0].settings.forward_waits == "module"
    ref, _ = _fit(strategy("step") if kw else "auto")
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)


class _SaysItDoesNot(_ReadsWeights):
    reads_weights_between_steps = False


def test_with_the_fraction_chosen_for_the_user_the_rebuilt_optimizer_keeps_waiting_by_module(info):
    """offload_fraction="auto" rebuilds the optimizer after its probe: the new one waits by
    module too (the hooks find the current optimizer), and the run ends where Trainer() ends."""
    strategy = FastOptStrategy(offload_fraction="auto", bucket_size_mb=0.0002, copy_on_cpu=True,
                               forward_waits="module")
    ours, trainer = _fit(strategy)
    opt = trainer.strategy.engines[0]
    assert "offload_fraction='auto' chose" in info.text
    assert opt.settings.forward_waits == "module" and opt._in_flight.covered == set(ours.parameters())
    ref, _ = _fit("auto")
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("callback,mode", [(_ReadsWeights(), "step"), (_SaysItDoesNot(), "module")])
def test_the_strategy_falls_back_to_waiting_at_the_step_where_weights_can_be_read(info, callback, mode):
    strategy = FastOptStrategy(offload_fraction=0.5, bucket_size_mb=0.0002, copy_on_cpu=True, forward_waits="module")
    _, trainer = _fit(strategy, [callback])
    said = "forward_waits='module' not used: _ReadsWeights.on_train_batch_end can read the weights between steps"
    assert (said in info.text) == (mode == "step")
    assert trainer.strategy.engines[0].settings.forward_waits == mode


class _EpochEnd(_Validated):
    def on_train_epoch_end(self):  # reads no weight (a log line of the epoch's losses, say)
        pass


class _EpochEndSaysItDoesNot(_EpochEnd):
    reads_weights_between_steps = False


@pytest.mark.parametrize("cls,mode", [(_EpochEnd, "step"), (_EpochEndSaysItDoesNot, "module")])
def test_a_lightning_module_whose_hooks_read_no_weights_can_say_so(info, cls, mode):
    """A LightningModule that overrides a hook between steps counts as a reader (the step
    waits, said in one line), unless it says its hooks read no weights, as a callback can."""
    strategy = FastOptStrategy(offload_fraction=0.5, bucket_size_mb=0.0002, copy_on_cpu=True, forward_waits="module")
    trainer = L.Trainer(strategy=strategy, accelerator=ACCELERATOR, devices=1, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(cls(lambda ps: torch.optim.AdamW(ps, lr=1e-2), sched=False), _data())
    said = f"forward_waits='module' not used: {cls.__name__}.on_train_epoch_end can read the weights between steps"
    assert (said in info.text) == (mode == "step")
    assert trainer.strategy.engines[0].settings.forward_waits == mode


@pytest.mark.parametrize("what", ["submodule", "lightning_module"])
def test_a_compiled_model_waits_at_the_step(info, what):
    """Forward pre-hooks inside torch.compile would be traced (the waits baked in) or break
    the graph: the strategy keeps "step" for a compiled submodule, or a LightningModule
    given to the Trainer compiled, and says why."""
    model = _Validated(lambda ps: torch.optim.AdamW(ps, lr=1e-2), sched=False)
    if what == "submodule":
        model.net[2] = torch.compile(model.net[2], backend="eager")
    strategy = FastOptStrategy(offload_fraction=0.5, bucket_size_mb=0.0002, copy_on_cpu=True, forward_waits="module")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model if what == "submodule" else torch.compile(model, backend="eager"), _data())
    assert "forward_waits='module' not used: the model is compiled (torch.compile)" in info.text
    assert trainer.strategy.engines[0].settings.forward_waits == "step"


def test_checkpoints_and_validation_wait_for_every_weight(monkeypatch, tmp_path):
    waited = []
    original = OffloadOptimizer.wait_for_weights

    def spy(self, params=None):
        if params is None:
            waited.append(bool(self._in_flight))
        return original(self, params)

    monkeypatch.setattr(OffloadOptimizer, "wait_for_weights", spy)
    strategy = FastOptStrategy(offload_fraction=1.0, bucket_size_mb=0.0002, copy_on_cpu=True, forward_waits="module")
    _fit(strategy, checkpoints=tmp_path)
    # 5 checkpoints (steps 3..15) and 2 validations found weights on their way (every module is covered)
    assert waited.count(True) >= 7


@pytest.mark.parametrize("make,match", [
    (lambda: FastOptStrategy(forward_waits="layer"), r"forward_waits must be one of \('step', 'module'\)"),
    (lambda: FastOptStrategy(forward_waits="module", zero_stage=1), "forward_waits='module' runs with zero_stage=0"),
    (lambda: FastOptFabricStrategy(forward_waits="module"), "forward_waits='module' is for the Trainer"),
    (lambda: OffloadOptimizer(FusedSGD(_net().parameters(), lr=0.1), forward_waits=True),
     "forward_waits must be one of"),
])
def test_bad_arguments_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [{"offload_fraction": 0.5}, {"offload_fraction": 1.0, "delayed_update": True,
                                                            "delayed_update_warmup": 1}], ids=["half", "delayed"])
def test_on_gpu_the_forward_reads_only_weights_that_have_arrived(kw, dtype):
    """Wide layers (32 MiB of weights each) make every bucket's copy slow enough for a
    forward that did not wait to overtake it: the run must still equal the one that waits
    for every copy at the step, bit for bit, and never take a weight of its own for one
    written by others (a fingerprint taken before the copy landed did: a bfloat16 weight's
    master then lost its bits)."""
    def run(mode):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).cuda().to(dtype)
        opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-3), {p: n for n, p in model.named_parameters()},
                               bucket_size_mb=16.5, forward_waits=mode, **kw)
        waits = ForwardWaits(model, lambda: [opt])
        opt.modules_wait_for(waits.covered)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(6):
            _step(model, opt, torch.randn(64, 2048, device="cuda", generator=g, dtype=dtype))
        assert not opt.masters._said
        opt.close()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run("module"), run("step")):
        assert torch.equal(a, b)
