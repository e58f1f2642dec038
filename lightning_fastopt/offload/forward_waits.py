"""Forward waits per bucket: the next forward starts before every new weight is back.

After a step each host bucket's new weights go to the device on the copy stream, in the
order the buckets were sent.  With ``forward_waits="step"`` (the default) the compute
stream waits for the last of those copies when the step ends, so the next forward starts
once every weight has arrived.  With ``forward_waits="module"`` it waits for a bucket's
copy only just before the forward of a module that owns one of the bucket's parameters (a
forward pre-hook, :class:`ForwardWaits`): the first layers compute while later layers'
weights are still crossing, which hides the copies of the offloaded share behind the
device share's forward (fraction below 1), or behind the forward itself (the delayed
update, whose buckets are sent in forward order).  The step goes further: it ends before
its CPU updates do, and a module's forward waits first for its bucket's update
(:mod:`~lightning_fastopt.offload.left_running`).

The contract that makes this safe: between a step and the next backward, an offloaded
weight is read only by the forward of a module that owns it (or after that forward ran).
:class:`WeightsInFlight` keeps everything else ordered after every copy:

- a bucket holding a parameter that no hooked module owns (one registered on the root
  module itself, which ``training_step`` reads directly) is waited for when the step
  ends, as with ``"step"``;
- the optimizer's own reads of the weights (the next step, the first gradient of the
  next backward, state dicts, refreshing masters, new groups) and :meth:`wait_all`, which
  the strategy calls before checkpoints and evaluation, wait for every copy.

What it cannot see is user code reading a weight directly before its module runs (a
weight used through ``torch.nn.functional`` by a module that never runs its own
forward); FastOptStrategy falls back to ``"step"`` when a hook between steps is
overridden (:func:`~lightning_fastopt.trainer.grad_readers.weight_readers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from lightning_fastopt.offload.copies import CopyStreams
from lightning_fastopt.offload.slots import HostBucket

FORWARD_WAITS = ("step", "module")


def check_forward_waits(forward_waits: Any) -> None:
    if forward_waits not in FORWARD_WAITS:
        raise ValueError(f"forward_waits must be one of {FORWARD_WAITS}, got {forward_waits!r}")


class WeightsInFlight:
    """The buckets whose weight copies the compute stream has not waited for yet, in the
    order they were sent (copies run in that order: waiting for one waits for every
    earlier one); and those whose CPU update was still running when the step ended (a
    step that ends early with ``"module"``, :meth:`updating`): each is waited for on the host,
    then for its own copy, which the worker issues when the update ends, in its order."""

    def __init__(self, copies: CopyStreams, by_module: bool) -> None:
        self.copies = copies
        self.by_module = by_module
        self.covered: set[Tensor] = set()  # parameters whose module waits before its forward
        self._sent: list[HostBucket] = []
        self._updating: dict[HostBucket, Future] = {}  # sent once its update (on the worker) ends

    def __bool__(self) -> bool:
        return bool(self._sent)

    def updating(self, futures: dict[HostBucket, Future]) -> None:
        """These buckets, about to be given to :meth:`arrive_later`, are still updating on
        the worker; each future ends once the bucket's weights are on their way."""
        self._updating.update(futures)

    def arrive_later(self, sent: list[HostBucket]) -> None:
        """A step sent these buckets' weights (in order).  With ``"step"`` the compute
        stream waits for all of them now; with ``"module"`` for those up to the last one
        with a parameter no module waits for, the rest in forward."""
        self._sent += sent
        if not self.by_module:
            self.wait_all()
            return
        uncovered = [b for b in self._sent if any(s.param not in self.covered for s in b.slots)]
        if uncovered:
            self._wait_for(uncovered)

    def wait_for(self, buckets: set[HostBucket]) -> None:
        """Make the compute stream wait for these buckets' copies (a module is about to run)."""
        asked = [b for b in self._sent if b in buckets]
        if asked:
            self._wait_for(asked)

    def wait_all(self) -> None:
        if self._sent:
            self._wait_for(list(self._sent))

    def _wait_for(self, asked: list[HostBucket]) -> None:
        """Wait for ``asked`` (in :attr:`_sent`'s order): a bucket sent at the step with
        every one sent before it (one stream, in order); one still updating for its
        update, then for its own copy."""
        plain = [b for b in asked if b not in self._updating]
        through = self._sent.index(plain[-1]) if plain else -1
        done = [b for b in self._sent[:through + 1] if b not in self._updating] + \
            [b for b in asked if b in self._updating]
        for b in done:
            future = self._updating.pop(b, None)
            if future is not None:
                if not future.done():  # the forward waits on the host for the CPU (timeline.py's lane)
                    with torch.profiler.record_function("fastopt::forward_wait"):
                        future.result()
                future.result()  # the worker issued its copy
                self.copies.compute_waits_for(b.params_sent)
        if plain:
            self.copies.compute_waits_for(plain[-1].params_sent)
        gone = set(done)
        self._sent = [b for b in self._sent if b not in gone]


class ForwardWaits:
    """Forward pre-hooks on every module below ``root`` that owns parameters (``root``'s
    own are read by ``training_step`` directly: not covered).  Each asks the optimizers
    ``optimizers()`` returns (their current ones: the offload fraction may be rebuilt) to
    wait for the weights of that module's parameters.  ``covered``: those parameters."""

    def __init__(self, root: Module, optimizers: Callable[[], Iterable[Any]]) -> None:
        self.covered: set[Tensor] = set()
        self._handles = []
        for module in root.modules():
            own = list(module.parameters(recurse=False))
            if module is root or not own:
                continue
            self._handles.append(module.register_forward_pre_hook(partial(_wait, optimizers, own)))
            self.covered.update(own)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _wait(optimizers: Callable[[], Iterable[Any]], params: list[Tensor], module: Module, args: Any) -> None:
    for o in optimizers():
        o.wait_for_weights(params)
