"""FastOptPrecision in real Lightning runs on the CPU: fp16 loss scaling with injected
inf/NaN gradients (skipped steps change nothing, the scale follows the rule, training
recovers), clipping on scaled gradients, equivalence with plain Lightning in fp32 (and in
fp16 with Lightning's own plugin, hooks before the step seeing the unscaled gradients),
the plugin state in checkpoints, and bad flags."""

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastopt.optim.takeover import engine_of
from lightning_fastopt import FastOptStrategy, FusedAdam
from lightning_fastopt import FastOptPrecision
from tests.helpers import ACCELERATOR, ADAM_AS_TORCH


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class Regressor(L.LightningModule):
    def __init__(self, make_opt=None, inject_at=(), grad_dtype_check=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.make_opt = make_opt or (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01))
        self.inject_at = set(inject_at)
        self.losses, self.events = [], []

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self):
        if self.global_step in self.inject_at:
            w = self.net[0].weight
            w.grad[0, 0] = math.inf if self.global_step % 2 else math.nan

    def _states(self):
        opt = engine_of(self.trainer.optimizers[0])
        if hasattr(opt, "state_of"):  # an offload optimizer keeps its state out of opt.state
            return {id(p): opt.state_of(p) for p in self.parameters()}
        return {id(p): s for p, s in opt.state.items()}

    def on_train_batch_start(self, batch, batch_idx):
        self._before = ([p.detach().clone() for p in self.parameters()],
                        {i: {k: v.clone() for k, v in s.items()} for i, s in self._states().items()})

    def on_train_batch_end(self, outputs, batch, batch_idx):
        plugin = self.trainer.precision_plugin
        step = self.global_step - 1
        params, states = self._before
        unchanged = all(torch.equal(a, b) for a, b in zip(params, self.parameters()))
        now = self._states()
        state_same = all(torch.equal(v, now[id(p)][k]) for p in self.parameters()
                         for k, v in states.get(id(p), {}).items())
        self.events.append((step, unchanged and state_same, getattr(plugin, "loss_scale", 1.0)))

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


def _trainer(plugin=None, **kw):
    args = dict(accelerator=ACCELERATOR, devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)
    args.update(kw)
    if plugin is not None:
        args["plugins"] = [plugin]
    return L.Trainer(**args)


@pytest.mark.parametrize("strategy", ["auto", "fastopt_offload", "half_offloaded"])
def test_fp16_overflow_skips_steps_and_follows_the_scale_rule(backend, strategy):
    """Injected inf/NaN gradients with Lightning's default strategy and with the offload
    optimizer (all, or half of the parameters offloaded)."""
    plugin = FastOptPrecision("16-mixed", initial_scale_power=10, loss_scale_window=4, hysteresis=2)
    model = Regressor(inject_at={3, 4, 5, 12})
    if strategy == "half_offloaded":
        strategy = FastOptStrategy(offload_fraction=0.5, bucket_size_mb=0.0001)
    trainer = _trainer(plugin, strategy=strategy)
    trainer.fit(model, _data())
    events = dict((s, (unchanged, scale)) for s, unchanged, scale in model.events)
    for step in (3, 4, 5, 12):
        assert events[step][0], f"step {step} overflowed but changed parameters or state"
    assert not events[2][0] and not events[6][0]
    # scale: 1024, x2 after 4 clean steps (0..3 has an overflow at 3: steps 0,1,2 clean),
    # overflow at 3 uses hysteresis, at 4 halves, at 5 halves again (hysteresis not refilled)
    assert events[2][1] == 1024 and events[3][1] == 1024 and events[4][1] == 512 and events[5][1] == 256
    assert events[9][1] == 512  # steps 6..9: four clean steps, the scale doubles
    assert plugin.skipped_steps == 4
    assert trainer.global_step == 24  # skipped steps still count, as in Lightning's AMP
    assert model.losses[-1] < 0.5 * model.losses[0]


