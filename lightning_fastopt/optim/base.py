"""What every fused optimizer shares: argument checks, state, bucketing, the step loop.

Subclasses are honest ``torch.optim.Optimizer``s (real ``defaults``, mutable
``param_groups``, LR schedulers work) whose state uses torch's names, so a
``state_dict`` moves between ours and the torch equivalent in both directions.  A
subclass declares its float32 state tensors (``state_keys``), whether it counts steps,
and implements ``_update`` for one bucket by calling a function of
:mod:`lightning_fastopt.functional`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt import ops
from lightning_fastopt.functional import grads_all_finite
from lightning_fastopt.optim.bucketing import Bucket, kernel_buckets, repeat_buckets
from lightning_fastopt.optim.closure import LeadingStep, StepClosure

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
COMPUTE = object()  # step(step_context=COMPUTE): the optimizer computes its step context itself
_GROUP_ONLY_KEYS = ("params", "param_names")


def check_range(name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False) -> None:
    """Raise a ValueError naming the argument and its allowed range (a TypeError when it is
    not a number at all)."""
    lo = "(" if low_open else "["
    hi = ")" if high_open or high == math.inf else "]"
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number in {lo}{low}, {high}{hi}, got {value!r}")
    v = float(value)
    ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok or math.isnan(v):
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value}")


def check_betas(betas) -> tuple:
    """Check ``betas`` (a pair of numbers in [0, 1)); returns it as a tuple."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        check_range(f"betas[{i}]", b, 0.0, 1.0, high_open=True)
    return tuple(betas)


def check_dtype(p: Tensor, which: str, who_steps: str) -> None:
    """Raise a TypeError when parameter ``p`` (``which``, in words) has a dtype the kernels
    do not step (complex, float64, integer); ``who_steps``: "FusedAdam steps", ..."""
    if p.dtype not in SUPPORTED_DTYPES:
        what = "complex" if p.is_complex() else str(p.dtype).replace("torch.", "")
        raise TypeError(f"{which} is {what} ({p.dtype}): {who_steps} float32, float16 and bfloat16 "
                        "parameters (a complex one can be kept as a real pair, torch.view_as_real)")


def check_lr(lr) -> None:
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"lr as a tensor must have one element, got shape {tuple(lr.shape)}")
    check_range("lr", lr, 0.0)


