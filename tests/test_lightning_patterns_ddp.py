"""The everyday Lightning patterns of test_lightning_patterns.py under ZeRO stage 2 on two
real processes (gloo), against ``Trainer()`` on one process over the same global batches
(tests/scripts/patterns_run.py): frozen and later unfrozen backbones,
``BackboneFinetuning``, ``grad_norm`` and gradients edited in hooks and callbacks, manual
accumulation with clipping, a GAN with and without ``toggle_optimizer``, tied weights (one
listed twice), weights written through ``.data`` (clamping, EMA).

The reference is one process rather than Lightning's ``ddp``: a parameter unfrozen after
DDP wrapped the model is never all-reduced by DDP, so ``ddp`` itself would not be the same
run there.  Two ranks average their halves of each batch of 16, summing in another order:
Adam's tolerance everywhere (rtol 1.3e-6, atol 1e-5), and both ranks end bit-identical."""

import runpy
from pathlib import Path

import pytest
import torch

from tests.helpers import run_script

# real processes: README's test command leaves these to CI (pytest -m slow)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "patterns_run.py"
TOL = dict(rtol=1.3e-6, atol=1e-5)
PATTERNS = list(runpy.run_path(str(SCRIPT))["PATTERNS"])  # the script's own list (no __main__: nothing runs)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    done = {}

    def get(strategy, devices):
        if (strategy, devices) not in done:
            out = tmp_path_factory.mktemp(strategy) / "weights.pt"
            run_script(SCRIPT, out, "--devices", devices, "--strategy", strategy, ranks=devices)  # started at once
            ranks = [torch.load(out, weights_only=True)]
            ranks += [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(1, devices)]
            done[strategy, devices] = ranks
        return done[strategy, devices]

    return get


@pytest.mark.parametrize("strategy", ["zero2", "zero2-offload"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_zero2_on_two_processes_ends_where_one_process_ends(run, strategy, pattern):
    rank0, rank1 = (r[pattern] for r in run(strategy, 2))
    ref = run("plain", 1)[0][pattern]
    for name, value in ref["weights"].items():
        torch.testing.assert_close(rank0["weights"][name], value, **TOL, msg=lambda m: f"{name}: {m}")
        assert torch.equal(rank0["weights"][name], rank1["weights"][name]), name
    assert len(rank0["norms"]) == len(ref["norms"])
    for ours, theirs in zip(rank0["norms"], ref["norms"]):
        assert ours.keys() == theirs.keys()
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k], **TOL)
