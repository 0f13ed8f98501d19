"""Trainer fixtures; the helpers live in trainer_harness.py. Other areas keep their own fixtures."""

from __future__ import annotations

import pytest
from trainer_harness import Run, finish, start_run


@pytest.fixture
def run_trainer(tmp_path):
    """run_trainer(*overrides, launcher="torchrun"|"accelerate"|"none", nproc=2, env=None, name="out")
    runs one training job to completion in tmp_path and returns a Run."""

    def run(*overrides: str, launcher: str = "torchrun", nproc: int = 2, env=None, name: str = "out") -> Run:
        output_dir = tmp_path / name
        return finish(
            start_run(output_dir, list(overrides), launcher=launcher, nproc=nproc, env=env), output_dir
        )

    return run
