"""benchmarks/largest_model.py reports why a try did not train and how far it got (issue 52):
on the H200 (2026-11-28) a 7.25B try was cut off by the call's time and reported a
Lightning warning, its last line printed, as the error."""

import json
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import largest_model
finally:
    sys.path.pop(0)

from tests.helpers import run_script  # noqa: E402

SCRIPT = REPO / "benchmarks" / "largest_model.py"

TRACEBACK_THEN_WARNING = """Traceback (most recent call last):
  File "largest_model.py", line 120, in child
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.
/site-packages/lightning/pytorch/trainer/connectors/data_connector.py:434: The 'train_dataloader' does not have many workers
"""


def test_the_exception_is_the_error_not_a_warning_printed_after_it():
    assert largest_model.failure(1, TRACEBACK_THEN_WARNING).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert largest_model.failure(1, "only a line\n") == "only a line"
    assert largest_model.failure(3, "") == "exit 3"


def test_a_signal_is_named():
    assert largest_model.failure(-9, TRACEBACK_THEN_WARNING) == (
        "killed by signal 9 (the host's out-of-memory killer sends it)")
    assert largest_model.failure(-15, "") == "killed by signal 15"


def test_the_last_progress_line_says_how_far_a_try_got():
    printed = "noise\nPROGRESS built on the meta device after 2.0 s\nmore noise\nPROGRESS step 1 took 3.10 s after 9.0 s\n"
    assert largest_model.last_progress(printed) == "step 1 took 3.10 s after 9.0 s"
    assert largest_model.last_progress("nothing of ours\n") is None


def test_a_try_stopped_by_its_time_limit_says_so_and_how_far_it_got(monkeypatch):
    def stopped(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"],
                                        output=b"PROGRESS set up (the model in host memory) after 80.0 s\n")

    monkeypatch.setattr(largest_model.subprocess, "run", stopped)
    args = Namespace(width=64, tokens=16, steps=3, state="float32", gpu_gib=1.0, tiny=True, timeout_s=7)
    got = largest_model.run_child(args, 4)
    assert got == dict(layers=4, trained=False, error="stopped after --timeout-s 7 s",
                       got_to="set up (the model in host memory) after 80.0 s")


def test_a_tiny_try_says_each_phase_of_its_set_up_in_order():
    """The child's progress lines name the strategy's set-up phases (the H200's 7.25B try
    was cut off before its first step, 2026-11-28, and nothing said where), then each step."""
    done = run_script(SCRIPT, "--tiny", "--child", "2", "--width", "64", "--tokens", "16", "--steps", "2",
                      "--gpu-gib", "1")
    said = [line.split(" after ")[0] for line in done.stdout.splitlines() if line.startswith(largest_model.PROGRESS)]
    phases = ["built on the meta device", "sharded on the meta device; materializing it in host memory",
              "materialized in host memory", "the optimizer set up", "set up: the first step begins"]
    # (the materializing line says how fast: on every core, benchmarks/host_init.py)
    rate = re.fullmatch(r"(.*): [\d.e+-]+B elements in [\d.]+ s, [\d.e+-]+B a second", said[2])
    assert rate, said[2]
    said[2] = rate.group(1)
    assert [line[len(largest_model.PROGRESS):] for line in said[:5]] == phases
    assert [line.split(" took ")[0] for line in said[5:]] == ["PROGRESS step 1", "PROGRESS step 2"]
    assert json.loads(done.stdout.splitlines()[-1])["trained"] is True


def test_the_model_is_initialized_on_every_core_the_same_whatever_the_threads():
    """benchmarks/host_init.py: a GPT built on the meta device is made in host memory and
    filled in chunks on a pool of threads, each chunk from its own seeded generator: the
    same values on one thread as on two, and run after run; the GPT's scheme (the weights'
    spread is checked against 0.02 within 2%: sampled numbers, 1.6M of them, so no exact
    reference); a module of another kind reset by its own ``reset_parameters``."""
    import torch
    from torch import nn

    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import host_init
        from gpt import TinyGPT
    finally:
        del sys.path[:2]

    def built(threads):
        torch.manual_seed(0)  # (the Conv1d's own reset draws from torch's generator)
        with torch.device("meta"):
            model = nn.Sequential(TinyGPT(n_layer=2, n_head=4, n_embd=256, block_size=32), nn.Conv1d(3, 5, 2))
        filled = host_init.initialize_on_all_cores(model, seed=3, threads=threads)
        return model, filled

    one, filled = built(1)
    two, _ = built(2)
    gpt, conv = one[0], one[1]
    assert not any(t.is_meta for t in one.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values()))
    assert filled == sum(p.numel() for p in gpt.parameters())  # the tied head once; the Conv1d by its own reset
    assert torch.equal(gpt.head.weight, gpt.tok.weight)
    block = gpt.blocks[0]
    assert torch.equal(block.ln1.weight, torch.ones(256)) and not block.ln1.bias.any() and not block.qkv.bias.any()
    weights = torch.cat([block.mlp[0].weight.flatten(), block.qkv.weight.flatten()])
    assert abs(weights.std().item() - host_init.STD) < 0.02 * host_init.STD
    assert not torch.equal(block.qkv.weight, gpt.blocks[1].qkv.weight)  # each tensor its own numbers
    assert conv.weight.abs().max() <= 1 / (3 * 2) ** 0.5 and conv.weight.std() > 0  # Conv1d's own reset: uniform
    again, _ = built(2)
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), again.state_dict().values()))
    # a tied weight whose second owner also has a parameter of its own (a head with a bias) stays tied
    with torch.device("meta"):
        embedding, head = nn.Embedding(16, 8), nn.Linear(8, 16)
        head.weight = embedding.weight
    host_init.initialize_on_all_cores(nn.Sequential(embedding, head), threads=2)
    expected = torch.empty(16, 8)
    host_init._fill((expected.view(-1), "normal", (0, 0, 0)))  # the first tensor's one chunk, seed 0
    assert head.weight is embedding.weight and torch.equal(head.weight, expected) and not head.bias.any()
