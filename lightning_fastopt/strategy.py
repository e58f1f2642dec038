"""FastOptStrategy: Lightning's DDP strategy with lightning_fastopt's fused optimizers and
precision plugin.

``import lightning_fastopt`` registers the name ``fastopt`` (fused kernels, no offload);
``Trainer(strategy="fastopt", precision="16-mixed")`` then needs no other change to a
Lightning project.  What the strategy adds to ``DDPStrategy`` (so devices, launchers,
cluster environments and torchrun work as in Lightning):

- the precision flag becomes :class:`~lightning_fastopt.precision.FastOptPrecision`
  with the strategy's loss-scale knobs (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``;
  anything else is a TypeError naming those);
- the optimizer from ``configure_optimizers`` (or the CLI) is mapped to the fused
  equivalent: ``torch.optim.Adam/AdamW/SGD/Adagrad`` become ``FusedAdam``/``FusedSGD``/
  ``FusedAdagrad`` with the same hyperparameters, sharing the very same ``param_groups``
  dicts, so LR schedulers bound to the user's optimizer keep working; our own optimizers
  are used as they are; any other optimizer is a clear error.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy

from lightning_fastopt.loss_scaler import DynamicLossScaler
from lightning_fastopt.optim import FusedAdagrad, FusedAdam, FusedOptimizer, FusedSGD
from lightning_fastopt.precision import SUPPORTED_PRECISIONS, FastOptPrecision

log = logging.getLogger(__name__)

# torch optimizer class -> the fused class that runs it
_MAPPED = {
    torch.optim.Adam: FusedAdam,
    torch.optim.AdamW: FusedAdam,
    torch.optim.SGD: FusedSGD,
    torch.optim.Adagrad: FusedAdagrad,
}
_SUPPORTED_NAMES = ("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.SGD", "torch.optim.Adagrad",
                    "lightning_fastopt.FusedAdam/CPUAdam/FusedLAMB/FusedSGD/FusedLars/FusedLion/FusedAdagrad")


def to_fused_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The fused equivalent of a torch optimizer, sharing its param_groups (and state)."""
    if isinstance(optimizer, FusedOptimizer):
        return optimizer
    fused_cls = _MAPPED.get(type(optimizer))
    if fused_cls is None:
        raise ValueError(f"the fastopt strategies cannot run {type(optimizer).__module__}.{type(optimizer).__name__}; "
                         f"supported optimizers: {', '.join(_SUPPORTED_NAMES)}")
    for group in optimizer.param_groups:
        for flag in ("differentiable", "capturable"):
            if group.get(flag):
                raise ValueError(f"{type(optimizer).__name__}({flag}=True) cannot be mapped to {fused_cls.__name__}")
    placeholder = torch.nn.Parameter(torch.zeros(1))
    fused = fused_cls([placeholder], **_fused_kwargs(optimizer))
    # the same dict objects: a scheduler writing group["lr"] into the user's optimizer
    # reaches ours; our own keys get their defaults
    fused.param_groups = optimizer.param_groups
    for group in fused.param_groups:
        for key, value in fused.defaults.items():
            group.setdefault(key, value)
        fused._validate_group(group)
    # the state moves over as it is (not through load_state_dict, which would replace the
    # shared param_groups with copies); ours keeps float32 state
    fused.state.clear()
    for p, st in optimizer.state.items():
        fused.state[p] = {k: v if k == "step" or not torch.is_tensor(v) else v.float().contiguous()
                          for k, v in st.items()}
    return fused


def _fused_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    d = optimizer.defaults
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or d.get("decoupled_weight_decay", False)
        return dict(lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                    amsgrad=d["amsgrad"], adamw_mode=bool(decoupled), maximize=d.get("maximize", False))
    if isinstance(optimizer, torch.optim.SGD):
        return dict(lr=d["lr"], momentum=d["momentum"], dampening=d["dampening"], weight_decay=d["weight_decay"],
                    nesterov=d["nesterov"], maximize=d.get("maximize", False))
    return dict(lr=d["lr"], lr_decay=d["lr_decay"], weight_decay=d["weight_decay"],
                initial_accumulator_value=d["initial_accumulator_value"], eps=d["eps"],
                maximize=d.get("maximize", False))


class FastOptStrategy(DDPStrategy):
    """DDP with fused optimizer steps and DeepSpeed-style fp16 loss scaling.

    Args:
        loss_scale: 0 for dynamic loss scaling (fp16), or a fixed scale.
        initial_scale_power: dynamic scaling starts at ``2 ** initial_scale_power``.
        loss_scale_window: clean steps before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        min_loss_scale: the scale never goes below this.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.
    """

    strategy_name = "fastopt"

    def __init__(self, loss_scale: float = 0.0, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, min_loss_scale: float = 1.0, **kwargs: Any) -> None:
        # set before super().__init__, which calls the precision_plugin setter
        self._scale_knobs = dict(loss_scale=loss_scale, initial_scale_power=initial_scale_power,
                                 loss_scale_window=loss_scale_window, hysteresis=hysteresis,
                                 min_loss_scale=min_loss_scale)
        DynamicLossScaler(**self._scale_knobs)  # bad knobs fail here, with the argument's name
        self._user_optimizers: dict[int, torch.optim.Optimizer] = {}
        super().__init__(**kwargs)

    # ------------------------------------------------------------------ precision
    @property
    def precision_plugin(self) -> FastOptPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = FastOptPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else self._to_fastopt_precision(plugin)

    def _to_fastopt_precision(self, plugin: Precision) -> FastOptPrecision:
        if isinstance(plugin, FastOptPrecision):
            return plugin
        if isinstance(plugin, MixedPrecision):
            device = getattr(plugin, "device", None)
            return FastOptPrecision(plugin.precision, device=device, **self._scale_knobs)
        if type(plugin) is Precision:
            return FastOptPrecision("32-true")
        raise TypeError(f"the fastopt strategies support precision in {SUPPORTED_PRECISIONS} "
                        f"(or plugins=[FastOptPrecision(...)]), got {type(plugin).__name__}"
                        f"({getattr(plugin, 'precision', '?')!r})")

    # ------------------------------------------------------------------ optimizers
    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        fused = []
        for opt in self.optimizers:
            new = to_fused_optimizer(opt)
            if new is not opt:
                log.info("lightning_fastopt: running %s as %s with the same hyperparameters",
                         type(opt).__name__, type(new).__name__)
                self._user_optimizers[id(new)] = opt
            fused.append(new)
        self.optimizers = fused

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        user = self._user_optimizers.get(id(optimizer))
        if user is not None:
            user._opt_called = True  # LR schedulers bound to the user's optimizer check this
        return out

    # ------------------------------------------------------------------ registry
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="DDP with lightning_fastopt's fused optimizers and fp16 loss scaling")
