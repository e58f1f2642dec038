"""A LitGPT model trained in a Lightning Fabric loop with ``fastopt_offload``.

    pip install litgpt
    python examples/litgpt_fabric.py                    # pythia-14m, built from LitGPT's config (no download)
    python examples/litgpt_fabric.py --strategy auto    # the same loop with Fabric's own strategy

The lines a LitGPT user changes in a Fabric loop: ``import lightning_fastopt`` (it
registers the names) and ``strategy="fastopt_offload"``.  The model trains a few steps on
one fixed random batch, so the loss must fall; it prints the losses.
"""

import argparse

import lightning as L
import torch

import lightning_fastopt  # noqa: F401  (registers strategy="fastopt_offload" for Fabric)


def main(argv=None) -> list[float]:
    from litgpt import GPT, Config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="fastopt_offload")
    ap.add_argument("--model", default="pythia-14m")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)

    fabric = L.Fabric(devices=1, strategy=args.strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(0)
    config = Config.from_name(args.model)
    with fabric.init_module():
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    tokens = torch.randint(0, config.padded_vocab_size, (4, 65), generator=torch.Generator().manual_seed(0))
    x, y = fabric.to_device(tokens[:, :-1]), fabric.to_device(tokens[:, 1:])
    losses = []
    for _ in range(args.steps):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    fabric.print(f"{args.strategy}: {sum(p.numel() for p in model.parameters()):,} parameters, losses "
                 + " ".join(f"{v:.3f}" for v in losses))
    return losses


if __name__ == "__main__":
    main()
