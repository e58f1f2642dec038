"""The CPU kernels built of the pieces a run needs (issue 51, item 9): a new user's first
AdamW run compiles the bindings, the reductions and Adam, not every algorithm; a later call
that needs more loads the full build; a cached full build is used from the start."""

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fastopt import FusedAdam, FusedLAMB, FusedSGD, ops
from lightning_fastopt.functional import fused_adam_, fused_sgd_
from lightning_fastopt.ops import cpu
from lightning_fastopt.ops.cpu import cpu_extension_spec, every_piece, with_needs
from lightning_fastopt.ops.cpu_kernels import adam_pieces
from lightning_fastopt.optim.from_torch import to_fused_optimizer


def _names(spec):
    return {Path(s).name for s in spec.sources}


def test_a_build_of_some_pieces_compiles_their_sources_and_binds_their_functions_only():
    adam = cpu_extension_spec(pieces={"adam"})
    assert _names(adam) == {"bindings.cpp", "reduce.cpp", "adam.cpp"}
    assert "-DFASTOPT_WITH_ADAM=1" in adam.cflags and "-DFASTOPT_WITH_SGD=0" in adam.cflags
    assert "-DFASTOPT_ADAM_CPU_FUSED=0" in adam.cflags and "-DFASTOPT_ADAM_CUDA_ROUNDINGS=0" in adam.cflags
    # Adam's roundings are Adam's: asking for one brings Adam
    fused = cpu_extension_spec(pieces={"adam_cpu_fused"})
    assert _names(fused) == {"bindings.cpp", "reduce.cpp", "adam.cpp", "adam_cpu_fused.cpp"}
    assert fused.pieces == {"adam", "adam_cpu_fused"} and "-DFASTOPT_ADAM_CPU_FUSED=1" in fused.cflags
    full = cpu_extension_spec(cuda_roundings=False)
    assert full.pieces == every_piece(False) and len(_names(full)) == 9
    # each its own build, the full one under the name builds have always had
    assert len({adam.name, fused.name, full.name}) == 3 and full.name == f"lightning_fastopt_cpu_{full.variant}"
    assert adam.core_seconds < full.core_seconds / 1.5  # the estimate says it is shorter
    assert adam.speed_key == full.speed_key  # this machine's measured speed serves both
    assert "adam" in adam.title and "sgd" not in adam.title
    with pytest.raises(ValueError, match=r"unknown CPU kernel piece\(s\) \['adamw'\]; expected some of"):
        with_needs({"adamw"})


def test_each_optimizer_names_the_pieces_its_steps_call():
    p = [torch.nn.Parameter(torch.randn(4))]
    assert FusedAdam(p).kernel_pieces() == {"adam"}
    assert FusedAdam(p, rounding="torch_cpu_fused").kernel_pieces() == {"adam", "adam_cpu_fused"}
    assert FusedSGD(p, lr=0.1).kernel_pieces() == {"sgd"} and FusedLAMB(p).kernel_pieces() == {"lamb"}
    # the user's torch optimizers, as the strategies take them over
    assert to_fused_optimizer(torch.optim.AdamW(p, fused=True)).kernel_pieces() == {"adam", "adam_cpu_fused"}
    assert to_fused_optimizer(torch.optim.AdamW(p)).kernel_pieces() == {"adam"}
    assert to_fused_optimizer(torch.optim.Adagrad(p)).kernel_pieces() == {"adagrad"}
    for rounding in ("torch_cuda_foreach", "torch_cuda_fused", "torch_cuda_for_loop"):
        assert adam_pieces(rounding) == {"adam", "adam_cuda_roundings"}


class _Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def _fit(strategy):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g)), batch_size=8)
    model = _Model()
    L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(model, data)
    return model


@pytest.mark.slow  # two builds in an empty cache: Adam's pieces (about 11 s on 2 cores), then every piece (19 s)
def test_a_first_adamw_run_builds_adams_pieces_only_and_more_comes_when_called(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)
    monkeypatch.setattr(cpu, "cuda_roundings_wanted", lambda: False)  # a machine without a GPU
    monkeypatch.setattr(cpu, "_loaded", {})
    monkeypatch.setattr(ops, "_cpu_kernels", {})
    ours = _fit("fastopt_offload")
    kernels = ops.cpu_backend()
    assert kernels.loaded.pieces == ["adam"]
    assert "building the CPU kernels (" in capfd.readouterr().err and not cpu.full_build_cached()
    ref = _fit("auto")  # Lightning's own: the same bits, from the build of Adam's piece
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
    # SGD now: the full build, whose Adam ends on the same bits
    p, g = torch.randn(100), torch.randn(100)
    q, m = p.clone(), torch.zeros(100)
    fused_sgd_([q], [g], [m], step=1, lr=0.1, momentum=0.9)
    assert sorted(kernels.loaded.pieces) == sorted(every_piece(False)) and not torch.equal(p, q)
    assert all(torch.equal(a, b) for a, b in zip(_fit("fastopt_offload").parameters(), ref.parameters()))
    # torch's fused=True rounding, in the full build already: nothing more is built
    capfd.readouterr()
    s = [p.clone()], [torch.zeros(100)], [torch.zeros(100)]
    fused_adam_(s[0], [g], s[1], s[2], step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                rounding="torch_cpu_fused")
    assert "building" not in capfd.readouterr().err
    # a new process (a fresh backend) finds the full build in the cache and loads it at the first need
    monkeypatch.setattr(ops, "_cpu_kernels", {})
    monkeypatch.setattr(cpu, "_loaded", {})
    assert sorted(ops.cpu_backend().need({"adam"}).pieces) == sorted(every_piece(False))
    assert "building" not in capfd.readouterr().err
