"""A model built on the meta device, made in host memory and initialized on every core
(issue 66's largest model: the 7.25B try of 2026-11-28 spent its call building).

``reset_parameters`` draws each tensor's random numbers on one thread from torch's one
generator (about 0.22 G parameters a second on this project's dev VM, 2026-12-07): a 12B
model takes a minute before its first step.  :func:`initialize_on_all_cores` instead cuts
each weight into chunks and fills them on a pool of threads, each chunk from a generator of
its own seeded by its place (the same values on every run of the same model and threads
or not), in the GPT's scheme (examples/gpt.py): ``Linear`` and ``Embedding`` weights
normal(0, 0.02), their biases zero, ``LayerNorm`` weights one and biases zero.  Not the
values ``reset_parameters`` would draw: a benchmark's timings and memory do not depend on
them.  A module of any other kind, or with buffers on the meta device, is reset as the
strategy would (``reset_parameters``, on the calling thread).

FSDP's shards (DTensors) are filled through their local tensors: each rank draws its own
rows' chunks.  Tied weights stay tied, filled once.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

CHUNK = 1 << 24  # elements a task fills (64 MiB of float32)
STD = 0.02


def initialize_on_all_cores(model: nn.Module, seed: int = 0, threads: int | None = None) -> int:
    """Materialize ``model``'s meta tensors in host memory and fill them (above) on ``threads``
    threads (default: the cores this process may use); the elements filled."""
    fills: list[tuple[torch.Tensor, str]] = []
    made: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}  # a meta parameter's id: it (kept) and what it became
    filled: set[int] = set()  # (tied weights: filled once, by their first owner)
    for module in model.modules():
        if not _materialize(module, made):
            continue
        known = isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)) and not list(module.buffers(False))
        if not known:
            module.reset_parameters()
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in filled:
                filled.add(id(param))
                kind = "zero" if name == "bias" else "one" if isinstance(module, nn.LayerNorm) else "normal"
                fills.append((_local(param), kind))
    tasks = []
    for i, (tensor, kind) in enumerate(fills):
        flat = tensor.view(-1)
        for j, start in enumerate(range(0, flat.numel(), CHUNK)):
            tasks.append((flat[start:start + CHUNK], kind, (seed, i, j)))
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:  # (the chunks are detached: no autograd)
        list(pool.map(_fill, tasks))
    return sum(t.numel() for t, _ in fills)


def _materialize(module: nn.Module, made: dict) -> bool:
    """Give ``module``'s own meta parameters and buffers uninitialized host memory (as
    ``Module.to_empty`` does, DTensors staying DTensors), a parameter tied to one made
    already the same; whether any of its own was on the meta device.  Not ``to_empty``: on a
    module whose parameters are partly made it gives those new storage too (``param.data``
    swapped in place), which a tied weight's fill had already written."""
    was_meta = False
    for name, param in module._parameters.items():
        if param is not None and id(param) in made:
            module._parameters[name] = made[id(param)][1]
        elif param is not None and param.is_meta:
            was_meta = True
            made[id(param)] = (param, nn.Parameter(torch.empty_like(param, device="cpu"),
                                                   requires_grad=param.requires_grad))
            module._parameters[name] = made[id(param)][1]
    for name, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta:
            was_meta = True
            module._buffers[name] = torch.empty_like(buffer, device="cpu")
    return was_meta


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds of ``param`` (a DTensor's local shard)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.detach()


def _fill(task: tuple[torch.Tensor, str, tuple[int, int, int]]) -> None:
    chunk, kind, place = task
    if kind == "zero":
        chunk.zero_()
    elif kind == "one":
        chunk.fill_(1.0)
    else:
        seed, tensor, index = place
        generator = torch.Generator().manual_seed((seed * 1_000_003 + tensor) * 1_000_003 + index)
        chunk.normal_(0.0, STD, generator=generator)
