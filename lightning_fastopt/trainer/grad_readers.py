"""Which user code reads gradients between backward and the optimizer step
(:func:`gradient_readers`), or weights between a step and the next forward
(:func:`weight_readers`).

The offload optimizer saves device memory by copying the gradients of offloaded
parameters to the host from backward hooks and freeing them on the device at once; ZeRO
stage 2 frees the gradients other ranks own.  Either way ``p.grad`` is gone before user
code could look at it.  The strategy does that only when nothing can look: none of the
hooks below overridden by the LightningModule or a callback, and automatic optimization
(in manual optimization ``manual_backward`` hands ``p.grad`` to the user's code).
Otherwise gradients stay in ``p.grad`` until the step, as in torch.

Likewise ``forward_waits="module"`` lets the next forward start before every new weight
is back on the device; the strategy does that only when no hook that runs between a
step and the next forward is overridden (beyond what Lightning's own callbacks that do
not read weights override) and optimization is automatic.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_fastopt.trainer.package import TrainerPackage

# hooks that run after backward and before the optimizer step (or between steps, with the
# gradients still in place), where user code reads or edits p.grad
CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")
MODULE_HOOKS = CALLBACK_HOOKS + ("configure_gradient_clipping", "optimizer_step")


def gradient_readers(module, callbacks: Iterable, package: TrainerPackage, keep_gradients: bool = False) -> list[str]:
    """Why gradients must stay in ``p.grad`` until the step: the strategy's
    ``keep_gradients=True`` (code anywhere may read them), each overridden hook as
    ``Class.hook``, and ``manual optimization``; empty when nothing reads them
    (``module`` and ``callbacks``: of ``package``)."""
    readers = ["code anywhere (keep_gradients=True)"] if keep_gradients else []
    readers += [] if module.automatic_optimization else ["manual optimization"]
    return readers + _overridden(module, callbacks, package, MODULE_HOOKS, CALLBACK_HOOKS)


def _overridden(module, callbacks: Iterable, package: TrainerPackage, module_hooks: tuple[str, ...],
                callback_hooks: tuple[str, ...]) -> list[str]:
    """Each of ``module_hooks`` the LightningModule overrides and each of ``callback_hooks``
    a callback overrides, as ``Class.hook``."""
    found = [f"{type(module).__name__}.{hook}" for hook in module_hooks
             if is_overridden(hook, module, package.LightningModule)]
    for callback in callbacks:
        found += [f"{type(callback).__name__}.{hook}" for hook in callback_hooks
                  if is_overridden(hook, callback, package.Callback)]
    return found


# the hooks Lightning's precision plugins run between the closure (backward) and the step,
# where its fp16 plugin has unscaled the gradients
AFTER_CLOSURE_CALLBACK_HOOKS = ("on_before_optimizer_step",)
AFTER_CLOSURE_MODULE_HOOKS = AFTER_CLOSURE_CALLBACK_HOOKS + ("configure_gradient_clipping",)


def readers_after_the_closure(module, callbacks: Iterable, package: TrainerPackage) -> list[str]:
    """The overridden hooks (``Class.hook``) that run between the closure and the step and
    can read the gradients there: Lightning's fp16 plugin gives them unscaled gradients."""
    return _overridden(module, callbacks, package, AFTER_CLOSURE_MODULE_HOOKS, AFTER_CLOSURE_CALLBACK_HOOKS)


# hooks that run after a step and before the next forward reaches its modules (or before
# the strategy's own hooks at the start of validation), where user code may read weights
BETWEEN_STEP_HOOKS = ("on_train_batch_end", "on_train_batch_start", "on_train_epoch_end", "on_train_epoch_start",
                      "on_validation_start", "on_before_zero_grad")


def weight_readers(module, callbacks: Iterable, package: TrainerPackage) -> list[str]:
    """Why the next forward must wait for every new weight: each overridden hook of
    :data:`BETWEEN_STEP_HOOKS` as ``Class.hook``, and ``manual optimization`` (user code
    runs after the step inside ``training_step``); empty when nothing reads them.  A
    LightningModule's or a callback's hooks with ``reads_weights_between_steps = False``
    (a class attribute: they read no weight) do not count, nor what
    Lightning's callbacks that read no weights override (``package.quiet_callbacks``:
    checkpoints read weights through the strategy, which waits for every weight first;
    with their subclasses in Lightning, TQDMProgressBar; what a user's subclass
    overrides still counts)."""
    readers = [] if module.automatic_optimization else ["manual optimization"]
    if getattr(module, "reads_weights_between_steps", True) is not False:
        readers += [f"{type(module).__name__}.{hook}" for hook in BETWEEN_STEP_HOOKS
                    if is_overridden(hook, module, package.LightningModule)]
    for callback in callbacks:
        if getattr(callback, "reads_weights_between_steps", True) is False:
            continue  # the callback says so (a timer, a logger of metrics)
        lightnings = next(c for c in type(callback).__mro__ if c.__module__.startswith(package.name + "."))
        base = lightnings if issubclass(lightnings, package.quiet_callbacks) else package.Callback
        readers += [f"{type(callback).__name__}.{hook}" for hook in BETWEEN_STEP_HOOKS
                    if is_overridden(hook, callback, base)]
    return readers


def forward_waits_refusals(module, callbacks: Iterable, package: TrainerPackage) -> list[str]:
    """Why no forward may wait for its own weights alone (``forward_waits="module"``),
    under any strategy: code that can read the weights between steps
    (:func:`weight_readers`), or a compiled model, where the forward pre-hooks would be
    traced or break the graph; empty when neither applies."""
    readers = weight_readers(module, callbacks, package)
    why_not = [f"{', '.join(readers)} can read the weights between steps"] if readers else []
    if _compiled(module):
        why_not.append("the model is compiled (torch.compile), where the forward pre-hooks would be traced or break "
                       "the graph")
    return why_not


def say_forward_waits(why_not: list[str], what: str) -> bool:
    """Whether ``forward_waits="module"`` is used (no reason against it in ``why_not``), said in
    one line: ``what`` it does, or why not."""
    if why_not:
        rank_zero_info(f"lightning_fastopt: forward_waits='module' not used: {'; '.join(why_not)}")
        return False
    rank_zero_info(f"lightning_fastopt: {what} (forward_waits='module')")
    return True


def _compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` (or a submodule) runs through torch.compile: a compiled submodule,
    or a LightningModule the Trainer was given compiled (Lightning notes ``_compiler_ctx``)."""
    from torch._dynamo import OptimizedModule

    return getattr(module, "_compiler_ctx", None) is not None or any(
        isinstance(m, OptimizedModule) for m in module.modules())
