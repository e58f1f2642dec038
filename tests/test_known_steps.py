"""Which optimizers the engines step on shares of the parameters
(:mod:`lightning_fastopt.optim.known_steps`): ``fastopt_fsdp`` on each rank's rows those
whose step works element by element, the DDP strategies on shares of whole parameters
those whose step updates each parameter alone; any other runs as torch runs it (the
Trainer-level comparisons are
``tests/test_fsdp_strategy.py::test_an_optimizer_whose_step_may_span_rows_runs_as_torch_on_the_dtensors``
and ``tests/test_drop_in.py::test_an_own_step_not_named_runs_as_torch_and_ends_where_trainer_ends``)."""

import pytest
import torch

from lightning_fastopt import FusedAdam, FusedLars
from lightning_fastopt.optim.known_steps import ELEMENTWISE_TORCH_OPTIMIZERS, steps_per_parameter, steps_rows


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


def test_torchs_optimizers_but_lbfgs_step_per_parameter():
    """Every optimizer torch ships updates each parameter from its own gradient and state
    (Adafactor's factored moments and Muon's orthogonalized update are per parameter too);
    LBFGS flattens them all."""
    classes = [c for c in vars(torch.optim).values() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
               and c is not torch.optim.Optimizer]
    assert len(classes) >= 14
    for cls in classes:
        matrix = [torch.nn.Parameter(torch.zeros(3, 2))]  # Muon takes matrices only
        optimizer = cls(matrix, lr=0.1) if cls is not torch.optim.LBFGS else cls(matrix)
        assert steps_per_parameter(optimizer) is (cls is not torch.optim.LBFGS), cls.__name__


def test_a_step_of_its_own_is_per_parameter_only_when_named():
    class Tuned(torch.optim.RMSprop):  # hyperparameters only: torch's step
        pass

    class OwnStep(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    class ThirdParty(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            return None

    assert steps_per_parameter(Tuned(_params(), lr=0.1)) and steps_per_parameter(FusedLars(_params(), lr=0.1))
    for optimizer in (OwnStep(_params(), lr=0.1), ThirdParty(_params())):
        assert not steps_per_parameter(optimizer), type(optimizer).__name__
        assert steps_per_parameter(optimizer, named=(type(optimizer).__name__,))
    assert steps_per_parameter(OwnStep(_params(), lr=0.1), named=("SGD",))  # a base class named covers its subclasses
