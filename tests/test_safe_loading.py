"""A checkpoint that torch's safe loader refuses is not called damaged (issue 71).

A LightningModule that saves a config dataclass of its own in its hyperparameters, trained
and saved under our strategies as a single file, a ZeRO directory and an FSDP
(distributed) directory: resuming it is refused as under plain Lightning (torch's
``weights_only=True`` default), with an error that names the refused class, says the
file is not damaged and gives both ways to load a file one trusts; those ways work
(``weights_only=False``, ``add_safe_globals``), through ``fit`` and through
``consolidate`` (``--no-weights-only``, or globals allowed in the same process).  A
checkpoint whose pickle would call ``os.system`` runs nothing without that opt-in, in
every path we load through: single files (Trainer, Fabric), ZeRO main files and shards,
FSDP's ``meta.pt`` and the non-tensor entries of its shards (which torch's own planner
loads unchecked), and ``consolidate``."""

from __future__ import annotations

import io
import pickle
import sys
import zipfile

import lightning as L
import pytest
import torch

from lightning_fastopt import FastOptStrategy
from lightning_fastopt.checkpoint import BrokenCheckpointError, consolidate
from lightning_fastopt.checkpoint.__main__ import main as checkpoint_command
from lightning_fastopt.checkpoint.distributed import _read_shards, consolidate_distributed
from lightning_fastopt.checkpoint.safe_loading import CheckpointClassNotFoundError, SafeLoaderRefusedError
from tests.test_precision import _data
from tests.user_objects import ConfiguredModel, UserConfig, touching

pytestmark = pytest.mark.usefixtures("no_process_group_left")  # (FSDP runs in this process)

STRATEGIES = {
    "single": lambda: FastOptStrategy(),
    "zero": lambda: FastOptStrategy(zero_stage=2),
    "fsdp": lambda: "fastopt_fsdp",
}


