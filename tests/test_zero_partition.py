"""The ZeRO partition: contiguous, stable, every rank within one tensor of its ideal share;
and ZeroOptimizer in one process (it owns everything and steps like the fused optimizer;
its state dict holds the hyperparameters as a scheduler left them)."""

import random

import pytest
import torch

from lightning_fastopt import FusedAdam
from lightning_fastopt.zero import ZeroOptimizer, assign_owners
from lightning_fastopt.zero.partition import owner_buckets


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_balanced_contiguous_and_stable(world):
    rng = random.Random(world)
    for _ in range(50):
        sizes = [rng.choice([0, 1, 7, 100, 4096, 50_000]) for _ in range(rng.randint(1, 40))]
        owners = assign_owners(sizes, world)
        assert owners == assign_owners(list(sizes), world)  # depends on the sizes only
        assert owners == sorted(owners) and all(0 <= o < world for o in owners)  # contiguous runs
        total = sum(sizes)
        for r in range(world):
            share = sum(n for n, o in zip(sizes, owners) if o == r)
            assert abs(share - total / world) <= max(sizes), (sizes, owners)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        assign_owners([1], 0)


@pytest.mark.parametrize("stage", [1, 2])
def test_one_process_owns_everything_and_matches_the_fused_optimizer(backend, stage):
    ps = [torch.randn(n, requires_grad=True) for n in (7, 1023, 1)]
    rs = [p.detach().clone().requires_grad_() for p in ps]
    zero = ZeroOptimizer(FusedAdam(ps, lr=1e-2), {p: f"p{i}" for i, p in enumerate(ps)}, stage=stage,
                         offload_fraction=0.5, copy_on_cpu=True)
    ref = FusedAdam(rs, lr=1e-2)
    assert zero.world_size == 1 and zero.owned_numel == 1031
    for _ in range(5):
        for p, r in zip(ps, rs):
            g = torch.randn_like(p)
            p.grad, r.grad = g, g.clone()
        zero.step()
        ref.step()
        zero.zero_grad()
    for p, r in zip(ps, rs):
        assert torch.equal(p, r)
    assert set(zero.partition().values()) == {0}
    assert set(zero.state_dict()["state"]) == {"p0", "p1", "p2"}


def test_the_state_dict_holds_the_hyperparameters_a_scheduler_set_after_the_last_step(backend):
    """A checkpoint is taken after the scheduler's step: a resumed run must start with the
    learning rate the scheduler set, not the one of the last optimizer step."""
    ps = [torch.randn(5, requires_grad=True)]
    zero = ZeroOptimizer(FusedAdam(ps, lr=1e-2), {ps[0]: "p"}, copy_on_cpu=True)
    sched = torch.optim.lr_scheduler.StepLR(zero, step_size=1, gamma=0.5)
    ps[0].grad = torch.ones(5)
    zero.step()
    sched.step()
    assert zero.param_groups[0]["lr"] == 5e-3
    assert zero.state_dict()["param_groups"][0]["lr"] == 5e-3


def test_bad_stage():
    with pytest.raises(ValueError, match="stage must be 1 or 2, got 3"):
        ZeroOptimizer(FusedAdam([torch.zeros(2, requires_grad=True)]), stage=3)


def test_stage_1_across_ranks_refuses_gradients_copied_before_ddp_reduced_them(monkeypatch):
    from lightning_fastopt.zero import optimizer as zero_optimizer

    monkeypatch.setattr(zero_optimizer, "world_size", lambda group=None: 2)  # refused before any collective
    with pytest.raises(ValueError, match="device_grads='copy_in_backward' at stage 1 would copy each gradient "
                                         "before DDP has reduced it"):
        ZeroOptimizer(FusedAdam([torch.zeros(2, requires_grad=True)]), stage=1, device_grads="copy_in_backward")


def test_owner_buckets_keep_order_split_dtypes_and_sizes():
    ps = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), torch.zeros(9), torch.zeros(2)]
    owners = [0, 0, 0, 1, 1]
    index = {id(p): i for i, p in enumerate(ps)}
    got = [(o, [index[id(p)] for p in chunk]) for o, chunk in owner_buckets(ps, owners, 32)]
    assert got == [(0, [1]), (0, [0, 2]), (1, [3]), (1, [4])]  # 9 floats exceed 32 bytes: alone
    backward = [(o, [index[id(p)] for p in chunk]) for o, chunk in owner_buckets(ps[::-1], owners[::-1], 32)]
    assert backward == [(1, [4]), (1, [3]), (0, [1]), (0, [2, 0])]


def test_one_process_says_zero_has_nothing_to_shard(caplog, monkeypatch):
    """``fastopt_zero2`` with one process ran without a word (issue: sharp edges)."""
    import logging

    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    with caplog.at_level(logging.INFO):
        ZeroOptimizer(FusedAdam([torch.nn.Parameter(torch.zeros(4))], lr=0.1), stage=2)
    assert "ZeRO stage 2 has nothing to shard with one process" in caplog.text
