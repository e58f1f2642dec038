"""With one process the Trainer's fastopt strategy is a single-device strategy, as
``Trainer()``'s own is.

Lightning tells a distributed run from its strategy's type: a ``DDPStrategy`` is one,
whatever its number of processes (the batch-size finder refuses it, a loader's sampler is
replaced by a ``DistributedSampler``), and a ``ParallelStrategy`` is told about the
micro-batches of gradient accumulation.  ``FastOptStrategy`` is a ``DDPStrategy``, so that
devices, launchers, cluster environments, torchrun and the CLI's DDP arguments work as in
Lightning.  Its twin for one process, each front-end's ``FastOptSingleDeviceStrategy``, is
the same shared code (:class:`~lightning_fastopt.trainer.strategy.TrainerStrategy`) over
Lightning's ``SingleDeviceStrategy`` instead, with the few members of
:class:`OneProcessTrainerStrategy`.  When the Trainer is built, Lightning says how many
processes run (``set_world_ranks``, before anything reads a rank from a cluster
environment); with one, the instance takes its twin's class (:func:`take_twin_class`), whose
ranks are all 0 as ``Trainer()``'s.  ``isinstance(s, FastOptStrategy)`` holds for both
(:class:`HasOneProcessTwin`); ``isinstance(s, DDPStrategy)`` only with several processes.

With one process, then, as under ``Trainer()``: no launcher, no process group, no
DistributedDataParallel, the loader's own sampler, the RNG not reseeded, and
``validate``/``test``/``predict`` set up as on a single device.

A subclass of ``FastOptStrategy`` (the user's) keeps its class, whose overrides the twin
does not have: with one process it runs as Lightning's ``ddp`` does on one device (a
process group of one, a ``DistributedSampler``), and one log line says so.  To run it as
``Trainer()`` does, give it a twin: put the overrides in a mixin, derive one class from it
and ``FastOptStrategy`` and one from it and ``FastOptSingleDeviceStrategy``, and name each
from the other (``one_process_type``, ``processes_type``; tests/test_one_process.py does).
"""

from __future__ import annotations

from abc import ABCMeta
from typing import Any

import torch
from typing_extensions import override

__all__ = ["HasOneProcessTwin", "OneProcessTrainerStrategy", "take_twin_class", "without_twin"]


class HasOneProcessTwin(ABCMeta):
    """The metaclass of each front-end's ``FastOptStrategy``: an instance of its
    ``one_process_type`` is an instance of it too.  Only ``isinstance`` says so:
    ``issubclass`` does not, or Lightning's ``isinstance(s, DDPStrategy)`` (which asks
    every subclass of ``DDPStrategy``) would say so as well."""

    def __instancecheck__(cls, instance: Any) -> bool:
        twin = cls.__dict__.get("one_process_type")
        return super().__instancecheck__(instance) or (twin is not None and isinstance(instance, twin))


def take_twin_class(strategy, processes: int) -> bool:
    """Give ``strategy`` the class of its one-process twin when one process runs and its
    class has a twin that names it back (see the module's documentation); True if it did."""
    twin = getattr(type(strategy), "one_process_type", None)
    if processes != 1 or twin is None or twin.processes_type is not type(strategy):
        return False
    strategy.__class__ = twin
    return True


def without_twin(strategy) -> str | None:
    """The log line for a one-process strategy that kept a several-process class: a user's
    subclass without a twin (None otherwise)."""
    twin = getattr(type(strategy), "one_process_type", None)
    if twin is None or strategy.world_size != 1:
        return None
    return (f"lightning_fastopt: {type(strategy).__name__} (a subclass of {twin.processes_type.__name__}) runs one "
            "process as Lightning's ddp does: a process group of one and a DistributedSampler (give it a twin to "
            "run as Trainer() does: see lightning_fastopt.trainer.one_process)")


class OneProcessTrainerStrategy:
    """What a one-process ``FastOptStrategy`` adds to the shared code and Lightning's
    ``SingleDeviceStrategy`` (a mixin: each front-end puts it before
    :class:`~lightning_fastopt.trainer.strategy.TrainerStrategy` and that class).  Made from
    a ``FastOptStrategy`` when the Trainer is built, never constructed itself: the devices
    given to the ``DDPStrategy`` it was stay readable (``num_nodes``, ``num_processes``);
    the first is the root device.  It has no ``parallel_devices``, as
    ``SingleDeviceStrategy`` has none: a Trainer given a strategy object that has one
    checks it against its ``accelerator`` flag, which a strategy that served a Trainer
    before sets to an accelerator object, and refuses it; the same object is built into
    a second Trainer (a library's prediction Trainer, say) as Lightning's own is."""

    processes_type: type  # the front-end's FastOptStrategy
    global_rank = local_rank = node_rank = 0
    world_size = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__name__} is what a FastOptStrategy becomes when the Trainer runs one process; "
                        "construct FastOptStrategy (or name a fastopt strategy)")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:  # a later Trainer's flag (one node: one process)
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self._parallel_devices) if self._parallel_devices is not None else 0

    def set_world_ranks(self) -> None:
        """The ranks are all 0, as ``Trainer()``'s, whatever cluster environment Lightning
        detected (it is never asked)."""

    @property
    @override
    def root_device(self) -> torch.device:
        return self._parallel_devices[0]

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """A backward of automatic optimization outside the optimizer step is a micro-batch
        that accumulates (Lightning runs its closure alone, and tells only a parallel
        strategy, through ``block_backward_sync``): the offload optimizers copy nothing
        during it, as with several processes, so that gradients add up on the device as
        torch adds them.  (``Strategy.backward`` calls this hook and ``post_backward``.)"""
        self._engines.set_accumulating(not self._stepping and self.lightning_module.automatic_optimization)
        super().pre_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        self._engines.set_accumulating(False)
        super().post_backward(closure_loss)
