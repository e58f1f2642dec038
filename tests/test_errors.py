"""Bad input gets a clear error at construction (or at the step that sees it), naming
the argument and the allowed range; every torch.optim keyword is either honoured or
refused, never silently dropped."""

import inspect
import math

import pytest
import torch

from lightning_fastopt import CPUAdam, FusedAdagrad, FusedAdam, FusedLAMB, FusedLars, FusedLion, FusedSGD
from lightning_fastopt import functional as F


def _p():
    return [torch.randn(3, requires_grad=True)]


@pytest.mark.parametrize("make,match", [
    (lambda: FusedAdam(_p(), lr=-1e-3), r"lr must be in \[0.0, inf\), got -0.001"),
    (lambda: FusedAdam(_p(), lr=math.nan), r"lr must be in"),
    (lambda: FusedAdam(_p(), betas=(1.0, 0.999)), r"betas\[0\] must be in \[0.0, 1.0\), got 1.0"),
    (lambda: FusedAdam(_p(), betas=(0.9, -0.1)), r"betas\[1\] must be in \[0.0, 1.0\)"),
    (lambda: FusedAdam(_p(), betas=(0.9,)), r"betas must be a pair"),
    (lambda: FusedAdam(_p(), betas=0.9), r"betas must be a pair \(beta1, beta2\), got 0.9"),
    (lambda: FusedLion(_p(), betas=None), r"betas must be a pair \(beta1, beta2\), got None"),
    (lambda: FusedLAMB(_p(), betas="0.9,0.999"), r"betas must be a pair"),
    (lambda: FusedAdam(_p(), eps=-1.0), r"eps must be in \[0.0, inf\)"),
    (lambda: FusedAdam(_p(), weight_decay=-0.1), r"weight_decay must be in \[0.0, inf\)"),
    (lambda: FusedAdam(_p(), differentiable=True), r"differentiable=True"),
    (lambda: FusedAdam(_p(), capturable=True), r"capturable=True"),
    (lambda: FusedAdam(_p(), lr=torch.tensor([1e-3, 1e-3])), r"lr as a tensor must have one element"),
    (lambda: CPUAdam(_p(), fp32_optimizer_states=False), r"fp32_optimizer_states=False"),
    (lambda: FusedSGD(_p(), lr=0.1, momentum=-0.5), r"momentum must be in \[0.0, inf\)"),
    (lambda: FusedSGD(_p(), lr=0.1, dampening=1.5), r"dampening must be in \[0.0, 1.0\]"),
    (lambda: FusedSGD(_p(), lr=0.1, nesterov=True), r"nesterov=True requires momentum > 0"),
    (lambda: FusedSGD(_p(), lr=0.1, differentiable=True), r"differentiable=True"),
    (lambda: FusedAdagrad(_p(), lr_decay=-1), r"lr_decay must be in"),
    (lambda: FusedAdagrad(_p(), initial_accumulator_value=-1), r"initial_accumulator_value must be in"),
    (lambda: FusedAdagrad(_p(), eps=-1), r"eps must be in"),
    (lambda: FusedLion(_p(), betas=(0.9, 1.0)), r"betas\[1\] must be in"),
    (lambda: FusedLAMB(_p(), max_grad_norm=-1.0), r"max_grad_norm must be in \[0.0, inf\)"),
    (lambda: FusedLars(_p(), eeta=0.0), r"eeta must be in \(0.0, inf\)"),
    (lambda: FusedLars(_p(), epsilon=-1.0), r"epsilon must be in"),
])
def test_bad_hyperparameters_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make,match", [
    (lambda: FusedAdam(_p(), lr="1e-3"), r"lr must be a number in \[0.0, inf\), got '1e-3'"),
    (lambda: FusedSGD(_p(), lr=None), r"lr must be a number in \[0.0, inf\), got None"),
    (lambda: FusedAdam(_p(), betas=(0.9, "0.999")), r"betas\[1\] must be a number in \[0.0, 1.0\), got '0.999'"),
    (lambda: FusedAdam(_p(), weight_decay=True), r"weight_decay must be a number"),
])
def test_a_hyperparameter_that_is_not_a_number_raises_type_error_naming_it(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_bad_hyperparameter_in_added_group():
    opt = FusedAdam(_p())
    with pytest.raises(ValueError, match=r"lr must be in"):
        opt.add_param_group({"params": _p(), "lr": -1.0})


def test_complex_and_integer_params_raise_type_error():
    with pytest.raises(TypeError, match="complex"):
        FusedAdam([torch.randn(3, dtype=torch.complex64, requires_grad=True)])
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        FusedSGD([torch.zeros(3, dtype=torch.float64, requires_grad=True)], lr=0.1)


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedAdagrad, FusedLion, FusedLAMB, FusedLars])
def test_sparse_gradients_raise(backend, cls):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = cls(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"does not support sparse gradients: parameter 0 of group 0 \(shape \(10, 4\)\)"):
        opt.step()
    named = cls(emb.named_parameters(), lr=0.1)  # torch's named groups: the name is said
    with pytest.raises(ValueError, match=r"sparse gradients: 'weight' \(shape \(10, 4\)\) got one"):
        named.step()


