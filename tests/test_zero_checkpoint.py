"""ZeRO checkpoints in real processes (gloo): a directory of per-rank shards and a
manifest; saved at 2 ranks and resumed at 1, and the other way round, the run continues
as if never stopped (a global batch of 8 either way: the same samples per step, summed
in another order, so Adam's tolerance, rtol 1.3e-6 / atol 1e-5, against the run that was
not stopped; bit for bit against plain Lightning with torch AdamW resumed at the same
world size from the consolidated checkpoint); resumed at the same world size (another
stage and offload, or after a rank was killed mid-save) bit for bit; a re-save never
keeps a stale shard; an unfinished save leaves the previous checkpoint."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from lightning_fastopt import checkpoint as ck
from tests.helpers import run_script

# real processes: README's test command leaves these to CI (pytest -m slow)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "zero_run.py"
EPOCH_2 = "epoch=1-step=16.ckpt"


def _run(out, *args):
    """The script's run on ``--devices`` processes, started at once (``tests.helpers.run_script``)."""
    devices = int(args[args.index("--devices") + 1]) if "--devices" in args else 2
    run_script(SCRIPT, out, *args, ranks=devices)
    return torch.load(out / "final.pt", weights_only=True)


def _assert_equal(a, b):
    assert a["step"] == b["step"] == 32
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k


def _assert_close(a, b):
    assert a["step"] == b["step"] == 32
    for k in a["weights"]:
        torch.testing.assert_close(a["weights"][k], b["weights"][k], rtol=1.3e-6, atol=1e-5, msg=lambda m: f"{k}: {m}")


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero2ranks")
    return out, _run(out, "--devices", "2")


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero1rank")
    return out, _run(out, "--devices", "1")


def test_directory_layout_and_manifest(two_rank_run):
    out, _ = two_rank_run
    path = out / "ckpt" / EPOCH_2
    assert sorted(os.listdir(path)) == ["checkpoint.pt", "manifest.json", "optimizer_shard_00000.pt",
                                        "optimizer_shard_00001.pt"]
    import json

    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["zero_stage"] == 1 and manifest["format_version"] == 1
    owners = manifest["partitions"][0]
    assert set(owners.values()) == {0, 1} and list(owners)[0] == "net.0.weight"
    shard0 = torch.load(path / "optimizer_shard_00000.pt", weights_only=True)[0]
    assert set(shard0["state"]) == {n for n, r in owners.items() if r == 0}  # rank 0 saved only its own


@pytest.fixture(scope="module")
def plain_resumed_on_one(two_rank_run, tmp_path_factory):
    """Plain Lightning (``ddp``, one device, torch AdamW) resumed from the two-rank
    checkpoint, consolidated into one file by the command."""
    out, _ = two_rank_run
    tmp = tmp_path_factory.mktemp("plain")
    single = tmp / "consolidated.ckpt"
    run_script("-m", "lightning_fastopt.checkpoint", "consolidate", out / "ckpt" / EPOCH_2, single)
    return single, _run(tmp, "--devices", "1", "--strategy", "ddp", "--resume", str(single))


def test_resume_two_ranks_on_one(two_rank_run, plain_resumed_on_one, tmp_path):
    out, ref = two_rank_run
    over = tmp_path / "over.ckpt"
    shutil.copytree(out / "ckpt" / "last.ckpt", over)  # a two-rank checkpoint to save over
    resumed = _run(tmp_path, "--devices", "1", "--resume", str(out / "ckpt" / EPOCH_2), "--save-to", str(over))
    _assert_equal(resumed, plain_resumed_on_one[1])  # the shards merged lose nothing
    _assert_close(resumed, ref)
    # the one-rank save replaced the two-rank checkpoint whole: no stale shard of rank 1 left
    assert sorted(os.listdir(over)) == ["checkpoint.pt", "manifest.json", "optimizer_shard_00000.pt"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp") or ".old-" in p]
    assert ck.load_sharded(over)["global_step"] == 32


def test_resume_one_rank_on_two(one_rank_run, tmp_path):
    one, ref = one_rank_run
    resumed = _run(tmp_path / "two", "--devices", "2", "--resume", str(one / "ckpt" / EPOCH_2))
    _assert_close(resumed, ref)


def test_resume_stage_1_as_stage_2_offloaded(two_rank_run, tmp_path):
    """Another stage and offload fraction: the shards are merged and re-sharded."""
    out, ref = two_rank_run
    resumed = _run(tmp_path, "--devices", "2", "--stage", "2", "--offload", "0.5", "--resume",
                   str(out / "ckpt" / EPOCH_2))
    _assert_equal(resumed, ref)


def test_streamed_and_speculated_zero2_resumes_in_the_middle_where_the_synchronous_run_ends(tmp_path):
    """Stage 2 half offloaded, clipping by norm on: with ``stream_cpu_step`` (each bucket's
    update speculated as its reduction lands, committed or redone at the step) the run, and
    the run resumed from its checkpoint at epoch 2, end where the synchronous run ends."""
    args = ("--devices", "2", "--stage", "2", "--offload", "0.5", "--clip", "0.8")  # clips about half the steps
    synchronous = _run(tmp_path / "sync", *args)
    streamed = _run(tmp_path / "stream", *args, "--stream")
    resumed = _run(tmp_path / "resumed", *args, "--stream", "--resume", str(tmp_path / "stream" / "ckpt" / EPOCH_2))
    for run in (streamed, resumed):
        assert run["buckets"]["committed"] > 0 and run["buckets"]["redone"] > 0
        _assert_equal(run, synchronous)


def test_consolidated_checkpoint_resumes_under_plain_lightning(two_rank_run, plain_resumed_on_one):
    single, resumed = plain_resumed_on_one
    plain = torch.load(single, weights_only=True)
    assert list(plain["optimizer_states"][0]["state"]) == list(plain["state_dict"])  # whole, in model order
    _assert_close(resumed, two_rank_run[1])


def test_lightnings_own_loaders_name_the_way_out_of_a_sharded_directory(two_rank_run, tmp_path):
    """load_from_checkpoint, and resuming under Trainer(), on a sharded directory: an error
    naming the main file and the consolidate command, instead of a bare IsADirectoryError."""
    import lightning as L

    from lightning_fastopt.checkpoint.load_guard import ShardedCheckpointError
    from tests.scripts.zero_run import Model

    out, ref = two_rank_run
    path = out / "ckpt" / "last.ckpt"
    with pytest.raises(ShardedCheckpointError, match=f"for the model's weights alone, load {path}/checkpoint.pt; "
                       f"for one ordinary checkpoint file: python -m lightning_fastopt.checkpoint consolidate {path}"):
        Model.load_from_checkpoint(path)
    trainer = L.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ShardedCheckpointError, match="To resume training from it, use a fastopt strategy"):
        trainer.fit(Model(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8),
                                                                                        torch.randn(8, 1))),
                    ckpt_path=path)
    model = Model.load_from_checkpoint(path / "checkpoint.pt")  # the way the message names
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref["weights"][k]), k


