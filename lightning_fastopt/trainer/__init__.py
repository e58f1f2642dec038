"""The fastopt strategies and precision plugin for Lightning's Trainer: written once
(:mod:`.strategy`, :mod:`.precision`), bound to ``lightning.pytorch`` here
(:mod:`.lightning_pytorch`) and to the standalone ``pytorch_lightning`` in
:mod:`.pytorch_lightning` (imported only where that package is installed)."""

from lightning_fastopt.trainer.lightning_pytorch import FastOptFSDPStrategy, FastOptPrecision, FastOptStrategy

__all__ = ["FastOptFSDPStrategy", "FastOptPrecision", "FastOptStrategy"]
