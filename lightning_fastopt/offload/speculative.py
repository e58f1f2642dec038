"""The CPU update speculated during backward, checked at the step, then committed or
redone (``stream_cpu_step=True, speculate=True``): the streamed step for training that
needs every gradient before it steps (clipping by norm, fp16 loss scaling, LAMB's global
norm), and still ends where the synchronous step ends, bit for bit.

1. **Speculate.** As soon as a host bucket's gradients have landed, a worker thread copies
   its masters and optimizer state aside (:class:`~lightning_fastopt.offload.snapshot.BucketSnapshot`)
   and updates the bucket as the step would if nothing global changed it: with the loss
   scale the step is expected to take (``expected_grad_scale``, which the precision
   plugin announces before backward), the optimizer's step context for "no clipping"
   (:meth:`~lightning_fastopt.optim.base.FusedOptimizer.unclipped_context`), the
   hyperparameters as they are.  The new weights stay in host memory.
2. **Validate.** At ``step()`` the global facts are computed as the synchronous step
   computes them, on the gradients as they landed (the overflow check, the clipping
   norm, LAMB's global norm).  The speculation holds for a bucket when none of its
   gradients was written since backward ended (clipping multiplies them in place, which
   moves their version counters; a second backward adding to them is told by the
   gradient intake, :meth:`SpeculativeStep.grads_changed`), the step's loss scale, hyperparameters and keyword
   arguments (for the user's own step) are the ones it used, and the step context leads
   to the same update
   (:meth:`~lightning_fastopt.optim.base.FusedOptimizer.same_update`).
3. **Commit or redo.** A bucket whose speculation holds sends its staged weights to the
   device; nothing is copied back.  One whose speculation does not (clipping scaled
   its gradients, the loss scale moved) gets its masters and state back from the
   snapshot and is updated again in line, as the synchronous step would update it.  A
   step skipped for an overflow (or gradients dropped without a step) restores every
   speculated bucket.

Where each module's forward waits for its own weights (``forward_waits="module"``:
:func:`~lightning_fastopt.offload.left_running.ends_early`) the step does
not wait for the updates it redoes or held back: it fixes each one's plan (this step's
hyperparameters, loss scale and context) and leaves it to the worker, which puts a redone
bucket's snapshot back first and takes the bucket the next forward needs first; that
forward's pre-hook on a module waits for its bucket's update, then for its copy.  Clipping
that fires at every step then runs the CPU update beside the next forward instead of
before it.

FSDP's host shards (``host_shards``) are their own masters: the speculative update writes
them in place (compute reads only what FSDP gathers from them at the next forward, after
the step), the snapshot keeps them, and a commit has nothing to send.  Where the masters
and state are on disk (``offload_optimizer_device="nvme"``) the snapshot is the file: the
speculative update is written beside the bucket's last state, which stays until the step
commits the new one or discards it (the tier's ``snapshot``,
:class:`~lightning_fastopt.offload.state_tiers.DiskSnapshot`).

A redo costs more than the synchronous step would have: the snapshot, the speculative
update, the restore and the update again (on an H100 with 16 host cores, a ~1B GPT whose
every step clipped took 1712 ms a step speculated against 387 ms synchronous).  A commit gains at
most the update hidden behind backward, so speculation pays only where nearly every step
holds: the schedule speculates while at most :attr:`SpeculativeStep.misses_allowed` of the
last :attr:`SpeculativeStep.history` steps did not hold, and updates at the step otherwise,
each step still checked for whether its speculation would have held (the same check, on
what it would have assumed, recorded as the gradients landed).  Clipping that fires at
every step, every other or every third step then costs the synchronous step instead of
a redo each time, and a rare clip or loss-scale change keeps speculation on; a step
skipped for an overflow is not counted.

Gradients are read by the step's checks only after every speculative update has
finished reading them (:meth:`SpeculativeStep.before_gradients_read`).  The counts of
speculated, committed, redone, dropped and held back buckets (updated at the step, not
speculated, because the last speculation did not hold) and the time redoing took are in
``last_step_times`` with ``wall_clock_breakdown=True``.
"""

