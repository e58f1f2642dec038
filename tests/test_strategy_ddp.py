"""`fastopt` and `fastopt_offload` with 2 real processes (gloo): bit for bit the weights of Lightning's plain
`ddp` with torch AdamW (clipping, accumulation, an LR scheduler), ZeRO stages 1 and 2 (under
torchrun too) and ``forward_waits="module"`` included; with ``delayed_update`` bit for bit
``ddp`` with torch's update delayed; and an overflow on one rank skips the step on both.
Tolerances remain where the sum runs in another order than the unsharded run's (ZeRO's
fp16 gradients, LAMB's norm over the shards: no torch reference either)."""

from pathlib import Path

import pytest
import torch

from tests.helpers import free_port, run_script

# real processes: README's test command leaves these to CI (pytest -m slow)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "ddp_run.py"


def _run(strategy, out, *extra, launched_by_lightning=False):
    """The two ranks' results; ``launched_by_lightning``: the script started alone, its
    second process by Lightning's launcher, else both at once (``tests.helpers.run_script``)."""
    run_script(SCRIPT, strategy, out, *extra, ranks=None if launched_by_lightning else 2)
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A reference run's two ranks, run once per module for each set of arguments."""
    runs = {}

    def run(strategy, *extra):
        key = (strategy, *extra)
        if key not in runs:
            runs[key] = _run(strategy, tmp_path_factory.mktemp("reference") / "ref.pt", *extra)
        return [{k: v.clone() for k, v in r.items()} for r in runs[key]]
    return run


@pytest.mark.parametrize("strategy", ["fastopt", "fastopt_offload", "zero1", "zero1_offload", "zero2",
                                      "zero2_offload", "zero2_speculate", "ddp_speculate", "zero1_speculate"])
def test_two_process_fastopt_matches_plain_ddp(tmp_path, reference, strategy):
    """(``fastopt``'s second process is started by Lightning's launcher, as ``python
    train.py`` starts it; the others start both at once.)"""
    ours, ours_rank1 = _run(strategy, tmp_path / "fastopt.pt", launched_by_lightning=strategy == "fastopt")
    ref, _ = reference("ddp")
    if strategy.endswith("_speculate"):  # clipping is on: bucket updates were speculated as their reduction landed
        speculated = []
        for r in (ours, ours_rank1):
            if strategy in ("ddp_speculate", "zero1_speculate"):  # DDP's buckets, handed over as reduced
                assert int(r.pop("handed_over_in_backward")) > 0
            counts = {k: int(r.pop(k)) for k in [k for k in r if k.startswith("buckets_")]}
            assert counts.get("buckets_dropped", 0) == 0
            assert counts["buckets_speculated"] == counts.get("buckets_committed", 0) + counts.get("buckets_redone", 0)
            speculated.append(counts["buckets_speculated"])
        # (ZeRO-1: the rank owning the first layer only, whose gradients come last, takes its update at the step)
        assert min(speculated) > 0 if strategy != "zero1_speculate" else max(speculated) > 0
    if strategy.startswith("zero"):
        # each rank owns about half of the 8*16+16+16+1 = 161 elements, and keeps Adam's two
        # float32 moments for those only
        owned = [int(r.pop("owned_numel")) for r in (ours, ours_rank1)]
        state_bytes = [int(r.pop("state_bytes")) for r in (ours, ours_rank1)]
        grads = [int(r.pop("grad_numel")) for r in (ours, ours_rank1)]
        assert sum(owned) == 161 and max(owned) <= 161 // 2 + 128
        assert state_bytes == [8 * n for n in owned]
        # stage 2: a rank keeps only its own shard of the gradients when it steps (none when it is
        # offloaded through the accelerator path: each left for the host as its reduction landed); stage 1 all
        # (but its own shard's, offloaded through the accelerator path: on the host)
        expected = {"zero2_speculate": [0, 0], "zero2": owned, "zero2_offload": owned,
                    "zero1_speculate": [161 - n for n in owned]}.get(strategy, [161, 161])
        assert grads == expected
    assert ours.keys() == ref.keys()
    for k in ours:
        assert torch.equal(ours[k], ours_rank1[k])  # ranks stay in sync
        assert torch.equal(ours[k], ref[k]), k


def test_two_process_forward_waits_by_module_match_plain_ddp(tmp_path, reference):
    """forward_waits="module" under DDP (gradients copied at the step, after DDP's
    reduction): each step ends before its host updates, each module's forward waits for
    its own bucket, the weights are DDP's."""
    ours, ours_rank1 = _run("module_waits", tmp_path / "module.pt")
    assert ours.pop("waits_by_module", False) and ours_rank1.pop("waits_by_module", False)
    assert ours.pop("steps_ended_early") and ours_rank1.pop("steps_ended_early")
    ref, _ = reference("ddp")
    for k in ref:
        assert torch.equal(ours[k], ours_rank1[k])  # ranks stay in sync
        assert torch.equal(ours[k], ref[k]), k


