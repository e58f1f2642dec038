"""What the fastopt strategies refuse at set-up, before a training step has run, naming
the parameter: a dtype the offload and ZeRO optimizers do not keep masters of (complex,
integer; float64 ones are stepped by the user's optimizer class) and gradients
that will be sparse (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_fastopt.optim.base import check_dtype


def check_parameters(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """Raise TypeError (dtype) or ValueError (sparse gradients) for the first parameter of
    ``optimizer`` that the fused optimizers cannot step."""
    names = {p: n for n, p in module.named_parameters(remove_duplicate=False)}
    sparse = {m.weight: type(m).__name__ for m in module.modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(p, "a parameter not in the module")
            if p.dtype != torch.float64:
                check_dtype(p, f"parameter {name!r}", "the fastopt strategies step float64 (with the optimizer's "
                            "own step) and")
            if p in sparse:
                raise ValueError(f"parameter {name!r} gets sparse gradients ({sparse[p]}(sparse=True)): the fused "
                                 "optimizers need dense ones; build it with sparse=False")
