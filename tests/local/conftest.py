"""tests/local: multi-process runs on this machine (loopback "hosts", a local sshd, torch.distributed
and DeepSpeed jobs, Slurm, an S3 server, Chromium). Every test here is marked `slow` (seconds to
minutes each), except in a module that sets `ALL_SLOW = False` and marks its slow tests one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.loopback_launch import loopback_cluster  # noqa: F401 - the fixture, for every test here
from helpers.simulated_nodes import sim_workdir  # noqa: F401 - the fixture, for the scale tests

HERE = Path(__file__).resolve().parent


# First, so that `-m` (pytest's own hook) selects by the marker added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The hook sees the whole session's items, not only this folder's.
    for item in items:
        if HERE in item.path.parents and getattr(item.module, "ALL_SLOW", True):
            item.add_marker(pytest.mark.slow)
