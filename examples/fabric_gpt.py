"""The byte-level GPT of examples/gpt.py trained in a Lightning Fabric loop with ``fastopt_offload``.

    python examples/fabric_gpt.py                      # CPU or one GPU, 3 epochs
    python examples/fabric_gpt.py --devices 2          # two processes (Fabric's launcher)
    python examples/fabric_gpt.py --strategy fastopt   # or any other fastopt name, or Fabric's own

What a Fabric user changes is the ``strategy`` argument: the optimizer is a plain
``torch.optim.AdamW`` (run as the fused one, its master weights and state in CPU
memory), the LR scheduler is made on it as usual, and ``fabric.save`` writes the
optimizer state keyed by parameter name.
"""

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning_fastopt  # noqa: E402,F401  (registers strategy="fastopt_offload" for Fabric too)
from gpt import DEFAULT_TEXT, ByteWindows, TinyGPT  # noqa: E402


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="fastopt_offload")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--limit-batches", type=int, default=None, help="batches per epoch (a quick check)")
    ap.add_argument("--checkpoint", default="lightning_logs/fabric_gpt/last.ckpt")
    args = ap.parse_args(argv)

    fabric = L.Fabric(accelerator="auto", devices=args.devices, strategy=args.strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module():
        model = TinyGPT(n_layer=4, n_head=4, n_embd=128, block_size=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    data = torch.tensor(list(Path(DEFAULT_TEXT).read_bytes()), dtype=torch.long)
    loader = fabric.setup_dataloaders(DataLoader(ByteWindows(data, 64, 16), batch_size=32, shuffle=True))

    mean = float("nan")
    for epoch in range(args.epochs):
        losses = []
        for i, (x, y) in enumerate(loader):
            if i == args.limit_batches:
                break
            stepping = (i + 1) % args.accumulate == 0
            with fabric.no_backward_sync(model, enabled=not stepping):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
                fabric.backward(loss / args.accumulate)
            losses.append(loss.item())
            if stepping:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        mean = sum(losses) / len(losses)
        fabric.print(f"epoch {epoch}: mean train loss {mean:.3f}")
    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    fabric.print(f"checkpoint: {args.checkpoint}")
    return mean


if __name__ == "__main__":
    main()
