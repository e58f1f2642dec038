"""ZeRO stage 3's optimizer step: :class:`~lightning_fastopt.fsdp.LocalShardOptimizer` on
the local shards of torch FSDP2's DTensor parameters, against torch's optimizer stepping
the DTensors, on two gloo processes (``tests/scripts/fsdp_local_shards_run.py``).

Bit for bit (``torch.equal`` on the gathered weights and optimizer state) at offload
fractions 0, 0.5 and 1 through the accelerator code path on the CPU: AdamW, SGD with
Nesterov momentum, Adagrad, RAdam (its own step, not fused), clipping by norm (the norm
torch takes of the DTensor gradients) with gradient accumulation; shards that do not
divide evenly, and a rank that holds no row of a parameter."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import subprocess_env

pytestmark = pytest.mark.slow  # real processes: CI runs them (pytest -m slow)

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "fsdp_local_shards_run.py"
sys.path.insert(0, str(SCRIPT.parent))
from fsdp_local_shards_run import CONFIGS  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_local_shards")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], cwd=REPO, env=subprocess_env(REPO),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


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


def test_each_rank_steps_its_own_rows_and_clipping_sometimes_triggered(ranks):
    """33 rows split 17/16, one row held by rank 0 only: the ranks hold different shares,
    which add up to the model; the clipped runs were clipped on some steps and not others."""
    held = [rank["adamw-1"]["ours"]["held"] for rank in ranks]
    assert held[0] != held[1] and sum(held) == sum(w.numel() for w in ranks[0]["initial"].values())
    assert "offload_fraction=1.0" in ranks[0]["adamw-1"]["ours"]["engine"]
    for config, (_, _, clip, _) in CONFIGS.items():
        if clip:
            norms = [n.item() for n in ranks[0][config]["ours"]["norms"]]
            assert min(norms) < clip < max(norms), (config, norms)
