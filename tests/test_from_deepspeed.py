"""Coming from DeepSpeed (issue 69, its first part): Lightning's ``DeepSpeedStrategy`` arguments
and DeepSpeed's config files taken by our strategies (:mod:`lightning_fastopt.from_deepspeed`).
A run given DeepSpeed's words ends bit for bit where the same run given ours ends, and where
``Trainer()`` ends with the same clipping and accumulation; every argument of
``DeepSpeedStrategy`` is classified (ours, mapped, of no effect, refused) and in
docs/from_deepspeed.md's table; bad input is an error naming the key and the file."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastopt import FastOptFabricFSDPStrategy, FastOptFabricStrategy, FastOptFSDPStrategy, FastOptStrategy
from lightning_fastopt.from_deepspeed import DEEPSPEED_WORDS, read_config
from lightning_fastopt.from_deepspeed.arguments import NO_EFFECT, REFUSED
from tests.helpers import said_lines

REPO = Path(__file__).resolve().parent.parent


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=8)


def _fit(strategy, **kw):
    model = Net()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(model, _data())
    return trainer, [p.detach().clone() for p in model.parameters()]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------- the arguments
def test_deepspeeds_words_mean_what_they_mean_there():
    """Where DeepSpeed's words are used, DeepSpeed's defaults hold (stage 2, nothing offloaded
    without offload_optimizer=True); without them, ours (fastopt_offload's)."""
    assert (FastOptStrategy().zero_stage, FastOptStrategy().offload_fraction) == (0, 1.0)
    s = FastOptStrategy(stage=2, offload_optimizer=True)
    assert (s.zero_stage, s.offload_fraction) == (2, 1.0)
    s = FastOptStrategy(stage=1)
    assert (s.zero_stage, s.offload_fraction) == (1, 0.0)
    s = FastOptStrategy(offload_optimizer=True)
    assert (s.zero_stage, s.offload_fraction) == (2, 1.0)
    s = FastOptStrategy(zero_optimization=False, offload_optimizer=True)
    assert (s.zero_stage, s.offload_fraction) == (0, 1.0)
    s = FastOptStrategy(stage=2, offload_optimizer=True, offload_fraction=1.0, zero_stage=2)  # ours agreeing
    assert (s.zero_stage, s.offload_fraction) == (2, 1.0)
    f = FastOptFSDPStrategy(offload_optimizer=True)
    assert f.options.offload_fraction == 1.0
    assert FastOptFSDPStrategy(stage=3).options.offload_fraction == 0.0


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(stage=2, zero_stage=1), ValueError, r"zero_stage=1 and stage \(2\) disagree; give one"),
    (dict(offload_optimizer=True, offload_fraction=0.5), ValueError,
     r"offload_fraction=0.5 and offload_optimizer \(1.0\) disagree"),
    (dict(stage=3), ValueError, r"runs ZeRO stages 0-2: stage 3 \(stage\) is FastOptFSDPStrategy's"),
    (dict(stage=4), ValueError, "stage must be 0, 1, 2 or 3, got 4"),
    (dict(offload_optimizer="yes"), TypeError, "offload_optimizer must be True or False, got 'yes'"),
    (dict(offload_parameters=True), ValueError,
     r"does not take offload_parameters=True: parameters in host memory are ZeRO stage 3's, "
     r"FastOptFSDPStrategy\(offload_parameters=True\)"),
    (dict(remote_device="cpu"), ValueError, "does not take remote_device='cpu': ZeRO-3's initialization"),
    (dict(partition_activations=True), ValueError, "use torch.utils.checkpoint"),
    (dict(load_full_weights=True), ValueError, "not read yet"),
    (dict(exclude_frozen_parameters=True), ValueError, "hold every parameter"),
    (dict(overlap_com=False), TypeError, r"'overlap_com' \(did you mean 'overlap_comm'\?\)"),
], ids=["conflict-stage", "conflict-offload", "stage-3", "stage-4", "not-a-flag", "offload-parameters",
        "remote-device", "activations", "full-weights", "frozen", "misspelt"])
