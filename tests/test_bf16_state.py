"""Adam's moments in bfloat16 with stochastic rounding (``FusedAdam(state_dtype=torch.bfloat16)``,
``OffloadOptimizer(host_state_dtype=...)``, ``FastOptStrategy(host_state_dtype="bfloat16")``):

- on every CPU backend the stored moments are the definition's
  (``torch_backend.round_bf16_stochastic``) bit for bit: with betas 0 the moments are
  the gradient and its square, exact in float32, so only the rounding is compared;
- the rounding is unbiased (a value between two bfloat16 neighbours averages to itself;
  round-to-nearest would not) and picks one of the two neighbours;
- 50 steps, two groups, odd sizes: within 2% of the largest possible movement
  (steps x lr) of torch.optim.AdamW with float32 moments (0.5% measured);
- state dicts hold float32 moments (torch.optim loads them), and a resumed run ends
  where the uninterrupted one ends, bit for bit;
- the offload optimizer keeps the host buckets' moments in bfloat16, the result is the
  same at every fraction on a CPU run; under ``Trainer()`` training follows float32;
- bad combinations are refused by name.
"""

import io

import lightning as L
import pytest
import torch

from lightning_fastopt import FastOptStrategy, FusedAdam, FusedSGD
from lightning_fastopt import functional as F
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.ops import torch_backend
from tests.helpers import ACCELERATOR, BIG, SIZES, split_groups

BF16 = torch.bfloat16


def _adam_betas_zero(g, seed):
    p = torch.zeros_like(g)
    m, v = torch.zeros_like(g, dtype=BF16), torch.zeros_like(g, dtype=BF16)
    F.fused_adam_([p], [g], [m], [v], step=seed, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)
    return m, v


@pytest.mark.parametrize("seed", [1, 2, 123456789])
def test_stored_moments_are_the_stochastic_rounding_of_the_definition(backend, seed):
    torch.manual_seed(seed)
    for n in SIZES + (BIG,):
        g = torch.randn(n) * 3
        m, v = _adam_betas_zero(g, seed)
        assert torch.equal(m, torch_backend.round_bf16_stochastic(g, seed, 0)), n
        assert torch.equal(v, torch_backend.round_bf16_stochastic(g * g, seed, 1)), n


@pytest.mark.parametrize("cut", [1024, 4096, 37])
def test_a_tensor_stepped_in_pieces_told_where_they_start_rounds_as_the_whole(backend, cut):
    """``index_bases``: each piece's moments draw the noise of their elements' places in
    the whole tensor (the disk tier's pieces, lightning_fastopt/offload/pieces.py), so the
    pieces' stored moments are the whole tensor's, bit for bit; untold, they differ."""
    torch.manual_seed(cut)
    n = 100_003
    g = torch.randn(n) * 3
    whole = _adam_betas_zero(g, 7)
    starts = list(range(0, n, cut))
    pieces = [g[a:a + cut] for a in starts]
    ps = [torch.zeros_like(x) for x in pieces]
    ms, vs = [torch.zeros_like(x, dtype=BF16) for x in pieces], [torch.zeros_like(x, dtype=BF16) for x in pieces]
    F.fused_adam_(ps, pieces, ms, vs, step=7, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0,
                  index_bases=starts)
    assert torch.equal(torch.cat(ms), whole[0]) and torch.equal(torch.cat(vs), whole[1])
    untold = _adam_betas_zero(pieces[1], 7)[0]
    assert not torch.equal(untold, whole[0][starts[1]:starts[1] + cut])


def test_specials_round_as_they_should(backend):
    """The definition keeps zeros, infinities, NaN and bfloat16 values as they are, and
    rounds the largest floats and subnormals to a neighbour (or past the largest, to
    inf); the kernels store what it says for the finite ones."""
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -2.0])
    out = torch_backend.round_bf16_stochastic(special, 5, 0).float()
    assert torch.equal(out.nan_to_num(7.0), special.nan_to_num(7.0)) and torch.signbit(out[1])
    edge = torch.tensor([3.4e38, -3.4e38, 1e-40, -1e-40, 1.0 + 2 ** -20])
    for seed in range(1, 21):  # a step count
        out = torch_backend.round_bf16_stochastic(edge, seed, 0).float()
        bits = edge.view(torch.int32)
        toward = (bits & -0x10000).view(torch.float32)  # the bfloat16 neighbours: toward zero,
        away = ((bits & -0x10000) + 0x10000).view(torch.float32)  # and away (past the largest: inf)
        assert torch.all((out == toward) | (out == away)), (edge, out)
        finite = torch.cat([edge, torch.tensor([1.0, -2.0, 0.0])])
        assert torch.equal(_adam_betas_zero(finite, seed)[0], torch_backend.round_bf16_stochastic(finite, seed, 0))


