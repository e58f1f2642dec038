"""The fastopt strategies and precision plugin for Lightning Fabric."""

from lightning_fastopt.fabric.fsdp_strategy import FastOptFabricFSDPStrategy
from lightning_fastopt.fabric.precision import FastOptFabricPrecision
from lightning_fastopt.fabric.strategy import FastOptFabricStrategy

__all__ = ["FastOptFabricFSDPStrategy", "FastOptFabricPrecision", "FastOptFabricStrategy"]
