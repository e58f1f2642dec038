"""The example through LightningCLI and the YAML configs in examples/configs: the strategy
by registered name and by class_path (in a fresh interpreter that never imported
lightning_fastopt), optimizer and scheduler by class_path, the precision plugin by
class_path, and the loss of the main job going down."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fastopt import FastOptPrecision, FastOptStrategy, FusedAdam, OffloadOptimizer
from tests.helpers import subprocess_env

pytest.importorskip("jsonargparse")

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "examples" / "configs"
SMALL = ["--model.n_layer", "1", "--model.n_embd", "32", "--trainer.limit_val_batches", "1",
         "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
         "--trainer.enable_checkpointing", "false"]


def _cli(config, tmp_path, *extra):
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from train_gpt import main
    finally:
        sys.path.pop(0)
    sys.argv[1:] = []  # the CLI gets its arguments from args, not from pytest's command line
    return main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path), *SMALL, *extra])


def test_main_job_config_strategy_by_name(tmp_path):
    cli = _cli(CONFIGS / "gpt_offload.yaml", tmp_path, "--trainer.max_epochs", "3")
    trainer = cli.trainer
    assert isinstance(trainer.strategy, FastOptStrategy) and trainer.strategy.offload_fraction == 1.0
    opt = trainer.strategy.engines[0]
    assert isinstance(opt, OffloadOptimizer) and type(opt.optimizer) is FusedAdam
    assert opt.offloaded_numel == sum(p.numel() for p in cli.model.parameters())
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    assert sched.optimizer.param_groups[0] is opt.param_groups[0]  # the scheduler drives our groups
    assert trainer.global_step == 3 * 10


def test_main_job_loss_goes_down(tmp_path, capsys):
    _cli(CONFIGS / "gpt_offload.yaml", tmp_path, "--trainer.max_epochs", "4", "--model.n_layer", "2",
         "--model.n_embd", "64")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "mean train loss" in ln]
    losses = [float(ln.rsplit(" ", 1)[1]) for ln in lines]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5


def test_main_job_says_where_its_checkpoint_went_and_how_to_continue(tmp_path, capsys):
    """The printed command trains further, in the same checkpoint directory, and the command
    it prints in turn holds one --ckpt_path."""
    import shlex
    import warnings

    at = SMALL.index("--trainer.enable_checkpointing")
    small = SMALL[:at] + SMALL[at + 2:]
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from train_gpt import main
    finally:
        sys.path.pop(0)
    sys.argv[1:] = []
    args = ["fit", "--config", str(CONFIGS / "gpt_offload.yaml"), "--trainer.default_root_dir", str(tmp_path),
            *small, "--trainer.max_steps", "2"]
    main(args)
    out = capsys.readouterr().out.splitlines()
    saved = next(ln for ln in out if ln.startswith("checkpoint: ")).split(": ", 1)[1]
    assert Path(saved).is_file() and Path(saved).parent == tmp_path / "checkpoints"
    command = next(ln for ln in out if ln.startswith("continue with: ")).split(": ", 1)[1]
    words = shlex.split(command)
    assert words[:2] == ["python3", "examples/train_gpt.py"] and words.count("--ckpt_path") == 1
    assert words[words.index("--trainer.max_steps") + 1] == "4" and words.count("--trainer.max_steps") == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = main(words[2:])
    assert resumed.trainer.global_step == 4  # two more steps
    assert not [w for w in caught if "dirpath has changed" in str(w.message)]
    again = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("continue with: "))
    words = shlex.split(again.split(": ", 1)[1])
    assert words.count("--ckpt_path") == 1 and words[words.index("--trainer.max_steps") + 1] == "8"


def test_the_continue_command_doubles_the_epochs_when_epochs_stopped_the_run():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from train_gpt import continue_command
    finally:
        sys.path.pop(0)

    class Stopped:
        max_steps, global_step, max_epochs, current_epoch = -1, 120, 20, 20

    command = continue_command(["fit", "--config", "c.yaml", "--trainer.max_epochs=20", "--ckpt_path", "old.ckpt"],
                               "last.ckpt", Stopped())
    assert command == ("python3 examples/train_gpt.py fit --config c.yaml --trainer.max_epochs 40 "
                       "--ckpt_path last.ckpt")


def test_class_path_config_in_a_fresh_interpreter(tmp_path):
    """No `import lightning_fastopt` anywhere: jsonargparse imports the strategy and the
    precision plugin from their class_path."""
    code = f"""
