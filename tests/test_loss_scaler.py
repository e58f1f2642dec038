"""The dynamic loss scaler's rule, its state, its errors, and the skip-and-recover loop
with a fused optimizer (injected inf/NaN gradients change nothing)."""

import io
import math
import warnings

import pytest
import torch

from lightning_fastopt import FusedAdam
from lightning_fastopt.core.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError


def test_starts_at_two_to_the_initial_power():
    assert DynamicLossScaler().scale == 2.0 ** 16
    assert DynamicLossScaler(initial_scale_power=5).scale == 32.0


def test_hysteresis_then_halving_then_floor():
    s = DynamicLossScaler(initial_scale_power=4, hysteresis=3, min_loss_scale=2.0, loss_scale_window=100,
                          at_min_loss_scale="skip")
    seen = []
    for _ in range(6):
        s.update(overflow=True)
        seen.append((s.scale, s.hysteresis_left))
    # two overflows use up the hysteresis, then every overflow halves, never below 2
    assert seen == [(16, 2), (16, 1), (8, 1), (4, 1), (2, 1), (2, 1)]
    assert s.skipped_steps == 6


def test_growth_after_exactly_window_clean_steps_refills_hysteresis():
    s = DynamicLossScaler(initial_scale_power=3, hysteresis=2, loss_scale_window=4)
    s.update(True)
    s.update(True)  # hysteresis 2 -> 1, then halve: 8 -> 4
    assert (s.scale, s.hysteresis_left) == (4, 1)
    for _ in range(3):
        s.update(False)
        assert s.scale == 4
    s.update(False)
    assert (s.scale, s.hysteresis_left, s.clean_steps) == (8, 2, 0)
    for _ in range(4):
        s.update(False)
    assert s.scale == 16
    s.update(False)
    s.update(True)  # an overflow restarts the clean count
    assert s.clean_steps == 0 and s.scale == 16 and s.hysteresis_left == 1


def test_static_scale_never_moves_but_counts_skips():
    s = DynamicLossScaler(loss_scale=128.0, loss_scale_window=1)
    for overflow in (True, False, False, True):
        s.update(overflow)
    assert s.scale == 128.0 and not s.dynamic and s.skipped_steps == 2


def test_a_static_scale_overflowing_step_after_step_is_not_skipped_forever_in_silence():
    """A static scale cannot go lower: an overflow (a spike) is skipped, and the
    `hysteresis`-th in a row gets the at_min_loss_scale policy, as when a dynamic scale
    at its minimum would have halved."""
    s = DynamicLossScaler(loss_scale=128.0, hysteresis=2)
    for overflow in (True, False, True, False, True, False, True):  # never two in a row
        s.update(overflow)
    assert s.skipped_steps == 4 and s.overflows_at_min == 0
    with pytest.raises(LossScaleAtMinimumError, match=r"with the loss scale static \(loss_scale=128, which never goes "
                                                      r"lower\), 1 time\(s\) in a row \(5 steps skipped in all\)"):
        s.update(True)
    quiet = DynamicLossScaler(loss_scale=128.0, hysteresis=1, at_min_loss_scale="skip")
    for _ in range(3):
        quiet.update(True)
    assert quiet.scale == 128.0 and quiet.skipped_steps == 3


def test_state_round_trip_through_weights_only_load():
    s = DynamicLossScaler(initial_scale_power=10, loss_scale_window=5)
    for overflow in (True, False, False, True, True, False):
        s.update(overflow)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    t = DynamicLossScaler(initial_scale_power=10, loss_scale_window=5)
    t.load_state_dict(torch.load(buf, weights_only=True))
    assert t.state_dict() == s.state_dict()
    for overflow in (False,) * 5 + (True,):
        s.update(overflow)
        t.update(overflow)
    assert t.state_dict() == s.state_dict()


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_scale=-1.0), "loss_scale must be 0"),
    (dict(loss_scale=math.inf), "loss_scale must be 0"),
    (dict(initial_scale_power=-1), "initial_scale_power must be an integer >= 0"),
    (dict(initial_scale_power=2.5), "initial_scale_power must be an integer"),
    (dict(initial_scale_power=200), r"initial_scale_power must be in \[0, 126\]"),
    (dict(loss_scale_window=0), "loss_scale_window must be an integer >= 1"),
    (dict(hysteresis=0), "hysteresis must be an integer >= 1"),
    (dict(min_loss_scale=0.0), "min_loss_scale must be a positive finite number"),
    (dict(initial_scale_power=0, min_loss_scale=4.0), "below min_loss_scale"),
])
def test_bad_knobs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)


def test_bad_state_raises():
    with pytest.raises(ValueError, match="missing"):
        DynamicLossScaler().load_state_dict({"scale": 2.0})


def test_overflowing_steps_change_nothing_and_training_recovers(backend):
    """fp16-style loop: scaled grads, kernel-side unscale, injected inf/NaN on some steps."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64))
    target = torch.randn(64)
    opt = FusedAdam([w], lr=0.05)
    scaler = DynamicLossScaler(initial_scale_power=8, loss_scale_window=3, hysteresis=2)
    losses = []
    for step in range(40):
        loss = ((w - target) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        (loss * scaler.scale).backward()
        if step in (5, 6, 7, 20):
            w.grad[3] = math.inf if step != 6 else math.nan
        before_w = w.detach().clone()
        before_state = {k: v.clone() for k, v in opt.state[w].items()}
        scale_before = scaler.scale
        opt.step(grad_scale=scaler.scale, check_finite=True)
        scaler.update(opt.last_step_skipped)
        if step in (5, 6, 7, 20):
            assert opt.last_step_skipped
            assert torch.equal(w.detach(), before_w)
            for k, v in before_state.items():
                assert torch.equal(opt.state[w][k], v)
        else:
            assert not opt.last_step_skipped
        if step == 6:  # second overflow in a row: hysteresis exhausted, the scale halves
            assert scaler.scale == scale_before / 2
    assert scaler.skipped_steps == opt.skipped_steps == 4
    assert losses[-1] < 0.2 * losses[0]


def test_overflowing_at_the_minimum_scale_raises_by_default_naming_the_counts():
    s = DynamicLossScaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1.0)
    s.update(True)  # 2 -> 1
    assert s.scale == 1.0
    with pytest.raises(LossScaleAtMinimumError, match=r"already at min_loss_scale=1, 1 time\(s\) in a row \(2 steps "
                                                      r"skipped in all\).*at_min_loss_scale='warn' or 'skip'"):
        s.update(True)


def test_warn_at_the_minimum_is_loud_but_not_a_flood_and_a_clean_step_resets_the_count():
    s = DynamicLossScaler(initial_scale_power=0, hysteresis=1, min_loss_scale=1.0, at_min_loss_scale="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(9):
            s.update(True)
    said = [str(w.message) for w in caught]
    assert [m.split(", ")[1].split(" ")[0] for m in said] == ["1", "2", "4", "8"]  # the 1st, 2nd, 4th, 8th
    s.update(False)
    assert s.overflows_at_min == 0 and s.skipped_steps == 9
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.update(True)
    assert len(caught) == 1 and "1 time(s) in a row" in str(caught[0].message)


def test_skip_at_the_minimum_is_quiet_and_a_bad_choice_is_refused():
    s = DynamicLossScaler(initial_scale_power=0, min_loss_scale=1.0, at_min_loss_scale="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            s.update(True)
    assert s.skipped_steps == 5
    with pytest.raises(ValueError, match=r"at_min_loss_scale must be one of \('raise', 'warn', 'skip'\), got 'stop'"):
        DynamicLossScaler(at_min_loss_scale="stop")
