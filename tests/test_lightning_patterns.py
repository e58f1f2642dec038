"""Everyday Lightning patterns under the fastopt strategies end where they end under
``Trainer()`` (one device): frozen and later unfrozen backbones, ``BackboneFinetuning``,
gradient norms logged and gradients edited in hooks, manual optimization with
accumulation and clipping, a GAN with and without ``toggle_optimizer``, tied weights,
weights written through ``.data`` by a callback.

Each runs on the CPU through the accelerator code path (``copy_on_cpu=True``: host
masters, gradient and weight copies, backward hooks) and through the plain CPU path.
SGD and AdamW bit for bit (torch.equal)."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, Callback
from lightning.pytorch.utilities import grad_norm
from torch import nn

import lightning_fastopt  # noqa: F401  (registers the strategy names)
from lightning_fastopt import FastOptStrategy
from tests.helpers import ACCELERATOR, assert_modules_equal, said_lines
from tests.test_precision import _data


STRATEGIES = {
    "fastopt": lambda: "fastopt",
    "offload-cpu-path": lambda: "fastopt_offload",
    "offload-accelerator-path": lambda: FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True),
    "half-offloaded-accelerator-path": lambda: FastOptStrategy(offload_fraction=0.5, bucket_size_mb=0.0002,
                                                               copy_on_cpu=True),
}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


class Net(L.LightningModule):
    """A backbone and a head; ``make_opt`` builds the optimizer over ``opt_params()``."""

    def __init__(self, make_opt=_sgd):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.make_opt = make_opt

    def loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def training_step(self, batch, _):
        return self.loss(batch)

    def opt_params(self):
        return self.parameters()

    def configure_optimizers(self):
        return self.make_opt(self.opt_params())


def _fit(strategy, model, epochs=3, **kw):
    args = dict(accelerator=ACCELERATOR, devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)
    args.update(kw)
    if strategy is not None:
        args["strategy"] = strategy
    trainer = L.Trainer(**args)
    trainer.fit(model, _data())
    return trainer


def _compare(make_model, strategy, callbacks=lambda: []):
    """Fit a model under the strategy and another under Trainer() (fresh callbacks each)."""
    ours, ref = make_model(), make_model()
    trainer = _fit(STRATEGIES[strategy](), ours, callbacks=callbacks())
    _fit(None, ref, callbacks=callbacks())
    assert_modules_equal(ours, ref)
    return trainer, ours, ref


# ---------------------------------------------------------------------------- frozen parameters
class FrozenBackbone(Net):
    """Fine-tuning: the frozen backbone's parameters are given to the optimizer anyway."""

    def __init__(self, make_opt=_sgd, unfreeze_at=None):
        super().__init__(make_opt)
        self.backbone.requires_grad_(False)
        self.unfreeze_at = unfreeze_at

    def on_train_epoch_start(self):
        if self.current_epoch == self.unfreeze_at:
            self.backbone.requires_grad_(True)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("unfreeze_at", [None, 1], ids=["frozen", "unfrozen-at-epoch-1"])
def test_frozen_parameters_given_to_the_optimizer(strategy, unfreeze_at):
    before = FrozenBackbone().backbone[0].weight.detach().clone()
    _, ours, _ = _compare(lambda: FrozenBackbone(unfreeze_at=unfreeze_at), strategy)
    moved = not torch.equal(ours.backbone[0].weight, before)
    assert moved == (unfreeze_at is not None)


class Finetuned(Net):
    def opt_params(self):
        return [p for p in self.parameters() if p.requires_grad]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("make_opt", [_sgd, _adamw], ids=["sgd", "adamw"])