def test_two_process_streamed_steps_that_end_before_their_updates_match_plain_ddp(tmp_path):
    """Streamed into backward as DDP hands each bucket over, every step ending before its
    CPU updates (forward_waits="module"): the weights are DDP's."""
    ours, ours_rank1 = _run("module_streamed", tmp_path / "streamed.pt", "--no-clip")
    assert ours.pop("waits_by_module", False) and ours_rank1.pop("waits_by_module", False)
    assert ours.pop("steps_ended_early") and ours_rank1.pop("steps_ended_early")
    ref, _ = _run("ddp", tmp_path / "ddp.pt", "--no-clip")
    for k in ref:
        assert torch.equal(ours[k], ours_rank1[k])  # ranks stay in sync
        assert torch.equal(ours[k], ref[k]), k


def test_two_process_speculated_steps_that_end_before_their_redone_updates_match_plain_ddp(tmp_path):
    """The same with clipping (speculated: a step ends before the updates it redoes or
    held back): the weights are DDP's.  Which buckets land during backward, and so how many
    are speculated and left running, depends on when DDP's all-reduces complete."""
    ours, ours_rank1 = _run("module_streamed", tmp_path / "speculated.pt")
    assert ours.pop("steps_ended_early") and ours_rank1.pop("steps_ended_early")
    ref, _ = _run("ddp", tmp_path / "ddp.pt")
    for k in ref:
        assert torch.equal(ours[k], ours_rank1[k])  # ranks stay in sync
        assert torch.equal(ours[k], ref[k]), k


def test_two_process_delayed_update_matches_ddp_with_torchs_update_delayed(tmp_path):
    ours, ours_rank1 = _run("delayed_offload", tmp_path / "delayed.pt")
    ref, _ = _run("ddp", tmp_path / "ddp.pt", "--delayed-reference")
    for k in ours:
        assert torch.equal(ours[k], ours_rank1[k])  # ranks stay in sync
        assert torch.equal(ours[k], ref[k]), k


@pytest.mark.parametrize("strategy", ["fastopt", "zero1", "zero2"])
def test_overflow_on_one_rank_skips_the_step_on_both(tmp_path, strategy):
    """An inf injected into rank 1's gradients (fp16 loss scaling) skips that step on both
    ranks: the same skip count, identical finite weights.  Under ZeRO rank 1 does not own
    the poisoned parameter's state: the overflow flag is still shared."""
    rank0, rank1 = _run(strategy, tmp_path / "inf.pt", "--inject-inf")
    for r in (rank0, rank1):
        for k in ("owned_numel", "state_bytes", "grad_numel"):
            r.pop(k, None)
    assert int(rank0.pop("skipped_steps")) == int(rank1.pop("skipped_steps")) == 1
    for k in rank0:
        assert torch.isfinite(rank0[k]).all()
        assert torch.equal(rank0[k], rank1[k])


@pytest.mark.parametrize("strategy", ["zero2", "zero2_offload"])
def test_zero2_with_an_optimizer_that_runs_as_torch_reduces_as_stage_1(tmp_path, reference, strategy):
    """A user's optimizer whose step combines every gradient (``GlobalNorm``) runs as torch
    runs it, on the model's weights: its gradients must be all-reduced, which ZeRO stage 2
    leaves to its engines; the strategy reduces them as stage 1 does (DDP wraps the model
    once the optimizers are known), bit for bit ``ddp``.  Before 2026-11-27 nothing
    reduced them (LBFGS alike): 0.07 from ``ddp`` after one epoch, silently."""
    ours, _ = _run(strategy, tmp_path / "zero.pt", "--global-norm")
    ref, _ = reference("ddp", "--global-norm")
    assert "owned_numel" not in ours  # no ZeRO engine: the optimizer ran as torch
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k


def test_zero1_lamb_global_norm_spans_the_shards(tmp_path):
    """FusedLAMB's global gradient norm (its max_grad_norm clipping) over shards held by
    two ranks equals the norm over the whole model, bit for bit: the ranks' per-gradient
    sums of squares are added in the parameters' order, as the unsharded step adds them."""
    ours, _ = _run("zero1", tmp_path / "zero.pt", "--lamb")
    ref, _ = _run("fastopt", tmp_path / "ref.pt", "--lamb")
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_fp16_loss_scaling_matches_unsharded(tmp_path, reference, strategy):
    """fp16 with dynamic loss scaling and clipping by norm: sharded optimizer state (and
    gradients) give the weights of the unsharded fastopt run, bit for bit (the total norm
    is built from the ranks' per-tensor norms as get_total_norm builds it)."""
    ours, rank1 = _run(strategy, tmp_path / "zero.pt", "--fp16")
    ref, _ = reference("fastopt", "--fp16")
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k
        assert torch.equal(ours[k], rank1[k])


def test_zero2_under_torchrun(tmp_path, reference):
    """torchrun starts the processes; Lightning takes the ranks from its environment."""
    out = tmp_path / "torchrun.pt"
    run_script("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(), SCRIPT, "zero2",
               out)
    ours, rank1 = (torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1))
    ref, _ = reference("ddp")
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k
        assert torch.equal(ours[k], rank1[k])


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero2_offload"])
def test_zero_on_two_gpus_with_nccl(tmp_path, strategy):
    """NCCL: needs two GPUs (skipped with fewer)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ours, rank1 = _run(strategy, tmp_path / "zero.pt", "--gpu")
    ref, _ = _run("ddp", tmp_path / "ddp.pt", "--gpu")
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
        assert torch.equal(ours[k], rank1[k])
