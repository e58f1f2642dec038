"""The offloaded state split between host memory and the disk (issue 72,
``lightning_fastopt/offload/split_tier.py``): with ``offload_optimizer_device="nvme"``,
``host_state_gib`` keeps whole buckets in host memory up to that many GiB (``"auto"``: what
the host has available at set-up, less the window and a reserve) and the rest on disk. A run
ends, and its state dict is, bit for bit as with all of it in host memory and all of it on
disk (every optimizer the kernels step, the CPU's path and the accelerator's, clipping, loss
scaling, accumulation, half weights, streamed and speculated updates); a checkpoint does not
depend on the split; bad input is refused when the optimizer or strategy is built."""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastopt import FastOptStrategy, FusedAdam
from lightning_fastopt.offload import OffloadOptimizer, split_tier
from lightning_fastopt.offload.split_tier import SplitTier, spread
from lightning_fastopt.offload.file_regions import planned_bytes
from tests.helpers import on_disk_through_two_buckets, split_groups
from tests.test_disk_tier import ALGORITHMS, GROUPS, _assert_same_state, _params, _train

GIB = 2**30


def _optimizer(params, make, tmp_path=None, host_share=None, **kw):
    """Over ``params`` in two groups, in buckets of 4 KiB; on disk in ``tmp_path`` where given
    (a window of two slots), with ``host_share`` of the buckets' bytes kept in host memory."""
    def build(**disk):
        return OffloadOptimizer(make(split_groups(params, GROUPS)), {p: f"p{i}" for i, p in enumerate(params)},
                                bucket_size_mb=0.004, **disk, **kw)
    if tmp_path is None:
        return build()
    disk = on_disk_through_two_buckets(tmp_path, build)
    if host_share is None:
        return build(**disk)
    sizing = build(**disk)
    total = sum(planned_bytes(b) for b in sizing.layout.buckets)
    sizing.close()
    return build(**disk, host_state_gib=host_share * total / GIB)


@pytest.mark.parametrize("copy_on_cpu", [False, True], ids=["cpu-run", "accelerator-path"])
@pytest.mark.parametrize("algorithm", ["adamw", "adamw-bf16-moments", "sgd", "lamb", "lars"])
def test_split_ends_where_host_memory_and_the_disk_end(tmp_path, algorithm, copy_on_cpu):
    make = ALGORITHMS[algorithm]
    runs = {}
    for name, where in (("host", None), ("disk", tmp_path / "disk"), ("split", tmp_path / "split")):
        if where is not None:
            where.mkdir()
        params = _params()
        opt = _optimizer(params, make, where, host_share=0.5 if name == "split" else None, offload_fraction=1.0,
                         copy_on_cpu=copy_on_cpu)
        if name == "split":
            tier = opt.layout.tier
            assert isinstance(tier, SplitTier) and 0 < len(tier.in_host) < len(opt.layout.buckets)
            assert len(tier.disk.regions) == len(opt.layout.buckets) - len(tier.in_host)
        _train(opt, params, 12)
        runs[name] = (params, opt.state_dict(), opt.skipped_steps)
        opt.close()
    for name in ("disk", "split"):
        assert all(torch.equal(a, b) for a, b in zip(runs[name][0], runs["host"][0])), name
        _assert_same_state(runs[name][1], runs["host"][1])
        assert runs[name][2] == runs["host"][2] == 1


def test_the_buckets_kept_in_host_memory_are_spread_over_the_step():
    assert spread([10] * 8, 40) == [False, True] * 4  # every other: each disk bucket beside a host one
    assert spread([10] * 6, 20) == [False, False, True, False, False, True]
    assert spread([10] * 4, 100) == [True] * 4 and spread([10] * 4, 0) == [False] * 4
    assert spread([10, 30, 10, 10], 25) == [True, False, True, False]  # the spread first, then what still fits
    assert sum(spread([7, 9, 11, 13, 5], 21)) * 5 <= 21 + 13 * 2  # never over the budget
    sizes = [7, 9, 11, 13, 5]
    for budget in range(0, 50):
        kept = spread(sizes, budget)
        assert sum(s for s, k in zip(sizes, kept) if k) <= budget


