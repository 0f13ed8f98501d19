"""`distributed.deepspeed_config: PATH`: the user's own DeepSpeed JSON, "auto" values filled from the
trainer config as the Hugging Face Trainer fills them, a disagreeing value refused by name (exit 2)."""

from __future__ import annotations

import json

import pytest

from trainer import exitcodes
from trainer.cli import main

#: The Qwen fine-tuning guide's ds_config_zero2.json (HF style: "auto" wherever the trainer decides).
QWEN_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 100,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}  # fmt: skip


def _write(tmp_path, data) -> str:
    path = tmp_path / "ds_config_zero2.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.slow
def test_the_qwen_zero2_json_trains_under_deepspeed_on_two_cpu_processes(run_trainer, tmp_path):
    path = _write(tmp_path, QWEN_ZERO2)
    run = run_trainer(
        "distributed.engine=deepspeed", f"distributed.deepspeed_config={path}",
        "train.max_steps=6", "train.log_every=1", "train.micro_batch_size=8",
        "train.gradient_accumulation_steps=2", "train.grad_clip=0.5", "checkpoint.save_steps=3",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4, 5, 6]
    assert run.metrics[-1]["loss"] < run.metrics[0]["loss"]
    ran = json.loads((run.output_dir / "ds_config.json").read_text())
    # "auto" took the trainer's values; what the user wrote (bucket sizes, overlap_comm) went through.
    assert "auto" not in json.dumps(ran)
    assert (ran["train_micro_batch_size_per_gpu"], ran["gradient_accumulation_steps"]) == (8, 2)
    assert (ran["train_batch_size"], ran["gradient_clipping"]) == (8 * 2 * 2, 0.5)
    assert ran["zero_optimization"]["overlap_comm"] is True
    assert ran["zero_optimization"]["reduce_bucket_size"] == 2e8
    assert ran["bf16"]["enabled"] is False and ran["fp16"]["enabled"] is False  # CPU: no bf16
    assert "optimizer" not in ran and "scheduler" not in ran  # the trainer's AdamW and schedule ran


CONFLICTS = [
    ({"train_micro_batch_size_per_gpu": 4}, ["train.micro_batch_size=16"],
     "sets train_micro_batch_size_per_gpu to 4 but train.micro_batch_size is 16"),
    ({"gradient_clipping": 2.0}, [],
     "sets gradient_clipping to 2.0 but train.grad_clip is 1.0"),
    ({"zero_optimization": {"stage": 3}}, [],
     "sets zero_optimization.stage to 3 but distributed.zero_stage is 2; "
     'write "auto" there (the trainer\'s value) or set distributed.zero_stage=3'),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}, [],
     "sets optimizer.params.lr to 1e-05 but train.learning_rate is 0.003"),
    ({"train_batch_size": 64}, [],
     "sets train_batch_size to 64 but train.micro_batch_size 16 x train.gradient_accumulation_steps 1 "
     "x world size 1 is 16"),
    ({"fp16": {"enabled": True}}, [], "enables fp16"),
]  # fmt: skip


@pytest.mark.parametrize(("json_part", "overrides", "message"), CONFLICTS)
def test_a_json_value_that_disagrees_with_the_trainer_is_refused_by_name(
    tmp_path, capsys, json_part, overrides, message
):
    path = _write(tmp_path, {**QWEN_ZERO2, **json_part})
    sets = ["distributed.engine=deepspeed", f"distributed.deepspeed_config={path}", *overrides]
    code = main(["train", "--dry-run", *[arg for item in sets for arg in ("--set", item)]])
    assert code == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"config error: distributed.deepspeed_config: {path} " in err and message in err


@pytest.mark.parametrize(
    ("content", "sets", "message"),
    [
        ("{not json", ["distributed.engine=deepspeed"], "is not valid JSON"),
        ("[1]", ["distributed.engine=deepspeed"], "must hold a JSON object (got list)"),
        ("{}", ["distributed.engine=ddp"], "applies to distributed.engine=deepspeed only (engine is ddp)"),
    ],
)
def test_an_unusable_json_file_is_refused(tmp_path, capsys, content, sets, message):
    path = tmp_path / "ds.json"
    path.write_text(content)
    sets = [*sets, f"distributed.deepspeed_config={path}"]
    assert main(["train", "--dry-run", *[a for s in sets for a in ("--set", s)]]) == exitcodes.CONFIG_ERROR
    assert message in capsys.readouterr().err


def test_a_missing_json_file_is_named(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    sets = ["distributed.engine=deepspeed", f"distributed.deepspeed_config={missing}"]
    assert main(["train", "--dry-run", *[a for s in sets for a in ("--set", s)]]) == exitcodes.CONFIG_ERROR
    assert f"distributed.deepspeed_config: cannot read {missing}" in capsys.readouterr().err
