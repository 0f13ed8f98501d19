"""What a stopped preflight's clean-up ends on a node (playbooks/files/cleanup.py, run as Ansible runs it).

The run's token is on Ansible's command lines (its `environment` becomes a `VAR=value` prefix of the
shell line), so any account on a node can read it in `ps` and tag a process of its own with it. The
clean-up runs once per account preflight used and ends only that account's tagged processes: a
process another account tagged is never signalled, and an untagged one of the same account lives on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLEANUP = (
    Path(__file__)
    .resolve()
    .parents[3]
    .joinpath(
        Path(__file__).resolve().parents[3]
        / "trainer"
        / "controller"
        / "preflight"
        / "playbooks"
        / "files"
        / "cleanup.py"
    )
)
MARKER, TOKEN = "CLUSTERTRAIN_PREFLIGHT", "5eb1f00dcafe1234"


def sleeper(tagged: bool, user: str | None = None) -> subprocess.Popen:
    env = {"PATH": os.environ["PATH"], **({MARKER: TOKEN} if tagged else {})}
    as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user else []
    return subprocess.Popen([*as_user, "sleep", "300"], env=env)


def cleanup() -> dict:
    done = subprocess.run(
        [sys.executable, str(CLEANUP), "--marker", MARKER, "--token", TOKEN],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


@pytest.mark.skipif(os.geteuid() != 0, reason="starts a process as another account (uid 65534)")
def test_only_this_accounts_tagged_processes_are_ended():
    ours, untagged, theirs = sleeper(True), sleeper(False), sleeper(True, user="65534")
    try:
        time.sleep(0.3)  # the environments are in /proc once the processes run
        result = cleanup()
        assert result["killed"] == [ours.pid]
        assert ours.wait(timeout=10) != 0, "preflight's own tagged process is ended"
        assert untagged.poll() is None, "an untagged process of the same account lives on"
        assert theirs.poll() is None, "a process another account tagged is never signalled"
    finally:
        for process in (ours, untagged, theirs):
            process.kill()
            process.wait()
