"""The offload optimizer's checkpoint state: what :meth:`OffloadOptimizer.state_dict
<lightning_fastopt.offload.optimizer.OffloadOptimizer.state_dict>` saves and
:meth:`~lightning_fastopt.offload.optimizer.OffloadOptimizer.load_state_dict` restores.

Saved: each parameter's optimizer state keyed by its name
(:mod:`lightning_fastopt.checkpoint.named_state`, the same for every offload fraction and
loadable by the torch.optim class), bfloat16 host moments as float32; beside a
half-precision parameter's state its float32 master (:data:`MASTER_KEY`: a resumed run
continues from all its bits); with ``delayed_update``, the masters of the update not yet
on the device (:data:`~lightning_fastopt.offload.delayed.SAVED_KEY`).

Loaded: the groups' settings in place (LR schedulers hold those dicts), each state to the
inner optimizer that owns the parameter now, each saved master where the model's weight
(loaded first) is still that master rounded, and a delayed update's pending masters:
pending again for a delayed optimizer's offloaded parameters, into the model otherwise.

An optimizer's own class (:class:`~lightning_fastopt.optim.user_step.UserStepOptimizer`)
may keep more (:mod:`~lightning_fastopt.optim.beside_parameters`): the keys of its groups its
code writes, saved with the groups and given back to every share; state under keys that are
not parameters, saved in ``"state"`` under its key, as torch saves it.

A parameter split into pieces (:mod:`~lightning_fastopt.offload.pieces`) is saved whole,
its pieces' tensors put together, and each piece loads its range.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.checkpoint.named_state import CheckpointMismatchError, named_state_dict, read_named_state
from lightning_fastopt.offload.delayed import SAVED_KEY, put_master
from lightning_fastopt.offload.pieces import WholeValues
from lightning_fastopt.offload.slots import ParamSlot, remember_weights
from lightning_fastopt.optim.user_step import UserStepOptimizer

# In the state dict, beside a half-precision parameter's optimizer state: its float32 master,
# whose low bits the half weight in the model's state dict does not hold (torch.optim ignores it).
MASTER_KEY = "fp32_master"


class EngineState:
    """The checkpoint state of one offload optimizer (see the module's documentation); a
    part of it, as the step schedules are (it reads the optimizer's slots and schedule)."""

    def __init__(self, optimizer) -> None:
        self.opt = optimizer

    def moved_to(self, new):
        """Close this optimizer and give ``new`` (built over the same parameters and groups,
        at another fraction) its state, float32 masters, skipped-step count and pending
        delayed update (moved over, not applied); returns ``new``."""
        opt = self.opt
        saved = self.saved()  # the state and a delayed update's pending masters, by name
        tier = opt.layout.tier
        whole = WholeValues(tier.hand_out, tier.blank)
        for members in opt.layout.in_residence([s for s in opt.layout.slots if s.separate_master], writes=False):
            for s in members:
                whole.add(s, "", s.master)
        masters = whole.under("")
        opt.close(apply_pending=False)
        new.load_state_dict(saved)
        pending = set(saved.get(SAVED_KEY, {}).get("weights", {}))
        kept = [s for s in new.layout.slots if s.separate_master and s.name in masters and s.name not in pending]
        for members in new.layout.in_residence(kept):
            for s in members:  # a half-precision weight's master has more bits than the weight
                put_master(s, s.of(masters[s.name]))
        remember_weights(kept)
        new.skipped_steps = opt.skipped_steps
        new.accumulating = opt.accumulating
        new.modules_wait_for(opt._in_flight.covered)
        return new

    def state_of(self, param: Tensor) -> dict[str, Any]:
        """One model parameter's state, where its share keeps it; with the state on disk, a
        copy as a checkpoint keeps it, in files of its own
        (:meth:`DiskTier.hand_out <lightning_fastopt.offload.state_tiers.DiskTier.hand_out>`),
        a parameter split into pieces put together."""
        opt = self.opt
        opt.schedule.wait()
        slot = opt.layout.slot_of[param]
        tier = opt.layout.tier
        if slot.bucket is None or not tier.on_disk:
            return opt.layout.inner_of(slot).state.get(slot.master, {})
        whole = WholeValues(tier.hand_out, tier.blank, saved_dtype)
        for members in opt.layout.in_residence(opt.layout.pieces_of[param], writes=False):
            for s in members:  # (the tensors point at nothing after)
                for k, v in opt.layout.inner_of(s).state.get(s.master, {}).items():
                    whole.add(s, k, v)
        return whole.by_name.get(slot.name, {})

    def beside_parameters(self) -> dict[Any, Any]:
        """The user's class's state under keys that are not parameters, as the first share
        that has any keeps it (every share that steps counts alike)."""
        opt = self.opt
        if not isinstance(opt.optimizer, UserStepOptimizer):
            return {}
        return next((own for own in (inner.own_state() for inner in opt.layout.inners()) if own), {})

    def _names(self) -> list[list[str]]:
        return [[self.opt.layout.slot_of[p].name for p in g["params"]] for g in self.opt.param_groups]

    def saved(self) -> dict[str, Any]:
        """The state dict, once every update under way has finished."""
        opt = self.opt
        opt.schedule.wait()
        tier = opt.layout.tier  # (on disk: copies, in files of their own)
        state = WholeValues(tier.hand_out, tier.blank, saved_dtype)
        for members in opt.layout.in_residence(opt.layout.slots, writes=False):
            for s in members:
                st = opt.layout.inner_of(s).state.get(s.master)
                if st:
                    for k, v in st.items():
                        state.add(s, k, v)
                    if s.param.dtype != s.master.dtype:
                        state.add(s, MASTER_KEY, s.master)
        saved = named_state_dict(opt.param_groups, self._names(), state.by_name)
        if isinstance(opt.optimizer, UserStepOptimizer):  # what the user's class keeps beside its parameters
            for group, written in zip(saved["param_groups"], opt.optimizer.group_keys.saved(opt.param_groups)):
                group.update(written)
            beside = self.beside_parameters()
            clash = [k for k in beside if k in saved["state"] or k in state.by_name]
            if clash:
                raise ValueError(f"{opt.optimizer.user_class.__name__} keeps state under {clash[0]!r}, which is also "
                                 "the name of a parameter: the state dict cannot hold both")
            saved["state"].update(beside)
        if opt.schedule.delayed is not None:
            saved[SAVED_KEY] = opt.schedule.delayed.saved(opt.layout)
        return saved

    def load(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict`` (raises CheckpointMismatchError when it belongs to another
        model); the model's weights are loaded first."""
        opt = self.opt
        opt.schedule.wait()
        opt._in_flight.wait_all()  # pending weights may be written into the model below
        user_step = isinstance(opt.optimizer, UserStepOptimizer)
        state_dict, beside = split_beside_parameters(state_dict) if user_step else (state_dict, {})
        by_name, saved_groups = read_named_state(state_dict, self._names(),
                                                 {s.name: s.param.shape for s in opt.layout.slots}, opt.param_groups,
                                                 moments_shaped=not user_step)
        for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
            group.update(saved)  # in place: LR schedulers hold these dicts
            opt.optimizer._validate_group(group)
            if user_step:  # every share, also the keys the class's code writes (not copied at a step)
                for inner in opt.layout.inners():
                    inner.param_groups[i].update(saved)
        for inner in opt.layout.inners():
            inner.state.clear()
            if user_step:
                inner.put_own_state(beside)
        masters = {}
        for members in opt.layout.in_residence(opt.layout.slots):
            for s in members:
                st = dict(by_name.get(s.name) or {})
                if MASTER_KEY in st:
                    masters[s] = st.pop(MASTER_KEY)
                if st:
                    opt.layout.set_state(s, st)
        self._load_masters(masters)
        self._load_pending(state_dict.get(SAVED_KEY))

    def _load_masters(self, masters: Mapping[ParamSlot, Tensor]) -> None:
        """Saved float32 masters of half-precision parameters, each taken where the model's
        weight (loaded first) is that master rounded: the weight was not changed since, and
        the master carries the bits it lacks; elsewhere the master follows the weight."""
        taken = []
        for members in self.opt.layout.in_residence(list(masters)):
            for s in members:
                m = masters[s]
                if not s.separate_master or tuple(m.shape) != tuple(s.param.shape):
                    continue
                m = s.of(m)
                if torch.equal(m.to(s.param.device, s.param.dtype), s.weight()):
                    put_master(s, m)
                    taken.append(s)
        remember_weights(taken)

    def _load_pending(self, saved: Mapping[str, Any] | None) -> None:
        """A delayed update's pending masters from a checkpoint: pending again for the
        offloaded parameters of a delayed optimizer, into the model for any other."""
        delayed = self.opt.schedule.delayed
        weights = dict((saved or {}).get("weights", {}))
        by_name: dict[str, list[ParamSlot]] = {}
        for s in self.opt.layout.slots:
            by_name.setdefault(s.name, []).append(s)
        for name, w in weights.items():
            slots = by_name.get(name)
            if slots is None or tuple(w.shape) != tuple(slots[0].param.shape):
                raise CheckpointMismatchError(f"the checkpoint's pending weight {name!r} "
                                              f"({tuple(w.shape)}) does not match a parameter of this model")
        pending = {s: s.of(w) for n, w in weights.items() for s in by_name[n]}
        later = {s: w for s, w in pending.items() if delayed is not None and s.bucket is not None}
        if delayed is not None:
            delayed.restore(later, self.opt.layout)
            if saved:
                delayed.steps = int(saved.get("steps", 0))
        now = [s for s in pending if s not in later]
        for members in self.opt.layout.in_residence(now):
            for s in members:
                if s.separate_master:
                    put_master(s, pending[s])
                    s.weight().copy_(s.master)
                else:
                    s.weight().copy_(pending[s])
        remember_weights(list(pending))  # the model's weights as loaded are the device's


def saved_dtype(value: Any) -> torch.dtype | None:
    """The dtype a state value is saved in where it is not its own: bfloat16 moments
    (``host_state_dtype``) as float32, as torch.optim keeps them."""
    return torch.float32 if isinstance(value, Tensor) and value.dtype == torch.bfloat16 else None


def split_beside_parameters(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[Any, Any]]:
    """``state_dict`` without the entries of its ``"state"`` that no group lists (a user's
    class's state under keys that are not parameters, MADGRAD's ``"k"``, saved where torch
    saves it), and those entries."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        return dict(state_dict) if isinstance(state_dict, Mapping) else state_dict, {}
    listed = {k for g in state_dict.get("param_groups", ()) for k in g.get("params", ())}
    beside = {k: v for k, v in state_dict["state"].items() if k not in listed}
    rest = {k: v for k, v in state_dict["state"].items() if k in listed}
    return dict(state_dict, state=rest), beside
