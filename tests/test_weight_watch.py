"""The fingerprints that notice writes to the weights (lightning_fastopt.offload.weight_watch).

- ``torch_backend.fingerprint`` equals its definition evaluated with Python integers
  (SplitMix64 of bits ^ index << 32, summed modulo 2**64), for every dtype it takes;
- one changed element (any single bit, anywhere) and two swapped elements always change it;
- the compiled CPU kernels (each instruction set) give the torch values bit for bit, over
  sizes spread across threads, and ``changed_since`` flags exactly the tensors written
  since, through ``.data`` too, on every CPU backend;
- on a GPU (marked ``cuda``): the multi-tensor CUDA kernel gives the torch values bit for
  bit, over chunk boundaries and more tensors than one launch holds, and tensors it does
  not take (non-contiguous, float64) fall back to torch in the same call.
"""

import pytest
import torch

from lightning_fastopt.offload.weight_watch import changed_since, fingerprints
from lightning_fastopt.ops.torch_backend import fingerprint
from tests.helpers import BIG, SIZES

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_WIDTH = {torch.float32: (32, torch.int32), torch.float16: (16, torch.int16), torch.bfloat16: (16, torch.int16),
          torch.float64: (64, torch.int64)}
_WRAP = 2 ** 64


def _by_definition(t: torch.Tensor) -> int:
    width, bits_dtype = _WIDTH[t.dtype]
    total = 0
    for i, b in enumerate(t.reshape(-1).view(bits_dtype).tolist()):
        z = (b % (1 << width)) ^ ((i << 32) % _WRAP)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _WRAP
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _WRAP
        total = (total + (z ^ (z >> 31))) % _WRAP
    return total - _WRAP if total >= 2 ** 63 else total


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_torch_fingerprint_is_its_definition(dtype):
    tensors = [torch.randn(n).to(dtype) for n in (0, 1, 7, 300)] + [torch.randn(13, 5).to(dtype)]
    got = fingerprint(tensors)
    assert got.dtype == torch.int64 and got.shape == (len(tensors),)
    assert got.tolist() == [_by_definition(t) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_changed_bit_or_two_swapped_elements_always_change_it(dtype):
    width, bits_dtype = _WIDTH[dtype]
    t = torch.randn(4099).to(dtype)
    before = fingerprint([t]).item()
    bits = t.view(bits_dtype)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        i = int(torch.randint(t.numel(), (1,), generator=g))
        bit = int(torch.randint(width, (1,), generator=g))
        flipped = t.clone()
        flipped.view(bits_dtype)[i] = bits[i] ^ (1 << bit if bit < width - 1 else -(1 << bit))
        assert fingerprint([flipped]).item() != before, (i, bit)
    for i, j in ((0, 1), (5, 4098), (1021, 2042)):
        swapped = t.clone()
        swapped[i], swapped[j] = t[j], t[i]
        if not torch.equal(t[i].view(bits_dtype), t[j].view(bits_dtype)):
            assert fingerprint([swapped]).item() != before


def test_the_compiled_cpu_kernels_give_the_torch_values(compiled):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tensors = [torch.randn(n).to(dtype) for n in list(SIZES) + [65_537, BIG]]
        assert torch.equal(compiled.fingerprint(tensors), fingerprint(tensors))
    many = [torch.randn(int(n)) for n in torch.randint(1, 3000, (300,))]
    assert torch.equal(compiled.fingerprint(many), fingerprint(many))


def test_changed_since_flags_the_written_tensors_only(backend):
    weights = [torch.randn(n) for n in (1, 7, 1023, 5000)] + [torch.randn(64).half(), torch.randn(9, 9).t(),
                                                               torch.randn(5, dtype=torch.float64)]
    earlier = fingerprints(weights)
    assert [f.item() for f in earlier] == fingerprint(weights).tolist()
    assert changed_since(weights, earlier) == [False] * len(weights)
    weights[2].data.clamp_(-0.1, 0.1)  # through .data: the version counter does not move
    weights[4].data[3] += 1
    weights[5].data[0, 1] = 7.0
    assert changed_since(weights, earlier) == [False, False, True, False, True, True, False]


# ---------------------------------------------------------------------------- the CUDA kernel
@pytest.mark.cuda
def test_the_cuda_kernel_gives_the_torch_values(cuda_ext):
    kernel_sizes = list(SIZES) + [65_535, 65_536, 65_537, BIG]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tensors = [torch.randn(n, device="cuda").to(dtype) for n in kernel_sizes]
        assert torch.equal(cuda_ext.fingerprint(tensors), fingerprint(tensors))
    many = [torch.randn(int(n), device="cuda") for n in torch.randint(1, 3000, (700,))] + [
        torch.randn(21_000_001, device="cuda")]
    assert torch.equal(cuda_ext.fingerprint(many), fingerprint(many))


@pytest.mark.cuda
def test_tensors_the_kernel_does_not_take_are_fingerprinted_by_torch_in_the_same_call(cuda_ext):
    tensors = [torch.randn(100, device="cuda"), torch.randn(30, 40, device="cuda").t(),
               torch.randn(50, device="cuda", dtype=torch.float64), torch.randn(9, device="cuda").bfloat16()]
    got = fingerprints(tensors)
    assert [f.item() for f in got] == fingerprint(tensors).tolist()
    assert cuda_ext.calls.get("fingerprint") == 1
    tensors[1].data.zero_()
    assert changed_since(tensors, got) == [False, True, False, False]
