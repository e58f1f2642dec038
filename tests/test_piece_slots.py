"""A parameter larger than a bucket, with the state on disk, split into pieces
(``lightning_fastopt/offload/pieces.py``, issue 53): the window holds two buckets however
large one tensor is, and the run ends where the same run with the state in host memory
(whole tensors) ends, bit for bit, for each optimizer that steps pieces alike, on the
accelerator's path (``copy_on_cpu=True``), with half weights, clipping, loss scaling with
an overflow and accumulation, streamed, speculated and delayed; checkpoints hold each
parameter's state whole and load both ways; under the Trainer as plain Lightning ends,
resumed from a checkpoint; bfloat16 moments too (each piece told where it starts, for
their stochastic rounding); on a CPU run, where a float32 weight is its own master, each
piece's master is its range of the weight.  Where pieces would change the bits (LAMB's and
LARS's norms over the whole tensor) or cannot be views (a parameter that is not
contiguous), the tensor stays whole."""

import math

import pytest
import torch
from torch import nn

from lightning_fastopt import FusedAdagrad, FusedAdam, FusedLAMB, FusedLars, FusedLion, FusedSGD
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.offload.pieces import ALIGN, piece_elements
from tests.test_disk_tier import _assert_same_state, _train

BIG = 50_000  # elements: ten pieces of a 0.02 MiB bucket, whose masters and state alone take 0.6 MB
BUCKET_MB = 0.02
ALGORITHMS = {
    "adamw": lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05),
    "amsgrad": lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05, amsgrad=True),
    "sgd": lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adagrad": lambda g: FusedAdagrad(g, lr=1e-2, lr_decay=1e-3),
    "lion": lambda g: FusedLion(g, lr=1e-3, weight_decay=0.1),
    "adamw-bf16-moments": lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05),  # host_state_dtype="bfloat16"
}


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g).to(dtype).requires_grad_() for n in (BIG, 3000, 7, 1500)]


def _optimizer(params, make, disk=None, window_mb=0.25, **kw):
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}]
    where = dict(offload_optimizer_device="nvme", nvme_path=str(disk), nvme_window_mb=window_mb) if disk else {}
    return OffloadOptimizer(make(groups), {p: f"p{i}" for i, p in enumerate(params)}, bucket_size_mb=BUCKET_MB,
                            **{"copy_on_cpu": True, **kw}, **where)