def test_backbone_finetuning_adds_a_group_mid_training(strategy, make_opt):
    """``BackboneFinetuning`` freezes the backbone, then at epoch 1 unfreezes it and calls
    ``add_param_group`` on the optimizer the strategy runs."""
    trainer, _, _ = _compare(lambda: Finetuned(make_opt), strategy,
                             callbacks=lambda: [BackboneFinetuning(unfreeze_backbone_at_epoch=1,
                                                                   lambda_func=lambda _: 1.0)])
    opt = trainer.strategy.engines[0]
    assert len(opt.param_groups) == 2
    assert all(opt.owns(p) for p in trainer.lightning_module.backbone.parameters())


# ---------------------------------------------------------------------------- gradients in hooks
class GradientHooks(Net):
    """Logs Lightning's ``grad_norm`` and halves the gradients before every step."""

    def __init__(self):
        super().__init__()
        self.norms = []

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(grad_norm(self, norm_type=2))
        for p in self.parameters():
            p.grad.mul_(0.5)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_gradients_are_visible_and_editable_before_the_step(strategy):
    trainer, ours, ref = _compare(GradientHooks, strategy)
    assert len(ours.norms) == len(ref.norms) == 24
    for a, b in zip(ours.norms, ref.norms):
        assert a.keys() == b.keys() and len(a) == 7  # 6 parameters and the total
        for k in a:
            assert torch.equal(a[k], b[k]), k


class CallbackClipsGradients(Callback):
    def on_after_backward(self, trainer, pl_module):
        for p in pl_module.parameters():
            p.grad.clamp_(-0.01, 0.01)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_callback_edits_gradients_after_backward(strategy):
    _compare(Net, strategy, callbacks=lambda: [CallbackClipsGradients()])


def test_the_log_line_says_where_gradients_live(caplog, monkeypatch):
    import logging

    # Lightning stops its logger propagating to the root (where caplog listens) when the root had no
    # handler at import time, which depends on what imported lightning first.
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    with caplog.at_level(logging.INFO):
        _fit(FastOptStrategy(copy_on_cpu=True), GradientHooks(), epochs=1)
    assert "gradients stay in p.grad until the optimizer step, as in torch: GradientHooks.on_before_optimizer_step " \
           "can read them" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer = _fit(FastOptStrategy(copy_on_cpu=True), Net(), epochs=1)
    assert "copied to the host and freed on the device during backward (no hook or callback reads p.grad; " \
           "FastOptStrategy(keep_gradients=True) keeps them for code that reads them elsewhere)" in caplog.text
    assert trainer.strategy.engines[0].device_grads == "copy_in_backward"


@pytest.mark.parametrize("name", ["fastopt_zero1", "fastopt_zero2"])
def test_zero_with_one_process_and_nothing_offloaded_says_nothing_is_copied_to_the_host(monkeypatch, name):
    """One process, ZeRO, nothing offloaded: the log said ZeRO had nothing to shard and also
    that gradients of offloaded parameters were copied to the host."""
    import lightning_fastopt.plan.run_plan as run_plan
    import lightning_fastopt.trainer.strategy as trainer_strategy
    import lightning_fastopt.zero.optimizer as zero_optimizer

    said = said_lines(monkeypatch, trainer_strategy, run_plan, zero_optimizer)
    _fit(name, Net(), epochs=1)
    assert len([line for line in said if "has nothing to shard with one process" in line]) == 1, said
    assert not [line for line in said if "copied to the host" in line], said
    said.clear()
    _fit("fastopt_zero2_offload", Net(), epochs=1)  # offloaded: it is said
    assert len([line for line in said if "copied to the host and freed on the device" in line]) == 1, said


