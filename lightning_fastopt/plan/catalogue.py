"""Third-party optimizers verified to update each parameter from its own gradient and state
alone (issue 74): the strategies step them on their shares of whole parameters (offloaded,
sharded by ZeRO) with no argument, as they step torch's, through the optimizer's own ``step``
on the master weights (:class:`~lightning_fastopt.optim.user_step.UserStepOptimizer`).

Each entry names the class by module and name, the package that ships it and the versions
its test covers (tests/test_catalogue.py runs the real package offloaded at 0.5 and 1, under
``bf16-true`` and resumed from a checkpoint, bit for bit with Lightning's own strategy; ZeRO
stage 2 at two processes in the slow tests), the hyper-parameters under which the claim
does not hold (a norm over every gradient), and the methods a training loop calls before
the class steps (``ready``: schedule-free's ``train()``; the claim check calls them too).
What such a class keeps beside its parameters' state (its groups' counters, MADGRAD's
``state["k"]``) and the methods its users call (``train()``, ``eval()``) are handled on
every share (:mod:`~lightning_fastopt.optim.beside_parameters`,
:mod:`~lightning_fastopt.offload.shared_methods`).  A subclass that overrides ``step``, a version
outside the range, or such a hyper-parameter runs as torch runs it, as any other class does,
and the set-up says why.  ``per_parameter_optimizers`` names a class the catalogue lacks.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from lightning_fastopt.optim.from_torch import _defined

__all__ = ["CATALOGUE", "Entry", "catalogued"]


@dataclass(frozen=True)
class Entry:
    """A class verified per parameter: ``module`` and ``name`` as the class says them,
    ``package`` (its distribution) and ``versions`` (the range its test covers), and
    ``breaks``: hyper-parameters (of the optimizer's defaults) with the test of a value under
    which a step combines parameters, and why."""

    module: str
    name: str
    package: str
    versions: str
    breaks: tuple[tuple[str, Callable[[Any], bool], str], ...] = field(default=())
    ready: tuple[str, ...] = ()  # methods a training loop calls before stepping (schedule-free's train())

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name}"


def _positive(value: Any) -> bool:
    return bool(value) and value > 0


_PYTORCH_OPTIMIZER = ">=4.1,<4.2"
_SCHEDULEFREE = ">=1.4,<1.5"

CATALOGUE: tuple[Entry, ...] = (
    Entry("lion_pytorch.lion_pytorch", "Lion", "lion-pytorch", ">=0.2.5,<0.3"),
    Entry("pytorch_optimizer.optimizer.lion", "Lion", "pytorch-optimizer", _PYTORCH_OPTIMIZER),
    Entry("pytorch_optimizer.optimizer.adan", "Adan", "pytorch-optimizer", _PYTORCH_OPTIMIZER,
          (("max_grad_norm", _positive, "it clips by the norm of every gradient"),)),
    Entry("pytorch_optimizer.optimizer.adamp", "AdamP", "pytorch-optimizer", _PYTORCH_OPTIMIZER),
    Entry("pytorch_optimizer.optimizer.ademamix", "AdEMAMix", "pytorch-optimizer", _PYTORCH_OPTIMIZER),
    Entry("pytorch_optimizer.optimizer.soap", "SOAP", "pytorch-optimizer", _PYTORCH_OPTIMIZER),
    Entry("pytorch_optimizer.optimizer.madgrad", "MADGRAD", "pytorch-optimizer", _PYTORCH_OPTIMIZER),
    Entry("schedulefree.adamw_schedulefree", "AdamWScheduleFree", "schedulefree", _SCHEDULEFREE, ready=("train",)),
    Entry("schedulefree.sgd_schedulefree", "SGDScheduleFree", "schedulefree", _SCHEDULEFREE, ready=("train",)),
    Entry("schedulefree.radam_schedulefree", "RAdamScheduleFree", "schedulefree", _SCHEDULEFREE, ready=("train",)),
    Entry("transformers.optimization", "Adafactor", "transformers", ">=5.25,<5.26"),
    Entry("bitsandbytes.optim.adamw", "AdamW8bit", "bitsandbytes", ">=0.50,<0.51"),
)
"""The verified classes (docs/strategy.md has them as a table)."""


def catalogued(optimizer: Any) -> tuple[Entry | None, str | None, str | None]:
    """The entry of ``optimizer``'s class (or the class it derives from without its own
    ``step``), the installed version of its package, and why it does not hold here (None where
    it does): a ``step`` of the subclass's own, a version outside the entry's range, a
    hyper-parameter that breaks it."""
    cls = type(optimizer)
    for base in cls.__mro__:
        entry = next((e for e in CATALOGUE if e.module == base.__module__ and e.name == base.__qualname__), None)
        if entry is None:
            continue
        try:
            version = importlib.metadata.version(entry.package)
        except importlib.metadata.PackageNotFoundError:
            return entry, None, f"its package {entry.package} is not installed as a distribution"
        if base is not cls and _defined(cls.step) is not _defined(base.step):
            return entry, version, f"{cls.__name__} overrides the step of {entry.where}, the class verified"
        if Version(version) not in SpecifierSet(entry.versions):
            return entry, version, (f"{entry.package} {version} is outside the versions its catalogue entry was "
                                    f"verified on ({entry.versions})")
        defaults = getattr(optimizer, "defaults", {})
        for key, breaks, why in entry.breaks:
            values = [g.get(key, defaults.get(key)) for g in optimizer.param_groups]
            if any(breaks(v) for v in values):
                return entry, version, f"{key}={next(v for v in values if breaks(v))!r}: {why}"
        return entry, version, None
    return None, None, None
