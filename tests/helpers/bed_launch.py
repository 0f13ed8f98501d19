"""`trainer launch` on the Molecule test bed: the bed's inventory and settings, a per-test copy of the
inventory as a fixture, the launch command line, and the trainer processes on a node. A helper module,
not a test module: the bed's launch tests import it instead of each other."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "molecule" / "default" / "inventory"
STATUS = Path("/tmp/clustertrain-testbed.status")
ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "scripts" / "testbed" / "containers.conf")}
HOSTS = ("ct-head", "ct-worker1", "ct-worker2")
#: A master port of its own, inside the firewall's comm range, so preflight's tests never collide.
MASTER_PORT = 29541

#: Skips a test-bed test unless the bed is up (scripts/testbed/run-scenario.sh writes the status).
BED_UP = pytest.mark.skipif(
    not (STATUS.exists() and STATUS.read_text().startswith("up")),
    reason="the Molecule test bed is not up (/tmp/clustertrain-testbed.status)",
)


def group_vars() -> dict:
    merged: dict = {}
    for path in sorted((INVENTORY / "group_vars" / "cluster").glob("*.yml")):
        merged.update(yaml.safe_load(path.read_text()) or {})
    return merged


@pytest.fixture
def testbed(tmp_path):
    """(inventory with 1 process per node, the run's name, its output dir on this machine)."""
    inventory = tmp_path / "inventory"
    shutil.copytree(INVENTORY, inventory)
    overrides = {"training_procs_per_node": 1, "cluster_master_port": MASTER_PORT, "training_engine": "ddp"}
    (inventory / "group_vars" / "cluster" / "zz_launch_test.yml").write_text(yaml.safe_dump(overrides))
    run_name = f"test-{uuid.uuid4().hex[:8]}"
    output = Path(group_vars()["cluster_shared_dir"]) / "runs" / run_name
    yield inventory, run_name, output
    shutil.rmtree(output, ignore_errors=True)


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


def worker_trainer_pids(host: str, node_dir: str) -> list[int]:
    settings = group_vars()
    venv, user = settings["training_venv"], settings["cluster_training_user"]
    # As the training user: root in a container has no CAP_SYS_PTRACE, so it cannot read the
    # environment (the launch tag) of another user's processes and would find none.
    listed = subprocess.run(
        ["podman", "exec", "--user", user, host,
         f"{venv}/bin/python", f"{node_dir}/node_ctl.py", node_dir, "pids"],
        capture_output=True, text=True, env=ENV, check=True, timeout=60,
    )  # fmt: skip
    processes = json.loads(listed.stdout)["processes"]
    return [p["pid"] for p in processes if len(p["command"]) > 1 and p["command"][1].endswith("bin/trainer")]
