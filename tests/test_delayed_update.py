"""The delayed parameter update (``delayed_update=True``, :mod:`lightning_fastopt.offload.delayed`)
on the accelerator code path run on the CPU (``copy_on_cpu=True``):

- 50 steps equal a plain-PyTorch reference of the delayed recurrence (torch.optim on
  float32 masters, the model's weights one update old once the warm-up is over) with two
  parameter groups, an LR scheduler, accumulation over two micro-batches, clipping by
  norm, a loss scale with injected overflows (skipped steps, one in the warm-up), and a
  save and resume in the middle; SGD and AdamW bit for bit, at fractions 1 and 0.5 (the
  device share is not delayed);
- the resumed run ends where the uninterrupted one ends, bit for bit;
- the update runs while the next backward computes (timestamps);
- weights written between steps keep the write; training ends with the last update in
  the model; a checkpoint with a pending update loads into an optimizer without one;
- bad arguments are refused by name;
- under ``Trainer()``: the strategy's delayed run equals ``Trainer()`` with a callback
  that delays torch's update the same way, and resumes from a checkpoint exactly.
"""

import io
import math
import time

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fastopt import FastOptStrategy, FusedAdam, FusedSGD
from lightning_fastopt.checkpoint.named_state import CheckpointMismatchError
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.offload.delayed import SAVED_KEY
from tests.helpers import ACCELERATOR, assert_params_equal
from tests.references import DelayedTorchUpdate
from tests.test_streamed_step import _net

SCALE = 8.0  # a loss scale; a power of two, so scaled gradients are exact multiples
MAX_NORM = 0.5
OVERFLOW_AT = {3, 17, 18, 33}  # 3 is in the warm-up
WARMUP = 5


def _groups(params, names):
    """Two groups: weights with weight decay, biases without."""
    params = list(params)
    return [{"params": [p for p, n in zip(params, names) if n.endswith("weight")]},
            {"params": [p for p, n in zip(params, names) if n.endswith("bias")], "weight_decay": 0.0}]


OPTIMIZERS = {
    "sgd": (lambda g: FusedSGD(g, lr=0.05, momentum=0.9, weight_decay=1e-3),
            lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=False)),
    "adamw": (lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01, torch_sqrt=True),
              lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01, foreach=False)),
}


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(16, 24, generator=g) for _ in range(2)] for _ in range(steps)]


def _loss(model, x):
    return (model(x) - x[:, :1]).square().mean() / 2  # two micro-batches per step


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))


def _norm(grads):
    """An L2 norm that does not depend on the order of the tensors (fsum of per-tensor sums)."""
    return math.sqrt(math.fsum(g.double().square().sum().item() for g in grads))


class Ours:
    def __init__(self, name, fraction, model=None, saved=None, delayed=True, warmup=WARMUP):
        self.model = model or _net()
        names = [n for n, _ in self.model.named_parameters()]
        if saved is not None:
            self.model.load_state_dict(saved["model"])  # the model first, as Lightning does
        self.opt = OffloadOptimizer(OPTIMIZERS[name][0](_groups(self.model.parameters(), names)),
                                    {p: n for n, p in self.model.named_parameters()}, offload_fraction=fraction,
                                    bucket_size_mb=0.002, copy_on_cpu=True, delayed_update=delayed,
                                    delayed_update_warmup=warmup)
        self.sched = _schedule(self.opt.optimizer)
        if saved is not None:
            self.opt.load_state_dict(saved["optimizer"])
            self.sched.load_state_dict(saved["scheduler"])

    def step(self, t, micro_batches):
        self.opt.zero_grad()
        for i, x in enumerate(micro_batches):
            self.opt.accumulating = i < len(micro_batches) - 1  # as Lightning's block_backward_sync
            (_loss(self.model, x) * SCALE).backward()
        self.opt.accumulating = False
        grads = self.opt.gradients()  # where the step reads them (host buffers of offloaded parameters)
        if t in OVERFLOW_AT:
            grads[0].view(-1)[0] = math.inf
            assert self.opt.step(check_finite=True, grad_scale=SCALE) is None and self.opt.last_step_skipped
        else:
            coef = min(1.0, MAX_NORM / (_norm(grads) / SCALE + 1e-6))
            for g in grads:
                g.mul_(coef)
            self.opt.step(check_finite=True, grad_scale=SCALE)
            assert not self.opt.last_step_skipped
        self.opt.optimizer._opt_called = True  # as the strategy tells the scheduler (it is bound to the inner one)
        self.sched.step()

    def checkpoint(self):
        """Through torch.save and torch.load(weights_only=True), as a checkpoint file goes."""
        buffer = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict()}, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    def offloaded(self):
        return [self.opt.layout.slot_of[p].offloaded for p in self.model.parameters()]


