"""`trainer launch` on the Molecule test bed: the bed's inventory and settings, the launch command line
and a launch run to its end. A helper module, not a test module: the bed's launch tests import it
instead of each other (tests/helpers/simulated_nodes.py builds the same launch for simulated nodes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.testbed_nodes import cluster_settings

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "molecule" / "default" / "inventory"
STATUS = Path("/tmp/clustertrain-testbed.status")
ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "scripts" / "testbed" / "containers.conf")}
HOSTS = ("ct-head", "ct-worker1", "ct-worker2")

#: Skips a test-bed test unless the bed is up (scripts/testbed/run-scenario.sh writes the status).
BED_UP = pytest.mark.skipif(
    not (STATUS.exists() and STATUS.read_text().startswith("up")),
    reason="the Molecule test bed is not up (/tmp/clustertrain-testbed.status)",
)


def group_vars() -> dict:
    return cluster_settings(INVENTORY)


#: A blocked or lost peer fails the job in 2 minutes instead of the inventory's 30.
TEST_SETS = (
    "train.warmup_steps=1",
    "train.log_every=2",
    "checkpoint.save_steps=4",
    "distributed.timeout_s=120",
)


def launch(inventory: Path, run_name: str, *sets: str) -> list[str]:
    args = [a for s in (*TEST_SETS, *sets) for a in ("--set", s)]
    return [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--run-name", run_name, *args]


def run_launch(command: list[str], timeout: float) -> tuple[int, str]:
    """Run a launch to its end; past `timeout` it gets TERM, so it stops the bed's trainers itself."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=120)
        pytest.fail(f"trainer launch did not finish within {timeout:.0f} s:\n{out}")
    return proc.returncode, out
