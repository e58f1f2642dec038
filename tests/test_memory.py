"""estimate_memory against what OffloadOptimizer really allocates (the accelerator path
run on the CPU with copy_on_cpu=True), and its argument checks."""

import pytest
import torch

from lightning_fastopt import FusedAdam, FusedSGD, OffloadOptimizer, estimate_memory


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).to(dtype)


def _allocated(opt):
    """Bytes of every master, host buffer and state tensor the optimizer holds."""
    seen, total = set(), 0
    tensors = [t for b in opt._buckets for t in b.buffers]
    tensors += [s.master for s in opt._slots if s.separate_master and s.bucket is None]
    tensors += [v for inner in opt._inners() for st in inner.state.values() for k, v in st.items() if k != "step"]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


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
    padding = 3 * 64 * sum(len(b.slots) for b in opt._buckets)
    assert 0 <= _allocated(opt) - expected <= padding


def test_estimate_arithmetic_for_a_known_model():
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 float32 parameters
    full = estimate_memory(model, offload_fraction=1.0, optimizer="adamw")
    n = 1_001_000
    assert full.gpu == {"params": 4 * n, "grads": 0, "master_weights": 0, "optimizer_state": 0, "speculation": 0}
    assert full.cpu == {"params": 0, "grads": 4 * n, "master_weights": 4 * n, "optimizer_state": 8 * n,
                        "speculation": 0}
    speculating = estimate_memory(model, offload_fraction=1.0, optimizer="adamw", speculate=True)
    assert speculating.cpu["speculation"] == 12 * n and speculating.cpu_total == full.cpu_total + 12 * n
    none = estimate_memory(model, offload_fraction=0.0, optimizer="adamw")
    assert none.gpu_total == 16 * n and none.cpu_total == 0
    assert "optimizer_state" in str(full) and "1,001,000 of 1,001,000 parameters offloaded" in str(full)


def test_bad_arguments():
    with pytest.raises(ValueError, match="precision must be one of"):
        estimate_memory(_model(), precision="transformer-engine")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        estimate_memory(_model(), optimizer="rmsprop")
    with pytest.raises(ValueError, match=r"offload_fraction must be in \[0.0, 1.0\]"):
        estimate_memory(_model(), offload_fraction=2)


@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_the_speculation_estimate_matches_the_snapshots(fraction):
    """What the speculative step keeps aside (masters and state, besides a step count per
    parameter) is what estimate_memory(speculate=True) says and what the log line says."""
    model = _model()
    est = estimate_memory(model, offload_fraction=fraction, optimizer="adam", amsgrad=True, speculate=True)
    opt = OffloadOptimizer(FusedAdam(model.parameters(), amsgrad=True), offload_fraction=fraction,
                           bucket_size_mb=0.001, copy_on_cpu=True, stream_cpu_step=True, speculate=True)
    from lightning_fastopt.offload.speculative import snapshot_bytes
    promised = snapshot_bytes(opt._buckets)
    for _ in range(2):  # the first step creates the state: the second keeps it aside too
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    kept = sum(s.nbytes for s in opt.schedule.snapshots.values())
    slots = sum(len(b.slots) for b in opt._buckets)
    assert promised == est.cpu["speculation"] and 0 <= kept - promised <= 4 * slots
    opt.close()
