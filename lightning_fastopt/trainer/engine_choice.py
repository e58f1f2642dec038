"""Whether an engine steps an optimizer of a Trainer strategy, or it runs as Lightning's own
strategy runs it (said in one line): the decision the strategies make at set-up for each
optimizer from ``configure_optimizers``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_fastopt.core.precision import needs_closure
from lightning_fastopt.optim.known_steps import say_runs_as_torch


def runs_in_engine(optimizer, mock_optimizer: type, closure_optimizers: Sequence[str],
                   steps_on_shares: Callable[[Any], bool]) -> bool:
    """Whether an engine can step ``optimizer``: not Lightning's stand-in when
    ``configure_optimizers`` returns None (``mock_optimizer``), nor LBFGS and the classes
    named in ``closure_optimizers``, whose step evaluates the closure again after changing
    the weights (the weights it changes must be the model's), nor a step not known to give
    torch's bits on the strategy's shares (``steps_on_shares``, which says why)."""
    if isinstance(optimizer, mock_optimizer):
        return False
    if needs_closure(optimizer, closure_optimizers):
        say_runs_as_torch(optimizer)
        return False
    return steps_on_shares(optimizer)


def steps_as_torch(optimizers: Sequence[Any], in_engine: Sequence[bool], mock_optimizer: type) -> list[str]:
    """The names of the optimizers that run as torch runs them and step (Lightning's
    stand-in for no optimizer steps nothing)."""
    return [type(opt).__name__ for opt, engine in zip(optimizers, in_engine)
            if not engine and not isinstance(opt, mock_optimizer)]
