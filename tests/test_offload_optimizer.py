"""OffloadOptimizer on the CPU: the same steps as the optimizer it wraps (any fraction,
any bucket size, every algorithm), the accelerator code path (host masters, gradient
buffers, backward hooks, copies) exercised with copy_on_cpu=True, half-precision
parameters with float32 masters, master refresh, state dicts and their errors."""

import math

import pytest
import torch

from lightning_fastopt import FusedAdagrad, FusedAdam, FusedLAMB, FusedLars, FusedLion, FusedSGD
from lightning_fastopt.checkpoint import CheckpointMismatchError
from lightning_fastopt.offload import OffloadOptimizer, choose_offloaded, split_into_buckets
from tests.helpers import BIG, SIZES, split_groups

GROUPS = [dict(), dict(lr=3e-3, weight_decay=0.0), dict(lr=5e-4)]
ALGORITHMS = {
    "adamw": lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05, amsgrad=True),
    "sgd": lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adagrad": lambda g: FusedAdagrad(g, lr=1e-2, lr_decay=1e-3),
    "lion": lambda g: FusedLion(g, lr=1e-3, weight_decay=0.1),
    "lars": lambda g: FusedLars(g, lr=1e-2, momentum=0.9, weight_decay=1e-4),
    "lamb": lambda g: FusedLAMB(g, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0),
}


def _params(sizes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype).requires_grad_() for n in sizes]


def _names(params):
    return {p: f"p{i}" for i, p in enumerate(params)}


def _train(opt, params, steps, seed=1, skip_every=0, grad_dtype=None):
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        opt.zero_grad()
        for i, p in enumerate(params):
            if skip_every and (step + i) % skip_every == 0:
                continue  # this parameter gets no gradient this step
            p.grad = torch.randn(p.shape, generator=g).to(grad_dtype or p.dtype)
            if p.grad.numel() and step == 2 and i == 1:
                p.grad.mul_(1e3)  # a spike, so LAMB's global clipping engages
        opt.step()


@pytest.mark.parametrize("copy_on_cpu", [False, True], ids=["cpu-run", "accelerator-path"])
@pytest.mark.parametrize("fraction,bucket_mb", [(0.0, 64), (0.4, 0.00002), (1.0, 0.003), (1.0, 64)])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_same_steps_as_the_wrapped_optimizer(backend, algorithm, fraction, bucket_mb, copy_on_cpu):
    """30 steps, 3 groups, sizes 0/1/7/1023 and some parameters without a gradient on some
    steps: bit-identical to the plain fused optimizer (LAMB: rtol 1e-6, its global norm
    is summed in another order)."""
    sizes = SIZES * 3
    ref_params, params = _params(sizes), _params(sizes)
    make = ALGORITHMS[algorithm]
    ref = make(split_groups(ref_params, GROUPS))
    opt = OffloadOptimizer(make(split_groups(params, GROUPS)), _names(params), offload_fraction=fraction,
                           bucket_size_mb=bucket_mb, copy_on_cpu=copy_on_cpu)
    _train(ref, ref_params, 30, skip_every=5)
    _train(opt, params, 30, skip_every=5)
    for a, b in zip(params, ref_params):
        if algorithm == "lamb":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b)
    assert opt.offloaded_numel >= fraction * sum(sizes)


def test_big_tensor_and_the_accelerator_path(backend):
    params, ref_params = _params([BIG, 7]), _params([BIG, 7])
    ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.01)
    opt = OffloadOptimizer(FusedAdam(params, lr=1e-3, weight_decay=0.01, torch_sqrt=True), _names(params),
                           offload_fraction=0.5, bucket_size_mb=1, copy_on_cpu=True)
    _train(ref, ref_params, 5)
    _train(opt, params, 5)
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)


