"""pytest plugin: run Lightning's own tests of ``ModelParallelStrategy`` (FSDP2) with
lightning_fastopt's ``FastOptFSDPStrategy`` swapped in.

Load with ``-p fastopt_fsdp_swap`` (this file's folder on PYTHONPATH), from the peer
suite's ``tests`` folder.  ``lightning.pytorch.strategies.ModelParallelStrategy`` (and the
name in its own module) becomes a subclass of ``FastOptFSDPStrategy`` whose defaults are
``offload_fraction=FASTOPT_SWAP_FRACTION`` (default 0.5) and ``copy_on_cpu=True``: every
test that builds the class, or names it, gets ours.  Not part of the project's tests: the
numbers it gives are in docs/compatibility.md.

Environment:
  FASTOPT_SWAP=0            load the plugin but swap nothing (baseline with identical plumbing)
  FASTOPT_SWAP_FRACTION     offload_fraction (default 0.5)
"""

from __future__ import annotations

import os

_SETTINGS = {"swap": os.environ.get("FASTOPT_SWAP", "1") != "0",
             "fraction": float(os.environ.get("FASTOPT_SWAP_FRACTION", "0.5"))}


def pytest_configure(config):
    if not _SETTINGS["swap"]:
        return
    import lightning.pytorch.strategies as strategies
    import lightning.pytorch.strategies.model_parallel as model_parallel

    from lightning_fastopt import FastOptFSDPStrategy

    class ModelParallelStrategy(FastOptFSDPStrategy):
        def __init__(self, *args, offload_fraction=_SETTINGS["fraction"], copy_on_cpu=True, **kwargs):
            names = ("data_parallel_size", "tensor_parallel_size", "save_distributed_checkpoint",
                     "process_group_backend", "timeout")
            kwargs.update(zip(names, args))  # ModelParallelStrategy's arguments, by position
            super().__init__(offload_fraction=offload_fraction, copy_on_cpu=copy_on_cpu, **kwargs)

        def setup_environment(self):
            # Lightning's default mesh (data parallel across nodes, tensor parallel within), which the
            # tests assume; FastOptFSDPStrategy's own makes every process data-parallel
            if self._data_parallel_size == "auto":
                self._data_parallel_size = self.num_nodes
            if self._tensor_parallel_size == "auto":
                self._tensor_parallel_size = self.num_processes
            super().setup_environment()

    strategies.ModelParallelStrategy = model_parallel.ModelParallelStrategy = ModelParallelStrategy


def pytest_report_header(config):
    state = f"offload_fraction={_SETTINGS['fraction']}" if _SETTINGS["swap"] else "off (baseline)"
    return f"fastopt FSDP swap: {state}"