@pytest.mark.parametrize("x", [1.0 + 2 ** -10, -(1.0 + 3 * 2 ** -10), 3.0e-5 * (1 + 2 ** -9)])
def test_the_rounding_is_unbiased(compiled, x):
    n = 200_000
    g = torch.full((n,), x, dtype=torch.float32)
    m, _ = _adam_betas_zero(g, 11)
    bits = g.view(torch.int32)
    toward = (bits & -0x10000).view(torch.float32)  # the two bfloat16 neighbours
    away = ((bits & -0x10000) + 0x10000).view(torch.float32)
    values = m.float()
    assert torch.all((values == toward) | (values == away))
    step = (away - toward).abs()[0].item()
    bias_nearest = abs(g.to(BF16).float()[0].item() - x)  # round to nearest: always the same neighbour here
    bias = abs(values.double().mean().item() - x)
    sigma = step / 2 / n ** 0.5  # the standard deviation of the mean is at most this
    assert bias < 5 * sigma and bias_nearest > 20 * sigma, (bias, bias_nearest, sigma)


def _twins(steps=50, lr=1e-2, make=lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01, state_dtype=BF16)):
    torch.manual_seed(0)
    base = [torch.randn(n) for n in SIZES + (100_003,)]
    ours = [b.clone().requires_grad_() for b in base]
    ref = [b.clone().requires_grad_() for b in base]
    groups = [dict(), dict(lr=lr / 2, weight_decay=0.1, betas=(0.8, 0.99))]
    opt = make(split_groups(ours, groups))
    ref_opt = torch.optim.AdamW(split_groups(ref, groups), lr=lr, weight_decay=0.01, foreach=False)
    for _ in range(steps):
        for a, b in zip(ours, ref):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    return ours, ref, opt, ref_opt


def test_50_steps_follow_float32_adam(backend):
    ours, ref, opt, _ = _twins()
    assert all(st["exp_avg"].dtype == BF16 and st["exp_avg_sq"].dtype == BF16 for st in opt.state.values())
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0.02 * 50 * 1e-2)


def test_state_dicts_hold_float32_and_a_resumed_run_is_exact(backend):
    def make(params):
        return FusedAdam(params, lr=1e-2, state_dtype=BF16)

    torch.manual_seed(0)
    start = [torch.randn(n) for n in (7, 1023)]
    grads = [[torch.randn_like(s) for s in start] for _ in range(8)]

    def run(resume_at=None):
        params = [s.clone().requires_grad_() for s in start]
        opt = make(params)
        for t, gs in enumerate(grads):
            if t == resume_at:
                buffer = io.BytesIO()
                torch.save(opt.state_dict(), buffer)
                buffer.seek(0)
                saved = torch.load(buffer, weights_only=True)
                assert all(v.dtype == torch.float32 for st in saved["state"].values()
                           for k, v in st.items() if k != "step")
                torch.optim.AdamW([s.clone().requires_grad_() for s in start], lr=1e-2).load_state_dict(saved)
                opt = make(params)
                opt.load_state_dict(saved)
                assert all(st["exp_avg"].dtype == BF16 for st in opt.state.values())
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        return params, opt

    straight, a = run()
    resumed, b = run(resume_at=4)
    for x, y in zip(straight, resumed):
        assert torch.equal(x, y)
    for x, y in zip(straight, resumed):
        assert torch.equal(a.state[x]["exp_avg"], b.state[y]["exp_avg"])


def _offload_run(fraction, host_state_dtype, steps=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-2), {p: n for n, p in model.named_parameters()},
                           offload_fraction=fraction, bucket_size_mb=0.002, copy_on_cpu=True,
                           host_state_dtype=host_state_dtype)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 24, generator=g)).square().mean().backward()
        opt.step()
    return model, opt


