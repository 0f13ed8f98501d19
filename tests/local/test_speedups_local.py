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
