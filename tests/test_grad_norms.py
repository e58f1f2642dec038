"""The clipping norm of the offload optimizer (``gradient_norm``) is the one torch's
``clip_grad_norm_`` takes of the model's gradients: each per-tensor norm with
``_foreach_norm`` where torch takes it, on the device, before the gradient leaves for the
host (a CUDA reduction sums in another order than a CPU one: norms of the host copies
differed from ``Trainer()``'s by an ulp on an H100), every listing of a parameter counted,
the norms of the norms on the device.

On the accelerator code path (``copy_on_cpu=True``) the "device" gradients are CPU tensors
apart from their host copies: the tests check which tensors the norms were taken of."""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fastopt import FastOptPrecision, FastOptStrategy, FusedSGD
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.optim.from_torch import to_fused_optimizer
from tests.helpers import assert_modules_equal
from tests.test_precision import _data
from tests.test_strategy import Model


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 1))


def _backward(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 16, generator=g)).square().mean().backward()


class NormedTensors:
    """Every tensor ``torch._foreach_norm`` is called with, by storage address."""

    def __init__(self, monkeypatch):
        self.addresses: list[int] = []
        real = torch._foreach_norm

        def recording(tensors, *args, **kwargs):
            self.addresses += [t.data_ptr() for t in tensors]
            return real(tensors, *args, **kwargs)

        monkeypatch.setattr(torch, "_foreach_norm", recording)


