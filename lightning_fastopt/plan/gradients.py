"""Where an engine takes the gradients (the offload optimizer's ``device_grads``), and why:

- ``"keep"``: in ``p.grad`` until the step, as torch keeps them, where user code can read
  them there;
- ``"copy_in_backward"``: the offloaded ones copied to the host from backward's hooks and
  freed on the device at once (one process, or ZeRO stage 2, which reduces them itself);
- ``"copy_at_step"``: the same once DDP has all-reduced them (with FSDP: kept until the
  step, where user code can read them);
- ``"copy_when_reduced"``: FSDP's, as each reduce-scatter lands them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GradientRoute", "ddp_gradient_route", "fsdp_gradient_route", "zero_stage_that_runs"]


@dataclass(frozen=True)
class GradientRoute:
    """``kind``: the engine's ``device_grads``; ``line``: what the set-up says of it."""

    kind: str
    line: str | None = None


def zero_stage_that_runs(zero_stage: int, readers: Sequence[str], torch_steps: Sequence[str]) -> int:
    """Stage 2 frees other ranks' gradients during backward: it reduces them as stage 1 does
    where user code reads them (``readers``) or an optimizer runs as torch runs it, reading
    every parameter's gradient (``torch_steps``)."""
    return 1 if zero_stage == 2 and (readers or torch_steps) else zero_stage


def ddp_gradient_route(readers: Sequence[str], *, zero_stage: int, offload_fraction: float, ddp: bool,
                       keep_hint: str) -> GradientRoute:
    """Under the DDP strategies: kept where ``readers`` (user code, named) can read them, else
    copied during backward (``ddp``: once DDP has all-reduced them).  ``keep_hint`` says how
    to keep them for code the detection cannot see."""
    if readers:
        note = " (ZeRO stage 2 reduces them as stage 1 does)" if zero_stage == 2 else ""
        return GradientRoute("keep", f"gradients stay in p.grad until the optimizer step{note}, as in torch: "
                                     f"{', '.join(readers)} can read them")
    kind = "copy_at_step" if ddp else "copy_in_backward"
    if offload_fraction == 0:  # nothing offloaded, nothing copied: nothing to say
        return GradientRoute(kind)
    return GradientRoute(kind, "gradients of offloaded parameters are copied to the host and freed on the device "
                               f"during backward ({keep_hint})")


def fsdp_gradient_route(readers: Sequence[str], *, on_host: bool, copies: bool, keep_hint: str) -> GradientRoute:
    """Under the FSDP strategies: kept until the step where ``readers`` can read them, else
    handed over as FSDP's reduce-scatter lands them (``on_host``: FSDP's host shards, whose
    gradients land in host memory; ``copies``: offloaded rows whose gradients are copied
    to the host, said with ``keep_hint``)."""
    if readers:
        return GradientRoute("copy_at_step", "gradients stay in p.grad until the optimizer step, as in torch: "
                                             f"{', '.join(readers)} can read them")
    if on_host or not copies:
        return GradientRoute("copy_when_reduced")
    return GradientRoute("copy_when_reduced", "the offloaded rows' gradients go to the host as FSDP's reduce-scatter "
                                              f"lands them, and are freed on the device ({keep_hint})")
