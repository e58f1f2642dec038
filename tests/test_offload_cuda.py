"""The offload path on a GPU: side streams, events, pinned buffers and backward hooks.

Layers of very poor arithmetic density (a batch of 2 through wide Linear layers, so the
GPU finishes each kernel at once and any copy that is not properly ordered reads or
writes the wrong data), trained with offload_fraction 0, 0.5 and 1, each in its own
model, against a reference kept apart: the same weights after many steps.  Marked
`cuda`: skipped without a GPU, run on the GPU machine.
"""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fastopt import FastOptPrecision, FastOptStrategy, FusedAdam, OffloadOptimizer
from tests.helpers import assert_modules_equal

pytestmark = pytest.mark.cuda

# Training references run the same kernels unwrapped: a difference of a few ulps per step
# between our kernels and torch's AdamW (tested step by step with identical gradients in
# test_cuda_kernels) grows over 25 steps of this 6-layer model to 3e-6, the same at every
# offload fraction (seen on the H100 and reproduced on the CPU), which would hide what
# these tests look for: any difference the offload machinery makes.


def _model(width=1024, layers=6, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to("cuda", dtype)


def _train(model, opt, steps=25, accumulate=1):
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            if isinstance(opt, OffloadOptimizer):
                opt.accumulating = micro < accumulate - 1
            x = torch.randn(2, model[0].in_features, device="cuda", generator=g, dtype=model[0].weight.dtype)
            (model(x).float().square().mean() / accumulate).backward()
        if isinstance(opt, OffloadOptimizer):
            opt.accumulating = False
        opt.step()
    torch.cuda.synchronize()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_offloaded_training_matches_the_reference(fraction, overlap):
    """Bit for bit: the CPU kernels (offloaded share) and the CUDA kernels compute the same."""
    ref_model = _model()
    ref = FusedAdam(ref_model.parameters(), lr=1e-3, weight_decay=0.01)
    _train(ref_model, ref, accumulate=2)
    model = _model()
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01),
                           {p: n for n, p in model.named_parameters()}, offload_fraction=fraction,
                           bucket_size_mb=2, overlap=overlap)
    assert opt.offloaded_numel >= fraction * sum(p.numel() for p in model.parameters())
    for b in opt.layout.buckets:
        assert all(t.is_pinned() for t in b.buffers)
    _train(model, opt, accumulate=2)
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), f"{name}: {(a - b).abs().max().item()} away"
    opt.close()


def test_device_gradients_of_offloaded_parameters_are_freed():
    model = _model(layers=2)
    opt = OffloadOptimizer(FusedAdam(model.parameters()), offload_fraction=1.0)
    model(torch.randn(2, 1024, device="cuda")).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    grads = opt.gradients()
    assert len(grads) == 4 and all(g.device.type == "cpu" and g.is_pinned() for g in grads)
    opt.step()
    opt.close()


def test_bf16_weights_with_float32_masters_on_the_host():
    """Half-precision weights: the CPU writes the bf16 copy in the same pass as the update
    and it lands on the device; every weight is its float32 master rounded."""
    model = _model(layers=3, dtype=torch.bfloat16)
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-3), offload_fraction=0.5, bucket_size_mb=1)
    _train(model, opt, steps=10)
    for s in opt.layout.slots:
        assert s.separate_master and s.master.dtype == torch.float32
        assert s.master.device.type == ("cpu" if s.offloaded else "cuda")
        assert torch.equal(s.param, s.master.to("cuda", torch.bfloat16)), s.name
        assert opt.state_of(s.param)["exp_avg"].dtype == torch.float32
    opt.close()


def test_loading_weights_refreshes_the_host_masters():
    model = _model(layers=2)
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-3), offload_fraction=1.0)
    _train(model, opt, steps=2)
    fresh = _model(layers=2)
    model.load_state_dict(fresh.state_dict())  # in-place copies: the masters are now stale
    opt.zero_grad()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.state_dict()  # no effect on the masters
    for group in opt.param_groups:
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    opt.step()  # lr 0: the weights must come back as loaded, not as the stale masters
    torch.cuda.synchronize()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    opt.close()


class _GPUModel(L.LightningModule):
    def __init__(self, opt_cls=torch.optim.AdamW):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
        self.opt_cls = opt_cls

    def training_step(self, batch, _):
        (x,) = batch
        return self.net(x).float().square().mean()

    def configure_optimizers(self):
        opt = self.opt_cls(self.parameters(), lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 512, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_trainer_on_gpu_matches_plain_lightning(fraction):
    """bf16-mixed on the GPU, clipping, accumulation, a scheduler: fastopt_offload at each
    fraction ends where Trainer() stepping the same FusedAdam ends, bit for bit.  Under
    bf16 autocast one ulp of a float32 weight can flip its bfloat16 rounding, so the
    reference runs our kernels, and clips by value (by norm the sums of squares run in
    another order than torch's; that is compared in float32 on the CPU, test_strategy)."""
    kw = dict(accelerator="gpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, precision="bf16-mixed",
              accumulate_grad_batches=2, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    ours, ref = _GPUModel(FusedAdam), _GPUModel(FusedAdam)
    L.Trainer(strategy=FastOptStrategy(offload_fraction=fraction, bucket_size_mb=1), **kw).fit(ours, _loader())
    L.Trainer(**kw).fit(ref, _loader())
    assert_modules_equal(ours, ref)


def test_fp16_loss_scaling_on_gpu_with_offload():
    model = _GPUModel()
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, strategy="fastopt_offload",
                        plugins=[FastOptPrecision("16-mixed", initial_scale_power=30)])
    trainer.fit(model, _loader())
    # 2**30 overflows fp16 at once: the first steps are skipped and the scale comes down
    assert trainer.precision_plugin.skipped_steps >= 1
    assert trainer.precision_plugin.loss_scale < 2**30
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_device_share_runs_the_cuda_kernels(cuda_ext):
    model = _model(layers=4)
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-3), offload_fraction=0.5, bucket_size_mb=2)
    _train(model, opt, steps=3)
    assert cuda_ext.calls.get("adam_", 0) == 3  # one call per step for the GPU share
    opt.close()


def test_gradient_copies_start_while_backward_runs():
    """From a profiler trace: the first device-to-host gradient copy starts before the last
    backward kernel ends, i.e. copies are issued from the hooks on a side stream while
    backward computes, not after it.  (How much of the copy time is hidden is measured by
    benchmarks/gpt_offload.py, not asserted here.)"""
    model = _model(width=4096, layers=6)
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-3), offload_fraction=1.0, bucket_size_mb=64)
    x = torch.randn(2048, 4096, device="cuda")
    for _ in range(2):  # warm-up: allocations, kernel selection
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    opt.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(x).square().mean().backward()
        opt.step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    d2h = sorted((e.time_range.start, e.time_range.end) for e in events if "DtoH" in e.name)
    h2d = sorted((e.time_range.start, e.time_range.end) for e in events if "HtoD" in e.name)
    kernels = [(e.time_range.start, e.time_range.end) for e in events if "Memcpy" not in e.name
               and "Memset" not in e.name]
    assert d2h and h2d and kernels
    assert d2h[0][0] < max(end for _, end in kernels), "no gradient copy overlapped backward"
    opt.close()
