"""estimate_memory against what OffloadOptimizer really allocates (the accelerator path
run on the CPU with copy_on_cpu=True), and against what each rank of a two-process ZeRO
run allocates (gloo); its argument checks."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_fastopt import FusedAdam, FusedSGD, OffloadOptimizer, estimate_memory
from lightning_fastopt.zero import assign_owners
from tests.helpers import allocated_bytes, memory_model as _model, run_script

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make,name", [(lambda p: FusedAdam(p, amsgrad=True), "adam"),
                                       (lambda p: FusedSGD(p, lr=0.1, momentum=0.9), "sgd")])
def test_estimate_matches_the_allocations(fraction, dtype, make, name):
    model = _model(dtype)
    est = estimate_memory(model, offload_fraction=fraction, optimizer=name, amsgrad=name == "adam")
    opt = OffloadOptimizer(make(model.parameters()), offload_fraction=fraction, bucket_size_mb=0.001,
                           copy_on_cpu=True)
    model(torch.randn(4, 64).to(dtype)).float().sum().backward()
    opt.step()
    assert est.offloaded_params == opt.offloaded_numel
    # on the CPU, device and host are one memory: what the optimizer allocated (host
    # masters, gradient and copy buffers, device-side half masters, all state) is the
    # estimate's host total plus its device-side masters and state, up to the padding
    # that starts each host view on a cache line (< 64 bytes per tensor and buffer)
    expected = est.cpu_total + est.gpu["master_weights"] + est.gpu["optimizer_state"]
    allocated, padding = allocated_bytes(opt)
    assert 0 <= allocated - expected <= padding


def test_estimate_arithmetic_for_a_known_model():
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 float32 parameters
    full = estimate_memory(model, offload_fraction=1.0, optimizer="adamw")
    n = 1_001_000
    assert full.gpu == {"params": 4 * n, "grads": 0, "master_weights": 0, "optimizer_state": 0, "speculation": 0,
                        "gathered": 0}
    assert full.cpu == {"params": 0, "grads": 4 * n, "master_weights": 4 * n, "optimizer_state": 8 * n,
                        "speculation": 0, "gathered": 0}
    speculating = estimate_memory(model, offload_fraction=1.0, optimizer="adamw", speculate=True)
    assert speculating.cpu["speculation"] == 12 * n and speculating.cpu_total == full.cpu_total + 12 * n
    none = estimate_memory(model, offload_fraction=0.0, optimizer="adamw")
    assert none.gpu_total == 16 * n and none.cpu_total == 0
    assert "optimizer_state" in str(full) and "1,001,000 of 1,001,000 parameters offloaded" in str(full)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_estimate_is_what_each_rank_allocates(tmp_path, stage):
    """Two gloo processes, ZeRO at 0.5 of each shard offloaded: each rank's masters, host
    buffers and state are its estimate (rank=0 and rank=1), and so are the gradients on
    the accelerator: at stage 1 every one when backward has ended (DDP keeps them until the
    step); at stage 2 the rank's own non-offloaded ones (the others' are freed by the end
    of backward; the reductions still landing then are its communication buckets, which
    the estimate leaves out: here, at the step)."""
    run_script(REPO / "tests/scripts/zero_memory_run.py", tmp_path, stage, "0.5", timeout=300)
    model = _model(layers=4)
    numels = [p.numel() for p in model.parameters()]
    owners = assign_owners(numels, 2)
    owned = []
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        est = estimate_memory(model, offload_fraction=0.5, optimizer="adam", amsgrad=True, zero_stage=stage,
                              world_size=2, rank=rank)
        assert (est.owned_params, est.offloaded_params) == (got["owned"], got["offloaded"])
        assert 0 < est.offloaded_params < est.owned_params < est.total_params
        expected = est.cpu_total + est.gpu["master_weights"] + est.gpu["optimizer_state"]
        assert 0 <= got["allocated"] - expected <= got["padding"]
        kept = got["kept_grads"] if stage == 1 else got["kept_after_step"]
        assert est.gpu["grads"] == 4 * sum(n for n, k in zip(numels, kept) if k)
        if stage == 2:
            assert not any(k for k, o in zip(got["kept_grads"], owners) if o != rank)
        assert est.gpu["params"] == 4 * sum(numels)
        owned.append(est)
    default = estimate_memory(model, offload_fraction=0.5, optimizer="adam", amsgrad=True, zero_stage=stage,
                              world_size=2)
    assert default == max(owned, key=lambda e: (e.gpu_total, e.cpu_total))  # the rank that bounds the GPU
    assert f"ZeRO stage {stage}, rank {default.rank} of 2" in str(default)


def test_an_fsdp_estimate_is_what_each_rank_holds(tmp_path):
    """Two gloo processes, the model sharded by ``fully_shard`` (rows 33, 32 and 1 over two
    ranks: 17 and 16, 16 and 16, 1 and 0) and a LocalShardOptimizer at 0.5 of each rank's
    rows offloaded: each rank's rows, their gradients (kept until ``zero_grad``), masters,
    host buffers and state are its estimate (``zero_stage=3``, rank 0 and 1)."""
    run_script(REPO / "tests/scripts/zero_memory_run.py", tmp_path, "3", "0.5", timeout=300)
    model = _model(layers=4, rows=(33, 32, 1))
    ranks = []
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        est = estimate_memory(model, offload_fraction=0.5, optimizer="adam", amsgrad=True, zero_stage=3,
                              world_size=2, rank=rank)
        assert (est.owned_params, est.offloaded_params) == (got["owned"], got["offloaded"]) and got["owned"] == got["rows"]
        assert 0 < est.offloaded_params < est.owned_params < est.total_params
        expected = est.cpu_total + est.gpu["master_weights"] + est.gpu["optimizer_state"]
        assert 0 <= got["allocated"] - expected <= got["padding"]
        assert est.gpu["params"] == 4 * got["rows"] and est.gpu["grads"] == 4 * got["grad_rows"]
        assert all(got["kept_after_step"])
        ranks.append(est)
    assert ranks[0].owned_params + ranks[1].owned_params == ranks[0].total_params
    assert ranks[0].owned_params != ranks[1].owned_params
    default = estimate_memory(model, offload_fraction=0.5, optimizer="adam", amsgrad=True, zero_stage=3, world_size=2)
    assert default == max(ranks, key=lambda e: (e.gpu_total, e.cpu_total))
    assert "ZeRO stage 3, rank 0 of 2: a shard of" in str(default) and "rows of every parameter" in str(default)


@pytest.mark.slow  # four processes
def test_an_fsdp_estimate_with_tensor_parallelism_is_what_each_rank_holds(tmp_path):
    """Four gloo processes on a (2, 2) mesh: the embedding's rows (17: 9 and 8), the first
    Linear's rows and the second's columns split over the tensor-parallel pair, the
    LayerNorm and the second Linear's bias whole on both, each piece sharded by FSDP over
    the data-parallel pair (9 rows: 5 and 4), a LocalShardOptimizer at 0.5: each rank's
    rows, gradients, offloaded share, masters and state are its estimate given the same
    plan (``tensor_parallel_size=2``, ``tensor_parallel_plan``)."""
    import sys

    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    from zero_memory_run import tp_model, tp_plan

    run_script(REPO / "tests/scripts/zero_memory_run.py", tmp_path, "3tp", "0.5", timeout=300)
    model, ranks = tp_model(), []
    for rank in range(4):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        est = estimate_memory(model, offload_fraction=0.5, optimizer="adam", amsgrad=True, zero_stage=3,
                              world_size=4, rank=rank, tensor_parallel_size=2, tensor_parallel_plan=tp_plan())
        assert (est.owned_params, est.offloaded_params) == (got["owned"], got["offloaded"]) and got["owned"] == got["rows"]
        expected = est.cpu_total + est.gpu["master_weights"] + est.gpu["optimizer_state"]
        assert 0 <= got["allocated"] - expected <= got["padding"]
        assert est.gpu["params"] == 4 * got["rows"] and est.gpu["grads"] == 4 * got["grad_rows"]
        ranks.append(est)
    assert len({e.owned_params for e in ranks}) == 3  # uneven pieces and rows: 205, 197, 180, 180
    assert estimate_memory(model, offload_fraction=0.5, optimizer="adam", amsgrad=True, zero_stage=3, world_size=4,
                           tensor_parallel_size=2, tensor_parallel_plan=tp_plan()) == ranks[0]


def test_tensor_parallel_pieces_follow_torchs_styles():
    """Without processes: each style's split (SequenceParallel replicates, a wildcard path
    matches each block), and what the estimate refuses, by name."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from lightning_fastopt.fsdp.tensor_parallel_pieces import tensor_parallel_pieces

    blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(6), "up": nn.Linear(6, 10), "down": nn.Linear(10, 6)})
                           for _ in range(2))
    model = nn.ModuleDict({"embed": nn.Embedding(11, 6), "blocks": blocks})
    plan = {"embed": ColwiseParallel(), "blocks.*.norm": SequenceParallel(), "blocks.*.up": ColwiseParallel(),
            "blocks.*.down": RowwiseParallel()}
    shapes = [{n: tuple(t.shape) for n, t in zip(dict(model.named_parameters()),
                                                 tensor_parallel_pieces(model, plan, 3, r).values())} for r in range(3)]
    assert [s["embed.weight"] for s in shapes] == [(11, 2), (11, 2), (11, 2)]
    assert [s["blocks.1.up.weight"] for s in shapes] == [(4, 6), (4, 6), (2, 6)]
    assert [s["blocks.1.up.bias"] for s in shapes] == [(4,), (4,), (2,)]
    assert [s["blocks.0.down.weight"] for s in shapes] == [(6, 4), (6, 4), (6, 2)]
    assert {s["blocks.0.down.bias"] for s in shapes} == {(6,)} and {s["blocks.1.norm.weight"] for s in shapes} == {(6,)}
    with pytest.raises(ValueError, match=r"tensor_parallel_plan\['blocks.0.norm'\]: ColwiseParallel on LayerNorm"):
        tensor_parallel_pieces(model, {"blocks.0.norm": ColwiseParallel()}, 2, 0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is for zero_stage=3"):
        estimate_memory(model, zero_stage=2, world_size=4, tensor_parallel_size=2, tensor_parallel_plan=plan)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an int >= 1 that divides world_size \(4\)"):
        estimate_memory(model, zero_stage=3, world_size=4, tensor_parallel_size=3, tensor_parallel_plan=plan)
    with pytest.raises(ValueError, match="tensor_parallel_plan needs tensor_parallel_size > 1"):
        estimate_memory(model, zero_stage=3, world_size=4, tensor_parallel_plan=plan)


def test_the_default_rank_is_the_one_needing_the_most_accelerator_memory():
    """Offloading whole tensors from the end of each shard: rank 0 owns the most elements
    (61 + 40) but offloads all of them at 0.5, rank 1 (10 + 89) keeps 10 on the GPU.  The
    default is rank 1, the one a GPU must hold; an explicit rank is that rank's figures."""
    model = nn.Module()
    model.ps = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in (61, 40, 10, 89)])
    for stage in (1, 2):
        ranks = [estimate_memory(model, offload_fraction=0.5, zero_stage=stage, world_size=2, rank=r) for r in (0, 1)]
        assert ranks[0].owned_params == 101 > ranks[1].owned_params
        assert ranks[0].offloaded_params == 101 and ranks[1].offloaded_params == 89
        assert ranks[1].gpu_total > ranks[0].gpu_total
        assert estimate_memory(model, offload_fraction=0.5, zero_stage=stage, world_size=2) == ranks[1]
    # equal GPU needs: the most host memory decides (rank 0 offloads 101 elements, rank 1 89)
    at_one = [estimate_memory(model, offload_fraction=1.0, zero_stage=2, world_size=2, rank=r) for r in (0, 1)]
    assert at_one[0].gpu_total == at_one[1].gpu_total and at_one[0].cpu_total > at_one[1].cpu_total
    assert estimate_memory(model, offload_fraction=1.0, zero_stage=2, world_size=2).rank == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="precision must be one of"):
        estimate_memory(_model(), precision="transformer-engine")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        estimate_memory(_model(), optimizer="rmsprop")
    with pytest.raises(ValueError, match=r"offload_fraction must be in \[0.0, 1.0\]"):
        estimate_memory(_model(), offload_fraction=2)
    with pytest.raises(ValueError, match=r"zero_stage must be 0, 1, 2 or 3 \(fastopt_fsdp\), got 4"):
        estimate_memory(_model(), zero_stage=4)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        estimate_memory(_model(), world_size=0)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\) \(world_size=2\), got 2"):
        estimate_memory(_model(), zero_stage=1, world_size=2, rank=2)
    one = estimate_memory(_model(), zero_stage=2, world_size=1)  # nothing to shard: the plain estimate
    assert (one.gpu, one.cpu) == (estimate_memory(_model()).gpu, estimate_memory(_model()).cpu)


