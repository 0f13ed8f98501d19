"""`trainer launch` on the loopback cluster (loopback.py): the command line, the cluster as a fixture,
and a node's processes found as a stop finds them. A helper module, not a test module: the local
launch tests import it instead of each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import loopback
from helpers.loopback import VENV


@pytest.fixture
def loopback_cluster(tmp_path) -> tuple[Path, Path]:
    """(inventory, shared dir) for two local hosts, node0 (head) and node1 (worker)."""
    return loopback.write_inventory(tmp_path)


def launch_command(inventory: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--poll-interval", "1", *extra]


def run_env(tmp_path: Path) -> dict[str, str]:
    """The launcher's environment: its own TMPDIR, so its private dirs can be looked at."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(tmp))


TINY = ["--set", "train.warmup_steps=1", "--set", "train.log_every=2", "--set", "checkpoint.save_steps=3"]


def trainer_pids(node_dir: Path) -> list[int]:
    """The node's `trainer train` worker processes (found by the launch's tag, as a stop finds them)."""
    listed = subprocess.run(
        [str(VENV / "bin" / "python"), str(node_dir / "node_ctl.py"), str(node_dir), "pids"],
        capture_output=True,
        text=True,
        check=True,
    )
    processes = json.loads(listed.stdout)["processes"]
    # Both loopback "hosts" are this machine and share the launch's tag, so keep only this node's
    # processes (run.sh exports NODE_RANK): killing the other node's trainer too makes the first
    # failure a race.
    node_rank = f"NODE_RANK={node_dir.name.removeprefix('node-')}".encode()
    return [
        p["pid"]
        for p in processes
        if len(p["command"]) > 1
        and p["command"][1].endswith("bin/trainer")
        and node_rank in environ(p["pid"])
    ]


def launch_processes(node_dir: Path) -> list[int]:
    """The live processes of the node's launch (found by the launch's tag, as a stop finds them).
    Both loopback "hosts" are this machine and share the tag: NODE_RANK tells them apart."""
    listed = subprocess.run(
        [str(VENV / "bin" / "python"), str(node_dir / "node_ctl.py"), str(node_dir), "pids"],
        capture_output=True,
        text=True,
        check=True,
    )
    node_rank = f"NODE_RANK={node_dir.name.removeprefix('node-')}".encode()
    return [p["pid"] for p in json.loads(listed.stdout)["processes"] if node_rank in environ(p["pid"])]


def environ(pid: int) -> list[bytes]:
    """The process's environment as `VAR=value` bytes; [] once it is gone."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []
