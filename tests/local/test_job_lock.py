"""One trainer job per output dir, and only the trainer's own leftovers removed (issue 26, item 7).

Before: every `trainer train` start deleted any `*.tmp` in output_dir and checkpoints/ (a user's
`notes.tmp` vanished), and a second run on the same output dir deleted the first one's checkpoint
write in flight. Real `trainer train` runs on the CPU (tests/helpers/trainer_harness.py); the lock between
hosts through the CLI the batch scripts use (`python -m trainer.joblock`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from helpers.trainer_harness import (
    TIMEOUT_S,
    TRAINER,
    finish,
    kill_job,
    sets,
    signal_job,
    start_run,
    trainer_env,
    wait_for,
)

from trainer import exitcodes
from trainer.joblock import LOCK_FILE, STALE_AFTER_S

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

TINY = ["train.log_every=1", "checkpoint.save_steps=2", "train.max_steps=4"]
#: Rank 0 pauses inside the step-2 checkpoint write (the documented hook, trainer/node/checkpoint/writer.py).
PAUSE_IN_STEP_2 = {
    "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S": "3",
    "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP": "2",
}


def removal_lines(stdout: str, path) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("removing ") and f" {path} " in line]


@pytest.mark.slow
def test_a_users_tmp_files_survive_a_start_and_only_the_trainers_leftovers_go_each_logged(tmp_path):
    out = tmp_path / "out"
    checkpoints = out / "checkpoints"
    # What a killed run of the trainer leaves: a checkpoint write, latest's and run.json's atomic
    # writes, the shared-dir check's marker.
    partial = checkpoints / ".tmp-step-3"
    partial.mkdir(parents=True)
    (partial / "ddp_state.pt").write_bytes(b"\0" * 4096)
    ours = [
        partial,
        checkpoints / "latest.tmp",
        out / "run.json.tmp",
        out / f".shared-check-{uuid.uuid4().hex}",
    ]
    for path in ours[1:]:
        path.write_text("{")
    # The user's own files, named like temporary ones.
    users = {
        out / "notes.tmp": "my notes\n",
        out / "data.tmp" / "part-0": "rows\n",
        checkpoints / "notes.tmp": "also mine\n",
        checkpoints / ".tmp-mine" / "keep": "mine too\n",
    }
    for path, text in users.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    run = finish(start_run(out, TINY, launcher="none", nproc=1), out)

    assert run.returncode == 0, run.stderr[-3000:]
    assert {path: path.read_text() for path in users} == users, "a user's file was deleted"
    for path in ours:
        assert not path.exists(), path
        assert len(removal_lines(run.stdout, path)) == 1, f"the removal of {path} is not logged once"
    assert "removing incomplete checkpoint" in run.stdout and "(a run stopped while writing it)" in run.stdout
    assert not (out / LOCK_FILE).exists(), "the job lock outlived the job"


@pytest.mark.slow
def test_a_second_run_on_a_busy_output_dir_is_refused_and_the_first_finishes_unharmed(tmp_path):
    out = tmp_path / "out"
    first = start_run(out, TINY, launcher="torchrun", nproc=2, env=PAUSE_IN_STEP_2)
    partial = out / "checkpoints" / ".tmp-step-2"
    try:
        wait_for(
            lambda: (partial / "rng-rank0.pt").is_file() and (partial / "rng-rank1.pt").is_file(),
            timeout_s=300,
            what="the first run's step-2 write",
        )
        # Held in flight for as long as the second start takes: stopped, not killed (its processes,
        # the lock's holder among them, still exist; the pause hook alone could end too soon on a
        # loaded machine).
        signal_job(first, signal.SIGSTOP)
        lock = out / LOCK_FILE
        holder = json.loads(lock.read_text()) if lock.exists() else {}
        second = subprocess.run(
            [TRAINER, "train", *sets(f"output_dir={out}", *TINY)],
            capture_output=True,
            text=True,
            env=trainer_env(),
            timeout=TIMEOUT_S,
        )
        kept_in_flight = (partial / "rng-rank0.pt").is_file() and (partial / "rng-rank1.pt").is_file()
    finally:
        signal_job(first, signal.SIGCONT)

    assert kept_in_flight, "the second start deleted the first one's checkpoint write in flight"
    assert second.returncode == exitcodes.CONFIG_ERROR, second.stderr[-3000:]
    (refusal,) = [line for line in second.stderr.splitlines() if "is in use by" in line]
    assert f"pid {holder['pid']} on {socket.gethostname()}" in refusal and "another output_dir" in refusal
    assert "Traceback" not in second.stderr
    assert not any(line.startswith("removing ") for line in second.stdout.splitlines())

    done = finish(first, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.summary["final_step"] == 4 and len(set(done.summary["param_checksums"])) == 1
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-4"
    assert (out / "checkpoints" / "step-2" / "clustertrain_state.json").is_file()


@pytest.mark.slow
def test_the_lock_of_a_killed_run_is_taken_over_once_and_the_run_resumes(tmp_path):
    out = tmp_path / "out"
    killed = start_run(out, TINY, launcher="none", nproc=1, env=PAUSE_IN_STEP_2)
    try:
        wait_for(lambda: (out / "checkpoints" / ".tmp-step-2").is_dir(), 300, "the step-2 write")
    finally:
        kill_job(killed)
    stale = json.loads((out / LOCK_FILE).read_text())

    again = finish(start_run(out, TINY, launcher="none", nproc=1), out)

    assert again.returncode == 0, again.stderr[-3000:]
    (took,) = [line for line in again.stdout.splitlines() if line.startswith("took over ")]
    assert took.startswith(f"took over {out / LOCK_FILE} from trainer train, pid {stale['pid']} ")
    assert took.endswith(f"which no longer runs (pid {stale['pid']} is gone)")
    assert "removing incomplete checkpoint" in again.stdout
    assert again.summary["final_step"] == 4
    assert not (out / LOCK_FILE).exists()


def take(directory, *args: str) -> subprocess.CompletedProcess:
    """What a batch script runs to take the lock (scheduler._take_job_lock), holder this test."""
    return subprocess.run(
        [
            sys.executable,
            "-I",
            "-m",
            "trainer.joblock",
            "take",
            str(directory),
            "--pid",
            str(os.getpid()),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def plant(directory, *, host: str, age_s: float) -> dict:
    """A lock another job holds on `host` (which this machine cannot ask), last refreshed age_s ago."""
    directory.mkdir(parents=True, exist_ok=True)
    holder = {"token": "t" * 32, "job": "4242", "command": "the batch job of run r", "host": host,
              "pid": 1234, "pid_start": "99", "user": "alice", "taken_at": time.time() - age_s}  # fmt: skip
    (directory / LOCK_FILE).write_text(json.dumps(holder))
    os.utime(directory / LOCK_FILE, (time.time() - age_s,) * 2)
    return holder


def test_a_live_job_on_another_host_keeps_its_lock_and_a_silent_one_loses_it(tmp_path):
    live, silent = tmp_path / "live", tmp_path / "silent"
    plant(live, host="gpu-node-7", age_s=5)
    plant(silent, host="gpu-node-8", age_s=STALE_AFTER_S + 60)

    refused = take(live, "--job", "99")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "is in use by the batch job of run r (job 4242), pid 1234 on gpu-node-7" in refused.stderr
    assert f"once it is {STALE_AFTER_S} s without a heartbeat" in refused.stderr
    assert json.loads((live / LOCK_FILE).read_text())["host"] == "gpu-node-7", "the live lock changed"

    taken = take(silent, "--job", "99")
    assert taken.returncode == 0, taken.stderr
    assert taken.stderr.count("took over") == 1 and "gpu-node-8" in taken.stderr
    assert "stopped refreshing it" in taken.stderr
    mine = json.loads((silent / LOCK_FILE).read_text())
    assert mine["token"] == taken.stdout.strip() and mine["pid"] == os.getpid() and mine["job"] == "99"
    # Released with its token by the end of the batch script: the next job takes it at once.
    release = [
        sys.executable,
        "-I",
        "-m",
        "trainer.joblock",
        "release",
        str(silent),
        "--token",
        mine["token"],
    ]
    assert subprocess.run(release, timeout=60).returncode == 0
    assert not (silent / LOCK_FILE).exists()