@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_the_speculation_estimate_matches_the_snapshots(fraction):
    """What the speculative step keeps aside (masters and state, besides a step count per
    parameter) is what estimate_memory(speculate=True) says and what the log line says."""
    model = _model()
    est = estimate_memory(model, offload_fraction=fraction, optimizer="adam", amsgrad=True, speculate=True)
    opt = OffloadOptimizer(FusedAdam(model.parameters(), amsgrad=True), offload_fraction=fraction,
                           bucket_size_mb=0.001, copy_on_cpu=True, stream_cpu_step=True, speculate=True)
    from lightning_fastopt.offload.speculative import snapshot_bytes
    promised = snapshot_bytes(opt.layout.buckets)
    for _ in range(2):  # the first step creates the state: the second keeps it aside too
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    kept = sum(s.nbytes for s in opt.schedule.snapshots.values())
    slots = sum(len(b.slots) for b in opt.layout.buckets)
    assert promised == est.cpu["speculation"] and 0 <= kept - promised <= 4 * slots
    opt.close()


# ---------------------------------------------------------------------------- FSDP's units in flight, what fits
class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _gpt(layers, width=64, vocab=100):
    """A LightningModule as a GPT lays itself out: embedding, blocks, norm, head."""
    import lightning as L

    class GPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)
    return GPT()