def test_bad_deepspeed_words_are_refused_when_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        FastOptStrategy(**kwargs)


def test_the_pytorch_lightning_packages_strategy_takes_them_too():
    pytest.importorskip("pytorch_lightning")
    from lightning_fastopt.trainer.pytorch_lightning import FastOptStrategy as PLStrategy

    s = PLStrategy(stage=1, offload_optimizer=True, config={"zero_optimization": {"stage": 1}})
    assert (s.zero_stage, s.offload_fraction) == (1, 1.0)


def test_fsdp_strategies_take_stage_3_only():
    with pytest.raises(ValueError, match=r"FastOptFSDPStrategy is ZeRO stage 3 \(FSDP2\): stage=2"):
        FastOptFSDPStrategy(stage=2)
    with pytest.raises(ValueError, match=r"FastOptFabricFSDPStrategy is ZeRO stage 3"):
        FastOptFabricFSDPStrategy(config={"zero_optimization": {"stage": 1}})
    with pytest.raises(ValueError, match="offloads the parameters without the optimizer"):
        FastOptFSDPStrategy(config={"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    f = FastOptFSDPStrategy(config={"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                          "offload_optimizer": {"device": "cpu"}}})
    assert f.options.offload_parameters and f.options.offload_fraction == 1.0


def test_knobs_of_no_effect_are_taken_and_said_once(monkeypatch):
    import lightning_fastopt.from_deepspeed.arguments as deepspeed_words

    said = said_lines(monkeypatch, deepspeed_words)
    FastOptStrategy(stage=2, overlap_comm=False, reduce_bucket_size=5e8, thread_count=1)  # thread_count: its default
    assert said == ["lightning_fastopt: from DeepSpeed's words: offload_fraction=0.0 (offload_optimizer (default)), "
                    "zero_stage=2 (stage)",
                    "lightning_fastopt: no effect here (DeepSpeed's own tuning, logging or I/O): overlap_comm=False, "
                    "reduce_bucket_size=500000000.0"], said
    said.clear()
    FastOptStrategy()
    assert said == []


def test_every_argument_of_deepspeedstrategy_is_classified_and_in_the_docs_table():
    """Each of Lightning's DeepSpeedStrategy arguments: ours by the same name, mapped, of no
    effect, refused, or Lightning's own (passed on as to DDPStrategy); each a row of the table."""
    ours = set(inspect.signature(FastOptStrategy.__init__).parameters)
    lightnings = {"accelerator", "parallel_devices", "cluster_environment", "precision_plugin",
                  "process_group_backend", "timeout"}
    table = (REPO / "docs" / "from_deepspeed.md").read_text()
    for name in inspect.signature(DeepSpeedStrategy.__init__).parameters:
        if name == "self":
            continue
        assert name in ours | set(DEEPSPEED_WORDS) | set(NO_EFFECT) | set(REFUSED) | lightnings | {
            "offload_parameters"}, name
        assert f"| `{name}` |" in table, f"{name} has no row in docs/from_deepspeed.md"


