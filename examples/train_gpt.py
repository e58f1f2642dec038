"""Train the byte-level GPT through LightningCLI.

    python examples/train_gpt.py fit --config examples/configs/gpt_offload.yaml

The configs in ``examples/configs`` choose the strategy by its registered name
(``fastopt_offload``; importing lightning_fastopt here registers it) or by class_path,
the optimizer and the LR scheduler by class_path, and the precision.
"""

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning_fastopt  # noqa: E402,F401  (registers strategy="fastopt_offload")
from gpt import TextData, TinyGPT  # noqa: E402


def main(args=None):
    cli = LightningCLI(TinyGPT, TextData, args=args, save_config_kwargs={"overwrite": True})
    callback = cli.trainer.checkpoint_callback
    saved = (callback.last_model_path or callback.best_model_path) if callback else ""
    if cli.subcommand == "fit" and saved and cli.trainer.is_global_zero:
        argv = list(sys.argv[1:] if args is None else args)
        print(f"checkpoint: {saved}")
        print("resume with: python3 examples/train_gpt.py " + " ".join([*argv, "--ckpt_path", saved]))
    return cli


if __name__ == "__main__":
    main()
