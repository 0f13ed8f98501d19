"""A user's command gone quiet (issue 39): what its ranks use while it prints nothing, as the node
reports it (node_ctl.rank_usage and activity, on real processes), and how the launcher's monitor judges
it: working (a rank on a CPU, or moving bytes) is progress; a minute of quiet makes a suspect that a
culprit confirms as a stall and none dismisses (live.JobMonitor; hang_check.py reads the states);
the ceiling's quiet is a stall; without activity reports (a Slurm step) nothing is judged."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.node_helper import Said, node_ctl

from trainer.controller.launcher.live import JobMonitor
from trainer.controller.launcher.stall import COMPUTING_SHARE, STALL_FLOOR_S, used_time_or_io

LAUNCH_ID = "quiet-test-1"


@pytest.fixture
def ranks(tmp_path):
    """Node 1 of a launch: rank 2 computes (a busy loop), rank 3 sleeps, as a rank waiting in a gloo
    collective does; both tagged as run.sh and torchrun tag them."""
    node_dir = tmp_path / "node-1"
    node_dir.mkdir()
    (node_dir / "launch-id").write_text(f"{LAUNCH_ID}\n")
    (node_dir / "log").write_text("ready\n")
    os.utime(node_dir / "log", (0, 0))  # printed long ago: the node is quiet
    programs = {2: "while True: sum(i * i for i in range(10_000))", 3: "import time; time.sleep(120)"}
    started = [
        subprocess.Popen(
            [sys.executable, "-c", program],
            env=dict(os.environ, CLUSTERTRAIN_LAUNCH_ID=LAUNCH_ID, NODE_RANK="1", RANK=str(rank)),
        )
        for rank, program in programs.items()
    ]
    cpu_seconds(started[0].pid, at_least=0.2)  # past the interpreter's start-up: computing
    node_dir.joinpath("busy-pid").write_text(str(started[0].pid))
    yield node_dir
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


def cpu_seconds(pid: int, at_least: float = 0.0) -> float:
    """The process's CPU seconds as the kernel counts them, read here apart from node_ctl; waits (up to
    30 s) until it has used `at_least`."""
    deadline = time.monotonic() + 30
    while True:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        used = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if used >= at_least or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


def test_a_quiet_poll_says_what_each_rank_used(ranks):
    busy_pid = int((ranks / "busy-pid").read_text())
    cpu_before, started = cpu_seconds(busy_pid), time.monotonic()
    report = node_ctl().status(ranks, offset=0, wait=1.5, quiet=True, usage=True)
    cpu_after, elapsed = cpu_seconds(busy_pid), time.monotonic() - started
    used = report["activity"]
    assert used["seconds"] >= 1.4, used
    cpu_2, io_2 = used["ranks"]["2"]
    cpu_3, _ = used["ranks"]["3"]
    # The computing rank's share is what the kernel counted during the poll's window, which lies inside
    # the read here (one thread: outside the window it used at most the wall time outside it). How big
    # a share it got depends on the machine's load; that it computed and its peer slept does not.
    tick = 1 / os.sysconf("SC_CLK_TCK")
    measured = cpu_after - cpu_before
    assert measured - (elapsed - used["seconds"]) - 2 * tick <= cpu_2 <= measured + 2 * tick, (used, measured)
    assert cpu_2 / used["seconds"] >= 0.05 and cpu_3 / used["seconds"] < 0.02, used
    assert io_2 is not None, "this account reads its own processes' I/O counters"
    assert used_time_or_io(used) == (cpu_2 / used["seconds"] >= COMPUTING_SHARE), used
    # A rank computing is work; a node whose ranks all sleep is quiet.
    assert used_time_or_io({"seconds": 2.0, "ranks": {"2": [0.5, 0], "3": [0.0, 0]}})
    assert not used_time_or_io({"seconds": 2.0, "ranks": {"3": [0.01, 0], "": [0.5, 10**6]}})
    # Without `usage` (the bundled trainer's watch), or without a wait, nothing is read.
    assert node_ctl().status(ranks, offset=0, wait=1.0, quiet=True)["activity"] is None
    assert node_ctl().status(ranks, offset=0, wait=0.0, usage=True)["activity"] is None
    # A node whose log grew in the last seconds is seen working by its lines: nothing is read either.
    (ranks / "log").write_text("ready\nstep 1\n")
    assert node_ctl().status(ranks, offset=0, wait=1.0, quiet=True, usage=True)["activity"] is None


def monitor() -> JobMonitor:
    """A user's command on two nodes, followed with the adaptive watchdog (ceiling 600 s)."""
    return JobMonitor({"head": 0, "w1": 1}, "head", Said(), stall_timeout_s=600.0, stall_adaptive=True,
                      progress_from_steps=False)  # fmt: skip


def report(host: str, cpu: float, io: int = 0) -> dict:
    activity = {"seconds": 2.0, "ranks": {"0" if host == "head" else "1": [cpu, io]}}
    return {"host": host, "type": "report", "report": {"state": "running", "activity": activity}}


def quiet_for(watched: JobMonitor, seconds: float) -> None:
    watched.last_progress_at -= seconds
    watched.tick()


def test_working_is_progress_and_a_minute_of_quiet_is_a_suspect_not_a_stall():
    watched = monitor()
    watched.on_message(report("head", 0.0))
    watched.on_message(report("w1", 1.8))  # computing: progress, though nothing is printed
    assert watched.suspect is None and watched.stall is None
    quiet_for(watched, STALL_FLOOR_S + 1)
    assert watched.suspect is not None and watched.stall is None and not watched.must_stop
    assert "no rank used CPU or I/O" in watched.suspect.summary, watched.suspect
    watched.dismiss_suspect()  # no culprit: followed on, and not suspected again in the same quiet
    watched.tick()
    assert watched.suspect is None and watched.stall is None
    watched.on_message(report("w1", 0.0, io=10 * 2**20))  # writing a checkpoint: 5 MB/s of I/O
    quiet_for(watched, STALL_FLOOR_S + 1)  # a new quiet spell: suspected again after the minute
    assert watched.suspect is not None and watched.still_quiet
    watched.confirm_suspect()  # a culprit named: the stall
    assert watched.stall is not None and watched.must_stop


def test_the_ceilings_quiet_is_a_stall_and_without_activity_reports_nothing_is_judged():
    watched = monitor()
    watched.on_message(report("w1", 0.0))
    quiet_for(watched, 601)
    assert watched.stall is not None and "the ceiling, 600 s" in watched.stall.bound
    blind = monitor()  # a Slurm step's nodes: no activity in their reports
    blind.on_message({"host": "w1", "type": "report", "report": {"state": "running", "lines": ["x"]}})
    quiet_for(blind, 601)
    assert blind.suspect is None and blind.stall is None
