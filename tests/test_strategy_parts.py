"""The parts a Trainer strategy holds (issue 68), each alone: the engine set (which engine
steps which optimizer, the take-over and the give-back, accumulation marks, weight waits,
an engine replaced by a rebuilt one), the checkpoint part (its writer, ZeRO or one file,
an optimizer's state from its engine or torch's), the automatic fraction's part (refusals
at its start, a step run as given where nothing is probed).  The plan they follow:
tests/test_run_plan.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_fastopt import FusedAdam
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.optim.takeover import engine_of
from lightning_fastopt.trainer.auto_fraction_steps import AutoFractionSteps
from lightning_fastopt.trainer.engine_checkpoints import EngineCheckpoints
from lightning_fastopt.plan.run_plan import OptimizerPlan
from lightning_fastopt.plan.runner import Runner
from lightning_fastopt.trainer.engine_set import EngineSet


class _Mock(torch.optim.Optimizer):
    """Lightning's stand-in when configure_optimizers returns None."""

    def __init__(self):
        super().__init__([torch.zeros(1, requires_grad=True)], {})


def _optimizers():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    return [torch.optim.AdamW(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)]


def _engine(opt, plan):
    return OffloadOptimizer(FusedAdam(opt.param_groups, lr=0.1), copy_on_cpu=True)


def _plans(*in_engine):
    """Plans that put the optimizers ``in_engine`` marks in an engine (the rest run as torch)."""
    return [OptimizerPlan(Runner("Any", "kernel", engine=FusedAdam) if e else Runner("Any", "torch", "a test's"))
            for e in in_engine]


def test_the_engine_set_takes_over_what_it_is_told_and_gives_it_back():
    optimizers = _optimizers()
    engines = EngineSet()
    engines.take_over(optimizers, _plans(True, False), _engine)
    assert len(engines) == 1 and engine_of(optimizers[0]) is engines.engines[0]
    assert engine_of(optimizers[1]) is optimizers[1]  # not taken over
    assert engines.engine_for(optimizers, optimizers[0]) is engines.engines[0]
    assert engines.engine_for(optimizers, optimizers[1]) is None
    assert engines.offload_optimizers() == engines.engines and engines.partitions() == []
    engines.set_accumulating(True)
    assert engines.engines[0].accumulating
    engines.set_accumulating(False)
    assert not engines.engines[0].accumulating
    engines.wait_for_weights()  # nothing on its way: returns
    new = _engine(optimizers[0], None)
    old = engines.engines[0]
    engines.replace(optimizers, old, new)
    assert engines.engines == [new] and engine_of(optimizers[0]) is new
    engines.release(optimizers)
    assert engine_of(optimizers[0]) is optimizers[0]  # given back
    assert engines.engine_for(optimizers, optimizers[0]) is new  # kept after fit: checkpoints read its state


def test_the_checkpoint_part_saves_one_file_or_shards_and_takes_state_from_the_engines():
    optimizers = _optimizers()
    engines = EngineSet()
    engines.take_over(optimizers, _plans(True, False), _engine)
    part = EngineCheckpoints(engines, zero_stage=0)
    written = []
    part.save({"a": 1}, "path", ranks=None, one_file=lambda c, p: written.append((c, p)))
    assert written == [({"a": 1}, "path")]  # no ZeRO partition: Lightning's one file
    assert part.optimizer_state(optimizers, optimizers[0], lambda o: "torch's") == engines.engines[0].state_dict()
    assert part.optimizer_state(optimizers, optimizers[1], lambda o: "torch's") == "torch's"
    with pytest.raises(ValueError, match="the checkpoint has 1 optimizer state"):
        part.load_optimizer_states({"optimizer_states": [{}]}, optimizers)
    engines.release(optimizers)


def test_the_checkpoint_writer_is_the_users_or_ours():
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

    from lightning_fastopt.core.checkpoint_io import AtomicCheckpointIO

    assert isinstance(EngineCheckpoints.writer(None, _WrappingCheckpointIO), AtomicCheckpointIO)
    users = TorchCheckpointIO()
    assert EngineCheckpoints.writer(users, _WrappingCheckpointIO) is users
    wrapping = AsyncCheckpointIO()
    assert EngineCheckpoints.writer(wrapping, _WrappingCheckpointIO) is wrapping
    assert isinstance(wrapping.checkpoint_io, AtomicCheckpointIO)
    wrapping.teardown()


def test_the_automatic_fraction_refuses_what_it_cannot_measure_and_otherwise_steps_as_given():
    auto = AutoFractionSteps(EngineSet())
    manual = SimpleNamespace(lightning_module=SimpleNamespace(automatic_optimization=False), accumulate_grad_batches=1)
    with pytest.raises(ValueError, match="with manual optimization give a number"):
        auto.start(manual, True, None, torch.device("cpu"), lambda x: x)
    automatic = SimpleNamespace(lightning_module=SimpleNamespace(automatic_optimization=True), accumulate_grad_batches=1)
    with pytest.raises(ValueError, match="gpu_memory_budget_gb needs a CUDA device"):
        auto.start(automatic, True, 8.0, torch.device("cpu"), lambda x: x)
    auto.start(automatic, False, None, torch.device("cpu"), lambda x: x)  # not asked: no probe
    opt = _optimizers()[0]
    assert auto.step(opt, [opt], lambda: "loss", lambda closure: closure(), lambda: False) == "loss"