def run_ours(name, fraction, steps=50, resume_at=None):
    batches = _batches(steps)
    ours = Ours(name, fraction)
    for t in range(steps):
        if t == resume_at:
            saved = ours.checkpoint()
            ours.opt.close()
            ours = Ours(name, fraction, saved=saved)
        ours.step(t, batches[t])
    states = [{k: v.clone() for k, v in ours.opt.state_of(p).items()} for p in ours.model.parameters()]
    stale = [p.detach().clone() for p in ours.model.parameters()]
    ours.opt.close()  # the last update goes into the model
    return ours, stale, states


def run_reference(name, offloaded, steps=50):
    """torch.optim on float32 masters; forward and backward use the masters of before the
    last update for offloaded parameters once the warm-up is over (the delayed recurrence)."""
    model = _net()
    names = [n for n, _ in model.named_parameters()]
    masters = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = OPTIMIZERS[name][1](_groups(masters, names))
    sched = _schedule(opt)
    batches = _batches(steps)
    stale = None
    for t in range(steps):
        model.zero_grad()
        for x in batches[t]:
            (_loss(model, x) * SCALE).backward()
        before = [m.detach().clone() for m in masters]
        if t not in OVERFLOW_AT:
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad / SCALE
            coef = min(1.0, MAX_NORM / (_norm([m.grad for m in masters]) + 1e-6))
            for m in masters:
                m.grad.mul_(coef)
            opt.step()
        sched.step()
        with torch.no_grad():
            for p, m, b, off in zip(model.parameters(), masters, before, offloaded):
                p.copy_(b if off and t >= WARMUP else m)
        stale = [p.detach().clone() for p in model.parameters()]
    return masters, stale, [opt.state[m] for m in masters]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_delayed_update_follows_the_delayed_recurrence_of_torch_optim(compiled, name, fraction):
    ours, ours_stale, ours_states = run_ours(name, fraction, resume_at=25)
    offloaded = ours.offloaded()
    assert any(offloaded) and (all(offloaded) if fraction == 1.0 else not all(offloaded))
    masters, ref_stale, ref_states = run_reference(name, offloaded)
    # between steps the model held the masters of before the last update (offloaded share)
    assert_params_equal(ours_stale, ref_stale)
    # at the end it holds the last update
    assert_params_equal([p.detach() for p in ours.model.parameters()], [m.detach() for m in masters])
    for mine, theirs in zip(ours_states, ref_states):
        key = "momentum_buffer" if name == "sgd" else "exp_avg_sq"
        assert torch.equal(mine[key], theirs[key])
    for a, b, off in zip(ref_stale, masters, offloaded):  # the reference is one update old where it is offloaded
        assert torch.equal(a, b) != off


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_resumed_delayed_run_ends_where_the_uninterrupted_one_ends_bit_for_bit(compiled, name):
    straight, straight_stale, straight_states = run_ours(name, 1.0, steps=30)
    resumed, resumed_stale, resumed_states = run_ours(name, 1.0, steps=30, resume_at=12)
    for a, b in zip(straight_stale + list(straight.model.parameters()),
                    resumed_stale + list(resumed.model.parameters())):
        assert torch.equal(a, b)
    for sa, sb in zip(straight_states, resumed_states):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_no_delay_during_the_warm_up_equals_the_synchronous_step_bit_for_bit(compiled):
    batches = _batches(8)
    delayed, plain = Ours("adamw", 1.0, warmup=100), Ours("adamw", 1.0, delayed=False)
    for t in range(8):
        delayed.step(t, batches[t])
        plain.step(t, batches[t])
    for a, b in zip(delayed.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)
    assert not delayed.opt.schedule.delayed.pending
    for o in (delayed, plain):
        o.opt.close()