def test_the_units_planned_are_those_the_one_line_form_shards(monkeypatch):
    """``plan_units`` (what ``estimate_memory`` reads) takes the path ``shard_model`` takes:
    each Block, then the LightningModule's children holding the rest as roots."""
    import torch.distributed.fsdp

    from lightning_fastopt.fsdp.auto_shard import plan_units, shard_model

    model = _gpt(3)
    calls = []
    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard", lambda m, **kw: calls.append(m))
    shard_model(model, None, (Block,), 100_000_000)
    units = plan_units(model, (Block,), 100_000_000)
    assert [u.modules[0] for u in units] == calls == [*model.blocks, model.embed, model.norm, model.head]
    assert [u.root for u in units] == [False] * 3 + [True] * 3
    plain = nn.Sequential(*[Block() for _ in range(2)])
    assert [(u.modules[0], u.root) for u in plan_units(plain, (Block,), 1, forward_runs=True)] == \
        [(plain[0], False), (plain[1], False), (plain, True)]


def test_the_gathered_figure_is_the_roots_two_units_and_one_units_gradients():
    """``auto_wrap_policy``: the roots' weights (kept gathered from forward to backward),
    the two largest other units' (one working, the next prefetched) and the largest
    unit's gradients, in the model's dtype, the same on every rank; with the rows in host
    memory that is all the accelerator holds of the model."""
    block = 64 * 256 * 2 + 256 + 64
    roots = 100 * 64 + 2 * 64 + 64 * 100 + 100
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = _gpt(4).to(dtype)
        for world_size in (1, 4):
            est = estimate_memory(model, zero_stage=3, world_size=world_size, offload_parameters=True,
                                  auto_wrap_policy={Block}, precision="bf16-mixed")
            assert est.gpu["gathered"] == size * (roots + 2 * block + block) == est.gpu_total
    frozen = _gpt(4)
    frozen.blocks.requires_grad_(False)  # gathered all the same; gradients only of the roots (the head's the largest)
    est = estimate_memory(frozen, zero_stage=3, auto_wrap_policy={Block})
    assert est.gpu["gathered"] == 4 * (roots + 2 * block + 64 * 100 + 100)
    sized = estimate_memory(_gpt(4), zero_stage=3, min_num_params=block)  # each block by size, as the classes
    assert sized.gpu["gathered"] == estimate_memory(_gpt(4), zero_stage=3, auto_wrap_policy={Block}).gpu["gathered"]
    assert estimate_memory(_gpt(4), zero_stage=3).gpu["gathered"] == 0  # no policy given: not counted


