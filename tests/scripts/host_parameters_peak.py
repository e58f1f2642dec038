"""How much of a model the accelerator holds at once with its weights in host memory, for
tests/test_fsdp_host_parameters.py.

    python tests/scripts/host_parameters_peak.py OUT ACCELERATOR

One process (started as one rank of a Lightning run) fits a GPT laid out as transformers
are (an embedding, 16 blocks, a norm, a head; tiny batches, so that activations are small
beside the weights) for 3 steps under ``FastOptFSDPStrategy(offload_parameters=True,
auto_wrap_policy={Block})`` with AdamW, and writes OUT (JSON): the model's parameter bytes,
the accelerator's peak allocation during training (``torch.cuda.max_memory_allocated``,
reset when training starts; None on a CPU), the memory estimate's GPU figure for the same
model and policy, and the steps taken.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_fastopt import FastOptFSDPStrategy, estimate_memory  # noqa: E402

WIDTH, LAYERS, VOCAB, TOKENS = 512, 16, 1024, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class GPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def training_step(self, batch, _):
        x = self.embed(batch[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Peak(L.Callback):
    def __init__(self):
        self.peak = None

    def on_train_start(self, trainer, module):
        if torch.cuda.is_available() and module.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def on_train_end(self, trainer, module):
        if module.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()


def main():
    out, accelerator = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = GPT()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    estimate = estimate_memory(model, zero_stage=3, offload_parameters=True, auto_wrap_policy={Block})
    data = torch.utils.data.DataLoader(torch.randint(0, VOCAB, (6, TOKENS + 1)), batch_size=2)
    peak = Peak()
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[peak],
                        strategy=FastOptFSDPStrategy(offload_parameters=True, auto_wrap_policy={Block}))
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        Path(out).write_text(json.dumps(dict(param_bytes=params, peak=peak.peak, estimate_gpu=estimate.gpu_total,
                                             estimate_host=estimate.cpu_total, steps=trainer.global_step)))


if __name__ == "__main__":
    main()
