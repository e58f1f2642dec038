"""Which optimizers ``fastopt_fsdp`` steps on each rank's rows as plain tensors
(:mod:`lightning_fastopt.fsdp.row_steps`): those whose step works element by element;
any other runs as torch runs it, on the DTensors (the Trainer-level comparison is
``tests/test_fsdp_strategy.py::test_an_optimizer_whose_step_may_span_rows_runs_as_torch_on_the_dtensors``)."""

import pytest
import torch

from lightning_fastopt import FusedAdam, FusedLars
from lightning_fastopt.fsdp.row_steps import ELEMENTWISE_TORCH_OPTIMIZERS, steps_rows


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("cls", ELEMENTWISE_TORCH_OPTIMIZERS + (torch.optim.AdamW,), ids=lambda c: c.__name__)
def test_torchs_elementwise_optimizers_step_rows(cls):
    assert steps_rows(cls(_params(), lr=0.1))


def test_ours_step_rows_and_a_subclass_keeping_torchs_step_does_too():
    class Tuned(torch.optim.AdamW):  # hyperparameters only
        pass

    assert steps_rows(FusedAdam(_params(), lr=0.1)) and steps_rows(Tuned(_params(), lr=0.1))
    # LARS's norms span whole parameters: LocalShardOptimizer refuses it when built (tests/test_fsdp_local_shards.py)
    assert FusedLars.whole_tensor_norms and not FusedAdam.whole_tensor_norms


def test_a_step_not_known_to_be_elementwise_runs_on_the_dtensors_unless_named():
    class OwnStep(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    for optimizer in (OwnStep(_params(), lr=0.1), torch.optim.Adafactor(_params(), lr=0.1),
                      torch.optim.LBFGS(_params())):
        assert not steps_rows(optimizer), type(optimizer).__name__
        assert steps_rows(optimizer, named=(type(optimizer).__name__,))
    assert steps_rows(OwnStep(_params(), lr=0.1), named=("SGD",))  # a base class named covers its subclasses
