"""Whatever a job writes in its records, `trainer launch` stops every node before it lets go of the run.

On two loopback hosts a user's command writes, on node1, the exit record a rank writes
(`$CLUSTERTRAIN_PROGRESS_DIR/exit-1.json`) with `"time": "soon"`, and exits 3; node0's keeps running.
That record raised ValueError in the diagnosis before the stop: no report, node0 left running, the
run's lock released. Now the record is noted and ignored, the node's own exit is the cause, and node0
is stopped."""

from __future__ import annotations

import os
import signal
import subprocess

from helpers.loopback import write_inventory
from helpers.loopback_launch import launch_command

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

COMMAND = """
if [ "$NODE_RANK" = 1 ]; then
    sleep 2
    mkdir -p "$CLUSTERTRAIN_PROGRESS_DIR"
    echo '{"rank": 1, "time": "soon", "code": 3}' > "$CLUSTERTRAIN_PROGRESS_DIR/exit-1.json"
    exit 3
fi
echo $$ > "$SLEEPER"
exec sleep 300
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[-1][0] not in "ZX"
    except OSError:
        return False


def test_a_malformed_exit_record_is_ignored_and_every_node_is_stopped(tmp_path):
    inventory, shared = write_inventory(tmp_path)
    # The command's working dir (training_workdir's default), there before the launch as a cluster's
    # shared dir is: else node1's probe raced node0's start, which creates it (CI failed it so once).
    shared.mkdir()
    sleeper = tmp_path / "sleeper.pid"
    done = subprocess.run(
        launch_command(
            inventory, "--run-name", "malformed", "--env", f"SLEEPER={sleeper}", "--", "sh", "-c", COMMAND
        ),
        capture_output=True,
        text=True,
        timeout=240,
    )
    pid = int(sleeper.read_text()) if sleeper.exists() else None
    try:
        output = done.stdout + done.stderr
        assert pid is not None, output
        assert not alive(pid), "node0's command was left running\n" + output
        assert done.returncode == 3, output
        assert "ignored a malformed exit record of node1" in output, output
        assert "node1 (node 1) exited with code 3" in output, output
    finally:
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)
