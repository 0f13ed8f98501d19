"""A launch as `trainer launch` leaves it on one node, made by hand: the node dir's files (launch-id,
pid, launch.json, log) and a running process tagged with the launch's id, on a one-node loopback
cluster (ansible_connection local). For the verbs that read or stop a launch (`trainer status`,
`trainer stop`) without the minutes a real training start costs here; they run for real."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from helpers import loopback

#: What node_ctl.py finds a launch's processes by (TAG_VARIABLE there).
TAG_VARIABLE = "CLUSTERTRAIN_LAUNCH_ID"


def one_node_cluster(tmp_path: Path) -> tuple[Path, Path]:
    """(inventory, shared dir) of this machine as a one-node cluster, the training user this account."""
    return loopback.write_inventory(tmp_path, nodes=1)


def fake_launch(shared: Path, run_name: str, log_text: str) -> SimpleNamespace:
    """Run `run_name` as launched on node0: its node dir and its "trainer" (a sleep in a session of its
    own, tagged like a launch's processes). Kill `.process` when done."""
    launch_id = f"{run_name}-fake"
    node_dir = shared / "runs" / run_name / "launch" / "node-0"
    node_dir.mkdir(parents=True)
    process = subprocess.Popen(
        ["sleep", "600"], env={**os.environ, TAG_VARIABLE: launch_id}, start_new_session=True
    )
    (node_dir / "launch-id").write_text(launch_id + "\n")
    (node_dir / "pid").write_text(f"{process.pid}\n")
    (node_dir / "log").write_text(log_text)
    info = {
        "launch_id": launch_id,
        "attempt": 1,
        "nodes": {"node0": 0},
        "launched_at": time.time(),
        "controller": socket.gethostname(),
        "launcher_pid": 1,
        "bundled_trainer": False,
    }
    (node_dir / "launch.json").write_text(json.dumps(info))
    return SimpleNamespace(node_dir=node_dir, process=process, launch_id=launch_id)


def trainer(verb: str, inventory: Path, *extra: str) -> subprocess.CompletedProcess:
    """`trainer VERB -i INVENTORY ...`, as a user types it."""
    return subprocess.run(
        [sys.executable, "-m", "trainer", verb, "-i", str(inventory), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
