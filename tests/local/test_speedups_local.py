"""`trainer train` with every speed-up of issue 41 on (the default) and off (TRAINER_SPEEDUPS_OFF=all):
a LoRA fine-tuning of the tiny Qwen2 on one CPU process logs the same losses either way (fused AdamW,
no sync in the step, the CPU's labelled-only head), and the run with them off says so in its log.
tests/unit/node/test_speedups.py switches each one alone."""

from __future__ import annotations

import pytest
from helpers.finetune_harness import chat_data, finetune_sets, hf_cache, tiny_model  # noqa: F401
from helpers.trainer_harness import finish, start_run

from trainer.node.speedups import SPEEDUPS, VARIABLE


def test_every_speedup_on_or_off_trains_the_same_losses(tmp_path, tiny_model, chat_data):  # noqa: F811
    sets = finetune_sets(
        tiny_model,
        chat_data,
        "lora.enabled=true",
        "train.learning_rate=0.03",
        "train.max_steps=4",
        "train.log_every=2",
        "checkpoint.save_steps=0",
    )
    runs = {}
    for off in ("", "all"):
        output_dir = tmp_path / (off or "on")
        runs[off] = finish(start_run(output_dir, sets, nproc=1, env={VARIABLE: off}), output_dir)
        assert runs[off].returncode == 0, runs[off].stderr[-3000:]
    on, off = runs[""], runs["all"]
    assert f"speed-ups off ({VARIABLE}): {', '.join(SPEEDUPS)}" in off.stdout
    assert "speed-ups off" not in on.stdout
    losses = {name: [m["loss"] for m in run.metrics] for name, run in (("on", on), ("off", off))}
    assert len(losses["on"]) == 3 and losses["on"][-1] < losses["on"][0], losses
    assert losses["on"] == pytest.approx(losses["off"], rel=1e-4), losses


def test_bf16_weights_with_fp32_masters_train_as_fp32_weights_do_and_resume_exactly(
    tmp_path,
    tiny_model,  # noqa: F811
    chat_data,  # noqa: F811
):
    """bf16_master: a full fine-tuning with bf16 weights (model.dtype=bf16, as auto picks on a GPU) steps
    fp32 masters; its losses follow the fp32-weight run's within bf16 rounding, its checkpoint holds the
    fp32 masters, and a run resumed from that checkpoint logs the uninterrupted run's losses."""
    import torch

    sets = finetune_sets(
        tiny_model,
        chat_data,
        "train.mixed_precision=bf16",
        "train.learning_rate=0.003",
        "train.log_every=1",
        "checkpoint.save_steps=2",
    )

    def run(name: str, *extra: str):
        output_dir = tmp_path / name
        done = finish(start_run(output_dir, [*sets, *extra], nproc=1), output_dir)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    masters = run("masters", "model.dtype=bf16", "train.max_steps=4")
    fp32 = run("fp32", "model.dtype=fp32", "train.max_steps=4")
    assert "(qwen2, bfloat16)" in masters.stdout and "(qwen2, float32)" in fp32.stdout
    losses = {name: [m["loss"] for m in r.metrics] for name, r in (("masters", masters), ("fp32", fp32))}
    assert losses["masters"][-1] < losses["masters"][0], losses
    assert losses["masters"] == pytest.approx(losses["fp32"], rel=2e-2), losses
    state = torch.load(
        next((tmp_path / "masters").glob("checkpoints/step-2/**/ddp_state.pt")), weights_only=True
    )
    assert {value.dtype for value in state["model"].values()} == {torch.float32}, "the masters, not bf16"

    run("resumed", "model.dtype=bf16", "train.max_steps=2")
    resumed = run("resumed", "model.dtype=bf16", "train.max_steps=4")
    assert "resum" in resumed.stdout.lower()
    tail = [m["loss"] for m in resumed.metrics if m["step"] > 2]
    assert tail == pytest.approx(losses["masters"][2:], rel=1e-5), (tail, losses["masters"])