from __future__ import annotations

from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_fastopt.offload.left_running import UpdateQueue, ends_early, frozen
from lightning_fastopt.offload.schedule import CpuStepSchedule, Sent
from lightning_fastopt.offload.slots import HostBucket, ParamSlot, written_in_bucket, written_in_place
from lightning_fastopt.offload.snapshot import BucketSnapshot
from lightning_fastopt.optim.base import hyperparameters

# buckets per step, in the breakdown as buckets_<count> (a step the precision plugin skipped
# without calling the optimizer shows its dropped buckets in the next step's); left_running:
# redone or held back by a step that ended before their updates (ends_early)
COUNTS = ("speculated", "committed", "redone", "dropped", "held_back", "left_running")


@dataclass(eq=False)
class Speculation:
    """What one bucket's speculative update assumed, and the update itself."""

    grad_versions: list[int]
    grad_scale: Any
    context: Any
    hyperparameters: list[dict[str, Any]]
    step_kwargs: dict[str, Any]  # for the user's own step (empty unless backward ran inside a step given some)
    future: Future = field(default_factory=Future)
    changed: bool = False  # a gradient it read was added to since (a second backward)


class SpeculativeStep(CpuStepSchedule):
    name = "speculated during backward, checked at the step"
    host_updates_at_step = False
    starts_in_backward = True
    # speculate while at most misses_allowed of the last `history` steps would not have held
    # (misses_allowed = history: at every step, whatever the last ones did)
    history = 8
    misses_allowed = 1

    def __init__(self, optimizer) -> None:
        super().__init__(optimizer)
        self.running: dict[HostBucket, Speculation] = {}
        self.watched: dict[HostBucket, Speculation] = {}  # held back: what a speculation would have assumed
        self._held: deque[bool] = deque(maxlen=self.history)  # whether each of the last steps held (or would have)
        self._said_held_back = False
        self.snapshots: dict[HostBucket, BucketSnapshot] = {}
        self.totals = Counter()  # over the whole run, for tests and benchmarks
        self._counts = Counter()  # this step's
        self._redo_ms = 0.0
        self._open = True  # speculation starts only during backward, not once the step has begun
        self._rebased = False  # the gradients' versions taken again once backward ended (this step)
        self._queue = UpdateQueue(optimizer)  # updates left running by a step that ends early

    @property
    def ends_early(self) -> bool:
        """Whether ``step()`` returns before the redone and held-back updates have ended
        (:func:`~lightning_fastopt.offload.left_running.ends_early`)."""
        return ends_early(self.opt)

    # ------------------------------------------------------------------ during backward
    def grads_landed(self, bucket: HostBucket) -> None:
        opt = self.opt
        if not (opt.lands_during_backward and self._open):
            return
        spec = Speculation(_grad_versions(opt, bucket), frozen(opt.expected_grad_scale),
                           opt.optimizer.unclipped_context(), _hyperparameters(opt.param_groups),
                           dict(opt.step_kwargs))
        if not self._speculating():
            self.watched[bucket] = spec  # updated at the step; whether this would have held is checked there
            return
        spec.future = opt.updates.submit(self._speculate, bucket, spec)
        self.running[bucket] = spec

    def _speculate(self, bucket: HostBucket, spec: Speculation) -> list[ParamSlot]:
        """On the worker: once the bucket's gradients have landed, refresh the masters
        others wrote, keep masters and state aside, update (the weights stay on the host)."""
        opt = self.opt
        opt.copies.wait_on_host(bucket.grads_ready)
        opt.masters.written(written_in_bucket(bucket))
        tier = opt.layout.tier
        bucket.inner.grads_read_again = True  # (by the update redone, where the check at the step changes them)
        with opt.updates.on_worker(), tier.resident(bucket, speculative=True):
            self.snapshots.setdefault(bucket, tier.snapshot(bucket)).take(bucket.inner, bucket.slots)
            return opt.updates.step_inner(bucket.inner, bucket.slots, spec.grad_scale, spec.context, spec.step_kwargs)

    # ------------------------------------------------------------------ at the step
    def grads_changed(self, bucket: HostBucket) -> None:
        """A second backward added to the bucket's gradients: an update speculated on them no longer holds."""
        for spec in (self.running.get(bucket), self.watched.get(bucket)):
            if spec is not None:
                spec.changed = True

    def check_step(self, needs_gradients: bool, grad_scale, step_context) -> None:
        self._open = False
        self._backward_ended()

    def before_gradients_read(self) -> None:
        """The checks may scale the gradients in place: every speculative update has read them first."""
        self._open = False
        for spec in self.running.values():
            spec.future.result()
        self._backward_ended()

    def _backward_ended(self) -> None:
        """Once per step, before anything outside backward may write the gradients: each
        speculation's gradient versions taken again.  Writes since its bucket landed are
        backward's own to other tensors sharing their version counter (FSDP's host shards:
        a unit's gradients are views of one reduce-scatter output, and accumulating a later
        one moves the counter of all); a second backward's is told (:meth:`grads_changed`)."""
        if self._rebased:
            return
        self._rebased = True
        for bucket, spec in [*self.running.items(), *self.watched.items()]:
            spec.grad_versions = _grad_versions(self.opt, bucket)

    def host_step(self, grad_scale, context) -> Sent:
        """Each bucket's speculation committed where it holds, else redone (its snapshot put
        back first), a held-back one updated; where the step ends early
        (:func:`~lightning_fastopt.offload.left_running.ends_early`) the redone and
        held-back ones are left to the worker, each plan fixed now with this step's
        hyperparameters, loss scale and context, and handed to the weights in flight (the
        next forward's first layers first)."""
        opt = self.opt
        with opt._timer.phase("cpu_step"):
            done = self._join()
        written: list[ParamSlot] = []
        sent: list[HostBucket] = []
        held = [self._holds(b, spec, grad_scale, context) for b, spec in self.watched.items()]
        self._counts["held_back"] += len(self.watched)
        watched, self.watched = self.watched, {}
        later = self.ends_early
        leaving: list[HostBucket] = []  # updates left to the worker (ends_early), in the buckets' order
        redo: set[HostBucket] = set()  # of those, the redone ones (their snapshot put back first)
        for b in opt.layout.buckets:
            if b not in done:
                if later and b in watched:
                    leaving.append(b)
                    continue
                w, s = self.in_line([b], grad_scale, context)
            else:
                spec, updated = done[b]
                held.append(self._holds(b, spec, grad_scale, context))
                if held[-1]:
                    self._counts["committed"] += 1
                    self.snapshots[b].commit()
                    if updated:
                        with opt._timer.phase("param_h2d"), opt.layout.tier.resident(b, sent=b.params_sent,
                                                                                     writes=False):
                            opt.updates.send_weights(b, updated, opt._compute_done)
                    w, s = updated, [b] if updated else []
                elif later:
                    self._counts["redone"] += 1
                    leaving.append(b)
                    redo.add(b)
                    continue
                else:
                    self._counts["redone"] += 1
                    started = opt._timer.now()
                    self.snapshots[b].restore(b.inner)
                    w, s = self.in_line([b], grad_scale, context)
                    self._redo_ms += (opt._timer.now() - started) * 1e3
            written, sent = written + w, sent + s
        self._predict(held)
        left = self._queue.put_after_step(leaving, grad_scale, context,
                                          before=lambda b: self.snapshots[b].restore(b.inner) if b in redo else None)
        self._counts["left_running"] += len(left)
        self._queue.leave(left)
        return written, sent + list(left)

    def _speculating(self) -> bool:
        return self._misses() <= self.misses_allowed

    def _misses(self) -> int:
        """Of the last ``history`` steps, those whose speculation did not (or would not) hold."""
        return sum(not h for h in self._held)

    def _predict(self, held: list[bool]) -> None:
        """This step held where every bucket speculated or watched held."""
        if not held:
            return
        self._held.append(all(held))
        if not self._speculating() and not self._said_held_back:
            self._said_held_back = True
            rank_zero_info(f"lightning_fastopt: {self._misses()} of the last {len(self._held)} "
                           "speculated CPU updates did not hold (clipping or the loss scale changed the "
                           "gradients): host buckets are updated at the step, and speculated again once at most "
                           f"{self.misses_allowed} of the last {self.history} steps would not have held")

    def _holds(self, bucket: HostBucket, spec: Speculation, grad_scale, context) -> bool:
        opt = self.opt
        return (not spec.changed and not bucket.scales and _grad_versions(opt, bucket) == spec.grad_versions
                and _same(spec.grad_scale, grad_scale)
                and opt.optimizer.same_update(spec.context, context)
                and _same(spec.hyperparameters, _hyperparameters(opt.param_groups))
                and _same(spec.step_kwargs, opt.step_kwargs))

    def skipped(self) -> None:
        self._drop()

    def end(self) -> None:
        self._drop()  # gradients forgotten without a step that took these updates
        self.watched = {}
        self._open = True
        self._rebased = False

    def wait(self) -> None:
        """The state is about to be read or replaced: the updates the last step left
        running have ended, and updates no step has taken are undone (a step redoes them),
        so nobody sees a speculated state."""
        self._queue.wait_left()
        self._drop()

    def breakdown(self) -> dict[str, float]:
        counts = {f"buckets_{k}": float(self._counts[k]) for k in COUNTS}
        counts["redo"] = self._redo_ms
        self.totals.update(self._counts)
        self._counts.clear()
        self._redo_ms = 0.0
        return counts

    def _join(self) -> dict[HostBucket, tuple[Speculation, list[ParamSlot]]]:
        running, self.running = self.running, {}
        self._counts["speculated"] += len(running)
        return {b: (spec, spec.future.result()) for b, spec in running.items()}

    def _drop(self) -> None:
        """Undo the speculative updates nobody took: the masters and state go back."""
        for b in self._join():
            self._counts["dropped"] += 1
            self.snapshots[b].restore(b.inner)


