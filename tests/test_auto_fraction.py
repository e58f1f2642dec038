"""``offload_fraction="auto"`` (:mod:`lightning_fastopt.offload.auto_fraction`):

- the choice from measured timings and memory: nothing hidden with the exact step, the
  backward share with ``stream_cpu_step``, forward and backward (every micro-batch)
  with ``delayed_update``; the smallest fraction within a memory budget when hiding is
  not enough; fraction 1 when nothing fits; bad modes and a budget without a peak refused;
- the probe skips the first steps, measures the next ones, and measures again a step
  that did not run;
- ``OffloadOptimizer.with_fraction`` between steps changes nothing in the results: a
  run switched in the middle ends where the run at one fraction ends, bit for bit (float32,
  half weights with float32 masters, a delayed update pending), through the accelerator
  code path on the CPU;
- under ``Trainer()``: the strategy probes, says what it chose and why, rebuilds the
  optimizer, and ends where ``Trainer()`` ends; bad arguments are refused by name.
"""

import logging

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fastopt import FastOptStrategy, FusedAdam, FusedSGD
from lightning_fastopt.offload import OffloadOptimizer, auto_fraction
from lightning_fastopt.offload.auto_fraction import FractionProbe, ProbeResult, choose_fraction
from tests.helpers import ACCELERATOR

GiB = 2**30


def _params(sizes):
    return [torch.empty(n, device="meta") for n in sizes]


# 1.0e9 elements in 100 tensors of 1e7 (the 1B GPT's scale): fractions are multiples of 0.01
BIG = _params([10_000_000] * 100)


def _bytes(p):
    return 12 * p.numel()  # Adam's two moments and a bf16 gradient... any per-element figure


def test_the_exact_step_hides_nothing():
    fraction, why = choose_fraction(ProbeResult(120.0, 0.17), BIG, _bytes, hide="exact")
    assert fraction == 0.0
    assert "nothing hides it" in why and "0 is the largest fraction it hides" in why


def test_the_streamed_step_hides_the_cpu_update_behind_backward():
    # 80 ms of backward hide 80e6 / 0.17 = 4.7e8 elements: 47 tensors of 1e7
    fraction, why = choose_fraction(ProbeResult(120.0, 0.17), BIG, _bytes, hide="streamed")
    assert fraction == 0.47
    assert "80.0 ms of backward per step hide it (stream_cpu_step" in why


def test_the_delayed_update_hides_it_behind_every_micro_batch_of_the_next_step():
    one, _ = choose_fraction(ProbeResult(120.0, 0.17), BIG, _bytes, hide="delayed")
    assert one == 0.7  # 120 ms hide 7.06e8 elements
    two, why = choose_fraction(ProbeResult(60.0, 0.17), BIG, _bytes, hide="delayed", accumulate=2)
    assert two == one and "120.0 ms of forward and backward per step hide it (delayed_update)" in why
    assert choose_fraction(ProbeResult(500.0, 0.17), BIG, _bytes, hide="delayed")[0] == 1.0