class ReadsGradientsAfterTheStep(Net):
    """Reads p.grad in on_train_batch_end, after the step: no hook the detection sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, *args):
        self.seen.append([None if p.grad is None else p.grad.clone() for p in self.parameters()])


@pytest.mark.parametrize("fraction,copy_on_cpu", [(1.0, False), (1.0, True), (0.5, True)],
                         ids=["offload-cpu-path", "offload-accelerator-path", "half-offloaded-accelerator-path"])
def test_keep_gradients_keeps_them_for_code_the_detection_cannot_see(fraction, copy_on_cpu):
    ours, ref = ReadsGradientsAfterTheStep(), ReadsGradientsAfterTheStep()
    trainer = _fit(FastOptStrategy(offload_fraction=fraction, copy_on_cpu=copy_on_cpu, keep_gradients=True), ours)
    _fit(None, ref)
    assert trainer.strategy.engines[0].device_grads == "keep"
    assert_modules_equal(ours, ref)
    assert len(ours.seen) == len(ref.seen) == 24
    for a, b in zip(ours.seen, ref.seen):
        assert all(x is not None and torch.equal(x, y) for x, y in zip(a, b))


def test_keep_gradients_must_be_a_bool():
    with pytest.raises(TypeError, match="keep_gradients must be True or False, got 'yes'"):
        FastOptStrategy(keep_gradients="yes")


# ---------------------------------------------------------------------------- manual optimization
class ManualAccumulation(Net):
    """Two backward passes per step, clipping by norm, zero_grad after the step."""

    def __init__(self, make_opt=_sgd):
        super().__init__(make_opt)
        self.automatic_optimization = False

    def training_step(self, batch, _):
        opt = self.optimizers()
        x, y = batch
        n = len(x) // 2
        for half in (slice(0, n), slice(n, None)):
            self.manual_backward(self.loss((x[half], y[half])) / 2)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("make_opt", [_sgd, _adamw], ids=["sgd", "adamw"])
def test_manual_accumulation_and_clipping(strategy, make_opt):
    """Clipping by norm takes torch's get_total_norm: the same bits as Lightning's."""
    _compare(lambda: ManualAccumulation(make_opt), strategy)


class Gan(L.LightningModule):
    """A generator and a discriminator, two optimizers, manual optimization; the
    discriminator's gradients are zeroed after its step (as the Lightning GAN example)."""

    def __init__(self, toggle: bool):
        super().__init__()
        torch.manual_seed(0)
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.toggle = toggle
        self.automatic_optimization = False

    def training_step(self, batch, _):
        x, _ = batch
        g_opt, d_opt = self.optimizers()
        z = torch.tanh(2 * x[:, :4] + 1)  # per sample: the same noise however the batch is split over ranks
        bce = nn.functional.binary_cross_entropy_with_logits
        if self.toggle:
            self.toggle_optimizer(g_opt)
        fake = self.gen(z)
        g_loss = bce(self.disc(fake), x.new_ones(x.shape[0], 1))
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        if self.toggle:
            self.untoggle_optimizer(g_opt)
            self.toggle_optimizer(d_opt)
        d_loss = bce(self.disc(x), x.new_ones(x.shape[0], 1)) + bce(self.disc(fake.detach()), x.new_zeros(x.shape[0], 1))
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        if self.toggle:
            self.untoggle_optimizer(d_opt)

    def configure_optimizers(self):
        return _adamw(self.gen.parameters()), _sgd(self.disc.parameters())


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("toggle", [False, True], ids=["plain", "toggle_optimizer"])
def test_gan(strategy, toggle):
    """Without toggling, the generator's backward also leaves gradients on the
    discriminator, which its own step then adds to (torch accumulates them)."""
    _compare(lambda: Gan(toggle), strategy)


# ---------------------------------------------------------------------------- weights
class Tied(Net):
    def __init__(self, make_opt=_sgd):
        super().__init__(make_opt)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.backbone[4].weight = self.backbone[2].weight  # tied


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_tied_weights(strategy):
    _compare(Tied, strategy)


class TiedListedTwice(Tied):
    """The optimizer gets each layer's weight and bias, so the tied weight twice: torch
    warns, and its per-parameter loop (``foreach=False``, the CPU's default) updates it
    once per listing, which the fused optimizers follow.  torch's foreach loop (the
    GPU's default) does something else again, so the reference here asks for the
    per-parameter loop on every device."""

    def opt_params(self):
        return [t for m in self.modules() if isinstance(m, nn.Linear) for t in (m.weight, m.bias)]


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, foreach=False),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=False)], ids=["sgd", "adamw"])
def test_a_tied_weight_listed_twice(strategy, make_opt):
    _compare(lambda: TiedListedTwice(make_opt), strategy)


