"""SIGUSR2 to a rank saves a checkpoint at the end of the step it is in, then stops the run with
STOPPED_AT_CHECKPOINT (trainer.node.save_request): a real one-process `trainer train` on the CPU, with
no periodic checkpoint, so the only checkpoint is the one the signal asked for."""

from __future__ import annotations

import json
import signal
import time

import pytest
from helpers.trainer_harness import finish, kill_job, start_run, wait_for

from trainer import exitcodes
from trainer.node.checkpoint import STATE_FILE

#: A run far longer than the test waits: it is mid-run when the signal comes. No periodic checkpoint.
ENDLESS = [
    "train.max_steps=100000",
    "train.log_every=1",
    "train.micro_batch_size=2",
    "model.n_layer=1",
    "checkpoint.save_steps=0",
]


@pytest.mark.slow
def test_sigusr2_saves_the_step_it_is_in_then_stops_with_its_own_exit_code(tmp_path):
    output_dir = tmp_path / "out"
    process = start_run(output_dir, ENDLESS, launcher="none")
    metrics = output_dir / "metrics.jsonl"
    try:
        # Mid-run: a few steps logged (the loop runs; its handler is installed before the loop).
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 120, "step 3")
        signalled = time.monotonic()
        process.send_signal(signal.SIGUSR2)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            kill_job(process)
    print(f"save request: signal to exit {time.monotonic() - signalled:.2f} s")
    run = finish(process, output_dir)
    assert run.returncode == exitcodes.STOPPED_AT_CHECKPOINT, run.stderr[-3000:]
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "after its checkpoint" in line]
    assert len(lines) == 1, run.stdout[-3000:] + run.stderr[-3000:]
    step = int(lines[0].split("stopping at step ", 1)[1].split()[0])
    assert 3 <= step < 100000
    checkpoints = sorted(p.name for p in (output_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert checkpoints == [f"step-{step}"], checkpoints
    assert (output_dir / "checkpoints" / "latest").read_text().strip().endswith(f"step-{step}")
    state = json.loads((output_dir / "checkpoints" / f"step-{step}" / STATE_FILE).read_text())
    assert state["step"] == step
    # Every step trained is logged: the last logged step is the one saved.
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-1] == step
    assert not (output_dir / "summary.json").exists(), "a stopped run has no summary: it is not over"