# ---------------------------------------------------------------------------- the config
def _config_file(tmp_path, config) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def test_a_config_file_as_deepspeed_reads_it(tmp_path):
    path = _config_file(tmp_path, {
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "steps_per_print": 10, "wall_clock_breakdown": False,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                 "hysteresis": 3, "min_loss_scale": 2},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.4}}})
    config = read_config(path)
    assert config.arguments == {"stage": 2, "offload_optimizer": True, "offload_optimizer_device": "cpu",
                                "pin_memory": True, "offload_fraction": 0.4, "loss_scale": 0,
                                "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3,
                                "min_loss_scale": 2, "wall_clock_breakdown": False}
    assert config.trainer == {"gradient_clip_val": 1.0, "accumulate_grad_batches": 2} and config.precision == "16"
    assert set(config.no_effect) == {"train_micro_batch_size_per_gpu", "steps_per_print",
                                     "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients"}
    s = FastOptStrategy(config=str(path))
    assert (s.zero_stage, s.offload_fraction) == (2, 0.4)
    knobs = s._precisions.scale_knobs
    assert knobs["initial_scale_power"] == 12 and knobs["hysteresis"] == 3
    assert FastOptStrategy(config={"zero_optimization": {"stage": 1}}).zero_stage == 1  # a dict as well
    off = {"zero_hpz_partition_size": 1, "mics_shard_size": -1, "zero_quantized_weights": False}  # DeepSpeed's defaults
    assert FastOptStrategy(config={"zero_optimization": off, "prescale_gradients": False}).zero_stage == 2
    flags_off = {"partition_activations": False, "cpu_checkpointing": False, "number_checkpoints": None}  # HF's
    assert FastOptStrategy(config={"activation_checkpointing": flags_off}).zero_stage == 2
    with pytest.raises(ValueError, match="activation_checkpointing in .*use torch.utils.checkpoint"):
        FastOptStrategy(config={"activation_checkpointing": {**flags_off, "partition_activations": True}})
    nvme = FastOptStrategy(config={"zero_optimization": {"offload_optimizer": {"device": "nvme",
                                                                               "nvme_path": str(tmp_path)}}})
    assert (nvme.offload_optimizer_device, nvme.nvme_path, nvme.zero_stage) == ("nvme", str(tmp_path), 2)


@pytest.mark.parametrize("config,match", [
    ({"zero_optimisation": {}}, r"zero_optimisation in the DeepSpeed config .*ds_config.json: not a key DeepSpeed's "
                                r"config has here \(did you mean 'zero_optimization'\?\)"),
    ({"zero_optimization": {"stage": 2, "offload_optimiser": {}}},
     r"zero_optimization.offload_optimiser in .*: not a key .* \(did you mean 'offload_optimizer'\?\)"),
    ({"zero_optimization": {"stage": "2"}}, r"zero_optimization.stage in .*: must be an integer, got '2'"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, r"must be 'cpu', 'nvme' or 'none', got 'gpu'"),
    ({"zero_optimization": {"offload_optimizer": {"ratio": 2}}}, r"ratio in .*: must be in \[0, 1\], got 2"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, r"fp16.consecutive_hysteresis .* changes the math"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both fp16 and bf16 are enabled"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 0.001}}}, r"optimizer.type in .*: 'Lamb': DeepSpeed's LAMB clips"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, r"optimizer.params.lr in .*: 'auto' is filled in"),
    ({"optimizer": {"type": "AdamW", "params": {"lrr": 0.1}}}, r"optimizer.params.lrr in .*: not an argument of AdamW"),
    ({"optimizer": {"type": "Adamax", "params": {"momentum": 0.9}}}, r"not an argument of torch.optim.Adamax"),
    ({"optimizer": {"type": "Adafactorial"}}, r"'Adafactorial' is neither DeepSpeed's nor a torch.optim optimizer"),
    ({"scheduler": {"type": "CyclicLR", "params": {}}}, r"scheduler.type in .*: 'CyclicLR': not one of DeepSpeed's"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}},
     r"scheduler.params.cycle_min_lr in .*: OneCycle needs it"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}}},
     r"scheduler.params.total_num_steps in .*: WarmupDecayLR needs it"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}}, r"warmup_steps in .*: not an argument"),
    ({"communication_data_type": "fp16"}, "all-reduces gradients in a half type"),
    ({"prescale_gradients": True}, r"prescale_gradients in .*: gradients divided before the all-reduce"),
    ({"gradient_clipping": -1}, "must be 0 .* or more"),
    ({"zero_optimization": {"stage": 2}, "stage": 1}, r"stage in .*: not a key"),
    ({"zero_optimization": {"zero_hpz_partition_size": 8}}, r"zero_hpz_partition_size in .*: hierarchical"),
], ids=["misspelt", "misspelt-inner", "a-string", "device", "ratio", "consecutive", "two-halves", "lamb", "auto-lr",
        "adamw-key", "torch-key", "no-such-optimizer", "no-such-schedule", "onecycle-min", "no-total", "scheduler-key",
        "half-comm", "prescale", "negative-clip", "stray-key", "hpz"])