@pytest.mark.parametrize("ours,theirs", [(FusedAdam, torch.optim.Adam), (FusedAdam, torch.optim.AdamW),
                                         (FusedSGD, torch.optim.SGD), (FusedAdagrad, torch.optim.Adagrad)])
def test_every_torch_keyword_is_accepted(ours, theirs):
    """Drop-in: every keyword of the torch optimizer exists on ours (and is validated or honoured)."""
    ours_kw = inspect.signature(ours).parameters
    missing = [k for k in inspect.signature(theirs).parameters if k not in ours_kw]
    assert not missing, f"{ours.__name__} lacks torch keywords {missing}"


def test_torch_keywords_that_only_pick_an_implementation_are_accepted():
    FusedAdam(_p(), foreach=True, fused=False, maximize=True, decoupled_weight_decay=False)
    FusedSGD(_p(), lr=0.1, foreach=False, fused=True)
    FusedAdagrad(_p(), foreach=True, fused=None)


def test_decoupled_weight_decay_sets_adamw_mode():
    assert FusedAdam(_p(), decoupled_weight_decay=False).param_groups[0]["decoupled_weight_decay"] is False
    assert FusedAdam(_p(), adamw_mode=False).param_groups[0]["decoupled_weight_decay"] is False
    assert FusedAdam(_p()).param_groups[0]["decoupled_weight_decay"] is True


def test_lamb_non_finite_norm_without_check_is_an_error(backend):
    p = torch.randn(3, requires_grad=True)
    opt = FusedLAMB([p])
    p.grad = torch.tensor([1.0, math.inf, 0.0])
    before = p.detach().clone()
    with pytest.raises(ValueError, match="global gradient norm is inf"):
        opt.step()
    assert torch.equal(p.detach(), before)
    opt.step(check_finite=True)
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert torch.equal(p.detach(), before)


def test_step_check_finite_skips_and_counts(backend):
    params = [torch.randn(5, requires_grad=True) for _ in range(2)]
    opt = FusedSGD(params, lr=0.1, momentum=0.9)
    params[0].grad = torch.randn(5)
    params[1].grad = torch.tensor([0.0, math.nan, 0.0, 0.0, 0.0])
    before = [p.detach().clone() for p in params]
    opt.step(check_finite=True)
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(len(opt.state[p]) == 0 for p in params)  # no state created by a skipped step
    # the next good step is a true first step: the momentum buffer starts from the grad
    g = torch.randn(5)
    params[0].grad, params[1].grad = g, g.clone()
    opt.step(check_finite=True)
    assert not opt.last_step_skipped
    assert torch.equal(opt.state[params[0]]["momentum_buffer"], g)


def test_functional_bad_grad_scale():
    p, g = [torch.randn(3)], [torch.randn(3)]
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="grad_scale must be a positive finite number"):
            F.fused_sgd_(p, g, step=1, lr=0.1, grad_scale=bad)


def test_functional_dtype_errors(compiled):
    p = [torch.randn(3)]
    with pytest.raises(TypeError, match="must be float32, float16 or bfloat16"):
        F.fused_sgd_(p, [torch.zeros(3, dtype=torch.float64)], step=1, lr=0.1)
    with pytest.raises(TypeError, match="param_copies must be float16/bfloat16 copies of float32 params"):
        F.fused_sgd_(p, [torch.zeros(3)], step=1, lr=0.1, param_copies=[torch.empty(3)])
    with pytest.raises(TypeError, match="SGD keeps float32 optimizer state; bfloat16 state is for Adam on the CPU"):
        F.fused_sgd_(p, [torch.zeros(3)], [torch.zeros(3, dtype=torch.bfloat16)], step=2, lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match=r"optimizer state must be float32 \(or bfloat16: Adam on the CPU\)"):
        F.fused_sgd_(p, [torch.zeros(3)], [torch.zeros(3, dtype=torch.float16)], step=2, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="has 4 elements, expected 3"):
        F.fused_sgd_(p, [torch.zeros(4)], step=1, lr=0.1)


def test_a_wrapper_whose_construction_failed_still_has_a_repr():
    """A traceback or debugger shows the object whose __init__ raised: its repr must not
    raise too (it read attributes that were never set)."""
    from lightning_fastopt import OffloadOptimizer
    from lightning_fastopt.zero import ZeroOptimizer

    p = torch.nn.Parameter(torch.zeros(3))
    for cls in (OffloadOptimizer, ZeroOptimizer):
        half_built = cls.__new__(cls)
        with pytest.raises(TypeError, match="runs lightning_fastopt's fused optimizers"):
            cls.__init__(half_built, torch.optim.AdamW([p]), {p: "p"})
        assert repr(half_built) == f"{cls.__name__}(not built)"
    built = OffloadOptimizer(FusedAdam([p]), {p: "p"}, offload_fraction=1.0)
    assert repr(built).startswith("OffloadOptimizer(FusedAdam, offload_fraction=1.0, offloaded=3 of 3 elements")
    built.close()
