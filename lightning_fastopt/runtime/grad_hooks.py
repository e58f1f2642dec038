"""GradReadyHooks: post-accumulate-grad hooks on the parameters that can receive a gradient.

torch refuses a hook on a tensor that does not require gradients, and fine-tuning keeps
frozen parameters in the optimizer (``backbone.requires_grad_(False)`` and then
``AdamW(self.parameters())``, or ``BackboneFinetuning`` unfreezing them later).  So a hook
is registered only on the parameters that require gradients now, and :meth:`refresh`
(called between steps) adds one to each parameter that became trainable since.  A
parameter unfrozen after the last refresh still has its gradient used: the owner reads
what the hooks did not see when the step starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor


class GradReadyHooks:
    def __init__(self, params: Iterable[Tensor], on_ready: Callable[[Tensor], None]) -> None:
        self._params: list[Tensor] = []
        self._on_ready = on_ready
        self._handles: dict[Tensor, object] = {}
        self.add(params)

    def add(self, params: Iterable[Tensor]) -> None:
        """Watch more parameters (a parameter group added after construction)."""
        self._params.extend(params)
        self.refresh()

    def refresh(self) -> None:
        """Hook every watched parameter that requires gradients and has no hook yet."""
        for p in self._params:
            if p.requires_grad and p not in self._handles:
                self._handles[p] = p.register_post_accumulate_grad_hook(self._on_ready)

    def hooked(self, param: Tensor) -> bool:
        return param in self._handles

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}
        self._params = []
