"""Resuming from an existing output dir: what `checkpoint.resume: auto` does when it cannot or need not."""

from __future__ import annotations

from trainer import exitcodes

TINY = ["train.max_steps=3", "train.log_every=1", "model.n_layer=1", "checkpoint.save_steps=2"]


def test_resume_with_another_model_is_refused_and_a_finished_run_is_not_retrained(run_trainer):
    first = run_trainer(*TINY, launcher="none")
    assert first.returncode == 0, first.stderr[-3000:]
    metrics_before = (first.output_dir / "metrics.jsonl").read_text()

    other_model = run_trainer(*TINY, "model.n_layer=2", launcher="none")
    assert other_model.returncode == exitcodes.CONFIG_ERROR
    assert "config error: checkpoint.resume: " in other_model.stderr
    assert "was written with model = {'n_layer': 1" in other_model.stderr
    assert "checkpoint.resume=never" in other_model.stderr  # the way out
    assert (first.output_dir / "metrics.jsonl").read_text() == metrics_before, "nothing may change"

    again = run_trainer(*TINY, launcher="none")
    assert again.returncode == 0
    assert "already trained to step 3" in again.stdout
    assert not any(line.startswith("step ") for line in again.stdout.splitlines())

    fresh = run_trainer(*TINY, "checkpoint.resume=never", "train.max_steps=4", launcher="none")
    assert fresh.returncode == 0
    assert fresh.summary["resumed_from"] is None and fresh.summary["steps_this_run"] == 4
    assert [m["step"] for m in fresh.metrics] == [1, 2, 3, 4]


def test_a_checkpoint_from_before_the_state_file_rename_still_resumes(run_trainer):
    # Our state file is not `trainer_state.json` (the Hugging Face Trainer's, another schema), but the
    # checkpoints older versions wrote under that name still resume.
    first = run_trainer(*TINY, "train.max_steps=2", launcher="none")
    assert first.returncode == 0, first.stderr[-3000:]
    step2 = first.output_dir / "checkpoints" / "step-2"
    assert not (step2 / "trainer_state.json").exists()
    (step2 / "clustertrain_state.json").rename(step2 / "trainer_state.json")  # as an old version left it

    resumed = run_trainer(*TINY, "train.max_steps=4", launcher="none")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from"].endswith("step-2")
    assert resumed.summary["steps_this_run"] == 2
    step4 = first.output_dir / "checkpoints" / "step-4"
    assert (step4 / "clustertrain_state.json").is_file() and not (step4 / "trainer_state.json").exists()