def test_which_sizes_fit_a_gpu_and_a_host():
    """``sizes_that_fit``: each size built on the meta device, estimated, and compared with
    the GPU and host given; with the weights in host memory the host decides the depth
    (16 bytes a parameter with AdamW), the GPU the units in flight."""
    from lightning_fastopt import sizes_that_fit

    def params(layers):
        return sum(p.numel() for p in _gpt(layers).parameters())
    host = 16 * params(6)  # six layers fit, seven do not
    built = []

    def build(layers):
        built.append(_gpt(layers))
        return built[-1]
    rows = sizes_that_fit(build, range(2, 10), gpu_memory=2**30, host_memory=host, zero_stage=3,
                          offload_parameters=True, auto_wrap_policy={Block})
    assert [(n, fits) for n, _, fits in rows] == [(n, n <= 6) for n in range(2, 10)]
    assert all(e.cpu_total == 16 * params(n) and e.gpu_total == e.gpu["gathered"] for n, e, _ in rows)
    assert all(p.is_meta for m in built for p in m.parameters())  # nothing allocated
    small_gpu = sizes_that_fit(_gpt, [4], gpu_memory=rows[0][1].gpu_total - 1, host_memory=host, zero_stage=3,
                               offload_parameters=True, auto_wrap_policy={Block})
    assert small_gpu[0][2] is False


