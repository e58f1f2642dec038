"""Nothing we did not write is deleted, and a checkpoint already saved is replaced as the
user asked (issue 67): ``consolidate``'s output path (a directory never, a file only with
``--overwrite``); a save over a checkpoint of the other kind (a full file over a
distributed or ZeRO directory, a directory over a file) replaces it, as Lightning's
``ModelParallelStrategy`` does, where a directory that holds anything else is refused
with an error that says which."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_fastopt.checkpoint import consolidate
from lightning_fastopt.checkpoint.__main__ import main as checkpoint_command
from lightning_fastopt.checkpoint.distributed import consolidate_distributed
from tests.test_safe_loading import _trainer
from tests.test_precision import _data
from tests.test_strategy import Model
from lightning_fastopt import FastOptStrategy

pytestmark = pytest.mark.usefixtures("no_process_group_left")  # (FSDP runs in this process)


@pytest.fixture(scope="module")
def zero_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("zero") / "step=2.ckpt"
    trainer = _trainer(FastOptStrategy(zero_stage=2), 2)
    trainer.fit(Model(lambda ps: torch.optim.AdamW(ps), sched=False), _data())
    trainer.save_checkpoint(path)
    return path


def _users_directory(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "results.csv").write_text("step,loss\n1,0.5\n")
    return out


def test_consolidate_never_replaces_a_directory(zero_dir, tmp_path, capsys):
    out = _users_directory(tmp_path)
    for flags in ([], ["--overwrite"]):
        with pytest.raises(SystemExit) as ended:
            checkpoint_command(["consolidate", *flags, str(zero_dir), str(out)])
        assert ended.value.code == 2
        err = capsys.readouterr().err
        assert f"is a directory: nothing was written (a directory is never replaced; name a file): '{out}'" in err
        assert (out / "results.csv").read_text() == "step,loss\n1,0.5\n"
    with pytest.raises(IsADirectoryError):
        consolidate(zero_dir, out, overwrite=True)
    with pytest.raises(IsADirectoryError):
        consolidate_distributed(tmp_path / "no such checkpoint", out, overwrite=True)
    assert (out / "results.csv").is_file()


def test_consolidate_checks_its_output_before_reading_the_checkpoint(tmp_path, capsys):
    """A damaged (here: missing) checkpoint with a directory at OUT: the error is OUT's."""
    out = _users_directory(tmp_path)
    with pytest.raises(SystemExit):
        checkpoint_command(["consolidate", str(tmp_path / "missing.ckpt"), str(out)])
    assert "is a directory: nothing was written" in capsys.readouterr().err


