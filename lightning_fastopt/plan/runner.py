"""What runs one of the user's optimizers, and why: our kernel, its own ``step`` on the
master weights where they live, torch as it is (on the model's weights, as Lightning's own
strategy runs it), or nothing (Lightning's stand-in when ``configure_optimizers`` returns
None).

The strategies step shares apart (:mod:`~lightning_fastopt.optim.known_steps` says which
steps give torch's bits there, :mod:`~lightning_fastopt.plan.catalogue` which third-party
classes are verified to): ``shares="parameters"`` under the DDP strategies (whole
parameters: the device's, each host bucket's, a rank's), ``shares="rows"`` under the FSDP
strategies (each rank's rows of every parameter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_fastopt.optim.base import FusedOptimizer
from lightning_fastopt.optim.closure import evaluates_closure_again
from lightning_fastopt.optim.from_torch import engine_class, why_not_fused
from lightning_fastopt.optim.known_steps import steps_per_parameter, steps_rows
from lightning_fastopt.optim.user_step import shared_methods
from lightning_fastopt.optim.wrapper import unwrapped
from lightning_fastopt.plan.catalogue import catalogued
from lightning_fastopt.plan.claim_check import combines_parameters

__all__ = ["RUNNERS", "SHARES", "Runner", "choose_runner"]

RUNNERS = ("kernel", "own step", "torch", "nothing")
"""What may run an optimizer: the first two in an engine, on the strategy's shares."""

SHARES = {"parameters": ("the model's weights", "per_parameter_optimizers"),
          "rows": ("the DTensor parameters", "elementwise_optimizers")}
"""The shares a strategy steps apart: where an optimizer that runs as torch steps instead,
and the strategy's argument that names classes known to work on such shares."""


@dataclass(frozen=True)
class Runner:
    """The choice for one optimizer (``name``: its class's): ``runs`` one of
    :data:`RUNNERS`, ``why`` (for ``"own step"``: why not a kernel; for ``"torch"``: why not
    on the shares), ``engine`` the class of the optimizer that runs it in an engine (our
    kernel's, or :class:`~lightning_fastopt.optim.user_step.UserStepOptimizer`), ``on``
    where one that runs as torch steps."""

    name: str
    runs: str
    why: str = ""
    engine: type[FusedOptimizer] | None = None
    on: str = ""
    mapped: bool = False  # a torch optimizer run by our kernel class (said in one line)
    catalogued: str = ""  # the package and version of a class the catalogue verified
    user_class: type | None = None  # the user's class, where its own step runs (its methods run on every share)

    @property
    def in_engine(self) -> bool:
        return self.runs in ("kernel", "own step")

    def line(self) -> str | None:
        """What the set-up says of it (None: nothing to say)."""
        if self.runs == "kernel" and self.mapped:
            return f"running {self.name} as {self.engine.__name__} with the same hyperparameters"
        if self.runs == "own step" and self.catalogued:
            return (f"{self.name} ({self.catalogued}) runs its own step on the master weights, where they live: "
                    "catalogued as updating each parameter alone (lightning_fastopt.plan.catalogue)"
                    + self._methods())
        if self.runs == "own step":
            return (f"{self.name} runs its own step on the master weights, where they live (not fused: {self.why})"
                    + self._methods())
        if self.runs == "torch":
            return f"{self.name} runs as torch runs it, on {self.on}, not offloaded: {self.why}"
        return None

    def _methods(self) -> str:
        names = shared_methods(self.user_class) if self.user_class is not None else ()
        return f"; {' and '.join(f'{n}()' for n in names)} run on every share" if names else ""

    def describe(self) -> str:
        """Its cell in the plan's table."""
        if self.runs == "kernel":
            return f"kernel ({self.engine.__name__})"
        return self.runs if self.runs == "nothing" else f"{self.runs} ({self.why})"


def choose_runner(optimizer: Any, *, shares: str, closure_optimizers: tuple[str, ...] = (),
                  named: tuple[str, ...] = (), stand_in: type | None = None) -> Runner:
    """What runs ``optimizer`` on ``shares`` (one of :data:`SHARES`): ``closure_optimizers``
    (their step evaluates the closure again after changing the weights) run as torch,
    ``named`` (the strategy's argument for these shares) are known to work there;
    ``stand_in``: Lightning's optimizer for no optimizer, which steps nothing."""
    optimizer = unwrapped(optimizer)
    name = type(optimizer).__name__
    on, argument = SHARES[shares]
    if stand_in is not None and isinstance(optimizer, stand_in):
        return Runner(name, "nothing")
    if evaluates_closure_again(optimizer, closure_optimizers):
        why = ("its step evaluates the closure again after changing them" if isinstance(optimizer, torch.optim.LBFGS)
               else "named in closure_optimizers")
        return Runner(name, "torch", why, on="the model's weights")
    if shares == "rows" and not steps_rows(optimizer, named):
        return Runner(name, "torch", "its step is not known to work element by element, and on each rank's rows a "
                                     "norm or matrix function of a parameter would span only those rows "
                                     f"({argument}=[{name!r}] steps it on them)", on=on)
    if shares == "parameters" and steps_per_parameter(optimizer, named) and not steps_per_parameter(optimizer):
        differed = combines_parameters(optimizer)  # named in per_parameter_optimizers: the claim checked
        if differed is not None:
            raise ValueError(f"{name} is named in per_parameter_optimizers as updating each parameter from its own "
                             f"gradient and state alone, but {differed}: its step combines parameters, and on the "
                             "strategy's shares (the device's, each host bucket's, a rank's) it would give other numbers "
                             f"than torch. Leave it out of per_parameter_optimizers: it then runs as torch runs it")
    if shares == "parameters" and not steps_per_parameter(optimizer, named):
        entry, version, why_not = catalogued(optimizer)
        if entry is not None and why_not is None:
            why_not = combines_parameters(optimizer, entry.ready)  # the catalogue's claim, checked with these settings
        if entry is not None and why_not is None:
            return Runner(name, "own step", f"catalogued ({entry.package} {version})", engine_class(optimizer),
                          catalogued=f"{entry.package} {version}", user_class=type(optimizer))
        return Runner(name, "torch", (f"{why_not}; " if why_not else "") +
                      "its step is not known to update each parameter from its own gradient and state alone, and the "
                      "strategy steps shares of the parameters apart (the device's, each host bucket's, a rank's), "
                      f"where a norm over every gradient would see one share's ({argument}=[{name!r}] steps it on "
                      "them)", on=on)
    why_not = why_not_fused(optimizer)
    if why_not is not None:
        return Runner(name, "own step", why_not, engine_class(optimizer), user_class=type(optimizer))
    return Runner(name, "kernel", engine=engine_class(optimizer), mapped=not isinstance(optimizer, FusedOptimizer))