def afford_speculation(buckets: list[HostBucket]) -> bool:
    """Whether the host has the memory speculating on ``buckets`` keeps aside (said in one
    line, either way; without it the CPU step runs at the step)."""
    needed, available = snapshot_bytes(buckets), available_host_bytes()
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    if available is not None and needed > available:
        rank_zero_info(f"lightning_fastopt: speculate=True not used: keeping the offloaded masters and optimizer "
                       f"state aside takes {gib(needed)} of host memory, {gib(available)} is available; the CPU "
                       "step runs at the step")
        return False
    rank_zero_info(f"lightning_fastopt: speculate=True keeps the offloaded masters and optimizer state aside: "
                   f"{gib(needed)} more host memory" + (f" ({gib(available)} available)" if available else ""))
    return True


def snapshot_bytes(buckets: list[HostBucket]) -> int:
    """Host bytes the snapshots of ``buckets`` take once every bucket has state: each
    offloaded master and each of its state tensors (in the state's dtype) once more, and
    each half weight the update writes in place."""
    total = 0
    for b in buckets:
        state_size = torch.empty((), dtype=getattr(b.inner, "state_dtype", torch.float32)).element_size()
        for s in b.slots:
            keys = b.inner._bucket_state_keys(b.inner.param_groups[s.group])
            weight = s.param.element_size() if written_in_place(s) else 0
            total += s.numel * (s.master.element_size() + state_size * len(keys) + weight)
    return total


def available_host_bytes() -> int | None:
    """The host memory the kernel says is available (Linux's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _grad_versions(opt, bucket: HostBucket) -> list[int]:
    """The version counters of the gradients the bucket's update reads (in host memory:
    copied there, or FSDP's host shards' own): clipping multiplies them in place."""
    grads = [opt._intake.grad_of(s) for s in bucket.slots]
    return [-1 if g is None else g._version for g in grads]


def _hyperparameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: frozen(v) for k, v in hyperparameters(g).items()} for g in groups]


def _same(a: Any, b: Any) -> bool:
    """Equal, tensors by value (and never a tensor equal to a number: the kernels read them differently)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and \
            torch.equal(a.detach().cpu(), b.detach().cpu())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b

