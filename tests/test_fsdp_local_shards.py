"""ZeRO stage 3's optimizer step: :class:`~lightning_fastopt.fsdp.LocalShardOptimizer` on
the local shards of torch FSDP2's DTensor parameters, against torch's optimizer stepping
the DTensors, on two gloo processes (``tests/scripts/fsdp_local_shards_run.py``).

Bit for bit (``torch.equal`` on the gathered weights and optimizer state) at offload
fractions 0, 0.5 and 1 through the accelerator code path on the CPU: AdamW, SGD with
Nesterov momentum, Adagrad, RAdam (its own step, not fused), clipping by norm (the norm
torch takes of the DTensor gradients) with gradient accumulation; shards that do not
divide evenly, and a rank that holds no row of a parameter.  LAMB and LARS (norms over
whole parameters, summed over the ranks' rows) against themselves on the unsharded model,
within a tolerance.  In one process: parameters
``fully_shard`` did not reach (plain tensors) step as torch steps them, with an fp16 overflow
skipped; what it cannot run is refused when it is built (LAMB and LARS with the CPU step
streamed or delayed)."""

import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_script

slow = pytest.mark.slow  # real processes: CI runs them (pytest -m slow)

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "fsdp_local_shards_run.py"
sys.path.insert(0, str(SCRIPT.parent))
from fsdp_local_shards_run import CONFIGS, WHOLE_NORMS  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_local_shards")
    run_script(SCRIPT, out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@slow
@pytest.mark.parametrize("config", CONFIGS)
def test_the_step_on_local_shards_ends_where_torchs_step_on_the_dtensors_ends(ranks, config):
    for rank in ranks:
        ref, ours = rank[config]["torch"], rank[config]["ours"]
        for name, weight in ref["weights"].items():
            assert torch.equal(ours["weights"][name], weight), name
            assert not torch.equal(weight, rank["initial"][name]), name  # it trained
            assert ours["state"][name].keys() == ref["state"][name].keys(), name
            for key, value in ref["state"][name].items():
                assert torch.equal(torch.as_tensor(ours["state"][name][key]), torch.as_tensor(value)), (name, key)
        assert [n.item() for n in ours["norms"]] == [n.item() for n in ref["norms"]]
    assert ranks[0][config]["ours"]["weights"].keys() == ranks[1][config]["ours"]["weights"].keys()


@slow
@pytest.mark.parametrize("config", [c for c, (*_, own_rows) in WHOLE_NORMS.items() if not own_rows])
def test_lamb_and_lars_on_rows_take_the_whole_parameters_norms(ranks, config):
    """LAMB's and LARS's trust ratios (and LAMB's clipping by the norm of every gradient)
    read norms over whole parameters: each rank takes those of its rows, the ranks sum
    them, the updates take the totals.  No exact reference exists (LAMB and LARS are not in
    torch, and the sums of the rows are added in another order than one pass over a
    tensor): against the same optimizer on the unsharded model stepped with the ranks'
    mean gradient, within 1e-7 after 6 steps that moved every weight by 6e-4 or more,
    clipping and accumulation, half or all rows offloaded.  Each rank's rows taking their
    own norms (``*-own-rows``, nothing summed) ends more than 1e-4 away: the tolerance
    tells the two apart."""
    for rank in ranks:
        ours, ref = rank[config]["weights"], rank[config]["reference"]
        for name, weight in ref.items():
            assert (weight - rank["initial"][name]).abs().max() > 5e-4, name  # it trained
            torch.testing.assert_close(ours[name], weight, rtol=0, atol=1e-7)
        for own in (c for c, (*_, own_rows) in WHOLE_NORMS.items() if own_rows):
            off = max((rank[own]["weights"][n] - rank[own]["reference"][n]).abs().max() for n in ref)
            assert off > 1e-4, (own, off)


@slow
def test_each_rank_steps_its_own_rows_and_clipping_sometimes_triggered(ranks):
    """33 rows split 17/16, one row held by rank 0 only: the ranks hold different shares,
    which add up to the model; the clipped runs were clipped on some steps and not others."""
    held = [rank["adamw-1"]["ours"]["held"] for rank in ranks]
    assert held[0] != held[1] and sum(held) == sum(w.numel() for w in ranks[0]["initial"].values())
    assert "offload_fraction=1.0" in ranks[0]["adamw-1"]["ours"]["engine"]
    for rank in ranks:  # the overflow one rank saw skipped the step on both; nothing else was skipped
        assert [rank[c]["ours"]["skipped"] for c in CONFIGS] == [1 if c == "adamw-overflow" else 0 for c in CONFIGS]
    for config, (_, _, clip, _, _) in CONFIGS.items():
        if clip:
            norms = [n.item() for n in ranks[0][config]["ours"]["norms"]]
            assert min(norms) < clip < max(norms), (config, norms)


def test_plain_parameters_step_as_torch_steps_them_and_an_overflow_is_skipped():
    from lightning_fastopt.fsdp import LocalShardOptimizer
    from lightning_fastopt.optim.from_torch import to_fused_optimizer

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))

    ref, ours = net(), net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = LocalShardOptimizer(to_fused_optimizer(torch.optim.AdamW(ours.parameters(), lr=1e-2)),
                                 offload_fraction=0.5, copy_on_cpu=True, bucket_size_mb=0.0001)
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(4, 6, generator=g)
        ours(x).square().mean().backward()
        if step == 2:  # an inf: skipped, the weights untouched
            next(ours.parameters()).grad[0, 0] = float("inf")
            before = [p.clone() for p in ours.parameters()]
            assert engine.step(check_finite=True) is None and engine.last_step_skipped
            assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))
            engine.zero_grad()
            continue
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.step(check_finite=True)
        engine.zero_grad()
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert engine.skipped_steps == 1 and "holds 47 of 47 elements" in repr(engine)