class FusedOptimizer(torch.optim.Optimizer):
    """Base class.  Two attributes let a wrapper (the offload optimizer) drive the kernels
    over tensors it owns: ``grad_source`` maps a parameter to the gradient to use instead
    of ``p.grad`` (for example a float32 master updated from a pinned bfloat16 host
    buffer), and ``copies_to`` maps a parameter to a half-precision tensor that receives
    the updated value in the same pass.  Both default to None (plain ``p.grad``, no copy).
    A third, ``step_kwargs``, holds the keyword arguments a wrapper's step was given for
    the user's own ``step`` (only an optimizer with :attr:`takes_step_kwargs` gets any),
    and a fourth, ``step_closure``, the closure of the wrapper's step, evaluated, for that
    ``step`` (:mod:`~lightning_fastopt.optim.closure`).  A fifth, ``grad_factors``, holds
    numbers the gradients are multiplied by as the kernels read them (clipping's
    coefficient, without a pass of its own; the gradients stay as they are), for an
    optimizer that :attr:`reads_grad_factors`.
    """

    state_keys: tuple[str, ...] = ()
    counts_steps: bool = True
    supports_capturable = False  # capturable=True: step counts on the device, no host synchronisation
    takes_step_kwargs = False  # step() passes keyword arguments beyond its own to the user's step
    # the update of a tensor reads norms over the whole tensor (LAMB's and LARS's trust ratios):
    # it cannot step a piece of one (FSDP2's local rows) on its own, unless a wrapper sums
    # each piece's norm_sums() over the pieces and hands the totals to given_norms first
    whole_tensor_norms = False
    # the update of an element reads that element's gradient and state and the step's scalars
    # alone, so a tensor may be stepped in pieces, each with its own state, in the same bits
    # (lightning_fastopt.offload.pieces): set by the elementwise kernels' classes
    steps_pieces = False
    # the update reads every gradient through one of the functions that take grad_factors
    # (lightning_fastopt.functional): a wrapper may set grad_factors instead of multiplying
    reads_grad_factors = False
    grad_factors: tuple[float, ...] = ()
    given_norms: dict[Tensor, Tensor] | None = None
    # where a tensor it steps starts in a whole tensor it is a piece of (elements; a wrapper's,
    # lightning_fastopt.offload.pieces): bfloat16 state's stochastic rounding reads the index
    element_offsets: dict[Tensor, int] | None = None
    grad_source: dict[Tensor, Tensor] | None = None
    copies_to: dict[Tensor, Tensor] | None = None
    step_kwargs: dict[str, Any] = {}
    step_closure: StepClosure | None = None
    # the piece of the CPU kernels this optimizer's step calls (lightning_fastopt.ops.cpu), so that a
    # strategy builds just those before the first step; None: it calls none of ours
    kernel_piece: str | None = None

    def kernel_pieces(self) -> frozenset[str]:
        """The pieces of the CPU kernels the steps of this optimizer call (its groups' roundings
        included, where an algorithm has pieces for them: Adam's)."""
        return frozenset() if self.kernel_piece is None else frozenset({self.kernel_piece})

    def __init__(self, params, defaults: dict[str, Any], *, foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False) -> None:
        name = type(self).__name__
        if differentiable:
            raise ValueError(f"{name} does not support differentiable=True (the kernels update in place "
                             "outside autograd); use the torch.optim optimizer for that")
        if capturable and not self.supports_capturable:
            raise ValueError(f"{name} does not support capturable=True; FusedAdam does, and FusedSGD and "
                             "FusedLion need no flag to be captured")
        # foreach / fused choose torch's implementation; ours is always fused, so they have no effect.
        del foreach, fused
        ops.check_environment()  # a bad LIGHTNING_FASTOPT_* variable fails here, not at the first step
        self.capturable = bool(capturable)
        super().__init__(params, defaults)
        if self.capturable:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.device.type != "cuda":
                        raise ValueError(f"{name}(capturable=True) needs CUDA parameters (CUDA-graph capture), "
                                         f"got one on {p.device}")
        self.skipped_steps = 0
        self.last_step_skipped = False

    def sibling(self, params_per_group: list[list[Tensor]]) -> FusedOptimizer:
        """A new optimizer of this class and these defaults, one group per group of this one
        (same hyperparameters) over other tensors, with its own state."""
        if len(params_per_group) != len(self.param_groups):
            raise ValueError(f"expected {len(self.param_groups)} parameter lists, got {len(params_per_group)}")
        groups = [dict(hyperparameters(g), params=list(ps)) for g, ps in zip(self.param_groups, params_per_group)]
        new = type(self).__new__(type(self))
        with duplicates_warned_already():
            FusedOptimizer.__init__(new, groups, dict(self.inner_defaults))
        return new

    @property
    def inner_defaults(self) -> dict[str, Any]:
        """The defaults of the optimizers :meth:`sibling` builds: this class's, where
        ``defaults`` are the user's torch optimizer's (one mapped to this class)."""
        return self.__dict__.get("_inner_defaults", self.defaults)

    @inner_defaults.setter
    def inner_defaults(self, defaults: dict[str, Any]) -> None:
        self.__dict__["_inner_defaults"] = defaults

    def _with_own_keys(self, group: dict[str, Any]) -> dict[str, Any]:
        """``group``, or for an optimizer made by ``to_fused_optimizer`` (which shares the
        torch optimizer's groups without adding this class's keys to them) a view of it
        with those keys from :attr:`inner_defaults`: the same dict each step, refreshed."""
        inner = self.__dict__.get("_inner_defaults")
        if inner is None:
            return group
        views = self.__dict__.setdefault("_group_views", {})
        kept, view = views.get(id(group), (None, None))
        if kept is not group:
            view = {}
            views[id(group)] = (group, view)
        view.clear()
        view.update(inner)
        view.update(group)
        return view

    def _new_step_tensor(self, value: float, device: torch.device) -> Tensor:
        """A step count: on the parameters' device when capturable (read by the kernels
        there), else a CPU scalar."""
        return torch.tensor(float(value), dtype=torch.float32, device=device if self.capturable else "cpu")

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group = self._normalize_group(dict(param_group))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._validate_group(group)
        for p in group["params"]:
            check_dtype(p, "a parameter", f"{type(self).__name__} steps")

    def _normalize_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """Translate our argument aliases into the stored keys (override)."""
        return group

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Raise ValueError for out-of-range hyperparameters (override)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A state dict from torch (or an older version) may lack our keys: use our defaults.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self.__dict__.setdefault("skipped_steps", 0)
        self.__dict__.setdefault("last_step_skipped", False)
        self.__dict__.setdefault("capturable", False)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # Parameters of a group share one step tensor here; give each its own in the
        # saved copy, since torch's optimizers increment every parameter's step.
        for st in sd["state"].values():
            if isinstance(st.get("step"), Tensor):
                st["step"] = st["step"].detach().clone()
        return sd

    def _switched_on(self, group: dict[str, Any], key: str) -> bool:
        """True once when group[key] becomes truthy (or is first seen truthy): the moment to
        create state that the option needs, without a pass over the parameters every step."""
        seen = self.__dict__.setdefault("_seen_options", {})
        now = bool(group[key])
        # the group itself is kept in the record: an id alone could be reused by a new group
        record = seen.get((id(group), key))
        before = record is not None and record[0] is group and record[1]
        seen[(id(group), key)] = (group, now)
        return now and not before

    # ------------------------------------------------------------------ state
    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        """Create the float32 state of a parameter (override for non-zero initial values)."""
        for key in self.state_keys:
            state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def _buckets(self, group: dict[str, Any]) -> list[Bucket]:
        """The parameters of a group that have gradients, in kernel calls
        (:func:`~lightning_fastopt.optim.bucketing.kernel_buckets`)."""
        return kernel_buckets(self, group)

    def _index_bases(self, params: list[Tensor]) -> list[int] | None:
        """Where each of ``params`` starts in a whole tensor it is a piece of
        (:attr:`element_offsets`; None where no wrapper said)."""
        offsets = self.element_offsets
        return None if not offsets else [offsets.get(p, 0) for p in params]

    def _bucket_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state tensors a bucket passes to the kernel (override when options add some)."""
        return self.state_keys

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scale: float | Tensor | None = None,
             check_finite: bool = False, found_inf: Tensor | None = None, step_context: Any = COMPUTE):
        """One optimizer step.

        grad_scale: divide the gradients by this (loss-scale unscaling, done in the kernel).
        check_finite: if any gradient is inf/NaN, change nothing (no parameter, no state,
        no step count), count the step in ``skipped_steps`` and set ``last_step_skipped``.
        found_inf: a one-element float32 tensor (torch.amp's overflow flag); when it is
        nonzero the step changes nothing, as with check_finite.  A capturable optimizer
        hands it to the CUDA kernels and its step counts take it into account on the
        device (no synchronisation, so ``skipped_steps`` does not count such steps);
        otherwise it is read once here.
        step_context: what :meth:`step_context` computed over every gradient of the step,
        when a wrapper steps several optimizers as one (FusedLAMB's global norm).
        """
        return run_step(self, closure, lambda _: self._take_step(grad_scale, check_finite, found_inf, step_context))

    def _take_step(self, grad_scale, check_finite: bool, found_inf: Tensor | None, step_context: Any) -> bool:
        """The step of :meth:`step`; returns True when it was skipped."""
        if self.grad_factors and not self.reads_grad_factors:
            raise ValueError(f"{type(self).__name__} does not read grad_factors: multiply the gradients instead")
        if found_inf is not None and not self.capturable:
            if float(found_inf.reshape(-1)[0]) != 0.0:
                return True
            found_inf = None
        if check_finite:
            source = self.grad_source
            grads = [p.grad if source is None else source.get(p) for group in self.param_groups
                     for p in group["params"]]
            if not grads_all_finite([g for g in grads if g is not None]):
                return True
        plans = [(group, self._buckets(group)) for group in map(self._with_own_keys, self.param_groups)]
        all_buckets = [b for _, buckets in plans for b in buckets]
        context = self.step_context([g for b in all_buckets for g in b.grads], grad_scale) \
            if step_context is COMPUTE else step_context
        for group, buckets in plans:
            for bucket in buckets:
                self._run_bucket(group, bucket, grad_scale, context, found_inf)
        for group, buckets in plans:
            for bucket in repeat_buckets(self, group, buckets):
                self._run_bucket(group, bucket, grad_scale, context, found_inf)
        return False

    def _run_bucket(self, group, bucket: Bucket, grad_scale, context, found_inf: Tensor | None) -> None:
        """Advance the bucket's step count and update its parameters."""
        if bucket.step_tensor is not None:
            step_t = bucket.step_tensor
            step_t.add_(1)
            if step_t.device.type == "cpu":
                bucket.step = int(step_t.item())
            else:  # capturable: the kernels read it on the device
                if found_inf is not None:
                    step_t.sub_(found_inf.reshape(()).to(step_t.device, torch.float32))
                bucket.step = step_t
        else:
            bucket.step = 1 if bucket.first else 2
        bucket.found_inf = found_inf
        self._update(group, bucket, grad_scale, context)

    # ------------------------------------------------------------------ whole-tensor norms
    def norm_sums(self, grad_scale, context: Any) -> dict[Tensor, Tensor]:
        """For an optimizer with :attr:`whole_tensor_norms`: each parameter's squared norms
        that the next step's update reads (a float64 tensor of two, over what this
        optimizer holds of the tensor), the step's scalars as :meth:`step` will take them,
        nothing written.  A wrapper holding pieces of tensors (FSDP2's rows) sums them over
        the pieces and sets :attr:`given_norms` (each parameter's totals) for the step."""
        out: dict[Tensor, Tensor] = {}
        for group in map(self._with_own_keys, self.param_groups):
            for bucket in self._buckets(group):
                if bucket.step_tensor is not None:
                    bucket.step = int(bucket.step_tensor.item()) + 1  # as _run_bucket advances it
                else:
                    bucket.step = 1 if bucket.first else 2
                out.update(zip(bucket.params, self._bucket_norm_sums(group, bucket, grad_scale, context)))
        return out

    def _bucket_norm_sums(self, group: dict[str, Any], bucket: Bucket, grad_scale, context: Any) -> Tensor:
        """:meth:`norm_sums` of one bucket, a float64 tensor of shape [len(params), 2] (override)."""
        raise NotImplementedError(f"{type(self).__name__} takes no norms over whole tensors")

    def _given_norms(self, bucket: Bucket) -> Tensor | None:
        """The squared norms over the whole tensors of the bucket's parameters, where a
        wrapper gave them (:attr:`given_norms`), stacked for the kernels; else None."""
        given = self.given_norms
        return None if given is None else torch.stack([given[p] for p in bucket.params]).contiguous()

    def step_context(self, grads: list[Tensor], grad_scale) -> Any:
        """Computed once per step from every gradient, before any update; None for
        optimizers that need nothing.  When it is not None it is what
        :meth:`step_context_of_square_sums` makes of each gradient's sum of squares
        (FusedLAMB's global norm), so that a wrapper holding the gradients in shards gathers
        the shards' sums, in the parameters' order, and gets the same bits."""
        return None

    def step_context_of_square_sums(self, sums: list[float], grad_scale) -> Any:
        """The step context from each gradient's sum of squares
        (:func:`~lightning_fastopt.functional.square_sums`), in the parameters' order."""
        raise NotImplementedError(f"{type(self).__name__} has no step context")

    def unclipped_context(self) -> Any:
        """The step context of a step that nothing global changes (no clipping): what an
        update speculated before every gradient is known runs with."""
        return None

    def same_update(self, speculated: Any, actual: Any) -> bool:
        """Whether an update run with the ``speculated`` step context is, bit for bit, the
        one the ``actual`` context gives."""
        return speculated is None and actual is None

    def _update(self, group: dict[str, Any], bucket: Bucket, grad_scale, context: Any) -> None:
        raise NotImplementedError


@contextlib.contextmanager
def duplicates_warned_already():
    """Silence torch's warning about a parameter listed twice in a group while building an
    optimizer over the groups of another, whose construction warned the user already."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate parameters")
        yield


def run_step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None,
             take_step: Callable[[StepClosure | None], bool], leading: LeadingStep | None = None) -> Any:
    """What every ``step()`` of lightning_fastopt does around the step itself: run the
    closure (with gradients enabled, as torch's optimizers do at the top of ``step``), then
    ``take_step(evaluated)``, counting it in the optimizer's ``skipped_steps`` and
    ``last_step_skipped`` when it returns True.  ``evaluated``: the closure with what it
    returned, for an optimizer's own step (:mod:`~lightning_fastopt.optim.closure`); a
    :class:`StepClosure` given as the closure (a wrapper handing its step down) is not run again.

    ``leading``: the user's step on the wrapper's leading share, entered first; the closure
    is evaluated when that step calls it, and not at all when it ends without calling it
    (the step is then not taken, and the wrapper's ``last_step_closure`` says the closure
    was ignored)."""
    loss, evaluated = None, None
    if isinstance(closure, StepClosure):
        loss, evaluated = closure.loss, closure
    elif closure is not None and leading is not None:
        if not leading.enter():
            optimizer.last_step_closure = StepClosure.not_called()
            optimizer.last_step_skipped = False
            return None
        try:
            with torch.enable_grad():
                loss = closure()
            optimizer.last_step_skipped = False
            skipped = take_step(StepClosure(loss, leading))
        except BaseException as e:
            leading.close(error=e)
            raise
        leading.close()
        return _count_skipped(optimizer, skipped, loss)
    elif closure is not None:
        with torch.enable_grad():
            loss = closure()
        evaluated = StepClosure(loss)
    optimizer.last_step_skipped = False
    return _count_skipped(optimizer, take_step(evaluated), loss)


def _count_skipped(optimizer: torch.optim.Optimizer, skipped: bool, loss: Any) -> Any:
    if skipped:
        optimizer.skipped_steps += 1
        optimizer.last_step_skipped = True
    return loss


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings, without its parameters."""
    return {k: v for k, v in group.items() if k not in _GROUP_ONLY_KEYS}


def copy_hyperparameters(into: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Give each group of ``into`` the settings of the matching group of ``groups`` (an
    inner optimizer follows the user's groups, where LR schedulers write); one that keeps
    state in its groups takes them its own way (``take_settings``: a user's class,
    :mod:`~lightning_fastopt.optim.beside_parameters`)."""
    take = getattr(into, "take_settings", None)
    if take is not None:
        take(groups)
        return
    for mine, theirs in zip(into.param_groups, groups):
        mine.update(hyperparameters(theirs))


def needs_step_context(optimizer: FusedOptimizer | type[FusedOptimizer]) -> bool:
    """Whether the optimizer (or its class) computes something over every gradient before
    stepping."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return cls.step_context is not FusedOptimizer.step_context


def spans_parameters(optimizer: FusedOptimizer | type[FusedOptimizer]) -> bool:
    """Whether the optimizer's (or its class's) update reads norms over whole parameters or
    something over every gradient (LAMB, LARS): pieces of parameters (FSDP2's rows) need
    those summed over the pieces before any is updated."""
    return optimizer.whole_tensor_norms or needs_step_context(optimizer)
