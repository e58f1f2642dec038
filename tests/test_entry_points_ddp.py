"""fit, validate, test and predict on one Trainer with 2 real processes (gloo), in two
orders (issue: drop-in for real Lightning projects): every rank ends with the weights,
the metrics and the predictions of Lightning's own ``ddp``, bit for bit (SGD with
momentum and weight decay rounds as torch does; the script: tests/scripts/entry_points_run.py)."""

from pathlib import Path

import pytest
import torch

from tests.helpers import run_script

# real processes: README's test command leaves these to CI (pytest -m slow)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "entry_points_run.py"


def _run(strategy, out):
    """The two ranks' results; ``half_offloaded``'s second process started by Lightning's
    launcher (as ``python train.py`` starts it), the others' both at once
    (``tests.helpers.run_script``)."""
    run_script(SCRIPT, strategy, out, ranks=None if strategy == "half_offloaded" else 2)
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _run("ddp", tmp_path_factory.mktemp("ddp") / "ddp.pt")


@pytest.mark.parametrize("strategy", ["half_offloaded", "fastopt_offload", "zero2_offload"])
def test_two_processes_end_where_ddp_ends(strategy, ddp, tmp_path):
    ours = _run(strategy, tmp_path / "ours.pt")
    for rank, (a, b) in enumerate(zip(ours, ddp)):
        assert a.keys() == b.keys()
        assert any(k.endswith("/predict") for k in a) and any("test/test_loss" in k for k in a)
        for k in a:
            assert torch.equal(a[k], b[k]), f"rank {rank} {k}: {(a[k].double() - b[k].double()).abs().max()}"
