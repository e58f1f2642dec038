"""With one process a fastopt strategy is a single-device strategy to Lightning, as
``Trainer()``'s (lightning_fastopt.trainer.one_process): Lightning's batch-size finder
refused it while it was a DDPStrategy of one process (issue: drop-in).  Each run is
compared with ``Trainer()`` on the same model and data, bit for bit."""

import logging

import pytest
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader

import lightning_fastopt  # noqa: F401  (registers the strategy names)
from lightning_fastopt import FastOptStrategy
from lightning_fastopt.core.engines import STRATEGY_NAMES
from lightning_fastopt.trainer.lightning_pytorch import FastOptSingleDeviceStrategy
from tests.helpers import assert_modules_equal
from tests.test_drop_in import STRATEGIES, Net, _data, _trainer


@pytest.mark.parametrize("name", [n for n, *_ in STRATEGY_NAMES])
def test_one_process_is_a_single_device_strategy_to_lightning(name):
    trainer, plain = _trainer(name), _trainer("auto")
    strategy = trainer.strategy
    assert type(strategy) is FastOptSingleDeviceStrategy
    assert isinstance(strategy, FastOptStrategy) and isinstance(strategy, SingleDeviceStrategy)
    assert not isinstance(strategy, DDPStrategy) and not trainer._accelerator_connector.is_distributed
    assert not issubclass(FastOptSingleDeviceStrategy, DDPStrategy)  # isinstance only, see HasOneProcessTwin
    assert strategy.launcher is None and strategy.root_device == plain.strategy.root_device
    assert (trainer.world_size, trainer.global_rank, trainer.num_devices, trainer.distributed_sampler_kwargs) == (
        plain.world_size, plain.global_rank, plain.num_devices, plain.distributed_sampler_kwargs)


