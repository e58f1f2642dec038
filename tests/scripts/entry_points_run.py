"""fit, validate, test and predict on one Trainer with 2 CPU processes (gloo), in two orders,
saving what each rank ends with.

    python tests/scripts/entry_points_run.py STRATEGY OUT

STRATEGY: ``ddp`` (Lightning's own, the reference), ``half_offloaded`` (half the parameters
offloaded through the accelerator code path), ``fastopt_offload``, or ``zero2_offload``.
Writes ``OUT.rank{r}``: for each order, the final weights, the validate and test metrics
(synchronised over the ranks) and this rank's predictions.

Lightning's launcher re-runs this script for rank 1, so it must be a script; every
Trainer after the first finds the processes started."""

import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lightning_fastopt  # noqa: E402
from tests.helpers import finish_process  # noqa: E402

ORDERS = {"fit-validate-test-predict": ("fit", "validate", "test", "predict"),
          "predict-validate-fit-test": ("predict", "validate", "fit", "test")}


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, _):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, _):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def _strategy(name):
    if name == "half_offloaded":
        return lightning_fastopt.FastOptStrategy(offload_fraction=0.5, copy_on_cpu=True, bucket_size_mb=0.0002)
    if name == "zero2_offload":
        return lightning_fastopt.FastOptStrategy(zero_stage=2, offload_fraction=1.0, bucket_size_mb=0.0002)
    return name


def _data(n):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=4)


def _run(strategy_name, order):
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(strategy_name), max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    out = {}
    for stage in order:
        if stage == "fit":
            trainer.fit(model, _data(64))
        elif stage == "predict":
            out["predict"] = torch.cat(trainer.predict(model, _data(16)))
        else:
            metrics = getattr(trainer, stage)(model, _data(16), verbose=False)[0]
            out.update({f"{stage}/{k}": torch.tensor(v) for k, v in metrics.items()})
    out.update({f"weights/{k}": v.detach().clone() for k, v in model.state_dict().items()})
    return trainer.global_rank, out


def main():
    strategy_name, out = sys.argv[1], sys.argv[2]
    results = {}
    for name, order in ORDERS.items():
        rank, result = _run(strategy_name, order)
        results.update({f"{name}/{k}": v for k, v in result.items()})
    torch.save(results, f"{out}.rank{rank}")


if __name__ == "__main__":
    main()
    finish_process()
