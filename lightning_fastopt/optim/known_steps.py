"""Which optimizers the engines step on a share of the parameters, and which run as torch.

An engine does not run an optimizer's ``step`` once over the model's parameters, as torch
does: it runs it on each share (the accelerator's, each host bucket's, the parameters a
rank owns under ZeRO; under ``fastopt_fsdp`` each rank's rows of every parameter), on the
fp32 masters where they live.  That gives torch's bits only for a step that never
combines what two shares hold:

- under the DDP strategies (``fastopt``, ``fastopt_offload``, ``fastopt_zero*``), shares
  are whole parameters: the step must update each parameter from its own gradient and
  state alone (:func:`steps_per_parameter`).  A norm over every gradient inside ``step``
  (timm's ``Lamb`` clips that way by default), or a statistic over all parameters
  (Prodigy's, D-Adaptation's step size), would see one share's.  Known to be per
  parameter: our kernels, torch's optimizers whose ``step`` is torch's (LBFGS, which
  flattens every parameter and evaluates the closure again, runs as torch anyway), and the
  classes a user names in the strategy's ``per_parameter_optimizers``;
- under ``fastopt_fsdp`` an optimizer's ``step`` sees DTensor parameters, where a norm, a
  mean over rows or a matrix function of one spans every rank's rows; ours steps plain
  tensors over this rank's rows, so the step must work element by element
  (:func:`steps_rows`): our kernels (LAMB's and LARS's norms over whole parameters are
  summed over the ranks by :class:`~lightning_fastopt.fsdp.LocalShardOptimizer`),
  torch's elementwise optimizers with their own ``step``, and the classes a user names in
  the strategy's ``elementwise_optimizers``.

Any other optimizer (a user's or third-party class with its own ``step``: a LARS, Muon,
Shampoo or Prodigy written in torch, or one whose kernels run on the accelerator only)
runs as torch runs it, on the model's weights (the DTensors under FSDP), not offloaded:
the run ends where Lightning's own strategy ends, and one log line names the argument
that steps it on shares (the run's plan, :mod:`~lightning_fastopt.plan.runner`).
"""

from __future__ import annotations

import torch

from lightning_fastopt.optim.base import FusedOptimizer
from lightning_fastopt.optim.from_torch import _defined

__all__ = ["ELEMENTWISE_TORCH_OPTIMIZERS", "steps_per_parameter", "steps_rows"]

# torch's optimizers whose step updates each element from that element's gradient and state
# and per-step scalars alone (AdamW is a subclass of Adam)
ELEMENTWISE_TORCH_OPTIMIZERS = (torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
                                torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                                torch.optim.ASGD, torch.optim.Rprop)


def _ours_or_named(optimizer: torch.optim.Optimizer, named: tuple[str, ...]) -> bool:
    """One of our optimizers, or of a class (or subclass of one) named in ``named``."""
    return isinstance(optimizer, FusedOptimizer) or any(c.__name__ in named for c in type(optimizer).__mro__)


def steps_rows(optimizer: torch.optim.Optimizer, named: tuple[str, ...] = ()) -> bool:
    """Whether ``optimizer``'s step may run on each rank's rows as plain tensors: ours, a
    class (or subclass of one) named in ``named`` (the strategy's ``elementwise_optimizers``),
    or one of torch's elementwise optimizers (or a subclass) whose ``step`` is torch's."""
    if _ours_or_named(optimizer, named):
        return True
    cls = type(optimizer)
    base = next((c for c in cls.__mro__ if c in ELEMENTWISE_TORCH_OPTIMIZERS), None)
    return base is not None and _defined(cls.step) is _defined(base.step)


def steps_per_parameter(optimizer: torch.optim.Optimizer, named: tuple[str, ...] = ()) -> bool:
    """Whether ``optimizer``'s step may run on shares of whole parameters: ours, a class (or
    subclass of one) named in ``named`` (the strategy's ``per_parameter_optimizers``), or
    one whose ``step`` is one of torch's optimizers' (LBFGS's excepted)."""
    if _ours_or_named(optimizer, named):
        return True
    step = _defined(type(optimizer).step)
    torchs = next((c for c in type(optimizer).__mro__ if f"{c.__module__}.".startswith("torch.optim.")
                   and "step" in vars(c)), None)
    return torchs is not None and torchs is not torch.optim.LBFGS and step is _defined(torchs.step)
