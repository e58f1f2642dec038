"""The fastopt strategies and precision plugin for Lightning Fabric."""

from lightning_fastopt.fabric.precision import FastOptFabricPrecision
from lightning_fastopt.fabric.strategy import FastOptFabricStrategy

__all__ = ["FastOptFabricPrecision", "FastOptFabricStrategy"]
