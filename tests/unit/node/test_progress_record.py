"""What each rank's progress record tells the launcher's watchdog (trainer.node.progress): the step it is
in, its slowest step after the first, and an announced pause (an evaluation, a checkpoint save) the
moment it begins, so a long save is given its own bound and never taken for a hang."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from trainer.node.progress import Progress


def read(directory, rank=0):
    return json.loads((directory / f"rank-{rank}.json").read_text())


def test_a_pause_is_in_the_record_the_moment_it_is_announced_and_gone_after(tmp_path):
    progress = Progress(tmp_path, rank=0)
    try:
        progress.started(1)
        progress.step_done(SimpleNamespace(step=1))
        with progress.announced("checkpoint"):
            during = read(tmp_path)  # written at once, not at the writer's next pass
        assert during["phase"] == "checkpoint" and during["done"] == 1
        assert time.time() - during["phase_since"] < 60
    finally:
        progress.close()
    after = read(tmp_path)
    assert after["phase"] == "train" and after["phase_since"] >= during["phase_since"]


def test_the_slowest_step_leaves_out_the_first(tmp_path):
    progress = Progress(tmp_path, rank=3)
    try:
        for step, seconds in ((1, 0.6), (2, 0.05), (3, 0.25), (4, 0.05)):
            progress.started(step)
            time.sleep(seconds)
            progress.step_done(SimpleNamespace(step=step))
    finally:
        progress.close()
    record = read(tmp_path, rank=3)
    assert record["done"] == 4
    # Step 1 (0.6 s, the warm-up) does not count; step 3 (0.25 s) is the slowest of the others.
    assert 0.25 <= record["slowest_step_s"] < 0.6, record


def test_a_step_that_lasts_says_whether_its_thread_computes_or_sleeps(tmp_path, monkeypatch):
    from trainer.node import progress as progress_module

    monkeypatch.setattr(progress_module, "BUSY_SAMPLE_S", 0.4)
    monkeypatch.setattr(progress_module, "WRITE_INTERVAL_S", 0.05)
    progress = Progress(tmp_path, rank=1, device="cpu")
    try:
        progress.started(1)
        assert read(tmp_path, rank=1)["busy_share"] is None  # a step just begun: no sample yet
        end = time.monotonic() + 2.0
        while time.monotonic() < end:  # the training thread computes a step that lasts
            sum(i * i for i in range(10_000))
        computing = read(tmp_path, rank=1)
        time.sleep(2.0)  # it sleeps, as a rank outside its collective or waiting in gloo's does
        sleeping = read(tmp_path, rank=1)
        progress.step_done(SimpleNamespace(step=1))
        progress.started(2)
        time.sleep(0.2)
        next_step = read(tmp_path, rank=1)
    finally:
        progress.close()
    assert computing["busy_share"] >= 0.2 and computing["device"] == "cpu", computing
    assert sleeping["busy_share"] < 0.05 and sleeping["time"] > computing["time"], sleeping
    assert next_step["started"] == 2 and next_step["busy_share"] is None, next_step
