"""pytest plugin: run Lightning's own ``tests_fabric`` with lightning_fastopt's Fabric
strategy swapped in (the Trainer's swap is ``../shared/peer_suites/lightning/harness``).

Load with ``-p fastopt_fabric_swap`` (this file's folder on PYTHONPATH).  Every
``lightning.fabric.Fabric`` built with no strategy (or strategy "auto"/"ddp"/None) on one
CPU device gets ``FastOptFabricStrategy(offload_fraction=..., copy_on_cpu=True)`` instead.
Not part of the project's tests: the numbers it gives are in docs/compatibility.md.

Environment:
  FASTOPT_SWAP=0            load the plugin but swap nothing (baseline with identical plumbing)
  FASTOPT_SWAP_FRACTION     offload_fraction (default 0.5)
"""

from __future__ import annotations

import functools
import os

_SWAPPABLE_STRATEGIES = (None, "auto", "ddp")
_counts = {"swapped": 0, "kept": 0}
# read once, when pytest starts: tests clear or patch os.environ
_SETTINGS = {"swap": os.environ.get("FASTOPT_SWAP", "1") != "0",
             "fraction": float(os.environ.get("FASTOPT_SWAP_FRACTION", "0.5"))}


def _one_cpu_device(kwargs) -> bool:
    accelerator = kwargs.get("accelerator", "auto")
    if not (accelerator in (None, "auto", "cpu") or type(accelerator).__name__ == "CPUAccelerator"):
        return False
    if kwargs.get("num_nodes", 1) not in (1, None):
        return False
    devices = kwargs.get("devices", "auto")
    if isinstance(devices, (list, tuple)):
        return len(devices) == 1
    return devices in (None, "auto", 1, "1")


def _install() -> None:
    from lightning.fabric import Fabric

    original = Fabric.__init__
    if getattr(original, "_fastopt_swap", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        from lightning_fastopt import FastOptFabricStrategy

        strategy = kwargs.get("strategy", "auto")
        if _SETTINGS["swap"] and not args and isinstance(strategy, (str, type(None))) \
                and strategy in _SWAPPABLE_STRATEGIES and _one_cpu_device(kwargs):
            kwargs["strategy"] = FastOptFabricStrategy(offload_fraction=_SETTINGS["fraction"], copy_on_cpu=True)
            _counts["swapped"] += 1
        else:
            _counts["kept"] += 1
        return original(self, *args, **kwargs)

    __init__._fastopt_swap = True
    Fabric.__init__ = __init__


def pytest_configure(config):
    import lightning_fastopt  # noqa: F401  (registers the names)

    _install()


def pytest_report_header(config):
    return (f"fastopt_fabric_swap: swap={'on' if _SETTINGS['swap'] else 'off'}, "
            f"offload_fraction={_SETTINGS['fraction']}, copy_on_cpu=True")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"fastopt_fabric_swap: {_counts['swapped']} Fabric(s) swapped, "
                                f"{_counts['kept']} kept")