def test_a_state_dict_loads_across_splits_and_the_line_says_each_tiers_bytes(tmp_path, caplog):
    make = ALGORITHMS["adamw"]
    params = _params()
    with caplog.at_level("INFO"):
        (tmp_path / "a").mkdir()
        opt = _optimizer(params, make, tmp_path / "a", host_share=0.3, offload_fraction=1.0)
    assert "split by host_state_gib=" in caplog.text and "in host memory and" in caplog.text \
        and "on disk, spread over the step" in caplog.text
    _train(opt, params, 6)
    saved = opt.state_dict()
    for where, host_share in (("b", None), ("c", 0.7), (None, None)):
        if where is not None:
            (tmp_path / where).mkdir()
        other_params = [p.detach().clone().requires_grad_() for p in params]
        other = _optimizer(other_params, make, None if where is None else tmp_path / where, host_share=host_share,
                           offload_fraction=1.0)
        other.load_state_dict(saved)
        _assert_same_state(other.state_dict(), saved)
        _train(other, other_params, 4, start=6)
        if where == "b":
            reference = [p.detach().clone() for p in other_params]
        else:
            assert all(torch.equal(a, b) for a, b in zip(other_params, reference)), where
        other.close()
    opt.close()


def test_auto_takes_what_is_available_less_the_window_and_the_reserve(tmp_path, monkeypatch):
    make = ALGORITHMS["adamw"]
    params = _params()
    sizing = _optimizer(params, make, tmp_path, offload_fraction=1.0, copy_on_cpu=True)
    region = max(planned_bytes(b) for b in sizing.layout.buckets)
    made = 4 * sum(p.numel() for p in params)  # the masters, made in host memory before they are placed
    # the gradient buffers, made but not yet written (not yet missing from what the system says is available)
    untouched = sum(b.numel() * b.element_size() for bucket in sizing.layout.buckets for b in bucket.buffers)
    assert untouched >= 4 * sum(p.numel() for p in params)
    window = sizing.layout.tier.window_bytes
    buckets = len(sizing.layout.buckets)
    sizing.close()
    monkeypatch.setattr(split_tier, "host_memory_bytes", lambda: 100 * GIB)
    # available besides the masters made: the window, a reserve of 1 GiB and 2.5 buckets' regions, for two processes
    to_come = 4 * sum(p.numel() for p in params)  # the gradients backward will make in host memory
    monkeypatch.setattr(split_tier, "available_host_bytes",
                        lambda: window + GIB + 5 * region - made + untouched + to_come)
    opt = OffloadOptimizer(make(split_groups(params, GROUPS)), {p: f"p{i}" for i, p in enumerate(params)},
                           bucket_size_mb=0.004, offload_fraction=1.0, offload_optimizer_device="nvme",
                           nvme_path=str(tmp_path), nvme_window_mb=sizing.layout.tier.window_mb,
                           host_state_gib="auto", host_reserve_gib=1.0, processes_per_host=2, copy_on_cpu=True)
    tier = opt.layout.tier
    assert tier.budget == int(5 * region // 2) and len(tier.in_host) == 2 < buckets
    assert "available after the model, its gradients and buffers, the window and host_reserve_gib=1" in tier.describe()
    assert "shared by 2 processes" in tier.describe()
    opt.close()
    monkeypatch.setattr(split_tier, "available_host_bytes", lambda: 9 * GIB)  # less than the 10% reserve: none
    opt = OffloadOptimizer(make(split_groups(params, GROUPS)), {p: f"p{i}" for i, p in enumerate(params)},
                           bucket_size_mb=0.004, offload_fraction=1.0, offload_optimizer_device="nvme",
                           nvme_path=str(tmp_path), host_state_gib="auto")
    assert not opt.layout.tier.in_host and "a reserve of 10% of the machine's memory" in opt.layout.tier.describe()
    opt.close()


def test_bad_host_state_arguments_are_refused_by_name(tmp_path):
    params = [torch.zeros(10, requires_grad=True)]

    def build(**kw):
        return OffloadOptimizer(FusedAdam(params), offload_fraction=1.0, **kw)
    disk = dict(offload_optimizer_device="nvme", nvme_path=str(tmp_path))
    for value in ("lots", -1, float("nan"), True):
        with pytest.raises(ValueError, match=r"host_state_gib must be a number of GiB, 0 or more, or 'auto'; got"):
            build(**disk, host_state_gib=value)
    with pytest.raises(ValueError, match=r"host_state_gib=1000000.0 is more than this machine's memory \(\d"):
        build(**disk, host_state_gib=1e6)
    with pytest.raises(ValueError, match="host_state_gib splits .* needs offload_optimizer_device='nvme' .* got "
                                         "offload_optimizer_device='cpu'"):
        build(host_state_gib=1.0)
    with pytest.raises(ValueError, match="host_reserve_gib is for host_state_gib='auto', got host_state_gib=1.0"):
        build(**disk, host_state_gib=1.0, host_reserve_gib=2.0)
    with pytest.raises(ValueError, match="host_reserve_gib is for host_state_gib='auto', got host_reserve_gib=2.0"):
        build(**disk, host_reserve_gib=2.0)
    with pytest.raises(ValueError, match="host_reserve_gib must be a number of GiB"):
        build(**disk, host_state_gib="auto", host_reserve_gib="some")
    for kw in (dict(host_state_gib="lots"), dict(host_state_gib=1.0), dict(host_reserve_gib=1.0)):
        with pytest.raises(ValueError, match="host_state_gib|host_reserve_gib"):
            FastOptStrategy(**kw, **({} if kw.get("host_state_gib") == 1.0 else disk))


class _Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*(nn.Linear(32, 32) for _ in range(6)), nn.Linear(32, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.body(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(strategy, ckpt_path=None, epochs=2, **kw):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g)
    model = _Net()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(model, DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=8),
                ckpt_path=ckpt_path)
    return trainer, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("settings", [dict(), dict(gradient_clip_val=0.05, accumulate_grad_batches=2),
                                      dict(precision="bf16-true")], ids=["adamw", "clip-accumulate", "bf16-true"])
def test_under_the_trainer_the_split_ends_where_trainer_ends_and_resumes_under_another(tmp_path, settings):
    def ours(host_state_gib, where):
        (tmp_path / where).mkdir(exist_ok=True)
        return FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True, bucket_size_mb=0.002,
                               offload_optimizer_device="nvme", nvme_path=str(tmp_path / where),
                               host_state_gib=host_state_gib)
    _, reference = _fit("auto", **settings)
    trainer, split = _fit(ours(0.00001, "split"), **settings)
    tier = trainer.strategy.engines[0].layout.tier
    assert 0 < len(tier.in_host) < len(trainer.strategy.engines[0].layout.buckets)
    if settings.get("precision") == "bf16-true":  # half weights beside float32 masters: against the all-disk run
        _, reference = _fit(ours(None, "disk"), **settings)
    assert all(torch.equal(a, b) for a, b in zip(split, reference))
    trainer, _ = _fit(ours(0.00001, "split"), epochs=1, **settings)
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    for strategy in (ours(None, "disk"), ours(0.00003, "more"), "auto"):
        if strategy == "auto" and settings.get("precision") == "bf16-true":
            continue  # (plain Lightning has no float32 masters)
        _, resumed = _fit(strategy, ckpt_path=str(tmp_path / "one.ckpt"), **settings)
        assert all(torch.equal(a, b) for a, b in zip(resumed, reference)), strategy


