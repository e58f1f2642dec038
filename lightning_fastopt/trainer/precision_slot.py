"""The precision plugin of a Trainer strategy of lightning_fastopt: Lightning's, as ours.

Lightning sets the plugin it built from the ``precision`` flag (or the user's, through
``plugins=``) on the strategy; the fastopt strategies keep the front-end's
:class:`~lightning_fastopt.trainer.precision.TrainerPrecision` made from it, with the
strategy's loss-scale knobs (``_scale_knobs``).  A plugin we cannot step with
(TransformerEngine's, a project's own) is kept as it is for validate, test and predict;
``_foreign_precision`` holds the refusal that ``fit`` raises when it sets up the optimizers.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_fastopt.trainer.precision import TrainerPrecision


class PrecisionSlot:
    """A mixin before Lightning's strategy class: ``precision_type`` names the front-end's
    plugin class; ``_scale_knobs`` and ``_foreign_precision`` are set in ``__init__``
    before Lightning's (which sets the plugin)."""

    precision_type: type[TrainerPrecision]
    _scale_knobs: dict[str, Any]
    _foreign_precision: TypeError | None = None

    @property
    @override
    def precision_plugin(self) -> TrainerPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = self.precision_type("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin) -> None:
        self._foreign_precision = None
        try:
            self._precision_plugin = None if plugin is None else self.precision_type.from_lightning(
                plugin, **self._scale_knobs)
        except TypeError as refusal:
            self._precision_plugin, self._foreign_precision = plugin, refusal

    def _refuse_foreign_precision(self) -> None:
        """At fit's set-up: our step cannot run under a plugin we could not take."""
        if self._foreign_precision is not None:
            raise self._foreign_precision