def test_partition_takes_the_last_parameters_first():
    ps = [torch.zeros(n) for n in (10, 20, 30, 40)]
    assert choose_offloaded(ps, 0.0) == [False] * 4
    assert choose_offloaded(ps, 1.0) == [True] * 4
    assert choose_offloaded(ps, 0.4) == [False, False, False, True]
    assert choose_offloaded(ps, 0.41) == [False, False, True, True]
    stays = lambda p: p is ps[3]  # noqa: E731  (kept on the device whatever the fraction; the others go in its place)
    assert choose_offloaded(ps, 1.0, stays) == [True, True, True, False]
    assert choose_offloaded(ps, 0.4, stays) == [False, True, True, False]
    assert split_into_buckets("abcd", [4, 4, 9, 1], 8) == [["a", "b"], ["c"], ["d"]]
    with pytest.raises(ValueError, match=r"offload_fraction must be in \[0.0, 1.0\], got 1.5"):
        choose_offloaded(ps, 1.5)


def test_the_description_says_the_share_offloaded_and_why_it_is_larger():
    """Whole tensors from the end: at 0.1 a last tensor of 4,000 of 4,110 elements takes
    97%, and the log line (the optimizer's repr) says so and why; where the share is about
    what was asked, it says the share alone."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 400, bias=False))
    names = {p: n for n, p in model.named_parameters()}
    for fraction, said in [(0.1, "offloaded=4000 of 4110 elements (97%, whole tensors from the end)"),
                           (0.95, "offloaded=4000 of 4110 elements (97%)"),
                           (1.0, "offloaded=4110 of 4110 elements (100%)")]:
        opt = OffloadOptimizer(FusedAdam(model.parameters()), names, offload_fraction=fraction, copy_on_cpu=True)
        assert f"offload_fraction={fraction}, {said}, " in repr(opt)
        opt.close()


def test_hooks_copy_final_gradients_and_free_the_device_ones(backend):
    """The accelerator path: backward hooks copy each gradient to its host buffer and drop
    the device gradient; while accumulating they copy nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    ref_model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    ref_model.load_state_dict(model.state_dict())
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-2, torch_sqrt=True),
                           dict((p, n) for n, p in model.named_parameters()), offload_fraction=1.0,
                           bucket_size_mb=0.0001, copy_on_cpu=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0)
    xs = torch.randn(6, 2, 5)
    for step in range(3):
        opt.zero_grad()
        ref.zero_grad()
        for micro, x in enumerate(xs[2 * step:2 * step + 2]):
            opt.accumulating = micro == 0  # what the strategy sets for a non-final micro-batch
            model(x).square().mean().backward()
            ref_model(x).square().mean().backward()
            if micro == 0:
                assert all(p.grad is not None for p in model.parameters())  # kept on the device
        opt.accumulating = False
        assert all(p.grad is None for p in model.parameters())  # copied, then freed
        host = opt.gradients()
        assert torch.equal(torch.cat([g.flatten() for g in host]).sort().values,
                           torch.cat([p.grad.flatten() for p in ref_model.parameters()]).sort().values)
        opt.step()
        ref.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("copy_on_cpu", [False, True], ids=["cpu-run", "accelerator-path"])
def test_half_parameters_keep_float32_masters(backend, dtype, copy_on_cpu):
    """bf16/fp16 model weights: the update runs on float32 masters from half gradients, as
    torch's AdamW on float32 copies of the weights and the gradients does, and the model
    gets the master rounded to its dtype."""
    sizes = (7, 1023, 1)
    params = _params(sizes, dtype)
    masters = [p.detach().float().requires_grad_() for p in params]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01)
    opt = OffloadOptimizer(FusedAdam(params, lr=1e-2, weight_decay=0.01, torch_sqrt=True), _names(params),
                           offload_fraction=0.5, bucket_size_mb=0.001, copy_on_cpu=copy_on_cpu)
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        for p, m in zip(params, masters):
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
            m.grad = p.grad.float()
        opt.step()
        ref.step()
    for p, m in zip(params, masters):
        assert p.dtype == dtype
        assert torch.equal(p.detach(), m.detach().to(dtype))
        assert torch.equal(opt.state_of(p)["exp_avg_sq"], ref.state[m]["exp_avg_sq"])
    # the float32 state lives beside the masters, not in the half weights
    assert all(opt.state_of(p)["exp_avg"].dtype == torch.float32 for p in params)