def test_what_it_cannot_run_is_refused_when_built():
    from lightning_fastopt import FusedAdam, FusedLAMB, FusedLars
    from lightning_fastopt.fsdp import LocalShardOptimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    # LAMB and LARS take norms summed over every rank's rows when the step starts: nothing of
    # theirs may be updated before (until 2026-11-27 both were refused on rows)
    for cls, early in ((FusedLAMB, dict(stream_cpu_step=True, speculate=True)), (FusedLars, dict(delayed_update=True))):
        with pytest.raises(ValueError, match=f"{cls.__name__} takes norms over whole parameters.*"
                                             f"{next(iter(early))}=True .*cannot be used with it"):
            LocalShardOptimizer(cls(params, lr=1e-3), device_grads="copy_when_reduced", copy_on_cpu=True, **early)
    with pytest.raises(ValueError, match=r"takes device_grads \('copy_at_step', 'copy_when_reduced'\).*got 'keep'"):
        LocalShardOptimizer(FusedAdam(params, lr=1e-3), device_grads="keep")


@slow
def test_streamed_gradients_leave_the_device_during_backward_and_updates_start_there(ranks):
    """Streamed: by the end of backward the offloaded parameters' ``p.grad`` are gone (4
    of the 6 at fraction 0.5, every one at 1); speculated: every host bucket's update was
    started during backward and, with clipping that sometimes scales, some were committed
    and some redone."""
    for rank in ranks:
        for config, (_, fraction, _, _, options) in CONFIGS.items():
            freed = rank[config]["ours"]["freed"]
            if options.get("device_grads") == "copy_when_reduced":
                assert set(freed) == ({6} if fraction == 1.0 else {4}), (config, freed)
            else:
                assert set(freed) == {0}, (config, freed)
            totals = rank[config]["ours"]["totals"]
            if options.get("speculate"):
                assert totals["speculated"] == totals["committed"] + totals["redone"] and totals["committed"] > 0
                assert totals["redone"] > 0
