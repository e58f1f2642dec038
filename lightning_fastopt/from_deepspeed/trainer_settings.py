"""What a DeepSpeed config asks of the Trainer (its ``gradient_clipping``,
``gradient_accumulation_steps`` and half precision), given to the Trainer when the model
is connected: before Lightning checks the loop's configuration, so that its own checks
(manual optimization clips and accumulates in ``training_step``) apply to them."""

from __future__ import annotations

from typing import Any

from lightning_fastopt.from_deepspeed.arguments import FromDeepSpeed

__all__ = ["PRECISIONS", "check_precision", "give_the_trainer", "refuse_the_trainers_settings"]

PRECISIONS = {"16": ("16-mixed",), "bf16": ("bf16-mixed", "bf16-true"), "32": ("32-true",)}
"""The Trainer's precision flags that honour each half precision a config enables."""


def give_the_trainer(settings: FromDeepSpeed, model: Any, precision: str | None) -> None:
    """Set the Trainer's (``model.trainer``'s, the LightningModule just connected)
    ``gradient_clip_val`` and ``accumulate_grad_batches`` where the config gives them and the
    Trainer was left at its default (an error where the two disagree), and check that its
    ``precision`` flag is the one the config enables; nothing where no config asks."""
    if not (settings.trainer or settings.precision):
        return
    trainer = model.trainer
    check_precision(settings, precision)
    clip = settings.trainer.get("gradient_clip_val")
    if "gradient_clip_val" in settings.trainer and clip is not None:
        if trainer.gradient_clip_val is None:
            trainer.gradient_clip_val = clip
        elif trainer.gradient_clip_val != clip:
            raise ValueError(f"{settings.where['gradient_clip_val']} ({clip}) and the Trainer's gradient_clip_val "
                             f"({trainer.gradient_clip_val}) disagree; give one")
    elif "gradient_clip_val" in settings.trainer and trainer.gradient_clip_val:
        raise ValueError(f"{settings.where['gradient_clip_val']} is 0 (no clipping) and the Trainer's "
                         f"gradient_clip_val is {trainer.gradient_clip_val}; give one")
    steps = settings.trainer.get("accumulate_grad_batches")
    if steps is not None and trainer.accumulate_grad_batches != steps:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(f"{settings.where['accumulate_grad_batches']} ({steps}) and the Trainer's "
                             f"accumulate_grad_batches ({trainer.accumulate_grad_batches}) disagree; give one")
        trainer.accumulate_grad_batches = steps


def check_precision(settings: FromDeepSpeed, precision: str | None, whose: str = "the Trainer") -> None:
    """The precision flag of the run (``whose``: the Trainer's or Fabric's) is the one the
    config enables (none is, or it agrees)."""
    if settings.precision is not None and precision not in PRECISIONS[settings.precision]:
        flags = " or ".join(repr(f) for f in PRECISIONS[settings.precision])
        raise ValueError(f"{settings.where['precision']} asks for {settings.precision} training: give {whose} "
                         f"precision={flags} (it has {precision!r})")


def refuse_the_trainers_settings(settings: FromDeepSpeed, strategy: str) -> None:
    """Under Fabric the loop is the user's: a config's clipping or accumulation has no Trainer
    to give them to."""
    config = settings.config
    for section in ("optimizer", "scheduler"):
        if config is not None and getattr(config, section) is not None:
            raise ValueError(f"{strategy}: the {section} section of the {config.source} is the loop's to make under "
                             "Fabric: create it in the loop and give it to fabric.setup; remove it from the config")
    for name, how in (("gradient_clip_val", "fabric.clip_gradients(model, optimizer, max_norm=...)"),
                      ("accumulate_grad_batches", "fabric.no_backward_sync(model) on the steps that accumulate")):
        if name in settings.trainer and settings.trainer[name] is not None:
            raise ValueError(f"{strategy}: {settings.where[name]} ({settings.trainer[name]}) is the loop's to do "
                             f"under Fabric: {how}; remove it from the config")
