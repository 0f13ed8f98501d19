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