def test_a_memory_budget_asks_for_the_smallest_fraction_that_fits():
    # at fraction 1 the peak is 20 GiB; each tensor kept on the device adds 12e7 bytes
    probe = ProbeResult(120.0, 0.17, peak_bytes=20 * GiB)
    roomy, why = choose_fraction(probe, BIG, _bytes, hide="streamed", budget_bytes=80 * GiB)
    assert roomy == 0.47 and "predicted peak" in why and "not hidden" not in why  # hidden, and it fits
    tight, why = choose_fraction(probe, BIG, _bytes, hide="streamed", budget_bytes=24 * GiB)
    kept = int((24 * GiB - 20 * GiB) // 12e7)  # tensors that fit on the device
    assert tight == round(1 - kept / 100, 2) and tight > 0.47
    assert "the smallest that fits (the CPU update is not hidden)" in why
    hopeless, why = choose_fraction(probe, BIG, _bytes, hide="streamed", budget_bytes=19 * GiB)
    assert hopeless == 1.0 and "even fraction 1 needs 20.00 GiB" in why


def test_whole_tensors_decide_where_a_fraction_falls():
    # one big tensor last: any fraction above 0 offloads it all, which the CPU cannot hide
    params = _params([1000, 1000, 1_000_000])
    assert choose_fraction(ProbeResult(0.5, 1.0), params, _bytes, hide="delayed")[0] == 0.0
    assert choose_fraction(ProbeResult(2.0, 1.0), params, _bytes, hide="delayed")[0] == 1.0


def test_bad_choices_are_refused():
    with pytest.raises(ValueError, match=r"hide must be one of \('exact', 'streamed', 'delayed'\)"):
        choose_fraction(ProbeResult(1.0, 1.0), BIG, _bytes, hide="overlapped")
    with pytest.raises(ValueError, match="gpu_memory_budget_gb needs the accelerator's peak memory"):
        choose_fraction(ProbeResult(1.0, 1.0), BIG, _bytes, hide="exact", budget_bytes=GiB)


def test_the_probe_skips_then_measures_and_measures_a_step_that_did_not_run_again():
    probe = FractionProbe(skip=2, steps=2)
    times = {"cpu_step": 2.0, "cpu_step_background": 1.0}
    for _ in range(2):
        assert not probe.measuring
        probe.add(50.0, times, 1000)
    assert probe.measuring and not probe.compute_ms
    probe.add(None, None, 1000)  # an fp16-skipped step
    assert probe.measuring and not probe.compute_ms
    probe.add(40.0, times, 1000)
    probe.add(60.0, {"cpu_step": 4.0}, 1000)
    assert probe.done and not probe.measuring
    result = probe.result(peak_bytes=5)
    assert result.compute_ms == 50.0 and result.cpu_ns_per_element == 3500.0 and result.peak_bytes == 5


# ---------------------------------------------------------------------- with_fraction
def _net(dtype=torch.float32):
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [nn.Linear(24, 24), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(24, 1)).to(dtype)


def _run(fractions, dtype=torch.float32, steps=10, switch_at=4, **kw):
    """Train with ``fractions[0]``, switching to ``fractions[1]`` before step ``switch_at``."""
    model = _net(dtype)
    names = {p: n for n, p in model.named_parameters()}
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01), names,
                           offload_fraction=fractions[0], bucket_size_mb=0.002, copy_on_cpu=True, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, 3, 0.5)
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        if t == switch_at and len(fractions) > 1:
            opt = opt.with_fraction(fractions[1])
        opt.zero_grad()
        model(torch.randn(16, 24, generator=g).to(dtype)).float().square().mean().backward()
        opt.step()
        opt.optimizer._opt_called = True
        sched.step()
    states = [{k: v.clone() for k, v in opt.state_of(p).items()} for p in model.parameters()]
    masters = [opt.layout.slot_of[p].master.clone() for p in model.parameters()]
    opt.close()
    return model, states, masters, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fractions,kw,like", [
    ((1.0, 0.3), {}, 1.0),
    ((0.0, 1.0), {}, 0.0),
    # during a delayed update's warm-up (as the probe is, by default): from then on like the new fraction
    ((1.0, 0.3), dict(delayed_update=True, delayed_update_warmup=6), 0.3),
    ((0.0, 1.0), dict(delayed_update=True, delayed_update_warmup=6), 1.0),
    # a delayed update pending at the switch moves over (only the offloaded share is delayed: same fraction)
    ((0.5, 0.5), dict(delayed_update=True, delayed_update_warmup=2), 0.5),
], ids=["exact-1-to-0.3", "exact-0-to-1", "warm-up-1-to-0.3", "warm-up-0-to-1", "pending"])
def test_switching_the_fraction_between_steps_changes_nothing(compiled, fractions, kw, like, dtype):
    """The exact step computes the same at every fraction, so a switched run ends where
    one at either fraction ends; with a delayed update, where the run at the fraction
    that was delayed ends."""
    switched, s_states, s_masters, opt = _run(fractions, dtype, **kw)
    assert opt.offload_fraction == fractions[1]
    straight, t_states, t_masters, _ = _run((like,), dtype, **kw)
    for a, b in zip(list(switched.parameters()) + s_masters, list(straight.parameters()) + t_masters):
        assert torch.equal(a, b)
    for sa, sb in zip(s_states, t_states):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------- under the Trainer
def _fit(strategy, **kw):
    from tests.test_streamed_step import _fit as fit

    return fit(strategy, **kw)