class ClampWeights(Callback):
    """WGAN's weight clipping, through ``.data`` (which does not bump the version counter)."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        for p in pl_module.parameters():
            p.data.clamp_(-0.2, 0.2)


class Ema(Callback):
    """Every 3 steps the weights are reset to an average of past weights, through ``.data``."""

    def __init__(self):
        self.avg = None

    def on_train_batch_end(self, trainer, pl_module, *args):
        params = list(pl_module.parameters())
        if self.avg is None:
            self.avg = [p.detach().clone() for p in params]
        for a, p in zip(self.avg, params):
            a.mul_(0.5).add_(p.detach(), alpha=0.5)
        if trainer.global_step % 3 == 0:
            for a, p in zip(self.avg, params):
                p.data.copy_(a)


class ClampBeforeStep(Callback):
    """Weight clipping between backward and the step: the step starts from the clipped
    weights (the offload optimizer then checks the weights when the step starts, not
    while the gradients leave during backward)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.parameters():
            p.data.clamp_(-0.2, 0.2)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("callback", [ClampWeights, Ema, ClampBeforeStep])
def test_weight_writes_outside_the_optimizer_are_kept(strategy, callback):
    _compare(Net, strategy, callbacks=lambda: [callback()])


class ManualClampBetweenBackwardAndStep(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, _):
        opt = self.optimizers()
        self.manual_backward(self.loss(batch))
        for p in self.parameters():
            p.data.clamp_(-0.2, 0.2)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_weight_writes_between_manual_backward_and_step_are_kept(strategy):
    _compare(ManualClampBetweenBackwardAndStep, strategy)


# ---------------------------------------------------------------------------- one device
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_one_device_keeps_the_users_sampler_and_starts_no_process_group(strategy):
    """A shuffling loader: the same batches as Trainer() (Lightning's ddp would replace the
    sampler with a DistributedSampler, shuffled with its own seed)."""
    import torch.distributed as dist

    def loader():
        data = _data().dataset
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                           generator=torch.Generator().manual_seed(3))

    ours, ref = Net(), Net()
    kw = dict(accelerator=ACCELERATOR, devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(strategy=STRATEGIES[strategy](), **kw)
    trainer.fit(ours, loader())
    assert isinstance(trainer.train_dataloader.sampler, torch.utils.data.RandomSampler)
    assert not dist.is_initialized()
    L.Trainer(**kw).fit(ref, loader())
    assert_modules_equal(ours, ref)


@pytest.mark.parametrize("kw", [dict(offload_fraction=0.5, bucket_size_mb=0.0002),
                                dict(offload_fraction=1.0, stream_cpu_step=True, bucket_size_mb=0.0002),
                                dict(offload_fraction=1.0, delayed_update=True, delayed_update_warmup=1)],
                         ids=["at-the-step", "speculated", "delayed"])
def test_an_untimed_run_reads_no_clock(kw):
    """Without ``wall_clock_breakdown`` the strategy reads no clock while it trains (the
    CPU updates are timed only for the breakdown): ``ThroughputMonitor`` and Lightning's
    tests mock ``time.perf_counter`` and count on every reading being theirs.  With
    clipping, so that the streamed step speculates."""
    from unittest import mock

    readings = []

    def clock():
        readings.append(1)
        return float(len(readings))

    def fit(strategy):
        readings.clear()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, gradient_clip_val=0.5,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        model = Net(_sgd)
        with mock.patch("time.perf_counter", side_effect=clock):
            trainer.fit(model, _data())
        return len(readings)

    assert fit(FastOptStrategy(copy_on_cpu=True, **kw)) == fit("auto")
