"""The precision plugin of a Trainer strategy of lightning_fastopt: Lightning's, as ours.

Lightning sets the plugin it built from the ``precision`` flag (or the user's, through
``plugins=``) on the strategy; the fastopt strategies keep the front-end's
:class:`~lightning_fastopt.trainer.precision.TrainerPrecision` made from it, with the
strategy's loss-scale knobs.  A plugin we cannot step with (TransformerEngine's, a
project's own) is kept as it is for validate, test and predict, and ``fit`` raises the
refusal when it sets up the optimizers.  :class:`PrecisionAdoption` makes those choices (a
part the strategy holds); :class:`PrecisionSlot` is the property Lightning sets and reads,
over Lightning's strategy class, which asks that part and nothing else of the strategy.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_fastopt.trainer.precision import TrainerPrecision


class PrecisionAdoption:
    """Args:
        precision_type: the front-end's plugin class.
        scale_knobs: the strategy's fp16 loss-scale arguments (DynamicLossScaler's).
    """

    def __init__(self, precision_type: type[TrainerPrecision], scale_knobs: dict[str, Any]) -> None:
        self.precision_type = precision_type
        self.scale_knobs = scale_knobs
        self.refusal: TypeError | None = None  # why a plugin kept as it is cannot step with us

    def default(self) -> TrainerPrecision:
        """The plugin where Lightning has set none yet."""
        return self.precision_type("32-true")

    def adopt(self, plugin) -> Any:
        """The plugin to keep for the one Lightning sets: ours made from it, or it as it is
        (with the refusal noted) where ours cannot be."""
        self.refusal = None
        if plugin is None:
            return None
        try:
            return self.precision_type.from_lightning(plugin, **self.scale_knobs)
        except TypeError as refusal:
            self.refusal = refusal
            return plugin

    def refuse_foreign(self) -> None:
        """At fit's set-up: our step cannot run under a plugin we could not take."""
        if self.refusal is not None:
            raise self.refusal


class PrecisionSlot:
    """A mixin before Lightning's strategy class: its ``precision_plugin`` property, whose
    choices are the strategy's :class:`PrecisionAdoption` (``_precisions``, made in
    ``__init__`` before Lightning's, which sets the plugin)."""

    _precisions: PrecisionAdoption

    @property
    @override
    def precision_plugin(self) -> TrainerPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = self._precisions.default()
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin) -> None:
        self._precision_plugin = self._precisions.adopt(plugin)