@pytest.mark.parametrize("forced", [None, 0.1])  # 0.1: the last layer (17 of 161 elements)
def test_the_strategy_probes_chooses_says_why_and_ends_where_trainer_ends(caplog, monkeypatch, forced):
    """``forced``: the choice made for the test (the CPU's timings decide otherwise), so
    the rebuilt optimizer has some parameters on each side."""
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    if forced is not None:
        monkeypatch.setattr(auto_fraction, "choose_fraction", lambda *a, **k: (forced, "forced for the test"))
    strategy = FastOptStrategy(offload_fraction="auto", bucket_size_mb=0.0002, copy_on_cpu=True)
    with caplog.at_level(logging.INFO):
        ours = _fit(strategy)
    assert "offload_fraction='auto': the first 5 steps run with everything offloaded" in caplog.text
    assert "offload_fraction='auto' chose " in caplog.text
    opt = ours.trainer.strategy.engines[0]
    assert isinstance(opt, OffloadOptimizer)
    # what Lightning hands the hooks shows the rebuilt engine's groups (LightningOptimizer copies them when made)
    assert ours.optimizers().param_groups is ours.trainer.optimizers[0].param_groups is opt.param_groups
    if forced is not None:
        assert "chose 0.1: forced for the test" in caplog.text and opt.offload_fraction == 0.1
        assert 0 < opt.offloaded_numel < sum(p.numel() for p in ours.parameters())
    else:
        assert "the CPU update took" in caplog.text and "0 is the largest fraction it hides" in caplog.text
    ref = _fit("auto")
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw,match", [
    (dict(offload_fraction="half"), "offload_fraction must be a number in \\[0.0, 1.0\\] or 'auto', got 'half'"),
    (dict(offload_fraction=1.5), "offload_fraction must be in \\[0.0, 1.0\\]"),
    (dict(offload_fraction="auto", zero_stage=1), "offload_fraction='auto' runs with zero_stage=0 only"),
    (dict(offload_fraction=0.5, gpu_memory_budget_gb=20), "gpu_memory_budget_gb is for offload_fraction='auto'"),
    (dict(offload_fraction="auto", gpu_memory_budget_gb=-1), "gpu_memory_budget_gb must be a positive number"),
])
def test_bad_arguments_are_refused_by_name(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FastOptStrategy(**kw)


@pytest.mark.skipif(ACCELERATOR != "cpu", reason="a budget is refused on a run without CUDA")
def test_a_memory_budget_without_cuda_is_refused_at_setup():
    strategy = FastOptStrategy(offload_fraction="auto", gpu_memory_budget_gb=8.0, copy_on_cpu=True)
    with pytest.raises(ValueError, match="gpu_memory_budget_gb needs a CUDA device to measure memory on"):
        _fit(strategy)


def test_manual_optimization_is_refused_at_setup():
    from tests.test_strategy import Model

    class Manual(Model):
        def __init__(self):
            super().__init__(lambda g: FusedSGD(g, lr=0.1), sched=False)
            self.automatic_optimization = False

        def training_step(self, batch, _):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, _))
            opt.step()

    trainer = L.Trainer(strategy=FastOptStrategy(offload_fraction="auto"), accelerator=ACCELERATOR, devices=1,
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    from tests.test_precision import _data

    with pytest.raises(ValueError, match="offload_fraction='auto' measures the forward and backward"):
        trainer.fit(Manual(), _data())


def test_auto_with_the_delayed_update_says_how_to_reproduce_the_run(caplog, monkeypatch):
    """With ``delayed_update`` the fraction ``auto`` picks is part of the math (only the
    offloaded share is delayed), and timings differ between machines: the line that says
    the choice gives the pinned argument, and a run pinned to it ends where the ``auto``
    run ended (issue: sharp edges)."""
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    monkeypatch.setattr(auto_fraction, "choose_fraction", lambda *a, **k: (0.1, "forced for the test"))
    delayed = dict(delayed_update=True, delayed_update_warmup=6, bucket_size_mb=0.0002, copy_on_cpu=True)
    with caplog.at_level(logging.INFO):
        auto = _fit(FastOptStrategy(offload_fraction="auto", **delayed))
    assert ("With delayed_update the fraction is part of the math (only the offloaded share is delayed) and timings "
            "differ between machines: to reproduce this run, offload_fraction=0.1 runs at it without probing"
            ) in caplog.text
    pinned = _fit(FastOptStrategy(offload_fraction=0.1, **delayed))
    other = _fit(FastOptStrategy(offload_fraction=1.0, **delayed))
    assert all(torch.equal(a, b) for a, b in zip(auto.parameters(), pinned.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(auto.parameters(), other.parameters()))