def test_unfinished_save_leaves_the_previous_checkpoint(two_rank_run, tmp_path):
    out, _ = two_rank_run
    path = tmp_path / "last.ckpt"
    shutil.copytree(out / "ckpt" / EPOCH_2, path)
    staging = ck.staging_path(path)
    os.makedirs(staging)
    ck.write_shard(staging, 0, [{"state": {}, "param_groups": []}])  # a rank dies here: no manifest, no move
    assert ck.is_sharded(path) and not ck.is_sharded(staging)
    assert ck.load_sharded(path)["global_step"] == 16
    with pytest.raises(RuntimeError, match="incomplete"):
        ck.write_manifest(staging, world_size=2, zero_stage=1, partitions=[])
    assert ck.load_sharded(path)["global_step"] == 16


def test_rank_killed_mid_save_leaves_the_previous_checkpoint(two_rank_run, tmp_path):
    """Rank 1 is killed (SIGKILL) half-way through writing its shard of the second
    checkpoint: rank 0 gives up at the barrier, the first checkpoint and last.ckpt still
    load whole, the half-written one never appears under its name, and training resumes."""
    proc = run_script(SCRIPT, tmp_path, "--devices", "2", "--kill-rank1-at-save", "3", check=False)
    assert proc.returncode != 0
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith("."))
    assert ckpts == ["epoch=0-step=8.ckpt", "last.ckpt"]  # saves 1 and 2: epoch 0 and last
    for name in ckpts:
        assert ck.load_sharded(tmp_path / "ckpt" / name)["global_step"] == 8
    ref = two_rank_run[1]  # the same run, not killed
    resumed = _run(tmp_path / "resumed", "--devices", "2", "--resume", str(tmp_path / "ckpt" / "last.ckpt"))
    _assert_equal(resumed, ref)


@pytest.mark.parametrize("stage", ["1", "2"])
def test_two_ranks_equal_one_process_with_the_same_global_batch(two_rank_run, one_rank_run, tmp_path, stage):
    one = one_rank_run[1] if stage == "1" else _run(tmp_path / "one", "--devices", "1", "--stage", stage)
    two = two_rank_run[1] if stage == "1" else _run(tmp_path / "two", "--devices", "2", "--stage", stage)
    _assert_close(two, one)


def test_consolidate_a_fabric_sharded_checkpoint(tmp_path, capsys):
    """A directory ``fabric.save`` wrote with ZeRO (each optimizer's entry a marker, the
    shards beside): the command writes the consolidated file and says what it holds (it
    wrote the file, then died with ``KeyError: 'optimizer_states'``; issue: sharp edges)."""
    from lightning_fastopt import FusedAdam
    from lightning_fastopt.checkpoint.__main__ import main
    from lightning_fastopt.checkpoint.sharded import SHARDS_KEY, save_sharded
    from lightning_fastopt.zero import ZeroOptimizer

    class OneRank:
        global_rank, world_size, is_global_zero = 0, 1, True

        def broadcast(self, obj, src=0):
            return obj

        def barrier(self, name=None):
            pass

    model = torch.nn.Linear(3, 2)
    opt = ZeroOptimizer(FusedAdam(model.parameters(), lr=0.1), dict(
        (p, n) for n, p in model.named_parameters()), stage=1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = {"model": model.state_dict(), "optimizer": {SHARDS_KEY: 0}, "step": 1,
             "optimizer_states": [opt.state_dict()]}
    save_sharded(state, tmp_path / "fabric.ckpt", OneRank(), zero_stage=1, partitions=[opt.partition()])
    main(["consolidate", str(tmp_path / "fabric.ckpt"), str(tmp_path / "one.ckpt")])
    assert "1 optimizer state(s) (under 'optimizer'), 2 parameter state(s)" in capsys.readouterr().out
    one = torch.load(tmp_path / "one.ckpt", weights_only=True)
    assert one["step"] == 1 and "optimizer_states" not in one
    assert len(one["optimizer"]["state"]) == 2