def test_the_memory_estimate_splits_the_state_and_gives_the_disk_a_column(tmp_path):
    """``estimate_memory(..., host_state_gib=G)``: G GiB of the masters and state in host
    memory, the rest on disk (a third column), within a bucket's size of the split the
    tier makes."""
    from lightning_fastopt import estimate_memory

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 48), nn.Linear(48, 48))
    n = sum(p.numel() for p in model.parameters())
    disk = dict(offload_fraction=1.0, optimizer="adamw", offload_optimizer_device="nvme", nvme_window_mb=0.2)
    whole = estimate_memory(model, **disk)
    half = estimate_memory(model, **disk, host_state_gib=6 * n / GIB)
    assert half.disk == whole.disk // 2 and half.cpu["master_weights"] + half.cpu["optimizer_state"] == 6 * n
    assert half.cpu["master_weights"] * 2 == half.cpu["optimizer_state"]  # whole buckets: masters with their moments
    assert half.disk_window == min(round(0.2 * 2**20), half.disk)  # what the disk's share needs
    header, total = str(half).splitlines()[0], next(r for r in str(half).splitlines() if r.startswith("total"))
    assert header.split() == ["GPU", "CPU", "disk"] and len(total.split()) == 7  # total and three columns
    everything = estimate_memory(model, **disk, host_state_gib=1.0)
    assert everything.disk == 0 and everything.disk_window == 0 and "disk" not in str(everything).splitlines()[0]
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-3), copy_on_cpu=True, bucket_size_mb=0.01,
                           offload_optimizer_device="nvme", nvme_path=str(tmp_path), nvme_window_mb=0.2,
                           host_state_gib=6 * n / GIB)
    tier = opt.layout.tier
    kept, largest = sum(tier.in_host.values()), max(planned_bytes(b) for b in opt.layout.buckets)
    assert half.cpu["master_weights"] + half.cpu["optimizer_state"] - largest <= kept <= 6 * n
    opt.close()
    with pytest.raises(ValueError, match="host_state_gib must be a number of GiB, 0 or more \\(the estimate cannot "
                                         "measure 'auto'"):
        estimate_memory(model, **disk, host_state_gib="auto")
    with pytest.raises(ValueError, match="host_state_gib splits the state on disk: it needs"):
        estimate_memory(model, offload_fraction=1.0, host_state_gib=1.0)


