"""The worker's join watcher (`node_ctl.py NODE_DIR watch-join`, started by run.sh beside a user's
command), run as run.sh runs it: it writes `joined` as soon as a process of the launch holds a
connection to the head, and gives up a minute after the launcher's world timeout when none ever does
(a script that never connects is not scanned for its whole run)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

NODE_CTL = (
    Path(__file__).resolve().parents[3]
    / "trainer"
    / "controller"
    / "launcher"
    / "playbooks"
    / "files"
    / "node_ctl.py"
)
LAUNCH_ID = "run-1234"


def node_dir(tmp_path: Path, head: str, world_timeout_s: float, runner_pid: int) -> Path:
    directory = tmp_path / "launch" / "node-1"
    directory.mkdir(parents=True)
    (directory / "launch-id").write_text(LAUNCH_ID + "\n")
    (directory / "pid").write_text(f"{runner_pid}\n")
    info = {"world_check": {"head_address": head}, "world_timeout_s": world_timeout_s}
    (directory / "launch.json").write_text(json.dumps(info))
    return directory


def watch(directory: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-I", "-S", str(NODE_CTL), str(directory), "watch-join"])


def test_a_connection_to_the_head_is_marked_joined_at_once(tmp_path):
    head = socket.create_server(("127.0.0.1", 0))
    head.settimeout(30)
    port = head.getsockname()[1]
    runner = subprocess.Popen(["sleep", "60"])
    # A process of the launch (its tag in the environment) that connects to the head and stays.
    client = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import socket, time; s = socket.create_connection(('127.0.0.1', {port})); time.sleep(60)",
        ],
        env={**os.environ, "CLUSTERTRAIN_LAUNCH_ID": LAUNCH_ID},
    )
    try:
        # Kept open to the end: a closed server side leaves no established connection.
        connection, _ = head.accept()
        directory = node_dir(tmp_path, "127.0.0.1", 120, runner.pid)
        watcher = watch(directory)
        assert watcher.wait(timeout=30) == 0
        assert (directory / "joined").read_text().strip() == LAUNCH_ID
        connection.close()
    finally:
        client.kill()
        runner.kill()
        head.close()


def test_no_connection_ever_gives_up_after_the_world_timeout(tmp_path):
    runner = subprocess.Popen(["sleep", "60"])
    try:
        # A world timeout of -58 s: the watcher's deadline (timeout + 60 s) is 2 s away.
        directory = node_dir(tmp_path, "192.0.2.1", -58, runner.pid)
        started = time.monotonic()
        watcher = watch(directory)
        assert watcher.wait(timeout=30) == 0
        assert 1.5 < time.monotonic() - started < 20, "it watched until its deadline, then stopped"
        assert runner.poll() is None, "the command still runs: only the watcher gave up"
        assert not (directory / "joined").exists()
    finally:
        runner.kill()
