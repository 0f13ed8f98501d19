"""`job.lock` between machines that share a host name, and a holder whose lock was taken from it.

Cloned images and containers share host names: a live job on the other machine holds the lock (its pid
means nothing here, its heartbeat is fresh), and a job here with the same host name must not take it
over as "gone". And when the lock changes hands under a live holder anyway (the three-way takeover
race, or an operator deleting a lock by hand), the holder's next heartbeat finds another token there
and stops its job, so two jobs never write one output dir."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from trainer.joblock import LOCK_FILE

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

#: A holder that takes the lock and beats every 0.2 s (the trainer's heartbeat thread), then waits.
HOLDER = """
import sys, time
import trainer.joblock as joblock
joblock.HEARTBEAT_S = 0.2
lock = joblock.JobLock(sys.argv[1])
lock.acquire()
lock.start_heartbeat()
print(lock.token, flush=True)
time.sleep(60)
"""


def take(directory) -> subprocess.CompletedProcess:
    """What a batch script runs to take the lock (`python -m trainer.joblock take`)."""
    command = [sys.executable, "-I", "-m", "trainer.joblock", "take", str(directory), "--command", "job B"]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_a_live_job_on_another_machine_with_this_host_name_keeps_its_lock(tmp_path):
    holder = {
        "token": "t" * 32,
        "command": "job A",
        "host": socket.gethostname(),  # the clone's host name: this one
        "machine": "0f3c-another-boot/pid:[4026531836]",
        "pid": 2**22 + 11,  # no such process here; it runs there
        "pid_start": "99",
        "user": "alice",
        "taken_at": time.time() - 5,
    }
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    refused = take(tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "is in use by job A" in refused.stderr, refused.stderr
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "t" * 32, "the live lock was taken over"


def test_a_holder_whose_lock_changed_hands_stops_its_job(tmp_path):
    job = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        token = job.stdout.readline().strip()
        assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == token
        # Another taker's lock linked into place while this one was aside (the race's outcome).
        other = {
            "token": "o" * 32,
            "command": "job B",
            "host": "gpu-node-9",
            "pid": 1,
            "taken_at": time.time(),
        }
        (tmp_path / "other").write_text(json.dumps(other))
        os.replace(tmp_path / "other", tmp_path / LOCK_FILE)
        code = job.wait(timeout=20)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    stderr = job.stderr.read()
    assert code != 0, stderr
    assert "was taken over by job B" in stderr and "stopping this job" in stderr, stderr
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "o" * 32, (
        "the new holder's lock was touched"
    )