def test_a_detected_cluster_environment_is_not_asked_for_ranks(monkeypatch):
    """SLURM detected (as Lightning's test_cpu_slurm_save_load mocks it) without the
    variables of a real job: one process reads no rank from it, as ``Trainer()`` does (a
    DDP strategy read ``SLURM_NODEID`` while the Trainer was built)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    monkeypatch.setattr(SLURMEnvironment, "detect", staticmethod(lambda: True))
    for var in ("SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    model, ref = Net(), Net()
    trainer = _trainer("fastopt_offload")
    trainer.fit(model, _data())
    _trainer("auto").fit(ref, _data())
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size) == (0, 0, 0, 1)
    assert_modules_equal(model, ref)


class SizedNet(Net):
    """Net with the ``batch_size`` attribute the batch-size finder scales."""

    def __init__(self):
        super().__init__()
        self.batch_size = 2

    def train_dataloader(self):
        return DataLoader(_data(64).dataset, batch_size=self.batch_size)

    def val_dataloader(self):
        return _data(16)


def _tuned(strategy, how, tmp_path):
    model = SizedNet()
    kw = dict(max_epochs=1, callbacks=[BatchSizeFinder(max_trials=3, steps_per_trial=2)] if how == "callback" else [])
    trainer = _trainer(strategy, tmp_path, **kw)
    if how == "tuner":
        Tuner(trainer).scale_batch_size(model, max_trials=3, steps_per_trial=2)
    trainer.fit(model)
    return model


@pytest.mark.parametrize("how", ["tuner", "callback"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_batch_size_finder_ends_where_trainers_ends(strategy, how, tmp_path):
    """``Tuner.scale_batch_size`` and the ``BatchSizeFinder`` callback (its trials train,
    then the weights are restored from a checkpoint), then fit: the batch size and the
    weights of ``Trainer()``."""
    ours, ref = _tuned(STRATEGIES[strategy](), how, tmp_path / "ours"), _tuned("auto", how, tmp_path / "ref")
    assert ours.batch_size == ref.batch_size > 2, (ours.batch_size, ref.batch_size)
    assert_modules_equal(ours, ref)


class SeesAccumulation(Callback):
    """Whether the engine was accumulating during each backward (read after it, inside
    the strategy's backward)."""

    def __init__(self):
        self.seen = []

    def on_after_backward(self, trainer, pl_module):
        self.seen.append(trainer.strategy.engines[0].accumulating)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_micro_batches_that_accumulate_copy_nothing(strategy):
    """A single-device strategy is not told which micro-batches accumulate
    (``block_backward_sync`` is for parallel ones): a backward outside the optimizer step
    is one, so the offload optimizer copies nothing to the host until the micro-batch
    that steps (gradients add up on the device as torch adds them), and the run ends
    where ``Trainer()`` ends."""
    def run(strategy, seen=None):
        model = Net(lambda ps: torch.optim.AdamW(ps, lr=0.01))
        _trainer(strategy, accumulate_grad_batches=2, callbacks=[seen] if seen else []).fit(model, _data())
        return model

    seen = SeesAccumulation()
    assert_modules_equal(run(STRATEGIES[strategy](), seen), run("auto"))
    assert seen.seen == [True, False] * 4  # 4 batches an epoch, 2 epochs, a step every second batch


def test_strategy_backward_wrapped_in_a_mock_is_called_once_per_micro_batch():
    """Lightning's own tests wrap ``Strategy.backward`` in a mock that calls the strategy's
    bound ``backward``; an override of ``backward`` in the twin recursed through it (it
    uses the ``pre_backward``/``post_backward`` hooks)."""
    from unittest import mock

    from lightning.pytorch.strategies import Strategy

    model = Net()
    trainer = _trainer(STRATEGIES["offloaded-accelerator-path"](), accumulate_grad_batches=2)
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward:
        trainer.fit(model, _data())
    assert backward.call_count == 8
    ref = Net()
    _trainer("auto", accumulate_grad_batches=2).fit(ref, _data())
    assert_modules_equal(model, ref)


def test_the_twin_is_made_not_constructed():
    with pytest.raises(TypeError, match="what a FastOptStrategy becomes .* construct FastOptStrategy"):
        FastOptSingleDeviceStrategy()


class CountsTrainStarts:
    """A user's override of a hook, in a mixin given to both twins (a method of one class
    cannot run on the other: its ``super()`` is bound to its class)."""

    def on_train_start(self) -> None:
        self.train_starts = getattr(self, "train_starts", 0) + 1
        super().on_train_start()


class Counting(CountsTrainStarts, FastOptStrategy):
    pass


class CountingTwins(CountsTrainStarts, FastOptStrategy):
    pass


class CountingOneProcess(CountsTrainStarts, FastOptSingleDeviceStrategy):
    processes_type = CountingTwins


CountingTwins.one_process_type = CountingOneProcess


def test_a_subclass_with_a_twin_keeps_its_overrides_at_one_process():
    model, ref = Net(), Net()
    trainer = _trainer(CountingTwins(offload_fraction=0.2, copy_on_cpu=True))
    trainer.fit(model, _data())
    _trainer("auto").fit(ref, _data())
    assert type(trainer.strategy) is CountingOneProcess and trainer.strategy.train_starts == 1
    assert isinstance(trainer.strategy, CountingTwins)
    assert_modules_equal(model, ref)


def test_a_subclass_without_a_twin_runs_one_process_as_lightnings_ddp(caplog, monkeypatch):
    """It keeps its class (the twin would lose its overrides), said in one line, and
    ends where Lightning's ``ddp`` on one device ends (a process group of one)."""
    for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.setenv(var, "")  # Lightning sets these for the process group: undone after the test
        monkeypatch.delenv(var)
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    model, ref = Net(), Net()
    try:
        trainer = _trainer(Counting(offload_fraction=0.2, copy_on_cpu=True))
        with caplog.at_level(logging.INFO):
            trainer.fit(model, _data())
        assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
        assert type(trainer.strategy) is Counting and trainer.strategy.train_starts == 1
        assert "Counting (a subclass of FastOptStrategy) runs one process as Lightning's ddp does" in caplog.text
        _trainer("ddp").fit(ref, _data())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert_modules_equal(model, ref)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_strategy_object_serves_a_second_trainer_as_lightnings_single_device_one_does(name):
    """Libraries build a prediction Trainer from the same keyword arguments: the object that
    served the first Trainer reached the second with ``accelerator="auto"`` and was refused
    ("CPU parallel_devices set through FastOptSingleDeviceStrategy class, but accelerator set
    to <CPUAccelerator>"), where Lightning's own SingleDeviceStrategy serves it (issue 39)."""
    import lightning as L

    strategy = STRATEGIES[name]()
    if isinstance(strategy, str):
        pytest.skip("a strategy name builds a new object for each Trainer")
    reference = SingleDeviceStrategy(device="cpu")

    def trainers(strategy):
        model = Net()
        first = _trainer(strategy, max_epochs=1)
        first.fit(model, _data())
        again = L.Trainer(strategy=strategy, accelerator="auto", devices=1, max_epochs=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        predictions = again.predict(model, _data())
        again.fit(model, _data())  # the same object trains on: a second epoch
        return model, predictions, again

    ours, our_predictions, again = trainers(strategy)
    ref, ref_predictions, _ = trainers(reference)
    assert isinstance(again.strategy, FastOptStrategy) and again.strategy is strategy
    assert all(torch.equal(a, b) for a, b in zip(our_predictions, ref_predictions))
    assert_modules_equal(ours, ref)