@pytest.mark.parametrize("copy_on_cpu", [True, False], ids=["accelerator-path", "cpu-run"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_tensor_larger_than_a_bucket_is_split_and_ends_where_host_memory_ends(tmp_path, algorithm, dtype,
                                                                                copy_on_cpu):
    """On the accelerator's path each piece's master is a copy of its range; on a CPU run a
    float32 weight is its own master, and each piece's master is its range of the weight
    (a bfloat16 one's a float32 copy)."""
    make = ALGORITHMS[algorithm]
    kw = dict(host_state_dtype="bfloat16") if algorithm.endswith("bf16-moments") else {}
    kw["copy_on_cpu"] = copy_on_cpu
    ref_params, params = _params(dtype), _params(dtype)
    ref = _optimizer(ref_params, make, **kw)
    opt = _optimizer(params, make, tmp_path, **kw)
    pieces = opt.layout.pieces_of[params[0]]
    size = piece_elements(round(BUCKET_MB * 2**20))
    assert len(pieces) == math.ceil(BIG / size) and len({s.bucket for s in pieces}) == len(pieces)
    assert [s.part for s in pieces][:2] == [(0, size), (size, 2 * size)] and size % ALIGN == 0
    assert len(ref.layout.pieces_of[ref_params[0]]) == 1  # in host memory: whole
    own = not copy_on_cpu and dtype == torch.float32
    assert all(s.master_is_weight == own and s.separate_master != own for s in pieces)
    window = sum(slot.buffer.numel() for slot in opt.layout.tier.window)
    assert window < 12 * BIG  # less than the big tensor's master and moments alone
    _train(ref, ref_params, 10)
    _train(opt, params, 10)
    assert opt.skipped_steps == ref.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    saved = opt.state_dict()
    _assert_same_state(saved, ref.state_dict())  # whole tensors, the float32 masters of half weights too
    for key, value in ref.state_of(ref_params[0]).items():
        assert torch.equal(torch.as_tensor(opt.state_of(params[0])[key]), torch.as_tensor(value).float()), key
    # both ways: the disk's state into host memory, host memory's onto the disk, trained on alike
    into_host = _optimizer([p.detach().clone().requires_grad_() for p in params], make, **kw)
    onto_disk = _optimizer([p.detach().clone().requires_grad_() for p in ref_params], make, tmp_path, **kw)
    into_host.load_state_dict(saved)
    onto_disk.load_state_dict(ref.state_dict())
    a, b = into_host.param_groups, onto_disk.param_groups
    params_a = [p for g in a for p in g["params"]]
    params_b = [p for g in b for p in g["params"]]
    _train(into_host, params_a, 4, seed=2, start=10)
    _train(onto_disk, params_b, 4, seed=2, start=10)
    _train(ref, ref_params, 4, seed=2, start=10)
    assert all(torch.equal(x, y) for x, y in zip(params_a, ref_params))
    assert all(torch.equal(x, y) for x, y in zip(params_b, ref_params))
    _assert_same_state(onto_disk.state_dict(), ref.state_dict())
    for o in (ref, opt, into_host, onto_disk):
        o.close()


@pytest.mark.parametrize("what", ["lamb", "lars", "not-contiguous"])
def test_what_pieces_would_change_stays_whole(tmp_path, what):
    """LAMB's and LARS's trust ratios read norms over the whole tensor; a parameter that is
    not contiguous has no flat ranges to view.  Each stays one slot, its bucket holding it
    whole (a window of two such buckets)."""
    make = {"lamb": lambda g: FusedLAMB(g, lr=1e-2), "lars": lambda g: FusedLars(g, lr=1e-2, momentum=0.9),
            "not-contiguous": lambda g: FusedAdam(g, lr=1e-2)}[what]
    params = _params()
    if what == "not-contiguous":
        params[0] = torch.randn(500, 100).t().requires_grad_()  # 50,000 elements, transposed
    groups = [{"params": params}]
    opt = OffloadOptimizer(make(groups), bucket_size_mb=BUCKET_MB, offload_optimizer_device="nvme",
                           nvme_path=str(tmp_path), nvme_window_mb=2.0, copy_on_cpu=True)
    assert len(opt.layout.pieces_of[params[0]]) == 1 and opt.layout.slot_of[params[0]].part is None
    opt.close()


def test_a_window_too_small_for_two_pieces_says_a_smaller_bucket_helps(tmp_path):
    """A split tensor's piece is a bucket's size: a smaller ``bucket_size_mb`` makes smaller
    pieces, and the error says so (a whole tensor's says it cannot help)."""
    params = _params()
    with pytest.raises(ValueError, match=r"nvme_window_mb=0\.05 holds 0 of the host buckets' regions .* give "
                                         r"nvme_window_mb=[\d.]+ at least, or a smaller bucket_size_mb"):
        _optimizer(params, ALGORITHMS["adamw"], tmp_path, window_mb=0.05)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 1))


@pytest.mark.parametrize("schedule", ["streamed", "speculated", "delayed"])
def test_pieces_through_backward_hooks_streamed_speculated_and_delayed(tmp_path, schedule):
    """Real backwards: the hooks copy a split weight's gradient piece by piece, each bucket's
    update starts when its piece has landed (streamed; speculated with clipping and an fp16
    overflow; delayed by a step), a second backward adds to the pieces on the host (its
    norm then the whole sum's; streamed: the first accumulates on the device, told), and the
    run ends where host memory's ends."""
    kw = {"streamed": dict(stream_cpu_step=True), "speculated": dict(stream_cpu_step=True, speculate=True),
          "delayed": dict(delayed_update=True, delayed_update_warmup=2)}[schedule]
    checks = schedule == "speculated"
    runs = []
    for disk in (None, tmp_path):
        model = _model()
        opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                               {p: n for n, p in model.named_parameters()}, bucket_size_mb=0.008, copy_on_cpu=True,
                               **kw, **(dict(offload_optimizer_device="nvme", nvme_path=str(disk),
                                             nvme_window_mb=0.1) if disk else {}))
        if checks:
            opt.schedule.misses_allowed = opt.schedule.history  # speculate at every step
        g = torch.Generator().manual_seed(1)
        for step in range(7):
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
            if checks and step == 2:
                x[0, 0] = float("inf")
            opt.expected_grad_scale = 4.0 if checks else None
            opt.zero_grad()
            for i in range(2 if step == 3 else 1):  # two backwards: the second adds to the host copies
                opt.accumulating = schedule == "streamed" and i == 0  # (streamed: told, else refused)
                (nn.functional.mse_loss(model(x), y) * (4.0 if checks else 1.0)).backward()
            if checks:
                total = opt.gradient_norm(4.0)
                if torch.isfinite(total):
                    torch._foreach_mul_(opt.gradients(), torch.clamp(0.05 / (total + 1e-6), max=1.0))
                opt.step(grad_scale=4.0, check_finite=True)
            else:
                opt.step()
        opt.apply_pending_update()
        runs.append((model, opt))
    (ref, ref_opt), (ours, opt) = runs
    assert len(opt.layout.pieces_of[ours[2].weight]) > 1  # 9216 elements, pieces of 2048
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
    _assert_same_state(opt.state_dict(), ref_opt.state_dict())
    ref_opt.close()
    opt.close()


