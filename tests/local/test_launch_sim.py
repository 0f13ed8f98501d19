"""`trainer launch` on three simulated nodes (scripts/testbed/netns_nodes.py: a network namespace, an
address and a real sshd each, reached over SSH as root becoming the training user): one process per
node, gloo between the nodes' addresses, the network interface found on each node at launch
(cluster_nccl_socket_ifname: auto, as the bed's inventory has it).

These ran on the Molecule bed (54 s of CI's critical path); what they show is the launcher's and the
trainer's across nodes reached over SSH, which the simulated nodes have. The assertions are the bed's
but the host names and the head's address (n00-n02 for ct-head, ct-worker1, ct-worker2).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
import yaml
from helpers.bed_launch import run_launch
from helpers.simulated_nodes import NEEDS_NETNS, launch_command, netns_nodes, trainer_pids

pytestmark = NEEDS_NETNS


@pytest.fixture
def cluster(sim_workdir) -> Iterator:
    """Three simulated nodes, one process each, the interface found at launch; down at the end."""
    with netns_nodes.nodes(3, sim_workdir / "sim") as nodes:
        overrides = {"cluster_nccl_socket_ifname": "auto"}
        (nodes.inventory / "group_vars" / "cluster" / "zz_launch_test.yml").write_text(
            yaml.safe_dump(overrides)
        )
        yield nodes


def test_three_node_launch_trains_with_agreeing_ranks(cluster):
    output = cluster.shared / "runs" / "three"
    rc, out = run_launch(launch_command(cluster, "three", "train.max_steps=8"), timeout=900)
    assert rc == 0, out
    assert "step 8/8" in out, "rank 0's log lines are shown"
    for node, host in enumerate(cluster.hosts):
        assert f"[{host}] node {node}: done" in out, out
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 8 and metrics[-1]["world_size"] == 3
    assert (output / "checkpoints" / "latest").read_text().strip() == "step-8"
    summary = json.loads((output / "summary.json").read_text())
    assert summary["world_size"] == 3
    assert len(summary["param_checksums"]) == 3 and len(set(map(str, summary["param_checksums"]))) == 1
    run_sh = (output / "launch" / "node-2" / "run.sh").read_text()
    head_address = cluster.addresses[cluster.hosts[0]]
    assert "export NODE_RANK=2" in run_sh and f"export MASTER_ADDR={head_address}" in run_sh
    assert "export NCCL_SOCKET_IFNAME==" in run_sh, "auto resolved to the exact interface on the node"
    # The other launchers' files, one job across the nodes: DeepSpeed's hostfile (each node's address,
    # one slot each), accelerate's per-node config, DeepSpeed's batch (the micro-batch on 3 ranks).
    launch = output / "launch"
    hostfile = "".join(f"{cluster.addresses[host]} slots=1\n" for host in cluster.hosts)
    assert (launch / "hostfile").read_text() == hostfile
    assert yaml.safe_load((launch / "accelerate-node2.yaml").read_text())["machine_rank"] == 2
    micro_batch = yaml.safe_load((launch / "config.yaml").read_text())["train"]["micro_batch_size"]
    assert json.loads((launch / "deepspeed.json").read_text())["train_batch_size"] == 3 * micro_batch


def test_killed_worker_stops_all_hosts_then_relaunch_resumes(cluster):
    output = cluster.shared / "runs" / "killed"
    launcher = subprocess.Popen(
        launch_command(cluster, "killed", "train.max_steps=400"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not (output / "checkpoints" / "latest").exists():
            assert launcher.poll() is None, launcher.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(1)
        victims = trainer_pids(cluster, 1)
        assert victims, "n01's trainer is running"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        out, _ = launcher.communicate(timeout=180)
        stopped_after = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.terminate()  # the launcher then stops the nodes' trainers itself
            launcher.communicate(timeout=120)
    assert launcher.returncode == 137, "128 + SIGKILL: the killed rank's own code, not torchrun's 1"
    assert "failed: killed by signal 9 (SIGKILL) (rank 1 on n01 (node 1), exit code 137)" in out, out
    # A survivor's broken collective is what followed, not the cause.
    survivor = r"rank (0 on n00 \(node 0\)|2 on n02 \(node 2\))"
    followed = rf"then: {survivor}: its collective failed after rank 1 on n01 \(node 1\) was killed"
    assert re.search(followed, out), out
    assert stopped_after < 60, f"{stopped_after:.0f} s from the kill to every host stopped"
    for node, host in enumerate(cluster.hosts):
        assert trainer_pids(cluster, node) == [], f"{host} still runs its trainer"

    latest = (output / "checkpoints" / "latest").read_text().strip()
    finish_at = int(latest.removeprefix("step-")) + 2
    rc, out = run_launch(launch_command(cluster, "killed", f"train.max_steps={finish_at}"), timeout=900)
    assert rc == 0, out
    summary = json.loads((output / "summary.json").read_text())
    assert summary["final_step"] == finish_at
    assert latest in str(summary["resumed_from"])