def test_the_update_runs_while_the_next_backward_computes(compiled):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(768, 768) for _ in range(6)])
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-3), {p: n for n, p in model.named_parameters()},
                           bucket_size_mb=2.5, copy_on_cpu=True, delayed_update=True, delayed_update_warmup=0)
    spans = []
    run = opt.updates.run

    def timed(inner, *args):
        started = time.perf_counter()
        out = run(inner, *args)
        if inner is not opt.layout.device_inner:
            spans.append((started, time.perf_counter()))
        return out

    opt.updates.run = timed
    x = torch.randn(1024, 768)
    backward_ends = []
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        backward_ends.append(time.perf_counter())
        opt.step()
    first_update = spans[:len(opt.layout.buckets)]  # launched by the first step
    assert len(opt.layout.buckets) >= 4 and len(first_update) == len(opt.layout.buckets)
    assert min(start for start, _ in first_update) < backward_ends[1], (first_update, backward_ends)
    opt.close()


def _single(delayed=True, **kw):
    model = _net()
    opt = OffloadOptimizer(FusedSGD(model.parameters(), lr=0.1), {p: n for n, p in model.named_parameters()},
                           bucket_size_mb=0.002, copy_on_cpu=True, delayed_update=delayed,
                           delayed_update_warmup=0, **kw)
    return model, opt


def _train_step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_a_weight_written_between_steps_keeps_the_write():
    model, opt = _single()
    x = torch.randn(8, 24)
    _train_step(model, opt, x)
    w = model[0].weight
    with torch.no_grad():
        w.data.fill_(0.25)  # a write through .data while the update of that weight is pending
    _train_step(model, opt, x)  # sends the pending update, but not to w; w's next update starts from the write
    slot = opt.layout.slot_of[w]
    opt.schedule.wait()
    grad = slot.spare_grad  # the gradient that update read (the buffers swapped when it was launched)
    expected = torch.full_like(w, 0.25).add(grad, alpha=-0.1)  # torch's SGD step
    assert torch.equal(slot.master, expected)
    assert torch.equal(w.detach(), torch.full_like(w, 0.25))
    _train_step(model, opt, x)
    assert torch.equal(w.detach(), expected)
    opt.close()
    assert torch.equal(w.detach(), slot.master)


def test_training_ends_with_the_last_update_in_the_model():
    model, opt = _single()
    before = [p.detach().clone() for p in model.parameters()]
    _train_step(model, opt, torch.randn(8, 24))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the first update is pending"
    masters = [opt.layout.slot_of[p].master for p in model.parameters()]
    assert opt.apply_pending_update() == len(masters)
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), masters))
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.apply_pending_update() == 0
    opt.close()


def test_a_pending_update_in_a_checkpoint_loads_into_an_optimizer_without_one():
    model, opt = _single()
    x = torch.randn(8, 24)
    for _ in range(3):
        _train_step(model, opt, x)
    saved = opt.state_dict()
    assert saved[SAVED_KEY]["steps"] == 3 and len(saved[SAVED_KEY]["weights"]) == len(list(model.parameters()))
    masters = {n: w.clone() for n, w in saved[SAVED_KEY]["weights"].items()}
    other, plain = _single(delayed=False)
    other.load_state_dict(model.state_dict())
    plain.load_state_dict(saved)  # the pending update finishes: into the model
    for n, p in other.named_parameters():
        assert torch.equal(p.detach(), masters[n])
    torch.optim.SGD(model.parameters(), lr=0.1).load_state_dict(saved)  # torch ignores the key
    bad = dict(saved, **{SAVED_KEY: {"steps": 1, "weights": {"0.weight": torch.zeros(3)}}})
    with pytest.raises(CheckpointMismatchError, match="pending weight '0.weight'"):
        plain.load_state_dict(bad)
    for o in (opt, plain):
        o.close()


