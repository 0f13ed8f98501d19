"""The run's lock (trainer.controller.launcher.runlock) on two loopback "hosts" (helpers/loopback_launch's
fixture): two launches of one run name started half a second apart (the race that had each stop the
other), and the lock a launcher killed with -9 leaves behind (refused, then taken over with --force).

The lock is the launcher's, whatever runs on the nodes: each launch runs a command that waits for a
flag file the test creates, so how long the job lasts is the test's choice, not the machine's load."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from helpers.loopback_launch import launch_command, launch_processes
from helpers.loopback_launch import loopback_cluster as _loopback_cluster  # noqa: F401 - the fixture, by its name


def launch(inventory: Path, run_name: str, flag: Path, *options: str) -> list[str]:
    """`trainer launch` of a command: every node prints `started`, waits for `flag`, prints `finished`
    and exits 0."""
    script = f"echo started; while [ ! -e {flag} ]; do sleep 0.2; done; echo finished"
    return [*launch_command(inventory, "--run-name", run_name, *options), "--", "bash", "-c", script]


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "launch" / "history.jsonl").read_text().splitlines()]


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert proc.poll() is None, f"the launcher ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)
    return value


def started(run: Path) -> bool:
    log = run / "launch" / "node-0" / "log"
    return log.exists() and "started" in log.read_text()


def test_two_launches_of_one_run_name_the_second_is_refused_and_the_first_finishes(request, tmp_path):
    inventory, shared = request.getfixturevalue("_loopback_cluster")
    shared.mkdir()  # the command's working dir (training_workdir's default)
    flag = tmp_path / "finish"
    command = launch(inventory, "twice", flag)
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.5)
    second = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launchers = [first, second]
    run = shared / "runs" / "twice"
    try:
        # Whichever took the lock first runs; the other is refused before its probe, naming it.
        ended: list[subprocess.Popen] = []
        while not ended:
            ended = [proc for proc in launchers if proc.poll() is not None]
            time.sleep(0.2)
        loser = ended[0]
        winner = launchers[1 - launchers.index(loser)]
        loser_out = loser.stdout.read()
        assert loser.returncode == 2, loser_out
        assert (
            f"run twice is locked by trainer launch pid {winner.pid} on {socket.gethostname()}" in loser_out
        ), loser_out
        assert "(on this controller)" in loser_out and "pick another --run-name" in loser_out, loser_out
        assert f"lock: {run}/launch/lock" in loser_out, loser_out
        wait_for(lambda: started(run), "the first launch's command", winner)
        # --force does not take the lock of a launcher that still runs.
        forced = subprocess.run(launch(inventory, "twice", flag, "--force"), capture_output=True, text=True)
        assert forced.returncode == 2, forced.stdout + forced.stderr
        assert "--force takes over only a dead launcher's lock" in forced.stdout, forced.stdout
        assert f"kill {winner.pid}" in forced.stdout, forced.stdout
        assert winner.poll() is None, "the refused launches did not stop the first"
        flag.touch()
        out, _ = winner.communicate(timeout=300)
    finally:
        flag.touch()
        for proc in launchers:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=120)
    assert winner.returncode == 0, out
    assert "done: run twice finished on all 2 node(s)" in out, out
    assert [r["event"] for r in history(run)] == ["launch"], "the refused launches changed nothing"
    assert not (run / "launch" / "lock").exists(), "the lock was released at the end"


def test_a_killed_launchers_lock_is_refused_without_force_and_taken_over_with_it(request, tmp_path):
    inventory, shared = request.getfixturevalue("_loopback_cluster")
    shared.mkdir()
    flag = tmp_path / "finish"
    command = launch(inventory, "stale", flag)
    run = shared / "runs" / "stale"
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: started(run), "the command's start", launcher)
    finally:
        os.kill(launcher.pid, signal.SIGKILL)  # nothing of the launcher runs any more; its lock stays
        launcher.wait()
    lock = json.loads((run / "launch" / "lock").read_text())
    assert lock["pid"] == launcher.pid and lock["controller"] == socket.gethostname(), lock
    stop = subprocess.run(
        launch_command(inventory, "--run-name", "stale", "--stop"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert launch_processes(run / "launch" / "node-0") == []
    assert (run / "launch" / "lock").exists(), "--stop leaves the lock alone"

    refused = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"locked by trainer launch pid {launcher.pid}" in refused.stdout, refused.stdout
    assert "which no longer runs (killed?)" in refused.stdout and "--force" in refused.stdout, refused.stdout

    flag.touch()
    forced = subprocess.run(launch(inventory, "stale", flag, "--force"), capture_output=True, text=True)
    out = forced.stdout + forced.stderr
    assert forced.returncode == 0, out
    assert f"--force: took over the lock of run stale from trainer launch pid {launcher.pid}" in out, out
    assert "done: run stale finished on all 2 node(s)" in out, out
    assert not (run / "launch" / "lock").exists(), "the new launcher released the lock at the end"
    taken = [r for r in history(run) if r["event"] == "lock_taken_over"]
    assert len(taken) == 1 and taken[0]["from"]["pid"] == launcher.pid, history(run)
