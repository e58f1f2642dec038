"""The everyday Lightning patterns of tests/test_lightning_patterns.py, one Trainer.fit each,
at one or two CPU processes (gloo), every one over the same global batches of 16.

    python tests/scripts/patterns_run.py OUT.pt --devices 2 --strategy zero2

Writes, on rank 0, {pattern: {"weights": state_dict, "norms": [grad_norm dicts]}} to OUT.pt
(and rank 1's weights to OUT.pt.rank1).  ``--strategy plain`` is ``Trainer()``.
Lightning's default launcher re-runs this script for rank 1, so it must be a script.
"""

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_fastopt import FastOptStrategy  # noqa: E402
from tests.helpers import finish_process  # noqa: E402
from tests.test_lightning_patterns import (CallbackClipsGradients, ClampWeights, Ema, Finetuned,  # noqa: E402
                                           FrozenBackbone, Gan, GradientHooks, ManualAccumulation, Net, Tied,
                                           TiedListedTwice, _adamw)
from tests.test_precision import _data  # noqa: E402

GLOBAL_BATCH = 16

# name -> (a new model, new callbacks, whether the run needs DDP's find_unused_parameters)
PATTERNS = {
    "frozen": (lambda: FrozenBackbone(), lambda: [], False),
    "unfrozen-at-epoch-1": (lambda: FrozenBackbone(_adamw, unfreeze_at=1), lambda: [], False),
    "backbone-finetuning": (lambda: Finetuned(_adamw),
                            lambda: [BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda _: 1.0)],
                            False),
    "grad-norm-and-edit": (lambda: GradientHooks(), lambda: [], False),
    "callback-clamps-grads": (lambda: Net(_adamw), lambda: [CallbackClipsGradients()], False),
    "manual-accumulation-clipping": (lambda: ManualAccumulation(_adamw), lambda: [], False),
    "gan": (lambda: Gan(toggle=False), lambda: [], True),
    "gan-toggle-optimizer": (lambda: Gan(toggle=True), lambda: [], True),
    "tied": (lambda: Tied(_adamw), lambda: [], False),
    "tied-listed-twice": (lambda: TiedListedTwice(lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)),
                          lambda: [], False),
    "clamp-weights-through-data": (lambda: Net(), lambda: [ClampWeights()], False),
    "ema-through-data": (lambda: Net(_adamw), lambda: [Ema()], False),
}

STRATEGIES = {
    "plain": lambda unused: "auto",
    "zero2": lambda unused: FastOptStrategy(zero_stage=2, offload_fraction=0.0, bucket_size_mb=0.0005,
                                            find_unused_parameters=unused, timeout=timedelta(seconds=60)),
    "zero2-offload": lambda unused: FastOptStrategy(zero_stage=2, offload_fraction=0.5, bucket_size_mb=0.0005,
                                                    copy_on_cpu=True, find_unused_parameters=unused,
                                                    timeout=timedelta(seconds=60)),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--strategy", default="zero2", choices=list(STRATEGIES))
    ap.add_argument("--only", nargs="*", help="run these patterns only")
    args = ap.parse_args()
    results = {}
    for name, (make_model, make_callbacks, unused) in PATTERNS.items():
        if args.only and name not in args.only:
            continue
        trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=STRATEGIES[args.strategy](unused),
                            max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, callbacks=make_callbacks())
        model = make_model()
        data = _data().dataset
        # the same global batches at every world size: rank r takes samples r, r + N, ... of each 16
        sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
        trainer.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH // trainer.world_size, sampler=sampler))
        results[name] = {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                         "norms": getattr(model, "norms", [])}
    suffix = "" if trainer.global_rank == 0 else f".rank{trainer.global_rank}"
    torch.save(results, f"{args.out}{suffix}")


if __name__ == "__main__":
    main()
    finish_process()