@pytest.mark.parametrize("kw,error,match", [
    (dict(delayed_update=1), TypeError, "delayed_update must be True or False, got 1"),
    (dict(delayed_update=True, delayed_update_warmup=-1), ValueError, "delayed_update_warmup must be a whole"),
    (dict(delayed_update=True, stream_cpu_step=True), ValueError, "exclude each other"),
    (dict(delayed_update=True, copy_on_cpu=False), ValueError, "delayed_update=True needs host masters apart"),
])
def test_bad_arguments_are_refused_by_name(kw, error, match):
    model = _net()
    args = dict(copy_on_cpu=True) | kw
    with pytest.raises(error, match=match):
        OffloadOptimizer(FusedSGD(model.parameters(), lr=0.1), offload_fraction=1.0, **args)


# ---------------------------------------------------------------------- under the Trainer
def _model():
    from tests.test_strategy import Model

    return Model(lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9), sched=True)


def _trainer_fit(strategy, model, ckpt_path=None, **kw):
    from tests.test_precision import _data

    args = dict(accelerator=ACCELERATOR, devices=1, max_epochs=4, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, strategy=strategy,
                accumulate_grad_batches=2, gradient_clip_val=0.3)
    args.update(kw)
    L.Trainer(**args).fit(model, _data(), ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("fraction", [1.0, 0.1])  # 0.1: the last layer's two tensors of the small model
def test_under_the_trainer_it_equals_trainer_with_torchs_update_delayed(caplog, monkeypatch, fraction):
    import logging

    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    strategy = FastOptStrategy(offload_fraction=fraction, bucket_size_mb=0.0002, delayed_update=True,
                               delayed_update_warmup=3)
    with caplog.at_level(logging.INFO):
        ours = _trainer_fit(strategy, _model())
    assert "after 3 synchronous step(s), each CPU update runs during the next forward and backward" in caplog.text
    opt = ours.trainer.strategy.engines[0]
    offloaded = [opt.owns(p) and opt.layout.slot_of[p].offloaded for p in ours.parameters()]
    assert any(offloaded) and all(offloaded) == (fraction == 1.0)
    # only the offloaded share is delayed: the reference delays those parameters
    reference = _trainer_fit("auto", _model(), callbacks=[DelayedTorchUpdate(3, offloaded)])
    plain = _trainer_fit("auto", _model())
    assert_params_equal(list(ours.parameters()), list(reference.parameters()))
    assert not all(torch.allclose(a, c, rtol=1e-4, atol=1e-5) for a, c in zip(ours.parameters(), plain.parameters()))


def test_under_the_trainer_a_delayed_run_resumes_from_a_checkpoint_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def strategy():
        return FastOptStrategy(bucket_size_mb=0.0002, delayed_update=True, delayed_update_warmup=3)

    every_epoch = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    straight = _trainer_fit(strategy(), _model(), enable_checkpointing=True, callbacks=[every_epoch])
    middle = tmp_path / "epoch=1.ckpt"  # after 8 steps: an update is pending
    saved = torch.load(middle, weights_only=True)["optimizer_states"][0][SAVED_KEY]
    assert saved["steps"] == 8 and saved["weights"]
    resumed = _trainer_fit(strategy(), _model(), ckpt_path=str(middle))
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw,error,match", [
    (dict(delayed_update=True, zero_stage=1), ValueError, "delayed_update=True runs with zero_stage=0 only"),
    (dict(delayed_update="yes"), TypeError, "delayed_update must be True or False"),
    (dict(delayed_update=True, delayed_update_warmup=2.5), ValueError, "delayed_update_warmup must be a whole"),
    (dict(delayed_update=True, stream_cpu_step=True), ValueError, "exclude each other"),
])
def test_the_strategy_refuses_bad_delayed_update_arguments(kw, error, match):
    with pytest.raises(error, match=match):
        FastOptStrategy(**kw)