def test_the_units_policy_is_checked_by_name():
    with pytest.raises(ValueError, match=r"auto_wrap_policy and min_num_params plan FSDP's units \(zero_stage=3\)"):
        estimate_memory(_gpt(2), auto_wrap_policy={Block})
    with pytest.raises(TypeError, match="auto_wrap_policy must be a set of torch.nn.Module classes"):
        estimate_memory(_gpt(2), zero_stage=3, auto_wrap_policy="Block")
    with pytest.raises(ValueError, match="min_num_params must be a positive integer"):
        estimate_memory(_gpt(2), zero_stage=3, min_num_params=0)


@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_bfloat16_host_moments_are_estimated_as_allocated(fraction):
    """``host_state_dtype="bfloat16"``: the offloaded share's two Adam moments at 2 bytes an
    element (the masters float32), as the offload optimizer allocates them; other
    optimizers are refused by name."""
    model = _model()
    est = estimate_memory(model, offload_fraction=fraction, optimizer="adamw", host_state_dtype="bfloat16")
    fp32 = estimate_memory(model, offload_fraction=fraction, optimizer="adamw")
    opt = OffloadOptimizer(FusedAdam(model.parameters()), offload_fraction=fraction, bucket_size_mb=0.001,
                           copy_on_cpu=True, host_state_dtype=torch.bfloat16)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    allocated, padding = allocated_bytes(opt)
    assert 0 <= allocated - (est.cpu_total + est.gpu["master_weights"] + est.gpu["optimizer_state"]) <= padding
    assert fp32.cpu["optimizer_state"] - est.cpu["optimizer_state"] == 4 * est.offloaded_params
    with pytest.raises(ValueError, match="host_state_dtype is for adam and adamw"):
        estimate_memory(model, optimizer="sgd", host_state_dtype="bfloat16")
    with pytest.raises(ValueError, match="state_dtype must be torch.float32 or torch.bfloat16"):
        estimate_memory(model, host_state_dtype="float16")
