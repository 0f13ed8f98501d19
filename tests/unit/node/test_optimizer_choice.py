"""train.optimizer: adamw, adamw_fused (torch's fused kernel; on the CPU too), adamw_8bit (bitsandbytes,
CUDA only): what runs is said in the log, and what cannot run here is refused before training."""

from __future__ import annotations

import json

import pytest
import torch

from trainer import exitcodes
from trainer.cli import main

#: 6 steps of the tiny GPT without dropout: two runs with the same seed train the same samples.
SHORT = [
    "train.max_steps=6",
    "train.log_every=1",
    "model.n_layer=1",
    "model.dropout=0",
    "train.micro_batch_size=4",
]


@pytest.mark.slow
def test_fused_adamw_on_the_cpu_trains_as_plain_adamw_does(run_trainer):
    plain = run_trainer(*SHORT, launcher="none", name="plain")
    fused = run_trainer(*SHORT, "train.optimizer=adamw_fused", launcher="none", name="fused")
    for run in (plain, fused):
        assert run.returncode == 0, run.stderr[-3000:]
    assert "optimizer: AdamW, fused (torch's CPU kernel, no GPU involved)" in fused.stdout
    assert "optimizer:" not in plain.stdout
    # The same algorithm: the same losses, to float rounding.
    assert [r["loss"] for r in fused.metrics] == pytest.approx([r["loss"] for r in plain.metrics], rel=1e-4)
    state = torch.load(fused.output_dir / "checkpoints" / "step-6" / "ddp_state.pt", weights_only=True)
    assert all(group["fused"] for group in state["optimizer"]["param_groups"])


@pytest.mark.slow
def test_fused_adamw_under_accelerate_on_two_processes(run_trainer):
    run = run_trainer(
        *SHORT, "distributed.engine=accelerate", "train.optimizer=adamw_fused", launcher="accelerate"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "optimizer: AdamW, fused" in run.stdout
    losses = [r["loss"] for r in run.metrics]
    assert losses[-1] < losses[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a node without a GPU")
def test_8bit_adamw_without_a_gpu_is_refused_before_anything_is_written(tmp_path, capsys):
    output_dir = tmp_path / "out"
    code = main(["train", "--set", f"output_dir={output_dir}", "--set", "train.optimizer=adamw_8bit"])
    assert code == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "train.optimizer: adamw_8bit runs on CUDA GPUs only" in err
    assert "use train.optimizer=adamw" in err
    assert not output_dir.exists()


def test_8bit_adamw_with_deepspeed_is_refused_at_load(capsys):
    args = [
        "train",
        "--dry-run",
        "--set",
        "train.optimizer=adamw_8bit",
        "--set",
        "distributed.engine=deepspeed",
    ]
    assert main(args) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "train.optimizer: adamw_8bit is not run under DeepSpeed here" in err
    assert "distributed.engine=ddp or accelerate" in err


def test_an_unknown_optimizer_name_lists_the_choices(capsys):
    assert main(["train", "--dry-run", "--set", "train.optimizer=adamw_torch"]) == exitcodes.CONFIG_ERROR
    assert "train.optimizer: must be one of 'adamw' | 'adamw_fused' | 'adamw_8bit'" in capsys.readouterr().err


def test_a_deepspeed_json_naming_another_optimizer_is_refused_by_name(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "OneBitAdam", "params": {"lr": "auto"}}}))
    args = ["train", "--dry-run", "--set", "distributed.engine=deepspeed"]
    args += ["--set", f"distributed.deepspeed_config={ds}"]
    assert main(args) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "names optimizer.type 'OneBitAdam', but the trainer's train.optimizer (adamw) is what runs" in err
    # AdamW there (the Qwen guide's JSON) is what runs anyway: accepted.
    ds.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    assert main(args) == exitcodes.OK