def test_a_bad_config_is_an_error_naming_the_key_and_the_file(tmp_path, config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FastOptStrategy(config=str(_config_file(tmp_path, config)))


def test_config_and_arguments_that_disagree_are_refused(tmp_path):
    path = _config_file(tmp_path, {"zero_optimization": {"stage": 1}})
    with pytest.raises(ValueError, match=r"stage=2 and the config's zero_optimization.stage of the DeepSpeed config "
                                         r".*ds_config.json \(1\) disagree"):
        FastOptStrategy(config=str(path), stage=2)
    with pytest.raises(ValueError, match=r"zero_stage=2 and zero_optimization.stage of the DeepSpeed config .* \(1\) "
                                         "disagree"):
        FastOptStrategy(config=str(path), zero_stage=2)
    with pytest.raises(FileNotFoundError, match="no DeepSpeed config file there"):
        FastOptStrategy(config=str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{\"zero_optimization\": ")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        FastOptStrategy(config=str(tmp_path / "broken.json"))


# ---------------------------------------------------------------------------- runs
def test_deepspeeds_words_run_as_ours_do_and_end_where_trainer_ends():
    _, ours = _fit(FastOptStrategy(zero_stage=2, offload_fraction=1.0, copy_on_cpu=True))
    _, theirs = _fit(FastOptStrategy(stage=2, offload_optimizer=True, copy_on_cpu=True))
    _, plain = _fit("auto")
    assert _equal(ours, theirs) and _equal(theirs, plain)


def test_the_configs_clipping_and_accumulation_are_the_trainers(tmp_path):
    """gradient_clipping and gradient_accumulation_steps of a config reach the Trainer: the run
    ends where Trainer(gradient_clip_val=..., accumulate_grad_batches=...) ends."""
    path = _config_file(tmp_path, {"gradient_clipping": 0.05, "gradient_accumulation_steps": 2,
                                   "train_micro_batch_size_per_gpu": 8,
                                   "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    trainer, theirs = _fit(FastOptStrategy(config=str(path), copy_on_cpu=True))
    assert trainer.gradient_clip_val == 0.05 and trainer.accumulate_grad_batches == 2
    _, plain = _fit("auto", gradient_clip_val=0.05, accumulate_grad_batches=2)
    _, unclipped = _fit("auto", accumulate_grad_batches=2)
    assert _equal(theirs, plain) and not _equal(theirs, unclipped)
    _, auto = _fit(FastOptStrategy(config={"gradient_clipping": "auto", "gradient_accumulation_steps": "auto",
                                           "fp16": {"enabled": "auto"}}, copy_on_cpu=True),
                   gradient_clip_val=0.05, accumulate_grad_batches=2)  # "auto": the Trainer's
    assert _equal(auto, plain)


@pytest.mark.parametrize("config,trainer_kw,match", [
    ({"gradient_clipping": 0.5}, dict(gradient_clip_val=1.0), r"gradient_clipping of the DeepSpeed config dict \(0.5\) "
                                                              r"and the Trainer's gradient_clip_val \(1.0\) disagree"),
    ({"gradient_clipping": 0}, dict(gradient_clip_val=1.0), "is 0 \\(no clipping\\) and the Trainer's"),
    ({"gradient_accumulation_steps": 4}, dict(accumulate_grad_batches=2), r"\(4\) and the Trainer's "
                                                                          r"accumulate_grad_batches \(2\) disagree"),
    ({"fp16": {"enabled": True}}, {}, r"fp16.enabled of the DeepSpeed config dict asks for 16 training: give the "
                                      r"Trainer precision='16-mixed' \(it has '32-true'\)"),
    ({"bf16": {"enabled": True}}, {}, r"precision='bf16-mixed' or 'bf16-true' \(it has '32-true'\)"),
], ids=["clip", "clip-off", "accumulation", "fp16", "bf16"])
def test_a_config_the_trainer_contradicts_is_refused_at_fit(config, trainer_kw, match):
    with pytest.raises(ValueError, match=match):
        _fit(FastOptStrategy(config=config, copy_on_cpu=True), **trainer_kw)


def test_the_configs_clipping_under_manual_optimization_is_refused_by_lightning():
    """Given to the Trainer before Lightning checks the loop: its own refusal applies."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    class Manual(Net):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    trainer = L.Trainer(strategy=FastOptStrategy(config={"gradient_clipping": 1.0}), accelerator="cpu", devices=1,
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(MisconfigurationException, match="gradient_clip_val"):
        trainer.fit(Manual(), _data())


def test_fabric_takes_the_words_and_leaves_clipping_to_the_loop():
    s = FastOptFabricStrategy(stage=1, offload_optimizer=True)
    assert (s.options.zero_stage, s.options.offload_fraction) == (1, 1.0)
    with pytest.raises(ValueError, match=r"gradient_clipping of the DeepSpeed config dict \(1.0\) is the loop's to do "
                                         r"under Fabric: fabric.clip_gradients"):
        FastOptFabricStrategy(config={"gradient_clipping": 1.0})
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FastOptFabricStrategy(config={"fp16": {"enabled": True}}))
    with pytest.raises(ValueError, match=r"asks for 16 training: give Fabric precision='16-mixed'"):
        fabric.launch()


def test_the_config_from_the_cli(tmp_path):
    pytest.importorskip("jsonargparse")
    from tests.test_cli import CONFIGS, _cli

    path = _config_file(tmp_path, {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu",
                                                                                           "ratio": 0.5}}})
    cli = _cli(CONFIGS / "gpt_offload.yaml", tmp_path, "--trainer.max_steps", "2", "--trainer.strategy",
               "lightning_fastopt.FastOptStrategy", "--trainer.strategy.config", str(path))
    strategy = cli.trainer.strategy
    assert (strategy.zero_stage, strategy.offload_fraction) == (1, 0.5) and cli.trainer.global_step == 2


# ---------------------------------------------------------------------------- optimizer and scheduler sections
@pytest.mark.parametrize("name,params", [
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=5, warmup_type="log")),
    ("WarmupLR", dict(warmup_min_lr=0.0, warmup_num_steps=1, warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=20, warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=3,
                           warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=12, warmup_num_steps=40)),
    ("WarmupCosineLR", dict(total_num_steps=25, warmup_min_ratio=0.1, warmup_num_steps=4, cos_min_ratio=0.01)),
    ("WarmupCosineLR", dict(total_num_steps=9, warmup_num_steps=3, warmup_type="linear")),
    ("OneCycle", dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=5)),
    ("OneCycle", dict(cycle_min_lr=[0.001, 0.002], cycle_max_lr=0.01, cycle_first_step_size=4,
                      cycle_second_step_size=3, cycle_first_stair_count=2, decay_step_size=2, decay_lr_rate=0.1,
                      decay_mom_rate=0.05, cycle_min_mom=0.85)),
    ("LRRangeTest", dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=3, lr_range_test_step_rate=0.5)),
    ("LRRangeTest", dict(lr_range_test_min_lr=[0.001, 0.01], lr_range_test_step_size=4, lr_range_test_staircase=True)),
], ids=["warmup-log", "warmup-linear-1", "decay-linear", "decay-longer-warmup", "cosine-log", "cosine-linear",
        "onecycle", "onecycle-stairs-decay", "range-test", "range-test-staircase"])
def test_each_steps_rate_is_deepspeeds_own(name, params):
    """Every step's rate (two parameter groups, 30 steps, past the end) the float DeepSpeed's
    own scheduler gives (deepspeed.runtime.lr_schedules), and OneCycle's Adam betas."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from lightning_fastopt.from_deepspeed.schedules import SCHEDULES

    def rates(make):
        groups = [{"params": [nn.Parameter(torch.zeros(2))], "lr": 0.02}, {"params": [nn.Parameter(torch.zeros(2))]}]
        optimizer = torch.optim.AdamW(groups, lr=0.05)
        schedule = make(optimizer)
        seen = []
        for _ in range(30):
            seen.append([(g["lr"], g["betas"]) for g in optimizer.param_groups])
            optimizer.step()
            schedule.step()
        return seen

    ours = rates(lambda o: SCHEDULES[name](o, **params))
    theirs = rates(lambda o: getattr(lr_schedules, name)(o, **params))
    assert ours == theirs


def test_the_optimizer_section_means_what_deepspeed_makes_of_it():
    from lightning_fastopt.from_deepspeed.sections import make_optimizer

    def made(section):
        return make_optimizer(section, [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1), requires_grad=False)],
                              "test")

    adam = made({"type": "Adam", "params": {"lr": 0.01}})  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    assert type(adam) is torch.optim.AdamW and adam.defaults["weight_decay"] == 0.0 and adam.defaults["eps"] == 1e-8
    assert len(adam.param_groups[0]["params"]) == 1  # those that require grad, as DeepSpeed's engine takes them
    assert type(made({"type": "Adam", "params": {"adam_w_mode": False}})) is torch.optim.Adam
    assert made({"type": "AdamW", "params": {"adam_w_mode": False}}).defaults["weight_decay"] == 0.0
    torchs = made({"type": "AdamW", "params": {"torch_adam": True, "betas": [0.8, 0.9]}})
    assert torchs.defaults["weight_decay"] == 0.01 and torchs.defaults["betas"] == (0.8, 0.9)  # torch's defaults
    sgd = made({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9


class _RecordsRates(L.Callback):
    def __init__(self):
        self.rates = []

    def on_train_batch_start(self, trainer, *args):
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


class _NeverConfigured(Net):
    def configure_optimizers(self):  # the config's section stands in: not called
        raise AssertionError("configure_optimizers was called")


def test_the_configs_optimizer_and_schedule_train_as_configure_optimizers_would():
    """Under the Trainer the sections stand in for configure_optimizers: the rate of every
    step is DeepSpeed's scheduler's, and the run ends where a Trainer() run whose
    configure_optimizers returns the same torch optimizer and schedule ends."""
    from lightning_fastopt.from_deepspeed.schedules import WarmupDecayLR

    schedule = {"total_num_steps": "auto", "warmup_min_lr": 0.001, "warmup_max_lr": 0.05, "warmup_num_steps": 4,
                "warmup_type": "linear"}
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
              "scheduler": {"type": "WarmupDecayLR", "params": schedule},
              "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    rates = _RecordsRates()
    model = _NeverConfigured()
    trainer = L.Trainer(strategy=FastOptStrategy(config=config, copy_on_cpu=True), accelerator="cpu", devices=1,
                        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[rates])
    trainer.fit(model, _data())
    ours = [p.detach().clone() for p in model.parameters()]

    class Configured(Net):
        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01, eps=1e-8)
            return [optimizer], [{"scheduler": WarmupDecayLR(optimizer, **{**schedule, "total_num_steps": 12}),
                                  "interval": "step"}]

    reference = Configured()
    L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(reference, _data())
    assert _equal(ours, [p.detach() for p in reference.parameters()])
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)
    theirs = lr_schedules.WarmupDecayLR(optimizer, **{**schedule, "total_num_steps": 12})
    expected = []
    for _ in range(12):
        expected.append(optimizer.param_groups[0]["lr"])
        theirs.step()
    assert rates.rates == expected


def test_a_scheduler_section_beside_configure_optimizers():
    """Without an optimizer section the section schedules configure_optimizers' optimizer; where
    configure_optimizers returns a scheduler too, DeepSpeed's engine takes the client's: so do
    we, and the log says the section is not used."""
    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}}}
    trainer, _ = _fit(FastOptStrategy(config=config, copy_on_cpu=True))
    from lightning_fastopt.from_deepspeed.schedules import WarmupLR

    assert isinstance(trainer.lr_scheduler_configs[0].scheduler, WarmupLR)
    assert trainer.lr_scheduler_configs[0].interval == "step"
    with pytest.raises(ValueError, match="the optimizer section of the DeepSpeed config dict is the loop's to make"):
        FastOptFabricStrategy(config={"optimizer": {"type": "AdamW"}})