def test_weights_changed_outside_refresh_the_masters(backend):
    """One source of truth: load_state_dict into the model, then step: the step starts
    from the loaded weights, not from the stale master."""
    params = _params((9, 4), torch.bfloat16)
    opt = OffloadOptimizer(FusedSGD(params, lr=0.5), _names(params), offload_fraction=1.0, copy_on_cpu=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    new = [torch.full_like(p, 2.0) for p in params]
    with torch.no_grad():
        for p, n in zip(params, new):
            p.copy_(n)  # what Module.load_state_dict does
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in params:
        assert torch.equal(p, torch.full_like(p, 1.5))  # 2 - 0.5 * 1, not (stale master) - 0.5


def test_state_dict_is_keyed_by_name_and_loads_into_torch(backend):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    names = {p: n for n, p in model.named_parameters()}
    opt = OffloadOptimizer(FusedAdam([{"params": model[0].parameters()}, {"params": model[1].parameters(),
                                                                            "lr": 0.1}], lr=1e-2),
                           names, offload_fraction=0.5, copy_on_cpu=True)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert list(sd["state"]) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert sd["param_groups"][1]["params"] == ["1.weight", "1.bias"] and sd["param_groups"][1]["lr"] == 0.1
    torch_opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}])
    torch_opt.load_state_dict(sd)
    assert torch_opt.param_groups[1]["lr"] == 0.1
    assert torch.equal(torch_opt.state[model[1].weight]["exp_avg"], opt.state_of(model[1].weight)["exp_avg"])
    # and back, from torch's integer-keyed form, into another fraction
    other = OffloadOptimizer(FusedAdam([{"params": model[0].parameters()}, {"params": model[1].parameters()}]),
                             names, offload_fraction=0.0)
    other.load_state_dict(torch_opt.state_dict())
    for p in model.parameters():
        for k, v in opt.state_of(p).items():
            assert torch.equal(other.state_of(p)[k], v)
    assert other.param_groups[1]["lr"] == 0.1


def test_mismatched_state_dicts_are_clear_errors():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = OffloadOptimizer(FusedAdam(model.parameters()), {p: n for n, p in model.named_parameters()})
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    wider = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    other = OffloadOptimizer(FusedAdam(wider.parameters()), {p: n for n, p in wider.named_parameters()})
    with pytest.raises(CheckpointMismatchError, match=r"'0.weight' has shape \(3, 4\) in the checkpoint, the "
                                                      r"parameter has shape \(5, 4\)"):
        other.load_state_dict(sd)
    renamed = OffloadOptimizer(FusedAdam(wider.parameters()), {p: "x." + n for n, p in wider.named_parameters()})
    with pytest.raises(CheckpointMismatchError, match=r"missing here: 'x.0.weight'"):
        renamed.load_state_dict(sd)
    two_groups = OffloadOptimizer(FusedAdam([{"params": model[0].parameters()}, {"params": model[1].parameters()}]))
    with pytest.raises(CheckpointMismatchError, match="has 1 parameter group"):
        two_groups.load_state_dict(sd)
    with pytest.raises(CheckpointMismatchError, match="not an optimizer state dict"):
        opt.load_state_dict({"weights": 1})


def test_bad_arguments():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match=r"offload_fraction must be in \[0.0, 1.0\], got -0.1"):
        OffloadOptimizer(FusedAdam(p), offload_fraction=-0.1)
    with pytest.raises(ValueError, match=r"bucket_size_mb must be in \(0.0, inf\), got 0"):
        OffloadOptimizer(FusedAdam(p), bucket_size_mb=0)
    with pytest.raises(TypeError, match="runs lightning_fastopt's fused optimizers .*, got AdamW"):
        OffloadOptimizer(torch.optim.AdamW(p))
    with pytest.raises(ValueError, match=r"device_grads must be one of \('copy_in_backward', 'copy_at_step', "
                                         r"'copy_when_reduced', 'keep'\), got 'free'"):
        OffloadOptimizer(FusedAdam(p), device_grads="free")
    opt = OffloadOptimizer(FusedAdam(p))
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": p})
    p[0].grad = torch.zeros(3).to_sparse()
    with pytest.raises(ValueError, match="sparse gradients"):
        opt.step()


