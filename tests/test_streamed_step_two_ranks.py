"""The CPU step speculated during backward across two gloo processes
(``tests/scripts/streamed_two_ranks_run.py``).

ZeRO stage 2: each bucket's update starts once its reduction has landed on its owner, and
the step's checks span the ranks (the overflow flag, the clipping norm, LAMB's global
norm).  Bit for bit the synchronous ZeRO step over 14 steps through the accelerator code
path on the CPU, at fractions 0.5 and 1 with several buckets: clipping that never, always
and sometimes triggers, fp16 overflows on one rank (the first step included), both,
accumulation with a scheduler, LAMB.

DDP: its buckets are handed over as each all-reduce completes (our communication hook
reduces as DDP does without one): bit for bit DDP as it is with the synchronous step,
clipping, fp16 with overflows, and ``gradient_as_bucket_view=True``; and ZeRO stage 1 (on
DDP) so fed, each rank's shard.  The Trainer-level runs against ``ddp`` are in
``tests/test_strategy_ddp.py`` (``zero2_speculate``, ``ddp_speculate``)."""

from pathlib import Path

import pytest
import torch

from tests.helpers import run_script

# real processes: README's test command leaves these to CI (pytest -m slow)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "streamed_two_ranks_run.py"
CONFIGS = ["clip-never", "clip-always", "clip-sometimes", "clip-sometimes-half", "sgd-clip-sometimes", "fp16",
           "fp16-and-clipping", "accumulation-and-scheduler", "lamb-global-norm"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("streamed_two_ranks")
    run_script(SCRIPT, out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _assert_same_run(a, b):
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name
        sa, sb = a["state"][name], b["state"][name]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name
    assert (a["loss_scale"], a["skipped_steps"]) == (b["loss_scale"], b["skipped_steps"])


@pytest.mark.parametrize("config", CONFIGS)
def test_speculated_zero2_ends_where_the_synchronous_zero2_step_ends(ranks, config):
    for rank in ranks:
        run = rank[config]
        _assert_same_run(run["speculated"], run["synchronous"])
    for name, w in ranks[0][config]["speculated"]["weights"].items():
        assert torch.equal(w, ranks[1][config]["speculated"]["weights"][name])  # the ranks stay in sync

    for rank in ranks:
        run = rank[config]["speculated"]
        totals, buckets = run["totals"], run["host_buckets"]
        assert buckets >= 2 and totals["speculated"] == buckets * 14  # every bucket, every step
        skipped = run["skipped_steps"]
        assert totals.get("dropped", 0) == buckets * skipped
        assert totals["speculated"] == totals.get("committed", 0) + totals.get("redone", 0) + totals.get("dropped", 0)
        if config in ("clip-never", "fp16"):
            assert totals.get("redone", 0) == 0  # the announced scale is the one the step takes
        elif config == "clip-always":
            assert totals.get("committed", 0) == 0
        else:
            assert totals.get("committed", 0) > 0 and totals.get("redone", 0) > 0
        if config.startswith("fp16"):
            assert skipped == 4  # an inf on rank 1 only skips the step on both


def test_a_buckets_update_starts_once_its_reduction_landed_before_backward_ends(ranks):
    """A backward slowed down between layers: the last layers' reductions land on their
    owner (rank 1) while the earlier layers' backward runs, and their updates start then."""
    timing = ranks[1]["timing"]
    assert len(timing["started"]) == timing["host_buckets"] >= 2
    assert min(timing["started"]) < timing["backward_ended"]
    for rank in ranks:
        assert rank["timing"]["totals"]["committed"] == rank["timing"]["totals"]["speculated"] > 0


@pytest.mark.parametrize("config", ["ddp-clip-sometimes", "ddp-fp16-and-clipping", "ddp-gradients-as-bucket-views",
                                    "zero1-fp16-and-clipping"])
def test_ddp_buckets_handed_over_as_reduced_end_where_ddp_with_the_synchronous_step_ends(ranks, config):
    for rank in ranks:
        _assert_same_run(rank[config]["speculated"], rank[config]["synchronous"])
        run = rank[config]["speculated"]
        totals = run["totals"]
        assert run["handed_over_in_backward"] > 0  # gradients reached the host before backward ended
        assert totals["committed"] > 0 and totals["redone"] > 0
        # a bucket whose reduction completes once backward has ended is not speculated (the step takes it)
        assert (totals.get("dropped", 0) > 0) == (run["skipped_steps"] > 0)
        if "fp16" in config:
            assert run["skipped_steps"] == 2  # an inf on rank 1 only skips the step on both
