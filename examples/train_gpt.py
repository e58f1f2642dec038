"""Train the byte-level GPT through LightningCLI.

    python examples/train_gpt.py fit --config examples/configs/gpt_offload.yaml

The configs in ``examples/configs`` choose the strategy by its registered name
(``fastopt_offload``; importing lightning_fastopt here registers it) or by class_path,
the optimizer and the LR scheduler by class_path, and the precision.

Checkpoints go to ``<default_root_dir>/checkpoints`` (one directory for a run and its
continuations); when ``fit`` ends the script prints the command that continues training
from the last one, for as many epochs (or steps) again.
"""

import os
import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning_fastopt  # noqa: E402,F401  (registers strategy="fastopt_offload")
from gpt import TextData, TinyGPT  # noqa: E402

# arguments that take a value and that the continuing command sets anew
_REPLACED = ("--ckpt_path", "--trainer.max_epochs", "--trainer.max_steps")


class GPTCLI(LightningCLI):
    def before_fit(self) -> None:
        callback = self.trainer.checkpoint_callback
        if callback is not None and callback.dirpath is None:  # not under the logger's new version_N
            callback.dirpath = os.path.join(self.trainer.default_root_dir, "checkpoints")


def continue_command(argv: list[str], saved: str, trainer) -> str:
    """The command that continues this run from ``saved``: the same arguments, without an
    earlier ``--ckpt_path`` and stopping point, training as long again as this run was
    allowed to (twice ``max_steps`` when steps stopped it, else twice the epochs)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _REPLACED:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in _REPLACED)):
            kept.append(arg)
    if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        until = ["--trainer.max_steps", str(2 * trainer.max_steps)]
    else:
        until = ["--trainer.max_epochs", str(2 * max(trainer.max_epochs or 0, trainer.current_epoch, 1))]
    return "python3 examples/train_gpt.py " + " ".join([*kept, *until, "--ckpt_path", saved])


def main(args=None):
    cli = GPTCLI(TinyGPT, TextData, args=args, save_config_kwargs={"overwrite": True})
    callback = cli.trainer.checkpoint_callback
    saved = (callback.last_model_path or callback.best_model_path) if callback else ""
    if cli.subcommand == "fit" and saved and cli.trainer.is_global_zero:
        argv = list(sys.argv[1:] if args is None else args)
        print(f"checkpoint: {saved}")
        print(f"continue with: {continue_command(argv, saved, cli.trainer)}")
    return cli


if __name__ == "__main__":
    main()