def test_settings_are_one_checked_value_given_whole_or_as_keywords():
    """OffloadSettings: an argument the engine does not take named, settings and keywords not
    both, and another fraction a copy with every other setting kept."""
    from lightning_fastopt.offload.settings import OffloadSettings

    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(TypeError, match=r"OffloadOptimizer got unexpected keyword argument\(s\) 'stream': it takes "
                                        r"those of OffloadSettings \(.*stream_cpu_step"):
        OffloadOptimizer(FusedAdam(p), stream=True)
    settings = OffloadSettings(offload_fraction=0.5, bucket_size_mb=1.0, copy_on_cpu=True)
    with pytest.raises(TypeError, match="settings or their keyword arguments, not both: got settings and overlap"):
        OffloadOptimizer(FusedAdam(p), None, settings, overlap=False)
    with pytest.raises(ValueError, match=r"speculate=True .* needs stream_cpu_step=True"):
        OffloadSettings(speculate=True)
    with pytest.raises(ValueError, match=r"step_cores must be None or core numbers \(integers, 0 or more\), got \(\)"):
        OffloadSettings(step_cores=())
    with pytest.raises(TypeError, match="host_shards must be True or False, got 1"):
        OffloadSettings(host_shards=1)
    with pytest.raises(ValueError, match="delayed_update=True needs host masters apart"):
        OffloadOptimizer(FusedAdam(p), delayed_update=True)  # a CPU run without copy_on_cpu
    opt = OffloadOptimizer(FusedAdam(p), None, settings)
    assert opt.settings is settings and opt.offload_fraction == 0.5 and opt.copies.needed
    again = opt.with_fraction(1.0)
    assert again.settings == OffloadSettings(offload_fraction=1.0, bucket_size_mb=1.0, copy_on_cpu=True)
    with pytest.raises(ValueError, match=r"offload_fraction must be in \[0.0, 1.0\], got 2"):
        again.with_fraction(2)
    assert again.settings.offload_fraction == 1.0  # refused before anything was closed or moved
    again.close()


def test_check_finite_skips_everything(backend):
    params = _params((5, 6))
    opt = OffloadOptimizer(FusedAdam(params, lr=0.1), _names(params), offload_fraction=0.5, copy_on_cpu=True)
    _train(opt, params, 2)
    before = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in opt.state_of(p).items()} for p in params}
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad[2] = math.inf
    opt.step(check_finite=True)
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert all(torch.equal(v, opt.state_of(p)[k]) for p in params for k, v in state[id(p)].items())


@pytest.mark.parametrize("copy_on_cpu", [False, True], ids=["cpu-run", "accelerator-path"])
def test_a_parameter_listed_twice_in_a_group_warns_once_and_saves_as_torch(copy_on_cpu):
    """torch's warning about the duplicate is the only one (the inner optimizers do not
    repeat it), and the state dict lists the parameter twice, as torch's does, and loads
    into torch.optim.SGD.  (That it is updated once per listing, as by torch, is in
    test_vs_torch_optim.py.)"""
    params = _params((5, 3))
    with pytest.warns(UserWarning, match="duplicate parameters") as caught:
        opt = OffloadOptimizer(FusedSGD([params[0], params[0], params[1]], lr=0.1, momentum=0.9), _names(params),
                               offload_fraction=0.5, copy_on_cpu=copy_on_cpu)
        _train(opt, params, 2)
    assert len(caught) == 1
    sd = opt.state_dict()
    assert sd["param_groups"][0]["params"] == ["p0", "p0", "p1"] and set(sd["state"]) == {"p0", "p1"}
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ref = torch.optim.SGD([params[0], params[0], params[1]], lr=0.1, momentum=0.9)
    ref.load_state_dict(sd)
    assert torch.equal(ref.state[params[0]]["momentum_buffer"], opt.state_of(params[0])["momentum_buffer"])
