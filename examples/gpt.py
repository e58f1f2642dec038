"""A small GPT-style language model over bytes, and the text it learns from.

Everything it needs ships in this repository: the model (pre-norm transformer blocks,
causal self-attention, tied input/output embeddings), a byte-level data module over
``examples/data/workshop_notes.txt`` (no tokenizer, no downloads) and a perplexity
metric from torchmetrics.  ``train_gpt.py`` trains it through LightningCLI.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "workshop_notes.txt"
VOCAB = 256  # bytes


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(L.LightningModule):
    """A byte-level GPT.  The optimizer comes from the CLI's ``optimizer:`` block (or
    from a ``configure_optimizers`` you add)."""

    # its hook between steps (on_train_epoch_end) prints the epoch's mean loss and reads no weight:
    # lightning_fastopt's forward_waits="module" may let the next forward start before every new weight is in
    reads_weights_between_steps = False

    def __init__(self, n_layer: int = 4, n_head: int = 4, n_embd: int = 128, block_size: int = 64,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(VOCAB, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self.apply(self._init_weights)
        self.val_perplexity = Perplexity()
        self._epoch_losses: list[float] = []

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)  # small logits at the start: loss near ln(256)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float().flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        self._epoch_losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_perplexity.update(self(x).float(), y)

    def on_validation_epoch_end(self):
        self.log("val_perplexity", self.val_perplexity.compute(), prog_bar=True, sync_dist=True)
        self.val_perplexity.reset()

    def on_train_epoch_end(self):
        if self._epoch_losses:
            mean = sum(self._epoch_losses) / len(self._epoch_losses)
            self.print(f"epoch {self.current_epoch}: mean train loss {mean:.3f}")
            self._epoch_losses.clear()


class ByteWindows(Dataset):
    """Windows of ``block_size + 1`` bytes, every ``stride`` bytes: input and next-byte target."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int) -> None:
        self.data, self.block_size = data, block_size
        self.starts = list(range(0, len(data) - block_size - 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        chunk = self.data[self.starts[i]:self.starts[i] + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class TextData(L.LightningDataModule):
    """The shipped text as bytes: the first 90% to train on, the rest to validate."""

    def __init__(self, path: str = str(DEFAULT_TEXT), block_size: int = 64, stride: int = 16,
                 batch_size: int = 32) -> None:
        super().__init__()
        self.path, self.block_size, self.stride, self.batch_size = path, block_size, stride, batch_size

    def setup(self, stage: str) -> None:
        data = torch.tensor(list(Path(self.path).read_bytes()), dtype=torch.long)
        cut = int(0.9 * len(data))
        self.train_set = ByteWindows(data[:cut], self.block_size, self.stride)
        self.val_set = ByteWindows(data[cut:], self.block_size, self.block_size)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)