def test_consolidate_replaces_a_file_only_when_asked(zero_dir, tmp_path, capsys):
    out = tmp_path / "one.ckpt"
    out.write_bytes(b"an older consolidated file")
    with pytest.raises(SystemExit) as ended:
        checkpoint_command(["consolidate", str(zero_dir), str(out)])
    assert ended.value.code == 2
    assert f"exists: nothing was written (to replace it, pass --overwrite, or overwrite=True): '{out}'" in \
        capsys.readouterr().err
    assert out.read_bytes() == b"an older consolidated file"
    with pytest.raises(FileExistsError):
        consolidate(zero_dir, out)

    checkpoint_command(["consolidate", "--overwrite", str(zero_dir), str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    assert len(torch.load(out, weights_only=True)["optimizer_states"]) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["one.ckpt"]  # no temporary file left beside it


# ---------------------------------------------------------------- a save over a checkpoint of the other kind
def _fit_fsdp(distributed: bool):
    from lightning_fastopt import FastOptFSDPStrategy

    trainer = _trainer(FastOptFSDPStrategy(save_distributed_checkpoint=distributed), 2)
    trainer.fit(Model(lambda ps: torch.optim.AdamW(ps), sched=False), _data())
    return trainer


@pytest.mark.parametrize("first,then", [(True, False), (False, True)],
                         ids=["directory-then-file", "file-then-directory"])
def test_the_trainers_fsdp_strategy_saves_over_a_checkpoint_of_the_other_kind(tmp_path, first, then):
    """As ``ModelParallelStrategy`` does: the second save replaces the first, and resumes."""
    path = tmp_path / "last.ckpt"
    _fit_fsdp(first).save_checkpoint(path)
    assert path.is_dir() == first
    _fit_fsdp(then).save_checkpoint(path)
    assert path.is_dir() == then and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    resumed = _trainer("fastopt_fsdp", 4)
    resumed.fit(Model(lambda ps: torch.optim.AdamW(ps), sched=False), _data(), ckpt_path=path)
    assert resumed.global_step == 4


@pytest.mark.parametrize("first,then", [(True, False), (False, True)],
                         ids=["directory-then-file", "file-then-directory"])
def test_fabrics_fsdp_strategy_saves_over_a_checkpoint_of_the_other_kind(tmp_path, first, then):
    import lightning as L

    from lightning_fastopt.fabric.fsdp_strategy import FastOptFabricFSDPStrategy

    path = tmp_path / "last.ckpt"
    for distributed in (first, then):
        fabric = L.Fabric(strategy=FastOptFabricFSDPStrategy(save_distributed_checkpoint=distributed),
                          accelerator="cpu", devices=1)
        fabric.launch()
        model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
        assert path.is_dir() == distributed
    assert fabric.load(path, {"model": model, "optimizer": optimizer})["step"] == 1


def test_a_file_never_replaces_a_directory_that_holds_anything_else(tmp_path):
    from lightning_fastopt.checkpoint.replacing import (CheckpointDirectoryHoldsOtherFilesError,
                                                        NotACheckpointDirectoryError)

    trainer = _fit_fsdp(True)
    plain = _users_directory(tmp_path)
    with pytest.raises(NotACheckpointDirectoryError, match=r"The checkpoint path exists and is a directory: .*"
                                                           r"which is not a checkpoint \(it holds results\.csv\)"):
        _fit_fsdp(False).save_checkpoint(plain)
    mixed = tmp_path / "last.ckpt"
    trainer.save_checkpoint(mixed)
    (mixed / "notes.txt").write_text("mine")
    before = sorted(p.name for p in mixed.iterdir())
    with pytest.raises(CheckpointDirectoryHoldsOtherFilesError, match=r"a distributed checkpoint .* also holds "
                                                                      r"files that are not the checkpoint's "
                                                                      r"\(notes\.txt\)"):
        _fit_fsdp(False).save_checkpoint(mixed)
    assert sorted(p.name for p in mixed.iterdir()) == before and (plain / "results.csv").is_file()
    one_file = _trainer(FastOptStrategy(), 2)
    one_file.fit(Model(lambda ps: torch.optim.AdamW(ps), sched=False), _data())
    with pytest.raises(CheckpointDirectoryHoldsOtherFilesError):  # the DDP strategy's one-file writer: the same rule
        one_file.save_checkpoint(mixed)
    assert sorted(p.name for p in mixed.iterdir()) == before


def test_a_single_file_replaces_a_zero_directory_that_holds_nothing_else(zero_dir, tmp_path):
    import shutil

    from lightning_fastopt.checkpoint.replacing import CheckpointDirectoryHoldsOtherFilesError

    path = tmp_path / "last.ckpt"
    shutil.copytree(zero_dir, path)
    (path / "results.csv").write_text("mine")
    trainer = _trainer(FastOptStrategy(), 2)
    trainer.fit(Model(lambda ps: torch.optim.AdamW(ps), sched=False), _data())
    with pytest.raises(CheckpointDirectoryHoldsOtherFilesError, match="sharded \\(ZeRO\\) checkpoint"):
        trainer.save_checkpoint(path)
    (path / "results.csv").unlink()
    trainer.save_checkpoint(path)
    assert path.is_file() and torch.load(path, weights_only=True)["global_step"] == 2


# ---------------------------------------------------------------- resuming with accumulation (docs/checkpoints.md)
class _Saves(L.Callback):
    """(global step, micro-batches done) at each save."""

    def __init__(self):
        self.seen = []

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self.seen.append((trainer.global_step, trainer.fit_loop.epoch_loop.batch_progress.current.completed))


class NoSaveAtTheStartStep(L.Callback):
    """The recipe of docs/checkpoints.md: a resumed run's checkpoint callbacks count the step
    it resumed at as saved (Lightning's ModelCheckpoint does not keep it in its state)."""

    def on_train_start(self, trainer, pl_module):
        if trainer.ckpt_path is not None:
            for callback in trainer.checkpoint_callbacks:
                callback._last_global_step_saved = trainer.global_step


@pytest.mark.parametrize("strategy", ["auto", "fastopt"])
def test_a_resumed_run_with_accumulation_saves_its_start_again_unless_told(tmp_path, strategy):
    """``accumulate_grad_batches=2`` and ``every_n_train_steps=2``: resumed from step 2, the
    run saves step 2 again after its first micro-batch (the file then says one micro-batch
    more than its weights and state hold: a kill before the next save skips it), under plain
    Lightning as under ours; with the callback of docs/checkpoints.md it does not."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(steps, callbacks, ckpt_path=None):
        saves = _Saves()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2), saves,
                                       *callbacks])
        trainer.fit(Model(lambda ps: torch.optim.AdamW(ps), sched=False), _data(), ckpt_path=ckpt_path)
        return saves.seen

    assert [step for step, _ in fit(2, [])] == [2]
    start = tmp_path / "epoch=0-step=2.ckpt"
    again = fit(4, [], ckpt_path=start)
    assert again[0][0] == 2 and again[0][1] == torch.load(start, weights_only=False)["loops"]["fit_loop"][
        "epoch_loop.batch_progress"]["current"]["completed"]  # the start re-saved, one micro-batch on
    fit(2, [])  # the start as it was
    told = fit(4, [NoSaveAtTheStartStep()], ckpt_path=start)
    assert [step for step, _ in told] == [4]