def _trainer(strategy, steps):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of each kind, 2 steps in, holding a ``UserConfig`` in its hyperparameters."""
    made = {}

    def make(kind):
        if kind not in made:
            path = tmp_path_factory.mktemp(kind) / f"{kind}.ckpt"
            trainer = _trainer(STRATEGIES[kind](), 2)
            trainer.fit(ConfiguredModel(UserConfig()), _data())
            trainer.save_checkpoint(path)
            made[kind] = path
        return made[kind]
    return make


def _refusal_says_what_and_how(err: BaseException, names: str, where: str) -> None:
    text = str(err)
    assert isinstance(err, pickle.UnpicklingError)  # as torch (and so plain Lightning) raises it
    assert where in text and names in text, text
    assert "was not loaded, for safety" in text and "The file is not damaged" in text, text
    assert "--no-weights-only" in text and "torch.serialization.add_safe_globals([" in text, text


@pytest.mark.parametrize("kind,where", [("single", "single.ckpt"), ("zero", "checkpoint.pt"), ("fsdp", "meta.pt")])
def test_a_checkpoint_holding_the_users_config_is_refused_as_not_damaged(saved, kind, where):
    path = saved(kind)
    with pytest.raises(SafeLoaderRefusedError) as caught:
        _trainer(STRATEGIES[kind](), 4).fit(ConfiguredModel(UserConfig()), _data(), ckpt_path=path)
    _refusal_says_what_and_how(caught.value, "tests.user_objects.UserConfig", where)
    assert "add_safe_globals([UserConfig])" in str(caught.value)
    assert caught.value.names == ["tests.user_objects.UserConfig"]


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_trusted_file_resumes_as_under_plain_lightning_both_ways(saved):
    """``weights_only=False`` to ``fit``, or the class allowed with ``safe_globals``: the
    resumed run ends bit for bit where ``Trainer()`` resumed the same way ends."""
    path = saved("single")
    ends = {}
    for name, strategy in (("ours", lambda: FastOptStrategy()), ("plain", lambda: "auto")):
        model = ConfiguredModel(UserConfig())
        _trainer(strategy(), 4).fit(model, _data(), ckpt_path=path, weights_only=False)
        ends[name, "weights_only=False"] = _weights(model)
        model = ConfiguredModel(UserConfig())
        with torch.serialization.safe_globals([UserConfig]):
            _trainer(strategy(), 4).fit(model, _data(), ckpt_path=path)
        ends[name, "safe_globals"] = _weights(model)
    for way in ("weights_only=False", "safe_globals"):
        for key, value in ends["plain", way].items():
            assert torch.equal(ends["ours", way][key], value), (way, key)


def test_a_trusted_zero_directory_resumes_with_weights_only_false(saved):
    trainer = _trainer(STRATEGIES["zero"](), 4)
    trainer.fit(ConfiguredModel(UserConfig()), _data(), ckpt_path=saved("zero"), weights_only=False)
    assert trainer.global_step == 4


def test_under_fsdp_the_refusal_names_the_ways_that_reach_the_strategy(saved):
    """Lightning's Trainer restores an FSDP strategy without fit's ``weights_only`` (under
    ``ModelParallelStrategy`` too): the message says so, and allowing the class resumes."""
    with pytest.raises(SafeLoaderRefusedError, match="does not pass fit's weights_only to an FSDP strategy"):
        _trainer(STRATEGIES["fsdp"](), 4).fit(ConfiguredModel(UserConfig()), _data(), ckpt_path=saved("fsdp"),
                                              weights_only=False)
    trainer = _trainer(STRATEGIES["fsdp"](), 4)
    with torch.serialization.safe_globals([UserConfig]):
        trainer.fit(ConfiguredModel(UserConfig()), _data(), ckpt_path=saved("fsdp"))
    assert trainer.global_step == 4


@pytest.mark.parametrize("kind,where", [("zero", "checkpoint.pt"), ("fsdp", "meta.pt")])
def test_consolidate_refuses_then_loads_what_the_user_trusts(saved, kind, where, tmp_path, capsys):
    path, out = saved(kind), tmp_path / "one.ckpt"
    with pytest.raises(SystemExit) as ended:
        checkpoint_command(["consolidate", str(path), str(out)])
    assert ended.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert f"{where} was not loaded, for safety" in err and "consolidate --no-weights-only" in err, err

    checkpoint_command(["consolidate", "--no-weights-only", str(path), str(out)])
    assert "wrote" in capsys.readouterr().out
    assert torch.load(out, weights_only=False)["hyper_parameters"]["cfg"] == UserConfig()

    library = consolidate if kind == "zero" else consolidate_distributed
    with pytest.raises(SafeLoaderRefusedError):
        library(path)
    with torch.serialization.safe_globals([UserConfig]):  # allowed in this process: the safe loader takes it
        assert library(path)["hyper_parameters"]["cfg"] == UserConfig()


def test_consolidate_names_a_class_defined_in_the_script_that_saved_it(tmp_path, capsys, monkeypatch):
    """Loaded without ``weights_only`` in a process that lacks ``__main__.Ghost``: not
    damaged either, and the error says where the class was defined."""
    from lightning_fastopt.checkpoint.atomic import save_atomically
    from lightning_fastopt.checkpoint.sharded import load_sharded

    class Ghost:
        pass

    Ghost.__module__, Ghost.__qualname__ = "__main__", "Ghost"
    directory = tmp_path / "zero.ckpt"
    trainer = _trainer(FastOptStrategy(zero_stage=2), 2)
    trainer.fit(ConfiguredModel(UserConfig()), _data())
    trainer.save_checkpoint(directory)
    main_file = directory / "checkpoint.pt"
    with monkeypatch.context() as patch:
        patch.setattr(sys.modules["__main__"], "Ghost", Ghost, raising=False)
        save_atomically({**torch.load(main_file, weights_only=False), "ghost": Ghost()}, main_file)
    with pytest.raises(CheckpointClassNotFoundError, match=r"cannot import: __main__\.Ghost\. The file is not "
                                                           r"damaged.*defined in the script that saved it"):
        load_sharded(directory, weights_only=False)
    with pytest.raises(SystemExit):
        checkpoint_command(["consolidate", "--no-weights-only", str(directory), str(tmp_path / "one.ckpt")])
    assert "__main__.Ghost" in capsys.readouterr().err


def test_a_damaged_pickle_inside_a_whole_archive_is_still_called_damaged(saved, tmp_path):
    """The archive intact, its pickle cut in half: torch's safe loader fails on it too, but
    it names no refused class: damaged, not refused."""
    good = saved("single")
    path = tmp_path / "cut.ckpt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            data = src.read(item)
            dst.writestr(item, data[: len(data) // 2] if item.filename.endswith("data.pkl") else data)
    with pytest.raises(BrokenCheckpointError, match="cannot read the checkpoint"):
        _trainer(FastOptStrategy(), 4).fit(ConfiguredModel(UserConfig()), _data(), ckpt_path=path,
                                           weights_only=True)


# ---------------------------------------------------------------- a pickle that would run a command
def _with_command(path, marker):
    """``path`` (a torch file) rewritten with an entry whose unpickling creates ``marker``."""
    loaded = torch.load(path, weights_only=False)
    if isinstance(loaded, list):  # a ZeRO shard file: one state per optimizer
        loaded[0]["extra"] = touching(marker)
    else:
        loaded["extra"] = touching(marker)
    torch.save(loaded, path)


def _copy(path, tmp_path):
    import shutil

    copy = tmp_path / path.name
    (shutil.copytree if path.is_dir() else shutil.copy)(path, copy)
    return copy


def _crafted(saved, tmp_path, target):
    """A copy of a checkpoint with one file rewritten to hold ``os.system``, and the marker
    file that running it would create."""
    kind, inside = target
    marker = tmp_path / "ran"
    path = _copy(saved(kind), tmp_path)
    if inside == "entry":  # a non-tensor entry of the distributed checkpoint's shards
        import torch.distributed.checkpoint as dcp

        state = _read_shards(path)
        assert not marker.exists()
        state["optimizer_0"]["param_groups"][0]["lr"] = touching(marker)
        crafted = tmp_path / "crafted.ckpt"
        dcp.save(state, checkpoint_id=crafted, no_dist=True)
        (crafted / "meta.pt").write_bytes((path / "meta.pt").read_bytes())
        _read_shards(crafted)  # torch's own planner loads such an entry unchecked: the command runs
        assert marker.exists()
        marker.unlink()
        return crafted, marker
    _with_command(path / inside if inside else path, marker)
    if path.is_dir():
        (path / "fastopt_checksums.json").unlink(missing_ok=True)  # a crafted checkpoint carries no checksums of ours
    return path, marker


TARGETS = {"single file": ("single", None), "ZeRO main file": ("zero", "checkpoint.pt"),
           "ZeRO shard": ("zero", "optimizer_shard_00000.pt"), "FSDP meta.pt": ("fsdp", "meta.pt"),
           "FSDP shard entry": ("fsdp", "entry")}


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_pickle_that_would_run_a_command_runs_nothing_when_resuming(saved, tmp_path, target):
    path, marker = _crafted(saved, tmp_path, TARGETS[target])
    kind = TARGETS[target][0]
    with torch.serialization.safe_globals([UserConfig]):  # the user's class allowed: the command still refused
        with pytest.raises(SafeLoaderRefusedError, match=r"posix\.system") as caught:
            _trainer(STRATEGIES[kind](), 4).fit(ConfiguredModel(UserConfig()), _data(), ckpt_path=path)
    assert "UserConfig" not in str(caught.value)
    assert not marker.exists()


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "single file"])
def test_a_pickle_that_would_run_a_command_runs_nothing_when_consolidated(saved, tmp_path, target, capsys):
    path, marker = _crafted(saved, tmp_path, TARGETS[target])
    with torch.serialization.safe_globals([UserConfig]), pytest.raises(SystemExit):
        checkpoint_command(["consolidate", str(path), str(tmp_path / "one.ckpt")])
    assert "posix.system" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "one.ckpt").exists()


def test_a_pickle_that_would_run_a_command_runs_nothing_under_fabric(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "fabric.ckpt"
    fabric = L.Fabric(strategy="fastopt", accelerator="cpu", devices=1)
    model = torch.nn.Linear(2, 2)
    fabric.save(path, {"model": model, "step": 1})
    _with_command(path, marker)
    with pytest.raises(SafeLoaderRefusedError, match=r"posix\.system"):
        fabric.load(path, {"model": model})
    assert not marker.exists()
    buffer = io.BytesIO(path.read_bytes())  # and with the opt-in, it runs: the test can fail
    torch.load(buffer, weights_only=False)
    assert marker.exists()


def test_the_errors_cross_processes_whole():
    """Pickled (an error sent from one process to another), each error keeps its message."""
    refused = SafeLoaderRefusedError("the checkpoint x.ckpt", ["tests.user_objects.UserConfig"]).with_ways("ways")
    missing = CheckpointClassNotFoundError("the checkpoint x.ckpt", ["__main__.Ghost"])
    for err in (refused, missing):
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and str(again) == str(err) and again.names == err.names
