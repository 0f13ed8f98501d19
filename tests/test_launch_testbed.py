"""`trainer launch` on the Molecule test bed: three containers, one process each, gloo over the podman
network, the bind-mounted shared dir standing in for the NFS share (its host path is the same, so the
tests read the run's files directly). The bed is shared with other tests and never changed here
beyond the runs this file starts (their run dirs are removed afterwards).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
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

pytestmark = [pytest.mark.testbed, pytest.mark.slow, BED_UP]


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


def test_three_node_launch_trains_with_agreeing_ranks(testbed):
    inventory, run_name, output = testbed
    rc, out = run_launch(launch(inventory, run_name, "train.max_steps=8"), timeout=900)
    assert rc == 0, out
    assert "step 8/8" in out and all(f"[{h}]" in out for h in HOSTS), out
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 8 and metrics[-1]["world_size"] == 3
    assert (output / "checkpoints" / "latest").read_text().strip() == "step-8"
    summary = json.loads((output / "summary.json").read_text())
    assert summary["world_size"] == 3
    assert len(summary["param_checksums"]) == 3 and len(set(map(str, summary["param_checksums"]))) == 1
    run_sh = (output / "launch" / "node-2" / "run.sh").read_text()
    assert "export NODE_RANK=2" in run_sh and "export MASTER_ADDR=10.89.42.10" in run_sh
    assert "export NCCL_SOCKET_IFNAME==" in run_sh, "auto resolved to the exact interface on the node"


def test_killed_worker_stops_all_hosts_then_relaunch_resumes(testbed):
    inventory, run_name, output = testbed
    launcher = subprocess.Popen(
        launch(inventory, run_name, "train.max_steps=400"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not (output / "checkpoints" / "latest").exists():
            assert launcher.poll() is None, launcher.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(1)
        node_dir = str(output / "launch" / "node-1")
        victims = worker_trainer_pids("ct-worker1", node_dir)
        assert victims, "ct-worker1's trainer is running"
        subprocess.run(
            ["podman", "exec", "ct-worker1", "kill", "-9", *map(str, victims)], env=ENV, check=True
        )
        killed_at = time.monotonic()
        out, _ = launcher.communicate(timeout=180)
        stopped_after = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.terminate()  # the launcher then stops the bed's trainers itself
            launcher.communicate(timeout=120)
    assert launcher.returncode == 137, "128 + SIGKILL: the killed rank's own code, not torchrun's 1"
    assert "failed: killed by signal 9 (SIGKILL) (rank 1 on ct-worker1 (node 1), exit code 137)" in out, out
    assert stopped_after < 60, f"{stopped_after:.0f} s from the kill to every host stopped"
    for rank, host in enumerate(HOSTS):
        left = worker_trainer_pids(host, str(output / "launch" / f"node-{rank}"))
        assert left == [], f"{host} still runs its trainer"

    latest = (output / "checkpoints" / "latest").read_text().strip()
    finish_at = int(latest.removeprefix("step-")) + 2
    rc, out = run_launch(launch(inventory, run_name, f"train.max_steps={finish_at}"), timeout=900)
    assert rc == 0, out
    summary = json.loads((output / "summary.json").read_text())
    assert summary["final_step"] == finish_at
    assert latest in str(summary["resumed_from"])
