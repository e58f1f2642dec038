"""Which optimizers ``fastopt_fsdp`` steps on each rank's rows.

Under ``ModelParallelStrategy`` an optimizer's ``step`` sees DTensor parameters: a norm,
a mean over rows or a matrix function of one spans every rank's rows.  Ours steps plain
tensors over this rank's rows (offloading them where asked), which gives torch's bits
only for a step that works element by element: our kernels (LAMB and LARS, which take
norms over whole parameters, are refused by :class:`~lightning_fastopt.fsdp.LocalShardOptimizer`),
torch's elementwise optimizers with their own ``step``, and the classes a user names in
the strategy's ``elementwise_optimizers``.  Any other optimizer (a user's LARS, Muon or
Shampoo written in torch) runs as torch runs it, on the DTensor parameters, not
offloaded: the run ends where ``ModelParallelStrategy``'s ends.
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_fastopt.optim.base import FusedOptimizer
from lightning_fastopt.optim.from_torch import _defined

__all__ = ["ELEMENTWISE_TORCH_OPTIMIZERS", "steps_rows", "say_steps_dtensors"]

# torch's optimizers whose step updates each element from that element's gradient and state
# and per-step scalars alone (AdamW is a subclass of Adam)
ELEMENTWISE_TORCH_OPTIMIZERS = (torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
                                torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                                torch.optim.ASGD, torch.optim.Rprop)


def steps_rows(optimizer: torch.optim.Optimizer, named: tuple[str, ...] = ()) -> bool:
    """Whether ``optimizer``'s step may run on each rank's rows as plain tensors: ours, a
    class (or subclass of one) named in ``named`` (the strategy's ``elementwise_optimizers``),
    or one of torch's elementwise optimizers (or a subclass) whose ``step`` is torch's."""
    cls = type(optimizer)
    if isinstance(optimizer, FusedOptimizer) or any(c.__name__ in named for c in cls.__mro__):
        return True
    base = next((c for c in cls.__mro__ if c in ELEMENTWISE_TORCH_OPTIMIZERS), None)
    return base is not None and _defined(cls.step) is _defined(base.step)


def say_steps_dtensors(optimizer: torch.optim.Optimizer) -> None:
    """The one line that says an optimizer runs as torch runs it, on the DTensors."""
    name = type(optimizer).__name__
    rank_zero_info(f"lightning_fastopt: {name} runs as torch runs it, on the DTensor parameters, not offloaded: its "
                   f"step is not known to work element by element, and on each rank's rows a norm or matrix function "
                   f"of a parameter would span only those rows (elementwise_optimizers=[{name!r}] steps it on them)")
