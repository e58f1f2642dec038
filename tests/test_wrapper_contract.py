"""The contract the precision plugin and the strategy rely on (OptimizerWrapper), held by
both wrappers: what each owns, its partition, the closure and skip counters of step(),
and which optimizers unscale inside their kernels."""

import pytest
import torch

from lightning_fastopt import FusedAdam, FusedSGD, OffloadOptimizer
from lightning_fastopt.checkpoint import CheckpointMismatchError
from lightning_fastopt.optim.wrapper import OptimizerWrapper, unscales_in_step
from lightning_fastopt.zero import ZeroOptimizer


def _params():
    return [torch.randn(n, requires_grad=True) for n in (7, 1023, 1)]


@pytest.mark.parametrize("make", [
    lambda ps, names: OffloadOptimizer(FusedAdam(ps, lr=1e-2), names, offload_fraction=0.5, copy_on_cpu=True),
    lambda ps, names: ZeroOptimizer(FusedAdam(ps, lr=1e-2), names, stage=1, offload_fraction=0.5, copy_on_cpu=True),
], ids=["offload", "zero"])
def test_both_wrappers_keep_the_contract(backend, make):
    ps = _params()
    names = {p: f"p{i}" for i, p in enumerate(ps)}
    opt = make(ps, names)
    assert isinstance(opt, OptimizerWrapper) and unscales_in_step(opt)
    stranger = torch.randn(3, requires_grad=True)
    assert all(opt.owns(p) for p in ps) and not opt.owns(stranger)  # one process owns everything
    assert opt.partition() == ({"p0": 0, "p1": 0, "p2": 0} if isinstance(opt, ZeroOptimizer) else None)
    assert opt.shards_gradients == isinstance(opt, ZeroOptimizer)

    def closure():
        for p in ps:
            p.grad = torch.full_like(p, float("inf")) if closure.overflow else torch.randn_like(p)
        return torch.tensor(3.0)

    closure.overflow = True
    assert float(opt.step(closure, check_finite=True)) == 3.0  # the closure ran (and its loss came back)
    assert opt.last_step_skipped and opt.skipped_steps == 1 and opt.state_of(ps[0]) == {}
    closure.overflow = False
    opt.step(closure, check_finite=True)
    assert not opt.last_step_skipped and opt.skipped_steps == 1
    assert float(opt.state_of(ps[0])["step"]) == 1.0
    closure()
    assert [g.shape for g in opt.gradients()] == [p.shape for p in ps]  # the next step's, where it reads them
    opt.close()


def test_the_wrapper_names_what_it_takes():
    with pytest.raises(TypeError, match="OffloadOptimizer runs lightning_fastopt's fused optimizers \\(to_fused_optimizer makes one of any torch optimizer\\), got SGD"):
        OffloadOptimizer(torch.optim.SGD(_params(), lr=0.1))
    with pytest.raises(TypeError, match="ZeroOptimizer runs lightning_fastopt's fused optimizers \\(to_fused_optimizer makes one of any torch optimizer\\), got SGD"):
        ZeroOptimizer(torch.optim.SGD(_params(), lr=0.1))


def test_only_our_optimizers_unscale_in_their_kernels():
    ps = _params()
    assert unscales_in_step(FusedSGD(ps, lr=0.1))
    assert not unscales_in_step(torch.optim.SGD(ps, lr=0.1))


_WRAPPERS = {
    "offload": lambda opt, names: OffloadOptimizer(opt, names, offload_fraction=0.5, copy_on_cpu=True),
    "zero": lambda opt, names: ZeroOptimizer(opt, names, stage=1, offload_fraction=0.5, copy_on_cpu=True),
}


def _stepped_state(make_opt):
    """The state dict of a torch.optim optimizer (names as torch.optim writes them) after one step."""
    ps = _params()
    opt = make_opt(ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("wrapper", list(_WRAPPERS))
def test_the_state_of_another_optimizer_is_refused_naming_what_differs(wrapper):
    """Resuming an AdamW run with SGD used to be accepted silently: the SGD group took
    AdamW's lr, betas and eps (torch.optim fails at the step, plain Lightning too)."""
    ps = _params()
    names = {p: f"p{i}" for i, p in enumerate(ps)}
    sgd = _WRAPPERS[wrapper](FusedSGD(ps, lr=0.1, momentum=0.9), names)
    adamw_state = _stepped_state(lambda q: torch.optim.AdamW(q, lr=1e-3))
    with pytest.raises(CheckpointMismatchError, match=r"parameter group 0: the checkpoint's optimizer state was "
                                                      r"written by another optimizer \(its groups have 'amsgrad', "
                                                      r"'betas', 'eps'; this optimizer's have 'dampening', "
                                                      r"'momentum', 'nesterov'\)"):
        sgd.load_state_dict(adamw_state)
    assert sgd.param_groups[0]["lr"] == 0.1 and "betas" not in sgd.param_groups[0]  # nothing was taken
    sgd.close()


@pytest.mark.parametrize("wrapper", list(_WRAPPERS))
@pytest.mark.parametrize("writer,reader", [
    (lambda q: torch.optim.AdamW(q, lr=1e-3), lambda q: FusedAdam(q, lr=1e-2)),
    (lambda q: torch.optim.Adam(q, lr=1e-3), lambda q: FusedAdam(q, lr=1e-2, adamw_mode=False)),
    (lambda q: torch.optim.SGD(q, lr=1e-3, momentum=0.9), lambda q: FusedSGD(q, lr=1e-2, momentum=0.5)),
], ids=["AdamW-FusedAdam", "Adam-FusedAdam", "SGD-FusedSGD"])
def test_the_state_of_the_same_rule_loads(wrapper, writer, reader):
    ps = _params()
    opt = _WRAPPERS[wrapper](reader(ps), {p: f"p{i}" for i, p in enumerate(ps)})
    opt.load_state_dict(_stepped_state(writer))
    assert opt.param_groups[0]["lr"] == 1e-3
    opt.close()