import sys
sys.path.insert(0, {str(REPO / 'examples')!r})
from gpt import TextData, TinyGPT
from lightning.pytorch.cli import LightningCLI
assert "lightning_fastopt" not in sys.modules
cli = LightningCLI(TinyGPT, TextData, args=sys.argv[1:])
t = cli.trainer
print("RESULT", type(t.strategy).__name__, t.strategy.offload_fraction, type(t.precision_plugin).__name__,
      t.precision_plugin.precision, type(t.strategy.engines[0].optimizer).__name__, t.global_step)
"""
    args = ["fit", "--config", str(CONFIGS / "gpt_offload_class_path.yaml"), "--trainer.default_root_dir",
            str(tmp_path), "--trainer.max_steps", "3", *SMALL]
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=subprocess_env(REPO),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    assert result.split()[1:] == ["FastOptSingleDeviceStrategy", "0.5", "FastOptPrecision", "16-mixed", "FusedLAMB", "3"]


def test_strategy_by_class_path_on_the_command_line(tmp_path):
    cli = _cli(CONFIGS / "gpt_offload.yaml", tmp_path, "--trainer.max_steps", "2", "--trainer.strategy",
               "lightning_fastopt.FastOptStrategy", "--trainer.strategy.offload_fraction", "0.25",
               "--trainer.strategy.initial_scale_power", "8",
               "--trainer.strategy.per_parameter_optimizers", "[Adan, Sophia]")
    assert isinstance(cli.trainer.strategy, FastOptStrategy)
    assert cli.trainer.strategy.offload_fraction == 0.25
    assert cli.trainer.strategy.per_parameter_optimizers == ("Adan", "Sophia")
    assert isinstance(cli.trainer.precision_plugin, FastOptPrecision)


def test_auto_fraction_and_the_delayed_update_from_the_command_line(tmp_path):
    cli = _cli(CONFIGS / "gpt_offload.yaml", tmp_path, "--trainer.max_steps", "7", "--trainer.strategy",
               "lightning_fastopt.FastOptStrategy", "--trainer.strategy.offload_fraction", "auto",
               "--trainer.strategy.delayed_update", "true", "--trainer.strategy.delayed_update_warmup", "3")
    strategy = cli.trainer.strategy
    assert strategy.auto_fraction and strategy.delayed_update and strategy.delayed_update_warmup == 3
    opt = strategy.engines[0]
    assert isinstance(opt, OffloadOptimizer) and opt.schedule.delayed is not None
    assert strategy._auto_fraction._auto._probes[id(opt)].done  # the rebuilt optimizer, after the 5 probe steps
    # Lightning steps the user's optimizer, and the rebuilt optimizer stepped it to the end
    assert strategy._engines.engine_for(strategy.optimizers, strategy._lightning_optimizers[0]) is opt


@pytest.mark.slow
def test_the_main_job_under_fastopt_fsdp_offload_by_name(tmp_path):
    """``--trainer.strategy fastopt_fsdp_offload`` on the example GPT, which has no
    configure_model, a ModuleList of blocks and tied embeddings: the strategy shards it
    (nothing reaches the size threshold; the embeddings are tied, so the GPT itself is the
    root) and it trains, in a process of its own."""
    code = f"""
import sys
sys.path.insert(0, {str(REPO / 'examples')!r})
from train_gpt import main
cli = main(sys.argv[1:])
s = cli.trainer.strategy
print("RESULT", type(s).__name__, s.offload_fraction, type(cli.trainer.optimizers[0]).__name__, cli.trainer.global_step)
"""
    args = ["fit", "--config", str(CONFIGS / "gpt_offload.yaml"), "--trainer.default_root_dir", str(tmp_path),
            "--trainer.max_steps", "2", *SMALL, "--trainer.strategy", "fastopt_fsdp_offload", "--trainer.precision",
            "32-true"]
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=subprocess_env(REPO),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    assert result.split()[1:] == ["FastOptFSDPStrategy", "1.0", "AdamW", "2"]
    said = proc.stdout + proc.stderr
    assert "share a parameter: TinyGPT itself is sharded as the root" in said
    assert "TinyGPT has no configure_model: sharded 0 module(s) with fully_shard (modules of at least" in said


def test_bad_value_in_a_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"offload_fraction must be in \[0.0, 1.0\], got 1.5"):
        _cli(CONFIGS / "gpt_offload.yaml", tmp_path, "--trainer.strategy", "lightning_fastopt.FastOptStrategy",
             "--trainer.strategy.offload_fraction", "1.5")