def test_fp16_without_overflow_matches_an_unscaled_run(backend):
    """Loss scaling is invisible when nothing overflows: same weights as fp16 autocast
    without scaling (static scale 1), within fp32 rounding of the scaled backward."""
    scaled, unscaled = Regressor(), Regressor()
    _trainer(FastOptPrecision("16-mixed", initial_scale_power=12, loss_scale_window=1000)).fit(scaled, _data())
    _trainer(FastOptPrecision("16-mixed", loss_scale=1.0)).fit(unscaled, _data())
    for a, b in zip(scaled.parameters(), unscaled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("algorithm,clip", [("norm", 0.05), ("value", 0.01)])
def test_32_true_with_clipping_and_accumulation_matches_plain_lightning(backend, algorithm, clip):
    ours = Regressor(make_opt=lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01, **ADAM_AS_TORCH))
    reference = Regressor(make_opt=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01))
    kw = dict(gradient_clip_val=clip, gradient_clip_algorithm=algorithm, accumulate_grad_batches=2)
    _trainer(FastOptPrecision("32-true"), **kw).fit(ours, _data())
    _trainer(None, **kw).fit(reference, _data())
    for a, b in zip(ours.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_clipping_scaled_gradients_equals_clipping_unscaled_ones():
    for algorithm, clip in (("norm", 0.5), ("value", 0.1)):
        g = torch.randn(100) * 3
        p1, p2 = nn.Parameter(torch.zeros(100)), nn.Parameter(torch.zeros(100))
        plugin = FastOptPrecision("16-mixed", initial_scale_power=8)
        p1.grad = g * plugin.loss_scale
        plugin.clip_gradients(torch.optim.SGD([p1], lr=0.1), clip, algorithm)
        p2.grad = g.clone()
        FastOptPrecision("32-true").clip_gradients(torch.optim.SGD([p2], lr=0.1), clip, algorithm)
        assert torch.equal(p1.grad / plugin.loss_scale, p2.grad)
    ref = nn.Parameter(torch.zeros(100))
    ref.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([ref], 0.5)
    p4 = nn.Parameter(torch.zeros(100))
    p4.grad = g.clone()
    FastOptPrecision("32-true").clip_gradients(torch.optim.SGD([p4], lr=0.1), 0.5, "norm")
    assert torch.equal(p4.grad, ref.grad)


class _SeesGradients(Regressor):
    """Records the gradients ``on_before_optimizer_step`` sees (in the module or, with
    ``in_callback``, in a callback)."""

    def __init__(self, make_opt, in_callback=False):
        super().__init__(make_opt=make_opt)
        self.seen, self.in_callback = [], in_callback

    def record(self):
        self.seen.append([p.grad.detach().clone() for p in self.parameters()])

    def configure_callbacks(self):
        if not self.in_callback:
            return []
        model = self

        class Records(L.Callback):
            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                model.record()
        return [Records()]


class _SeesGradientsInTheModule(_SeesGradients):
    def on_before_optimizer_step(self, optimizer):
        self.record()


@pytest.mark.parametrize("where", ["module", "callback"])
@pytest.mark.parametrize("strategy", ["auto", "half_offloaded", "offloaded"])
def test_fp16_hooks_before_the_step_see_unscaled_gradients_as_under_lightnings_own_plugin(strategy, where):
    """Lightning's ``16-mixed`` plugin unscales the gradients before
    ``on_before_optimizer_step`` and clipping (``grad_norm`` logged there reads them):
    where such a hook is overridden ours unscales them in place there too (before
    2026-11-27 the hook saw them multiplied by the loss scale, 65536); the hook sees the
    same bits, and the run ends on the same weights, clipping included, as
    ``Trainer(plugins=[MixedPrecision("16-mixed", "cpu")])`` (Lightning turns the flag into
    bf16 on the CPU; the plugin given itself scales with torch's GradScaler).  Where a step
    overflows, both unscale before the hook too (the scales then differ: our rule is
    DeepSpeed's, with hysteresis)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    cls = _SeesGradientsInTheModule if where == "module" else _SeesGradients
    make = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01)  # noqa: E731
    ours, ref = cls(make, in_callback=where == "callback"), cls(make, in_callback=where == "callback")
    chosen = {"auto": "auto", "half_offloaded": FastOptStrategy(offload_fraction=0.5, copy_on_cpu=True,
                                                                bucket_size_mb=0.0002),
              "offloaded": FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True)}[strategy]
    # scales that never overflow here (where they do, the scale rules differ: documented)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    _trainer(FastOptPrecision("16-mixed", initial_scale_power=10), accelerator="cpu", strategy=chosen,
             gradient_clip_val=0.05).fit(ours, _data())
    _trainer(MixedPrecision("16-mixed", "cpu", scaler), accelerator="cpu", gradient_clip_val=0.05).fit(ref, _data())
    assert ours.trainer.precision_plugin.skipped_steps == 0 and scaler.get_scale() == 2.0 ** 10
    assert len(ours.seen) == len(ref.seen) == 24
    for a, b in zip(ours.seen, ref.seen):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))


def test_stock_torch_optimizer_gets_unscaled_gradients(backend):
    model = Regressor(make_opt=lambda p: torch.optim.SGD(p, lr=1e-2))
    plugin = FastOptPrecision("16-mixed", initial_scale_power=14)
    _trainer(plugin, max_epochs=2).fit(model, _data())
    assert model.losses[-1] < model.losses[0]
    assert all(p.isfinite().all() for p in model.parameters())


def test_scaler_state_is_saved_and_restored(backend, tmp_path):
    plugin = FastOptPrecision("16-mixed", initial_scale_power=10, loss_scale_window=3)
    model = Regressor(inject_at={2, 3})
    trainer = _trainer(plugin, max_epochs=1)
    trainer.fit(model, _data())
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["FastOptPrecision"] == plugin.state_dict()
    resumed = FastOptPrecision("16-mixed", initial_scale_power=10, loss_scale_window=3)
    _trainer(resumed, max_epochs=1).fit(Regressor(), _data(), ckpt_path=path)  # already at max_epochs
    assert resumed.loss_scale == plugin.loss_scale and resumed.skipped_steps == plugin.skipped_steps == 2


def test_bf16_mixed_trains(backend):
    model = Regressor()
    plugin = FastOptPrecision("bf16-mixed")
    _trainer(plugin).fit(model, _data())
    assert plugin.loss_scale == 1.0 and plugin.skipped_steps == 0
    assert model.losses[-1] < 0.5 * model.losses[0]


@pytest.mark.parametrize("kwargs,match", [
    (dict(precision="16"), r"supports precision in \('16-mixed', 'bf16-mixed', '32-true', 'bf16-true', "
                           r"'16-true', '64-true'\), got '16'"),
    (dict(initial_scale_power=-2), "initial_scale_power must be an integer >= 0"),
    (dict(hysteresis=0), "hysteresis must be an integer >= 1"),
    (dict(min_loss_scale=-1.0), "min_loss_scale must be a positive finite number"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FastOptPrecision(**kwargs)


class NanLoss(Regressor):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * math.nan


@pytest.mark.parametrize("strategy", ["auto", "fastopt_offload"])
def test_fp16_training_whose_every_step_overflows_stops_with_a_clear_error(strategy):
    """A NaN loss overflows at every scale: once the scale is at its minimum the run stops
    (at_min_loss_scale="raise", the default) instead of skipping every step in silence."""
    from lightning_fastopt.core.loss_scaler import LossScaleAtMinimumError

    model = NanLoss()
    trainer = _trainer(FastOptPrecision("16-mixed", initial_scale_power=2, hysteresis=1), strategy=strategy)
    with pytest.raises(LossScaleAtMinimumError, match=r"min_loss_scale=1, 1 time\(s\) in a row \(3 steps skipped"):
        trainer.fit(model, _data())
    assert trainer.global_step == 2  # scales 4 and 2 skipped, then 1 overflowed again
