"""`trainer launch` on the Molecule test bed: three containers, one process each, gloo over the podman
network, the bind-mounted shared dir standing in for the NFS share (its host path is the same, so the
tests read the run's files directly). The bed is shared with other tests and never changed here
beyond the runs this file starts (their run dirs are removed afterwards).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from helpers.bed_launch import BED_UP, ENV, HOSTS, launch, run_launch, worker_trainer_pids

pytestmark = [pytest.mark.slow, BED_UP]


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