def test_the_offload_optimizer_keeps_host_moments_in_bfloat16(compiled):
    full, opt = _offload_run(1.0, "bfloat16")
    assert all(opt.state_of(p)["exp_avg"].dtype == BF16 for p in full.parameters())
    saved = opt.state_dict()
    assert all(st["exp_avg"].dtype == torch.float32 for st in saved["state"].values())
    half, opt_half = _offload_run(0.5, torch.bfloat16)
    for a, b in zip(full.parameters(), half.parameters()):  # a CPU run: the same kernels on both sides
        assert torch.equal(a, b)
    opt_half.load_state_dict(saved)
    assert all(opt_half.state_of(p)["exp_avg"].dtype == BF16 for p in half.parameters())
    plain, _ = _offload_run(1.0, None)
    assert not all(torch.equal(a, b) for a, b in zip(full.parameters(), plain.parameters()))
    for a, b in zip(full.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0.02 * 6 * 1e-2)


def test_under_the_trainer_bfloat16_moments_follow_float32(compiled):
    from tests.test_precision import Regressor, _data

    runs = {}
    for dtype in ("float32", "bfloat16"):
        model = Regressor()
        trainer = L.Trainer(strategy=FastOptStrategy(host_state_dtype=dtype, bucket_size_mb=0.0002),
                            accelerator=ACCELERATOR, devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, _data())
        runs[dtype] = model
        opt = trainer.strategy.engines[0]
        assert opt.state_of(model.net[0].weight)["exp_avg"].dtype == getattr(torch, dtype)
        # given back after fit as torch keeps it: float32 moments, as checkpoints hold them (a torch.optim.AdamW
        # given back with the bfloat16 ones raised at its next step); its step runs
        given = trainer.optimizers[0]
        assert {v.dtype for st in given.state.values() for k, v in st.items() if k != "step"} == {torch.float32}
        x, y = next(iter(_data()))
        given.zero_grad()
        torch.nn.functional.mse_loss(model.net(x), y).backward()
        given.step()
    assert runs["bfloat16"].losses[-1] < 0.5 * runs["bfloat16"].losses[0]
    for a, b in zip(runs["bfloat16"].parameters(), runs["float32"].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0.02 * 24 * 1e-2)  # 24 steps of lr 1e-2


@pytest.mark.parametrize("make,error,match", [
    (lambda ps: FusedAdam(ps, amsgrad=True, state_dtype=BF16), ValueError, "is for amsgrad=False"),
    (lambda ps: FusedAdam(ps, state_dtype=torch.float16), ValueError, "state_dtype must be torch.float32 or"),
    (lambda ps: OffloadOptimizer(FusedSGD(ps, lr=0.1), host_state_dtype="bfloat16", copy_on_cpu=True), ValueError,
     "it is for Adam/AdamW"),
    (lambda ps: FastOptStrategy(host_state_dtype="bfloat16", zero_stage=1), ValueError,
     "runs with zero_stage=0 only"),
    (lambda ps: FastOptStrategy(host_state_dtype="half"), ValueError, "state_dtype must be"),
])
def test_bad_combinations_are_refused_by_name(make, error, match):
    with pytest.raises(error, match=match):
        make([torch.nn.Parameter(torch.randn(3))])


def test_half_parameters_cannot_keep_bfloat16_moments():
    p = torch.nn.Parameter(torch.randn(3, dtype=BF16))
    opt = FusedAdam([p], state_dtype=BF16)
    p.grad = torch.randn(3, dtype=BF16)
    with pytest.raises(ValueError, match="is for float32 CPU parameters without amsgrad"):
        opt.step()


def test_the_other_kernels_refuse_bfloat16_state(compiled):
    p, g, buf = torch.randn(8), torch.randn(8), torch.zeros(8, dtype=BF16)
    with pytest.raises(TypeError, match="SGD keeps float32 optimizer state"):
        compiled.sgd_(params=[p], grads=[g], momentum_buffers=[buf], copies=None, lr=0.1, momentum=0.9, dampening=0.0,
                      weight_decay=0.0, inv_grad_scale=1.0, nesterov=False, maximize=False, wd_after_momentum=False,
                      first_step=True, check_finite=False)