def test_under_the_trainer_a_split_weight_ends_where_plain_lightning_ends_and_resumes(tmp_path):
    """``FastOptStrategy`` with the state on disk, a window far smaller than the largest
    weight's masters and state, clipping and accumulation: as plain Lightning with torch's
    AdamW ends; the checkpoint holds each weight's state whole (torch's layout) and a run
    resumed from it ends there too."""
    import lightning as L

    from lightning_fastopt import FastOptStrategy
    from tests.test_precision import _data

    class Wide(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 1))

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    disk = tmp_path / "nvme"
    disk.mkdir()

    def fit(strategy, model, epochs=2, ckpt_path=None, **extra):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, strategy=strategy, accumulate_grad_batches=2,
                            gradient_clip_val=0.1, **{"enable_checkpointing": False, **extra})
        trainer.fit(model, _data(), ckpt_path=ckpt_path)
        return trainer

    def ours():
        return FastOptStrategy(offload_optimizer_device="nvme", nvme_path=str(disk), nvme_window_mb=0.05,
                               bucket_size_mb=0.008, copy_on_cpu=True)
    model, ref = Wide(), Wide()
    trainer = fit(ours(), model)
    fit("auto", ref)
    engine = trainer.strategy.engines[0]
    assert len(engine.layout.pieces_of[model.net[2].weight]) == 4  # 8192 elements, pieces of 2048
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))

    first = Wide()
    half = fit(ours(), first, epochs=1, enable_checkpointing=True, default_root_dir=tmp_path)
    path = half.checkpoint_callback.best_model_path
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]["state"]
    assert sorted(tuple(v["exp_avg"].shape) for v in saved.values()) == \
        sorted(tuple(p.shape) for p in first.parameters())  # whole, as torch's AdamW keeps them
    resumed = Wide()
    fit(ours(), resumed, ckpt_path=path)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), ref.parameters()))


def test_a_delayed_updates_pending_masters_are_saved_whole_and_resumed(tmp_path):
    """``delayed_update=True``: a state dict taken while an update is pending holds the
    pending masters of a split weight whole, as host memory's does; a model and optimizer
    loaded from it (the model first, as Lightning loads) end where the uninterrupted run ends."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)) for _ in range(8)]

    def build(disk=None):
        model = _model()
        where = dict(offload_optimizer_device="nvme", nvme_path=str(disk), nvme_window_mb=0.1) if disk else {}
        return model, OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                       {p: n for n, p in model.named_parameters()}, bucket_size_mb=0.008,
                                       copy_on_cpu=True, delayed_update=True, delayed_update_warmup=2, **where)

    def train(model, opt, part):
        for x, y in part:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    ref, ref_opt = build()
    ours, opt = build(tmp_path)
    train(ref, ref_opt, batches[:5])
    train(ours, opt, batches[:5])
    ref_saved, saved = ref_opt.state_dict(), opt.state_dict()
    pending, ref_pending = saved["delayed_update"]["weights"], ref_saved["delayed_update"]["weights"]
    assert "2.weight" in pending and len(opt.layout.pieces_of[ours[2].weight]) > 1
    assert pending.keys() == ref_pending.keys() and all(torch.equal(pending[k], v) for k, v in ref_pending.items())
    _assert_same_state(saved, ref_saved)
    resumed, resumed_opt = build(tmp_path)
    resumed.load_state_dict(ours.state_dict())
    resumed_opt.load_state_dict(saved)
    opt.close()
    train(resumed, resumed_opt, batches[5:])
    train(ref, ref_opt, batches[5:])
    resumed_opt.apply_pending_update()
    ref_opt.apply_pending_update()
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), ref.parameters()))
    resumed_opt.close()
    ref_opt.close()
