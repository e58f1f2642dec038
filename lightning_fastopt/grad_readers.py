"""Which user code reads gradients between backward and the optimizer step.

The offload optimizer saves device memory by copying the gradients of offloaded
parameters to the host from backward hooks and freeing them on the device at once; ZeRO
stage 2 frees the gradients other ranks own.  Either way ``p.grad`` is gone before user
code could look at it.  The strategy does that only when nothing can look: none of the
hooks below overridden by the LightningModule or a callback, and automatic optimization
(in manual optimization ``manual_backward`` hands ``p.grad`` to the user's code).
Otherwise gradients stay in ``p.grad`` until the step, as in torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

# hooks that run after backward and before the optimizer step (or between steps, with the
# gradients still in place), where user code reads or edits p.grad
CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")
MODULE_HOOKS = CALLBACK_HOOKS + ("configure_gradient_clipping", "optimizer_step")


def gradient_readers(module: LightningModule, callbacks: Iterable[Callback]) -> list[str]:
    """Why gradients must stay in ``p.grad`` until the step: each overridden hook as
    ``Class.hook``, and ``manual optimization``; empty when nothing reads them."""
    readers = [] if module.automatic_optimization else ["manual optimization"]
    readers += [f"{type(module).__name__}.{hook}" for hook in MODULE_HOOKS
                if is_overridden(hook, module, LightningModule)]
    for callback in callbacks:
        readers += [f"{type(callback).__name__}.{hook}" for hook in CALLBACK_HOOKS
                    if is_overridden(hook, callback, Callback)]
    return readers
