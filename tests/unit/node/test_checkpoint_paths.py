"""The trainer writes its checkpoints where the launcher and `trainer export` look for them
(trainer.run_paths.RunPaths)."""

from __future__ import annotations

from pathlib import Path

from trainer.node.checkpoint import LATEST, checkpoints_dir
from trainer.run_paths import RunPaths


def test_the_trainer_writes_its_checkpoints_where_the_launcher_reads_the_latest():
    paths = RunPaths(Path("/srv/shared/runs/first"))
    assert checkpoints_dir(paths.run_dir) / LATEST == paths.latest
    assert checkpoints_dir(str(paths.run_dir)) == paths.checkpoints
