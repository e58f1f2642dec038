"""state_dicts move between our optimizers and torch.optim's in both directions, through
torch.save / torch.load(weights_only=True), and training continues on the same bits (ours
with torch's CPU square root, ``torch_sqrt=True``)."""

import io

import pytest
import torch

from lightning_fastopt import FusedAdagrad, FusedAdam, FusedSGD
from tests.helpers import SIZES, assert_params_equal, split_groups

PAIRS = {
    "adamw": (lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05, torch_sqrt=True),
              lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.05)),
    "adam-amsgrad": (lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05, adamw_mode=False, amsgrad=True,
                                         torch_sqrt=True),
                     lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.05, amsgrad=True)),
    "sgd-nesterov": (lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
                     lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "adagrad": (lambda g: FusedAdagrad(g, lr=1e-2, lr_decay=1e-3, initial_accumulator_value=0.1, torch_sqrt=True),
                lambda g: torch.optim.Adagrad(g, lr=1e-2, lr_decay=1e-3, initial_accumulator_value=0.1)),
}
OVERRIDES = [dict(), dict(lr=0.03)]


def _through_disk(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _train(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


def _grads(n_steps):
    return [[torch.randn(n) for n in SIZES] for _ in range(n_steps)]


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("direction", ["ours->torch", "torch->ours"])
def test_state_dict_round_trip(backend, name, direction):
    make_ours, make_torch = PAIRS[name]
    first, second = (make_ours, make_torch) if direction == "ours->torch" else (make_torch, make_ours)
    params = [torch.randn(n, requires_grad=True) for n in SIZES]
    opt = first(split_groups(params, OVERRIDES))
    _train(opt, params, _grads(10))
    sd = _through_disk(opt.state_dict())

    # the continuation from the loaded state, in the other library ...
    moved = [p.detach().clone().requires_grad_() for p in params]
    other = second(split_groups(moved, OVERRIDES))
    other.load_state_dict(sd)
    # ... equals the original optimizer carrying on
    later = _grads(10)
    _train(opt, params, later)
    _train(other, moved, later)
    assert_params_equal(params, moved)
    for p, q in zip(params, moved):
        for key, value in opt.state[p].items():
            if key == "step":
                assert float(other.state[q]["step"]) == float(value) == 20
            elif value is not None:
                assert torch.equal(other.state[q][key].float(), value.float())


def test_saved_steps_are_independent_tensors(backend):
    """Our params share a step tensor; the saved state must not, or torch would count
    every step once per parameter after loading it."""
    params = [torch.randn(4, requires_grad=True) for _ in range(3)]
    opt = FusedAdam(params)
    _train(opt, params, [[torch.randn(4) for _ in range(3)]])
    sd = opt.state_dict()
    steps = [s["step"] for s in sd["state"].values()]
    assert len({id(s) for s in steps}) == 3
    assert all(float(s) == 1 for s in steps)


def test_load_into_ours_keeps_our_defaults_for_missing_keys(backend):
    """A torch AdamW state dict has no 'bias_correction'; ours fills in its default."""
    p = torch.randn(5, requires_grad=True)
    t = torch.optim.AdamW([p])
    p.grad = torch.randn(5)
    t.step()
    ours = FusedAdam([p], bias_correction=True)
    ours.load_state_dict(t.state_dict())
    assert ours.param_groups[0]["bias_correction"] is True
    assert ours.param_groups[0]["decoupled_weight_decay"] is True
    p.grad = torch.randn(5)
    ours.step()
    assert float(ours.state[p]["step"]) == 2


def test_deepcopy_and_pickle(backend):
    import copy
    import pickle

    params = [torch.randn(7, requires_grad=True)]
    opt = FusedAdam(params, lr=1e-2)
    _train(opt, params, [[torch.randn(7)]])
    clone = copy.deepcopy(opt)
    assert clone.param_groups[0]["lr"] == 1e-2
    restored = pickle.loads(pickle.dumps(opt))
    assert restored.skipped_steps == 0