@pytest.mark.parametrize("device_grads", ["copy_in_backward", "copy_at_step", "keep"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_offloaded_gradients_are_normed_on_the_device_before_they_leave(monkeypatch, fraction, device_grads):
    ours, ref = _model(), _model()
    device_grads_seen = {}
    for p in ours.parameters():  # the device gradient's storage as backward leaves it (this hook runs first)
        p.register_post_accumulate_grad_hook(lambda p: device_grads_seen.__setitem__(p, p.grad.data_ptr()))
    opt = OffloadOptimizer(FusedSGD(ours.parameters(), lr=0.1), {p: n for n, p in ours.named_parameters()},
                           offload_fraction=fraction, bucket_size_mb=0.001, copy_on_cpu=True,
                           device_grads=device_grads)
    _backward(ref)
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    normed = NormedTensors(monkeypatch)
    _backward(ours)
    assert torch.equal(opt.gradient_norm(), expected)
    host_buffers = {s.host_grad.data_ptr() for s in opt.layout.slots if s.host_grad is not None}
    assert host_buffers and not host_buffers & set(normed.addresses)
    assert set(device_grads_seen.values()) <= set(normed.addresses)
    opt.close()


def test_a_parameter_listed_twice_counts_twice_and_a_second_backward_is_normed_where_it_was_summed(monkeypatch):
    """As ``clip_grad_norm_`` over Lightning's ``main_params`` (every listing, in order); a
    second backward before the step adds to the host copy: that sum exists on the host only."""
    ours, ref = _model(), _model()
    listing = lambda m: list(m.parameters()) + [m[0].weight]  # noqa: E731
    opt = OffloadOptimizer(FusedSGD(listing(ours), lr=0.1), {p: n for n, p in ours.named_parameters()},
                           offload_fraction=1.0, bucket_size_mb=0.001, copy_on_cpu=True)
    for seed in (1, 2):
        _backward(ours, seed)
        _backward(ref, seed)
    expected = torch.nn.utils.get_total_norm([p.grad for p in listing(ref)])
    normed = NormedTensors(monkeypatch)
    assert torch.equal(opt.gradient_norm(), expected)
    # after the second backward every offloaded gradient is a host sum: normed there, at the step
    assert set(normed.addresses) == {s.host_grad.data_ptr() for s in opt.layout.slots}
    opt.close()


def test_loss_scaled_float16_gradients_are_normed_in_float32_and_unscaled():
    """Scaled by 2**10, these float16 gradients (each finite) have a norm (about 115
    unscaled) past float16's range: taken in float32 and unscaled, it is torch's norm of the
    unscaled gradients (before: inf, and clipping zeroed every gradient)."""
    ours, ref = _model().half(), _model().half()
    opt = OffloadOptimizer(FusedSGD(ours.parameters(), lr=0.1), {p: n for n, p in ours.named_parameters()},
                           offload_fraction=0.5, bucket_size_mb=0.001, copy_on_cpu=True)
    g = torch.Generator().manual_seed(3)
    for a, b in zip(ours.parameters(), ref.parameters()):
        b.grad = (torch.randn(b.shape, generator=g) * 4).half()
        a.grad = b.grad * 2.0 ** 10
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters()) and torch.isfinite(expected)
    assert torch.equal(opt.gradient_norm(2.0 ** 10), expected)
    opt.close()


@pytest.mark.parametrize("device_grads", ["copy_in_backward", "copy_at_step", "keep"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_norm_asked_for_after_the_gradients_were_written_is_of_the_gradients_as_written(fraction, device_grads):
    """Clipped, then the norm asked for again (a second clipping in one step), or clamped
    in place first: torch's norm of the gradients as they are then (before: the first
    norm, taken on the device before the gradients were written, came back)."""
    ours, ref = _model(), _model()
    opt = OffloadOptimizer(FusedSGD(ours.parameters(), lr=0.1), {p: n for n, p in ours.named_parameters()},
                           offload_fraction=fraction, bucket_size_mb=0.001, copy_on_cpu=True,
                           device_grads=device_grads)
    _backward(ours)
    _backward(ref)
    grads = [p.grad for p in ref.parameters()]
    assert torch.equal(opt.gradient_norm(), torch.nn.utils.get_total_norm(grads))
    coef = torch.tensor(0.25)
    opt.scale_gradients(coef)
    torch._foreach_mul_(grads, coef)
    assert torch.equal(opt.gradient_norm(), torch.nn.utils.get_total_norm(grads))
    for g in opt.gradients():
        g.clamp_(-0.01, 0.01)
    for g in grads:
        g.clamp_(-0.01, 0.01)
    assert torch.equal(opt.gradient_norm(), torch.nn.utils.get_total_norm(grads))
    opt.close()


class _ClipsTwice(Model):
    """Its own clipping: by value, then by norm twice (each norm of the gradients as the
    last clipping left them)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.2, gradient_clip_algorithm="value")
        self.clip_gradients(optimizer, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")


@pytest.mark.parametrize("kw", [dict(offload_fraction=0.5), dict(offload_fraction=0.5, copy_on_cpu=True),
                                dict(offload_fraction=1.0, copy_on_cpu=True, stream_cpu_step=True)],
                         ids=["cpu", "accelerator-path", "accelerator-path-speculated"])
def test_under_the_trainer_clipping_twice_in_a_step_ends_where_trainer_ends(kw):
    def fit(strategy):
        model = _ClipsTwice(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, _data())
        return model

    ours = fit(FastOptStrategy(bucket_size_mb=0.0002, **kw))
    assert_modules_equal(ours, fit("auto"))


@pytest.mark.cuda
@pytest.mark.parametrize("stream", [False, True], ids=["at-the-step", "speculated"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_on_gpu_the_clipping_norm_is_torchs(fraction, stream):
    """The norm torch's clipping takes of the same gradients on the GPU, bit for bit, and
    the training clipped by it ends where torch's does (SGD: no scale invariance to hide
    a coefficient an ulp off)."""
    ours, ref = _model().cuda(), _model().cuda()
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    opt = OffloadOptimizer(to_fused_optimizer(make(ours)), {p: n for n, p in ours.named_parameters()},
                           offload_fraction=fraction, bucket_size_mb=0.001, stream_cpu_step=stream, speculate=stream)
    ref_opt, clipping = make(ref), FastOptPrecision("32-true")
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(6):
        x = torch.randn(64, 16, device="cuda", generator=g) * 30  # clipped at 0.5: every step
        for model, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).square().mean().backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert torch.equal(clipping.clip_scaled_gradients(opt, 0.5), expected)
        opt.step()
        ref_opt.step()
    torch.cuda.synchronize()
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    opt.close()