def test_in_a_fabric_loop_the_split_ends_where_fabrics_own_ends(tmp_path):
    from lightning.fabric import Fabric

    from lightning_fastopt import FastOptFabricStrategy

    def run(strategy):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            optimizer.zero_grad()
            fabric.backward(model(torch.randn(8, 32, generator=g)).square().mean())
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()], optimizer

    reference, _ = run("auto")
    ours, optimizer = run(FastOptFabricStrategy(offload_fraction=1.0, copy_on_cpu=True, bucket_size_mb=0.002,
                                                offload_optimizer_device="nvme", nvme_path=str(tmp_path),
                                                host_state_gib=0.00001))
    tier = optimizer.optimizer._fastopt_engine.layout.tier
    assert 0 < len(tier.in_host) < len(tier.in_host) + len(tier.disk.regions)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))


def test_auto_fraction_and_auto_host_state_plan_the_three_places_in_one_table(tmp_path, caplog, monkeypatch):
    """``offload_fraction="auto"`` with ``"nvme"`` and ``host_state_gib="auto"``: the fraction
    is chosen first (the accelerator's share), then host memory takes what it has available,
    the disk the rest; the choice's line ends with one table of the three places, and the run
    ends where Trainer() ends."""
    import logging

    from lightning_fastopt.offload import auto_fraction

    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    monkeypatch.setattr(auto_fraction, "choose_fraction", lambda *a, **k: (0.5, "forced for the test"))
    monkeypatch.setattr(split_tier, "host_memory_bytes", lambda: 100 * GIB)
    # 20 kB left for the state once the reserve (10 GiB) and the window (0.5 MiB) are taken: about half of it
    # (the masters made, 4 bytes an offloaded element, and the gradient buffers yet untouched, as many, cancel;
    # the model's gradients backward will make, 4 bytes an element, are taken)
    to_come = 4 * sum(p.numel() for p in _Net().parameters())
    monkeypatch.setattr(split_tier, "available_host_bytes", lambda: 10 * GIB + 2**19 + 20_000 + to_come)
    strategy = FastOptStrategy(offload_fraction="auto", copy_on_cpu=True, bucket_size_mb=0.002,
                               offload_optimizer_device="nvme", nvme_path=str(tmp_path), nvme_window_mb=512 / 1024,
                               host_state_gib="auto")
    with caplog.at_level(logging.INFO):
        trainer, ours = _fit(strategy)
    engine = trainer.strategy.engines[0]
    tier = engine.layout.tier
    assert engine.offload_fraction == 0.5 and 0 < len(tier.in_host) < len(engine.layout.buckets)
    table = caplog.text[caplog.text.index("where the masters and optimizer state are now:"):]
    rows = {line.split()[0]: line for line in table.splitlines()[1:6]}
    assert {"device", "host", "disk"} <= set(rows)
    assert rows["device"].split()[2] == f"{sum(s.numel for s in engine.layout.device_slots):,}"
    host_tensors = sum(len(b.slots) for b in tier.in_host)
    disk_tensors = sum(len(b.slots) for b in engine.layout.buckets if b not in tier.in_host)
    assert rows["host"].split()[2] == f"{host_tensors:,}" and rows["disk"].split()[1] == f"{disk_tensors:,}"
    _, reference = _fit("auto")
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))
