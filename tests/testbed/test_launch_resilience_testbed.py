"""`trainer launch` in the real world, on the Molecule test bed (pytest -m testbed): ct-worker2's SSH
blocked for less and for longer than the unreachable grace (ct-worker2 is reached over SSH on port
2222; the block is an iptables DROP in its own network namespace, plus `ss -K` on its sshd so the
open connection breaks at once), a rank stuck outside a collective, a killed worker trainer with
--max-restarts, SIGHUP to the launcher, and `trainer attach` after `kill -9` of the launcher.
One process per node (the fixture of helpers/bed_launch); run dirs are removed afterwards.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.bed_launch import BED_UP, ENV, HOSTS, launch, run_launch, worker_trainer_pids
from helpers.bed_launch import testbed as _testbed  # noqa: F401 - the fixture, by its name

pytestmark = [pytest.mark.slow, BED_UP]

SSH_PORT = 2222  # ct-worker2's sshd (molecule/default/prepare.yml)
DROP_SSH = ["INPUT", "-p", "tcp", "--dport", str(SSH_PORT), "-j", "DROP"]


@pytest.fixture
def bed(request) -> tuple[Path, str, Path]:
    """(inventory with 1 process per node, run name, its output dir on this machine)."""
    return request.getfixturevalue("_testbed")


def block_ssh(host: str = "ct-worker2") -> bool:
    """Drop every packet to the host's sshd; break its open connections. Whether they were broken."""
    subprocess.run(["podman", "exec", host, "iptables", "-I", *DROP_SSH], env=ENV, check=True, timeout=60)
    killed = subprocess.run(
        ["podman", "exec", host, "ss", "-K", "sport", "=", f":{SSH_PORT}"],
        env=ENV,
        capture_output=True,
        timeout=60,
    )
    return killed.returncode == 0


def unblock_ssh(host: str = "ct-worker2") -> None:
    subprocess.run(["podman", "exec", host, "iptables", "-D", *DROP_SSH], env=ENV, timeout=60)


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)


def wait_for_checkpoint(launcher: subprocess.Popen, output: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not (output / "checkpoints" / "latest").exists():
        assert launcher.poll() is None, launcher.stdout.read() if launcher.stdout else ""
        assert time.monotonic() < deadline, f"no checkpoint within {timeout:.0f} s"
        time.sleep(1)


def finish(launcher: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.terminate()  # the launcher then stops the bed's trainers itself
            launcher.communicate(timeout=180)
    return out


def no_trainer_left(output: Path) -> None:
    for rank, host in enumerate(HOSTS):
        assert worker_trainer_pids(host, str(output / "launch" / f"node-{rank}")) == [], host


def test_ssh_blocked_for_20_s_the_run_finishes(bed):
    inventory, run_name, output = bed
    # Long enough to outlast the block: the checkpoint at step 4, then 20 s blocked (a step takes 0.5
    # to 1.5 s on the bed); 200 steps took 5.5 min of CI's time.
    launcher = start(launch(inventory, run_name, "train.max_steps=80"))
    broken = False
    try:
        wait_for_checkpoint(launcher, output)
        broken = block_ssh()
        time.sleep(20)
    finally:
        unblock_ssh()
    out = finish(launcher, timeout=1200)
    assert launcher.returncode == 0, out
    assert "[ct-worker2] node 2: done" in out, out
    if broken:  # the open connection broke at once: the state line said so meanwhile
        assert "[ct-worker2] node 2: unreachable (" in out and "ct-worker2 answers again after" in out, out
    assert json.loads((output / "summary.json").read_text())["final_step"] == 80


def test_ssh_blocked_past_the_grace_stops_every_node_and_names_it(bed):
    inventory, run_name, output = bed
    launcher = start([*launch(inventory, run_name, "train.max_steps=4000"), "--unreachable-grace", "30"])
    try:
        wait_for_checkpoint(launcher, output)
        block_ssh()
        out = finish(launcher, timeout=600)
    finally:
        unblock_ssh()
    try:
        assert launcher.returncode == 69, "NODE_LOST: the cause's own code"
        assert "failed: ct-worker2 (node 2) was lost at step " in out and ": no answer for " in out, out
        assert "could not confirm the stop on ct-worker2" in out, out
    finally:
        subprocess.run([*launch(inventory, run_name), "--stop"], env=ENV, timeout=600)
    no_trainer_left(output)


def test_a_stuck_rank_stops_every_node_within_the_stall_timeout_and_is_named(bed):
    inventory, run_name, output = bed
    rc, out = run_launch(
        [
            *launch(inventory, run_name, "train.max_steps=400"),
            # Counted from the ranks' first report: 30 s is far beyond a tiny GPT step here, loaded.
            "--stall-timeout",
            "30",
            "--env",
            "TRAINER_TEST_STALL=1:4:3600",  # rank 1 (ct-worker1) sleeps before step 4
        ],
        timeout=1200,
    )
    assert rc == 1, out
    assert "behind: rank 1 on ct-worker1 (node 1) in step 3" in out, out
    assert "stack of rank 1 on ct-worker1:" in out and " in started" in out, out
    no_trainer_left(output)


def test_a_killed_worker_trainer_restarts_from_its_checkpoint_with_the_same_final_loss(bed):
    inventory, run_name, output = bed
    reference = output.with_name(run_name + "-straight")
    try:
        # 20 steps, 16 of them after the restart from step-4 (40 took 3.6 min of CI's critical path).
        rc, out = run_launch(launch(inventory, reference.name, "train.max_steps=20"), timeout=1200)
        assert rc == 0, out
        launcher = start([*launch(inventory, run_name, "train.max_steps=20"), "--max-restarts", "1"])
        wait_for_checkpoint(launcher, output)
        victims = worker_trainer_pids("ct-worker1", str(output / "launch" / "node-1"))
        assert victims, "ct-worker1's trainer is running"
        subprocess.run(
            ["podman", "exec", "ct-worker1", "kill", "-9", *map(str, victims)], env=ENV, check=True
        )
        out = finish(launcher, timeout=1200)
        assert launcher.returncode == 0, out
        assert "restart 1 of 1: killed by signal 9 (SIGKILL) (rank 1 on ct-worker1 (node 1)" in out, out
        summary = json.loads((output / "summary.json").read_text())
        straight = json.loads((reference / "summary.json").read_text())
        assert summary["resumed_from"] and summary["final_step"] == straight["final_step"] == 20
        # The same loss to 5 digits, not to the bit. Most likely cause: with three ranks, gloo's ring
        # allreduce adds each gradient element's three terms in an order set by where the element falls
        # in DDP's buckets, and a restarted process starts from the default buckets where the
        # uninterrupted one had rebuilt them, so the last float32 bits differ and the difference grows
        # with the steps trained after the restart (seen on the bed: 3.0046462218 vs 3.0046463013, and
        # 3.0131282012 vs 3.0131258965 after a restart from step-4, 7.6e-7 relative). A wrong resume
        # (a step's data or state off) differs in the second or third digit. The 2-rank tests (a sum of
        # two terms has one order: the loopback restart, the bed's node loss on the two survivors) still
        # compare exactly.
        assert math.isclose(summary["final_loss"], straight["final_loss"], rel_tol=1e-5, abs_tol=0), (
            summary["final_loss"],
            straight["final_loss"],
        )
    finally:
        subprocess.run(["rm", "-rf", str(reference)], check=False)


def test_sighup_to_the_launcher_stops_every_node(bed):
    inventory, run_name, output = bed
    launcher = start(launch(inventory, run_name, "train.max_steps=4000"))
    try:
        for line in launcher.stdout:
            if line.startswith("step "):
                launcher.send_signal(signal.SIGHUP)
                break
        launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.communicate(timeout=180)
    assert launcher.returncode == 130
    no_trainer_left(output)


def test_attach_after_kill_9_follows_the_run_to_its_end(bed):
    inventory, run_name, output = bed
    # Still running when attach comes in (seconds after the kill at the step-4 checkpoint); 120 steps
    # took 4 min of CI's time.
    launcher = start(launch(inventory, run_name, "train.max_steps=50"))
    try:
        wait_for_checkpoint(launcher, output)
    finally:
        launcher.kill()
        launcher.wait()
    attach = subprocess.run(
        [sys.executable, "-m", "trainer", "attach", "-i", str(inventory), "--run-name", run_name],
        capture_output=True, text=True, env=ENV, timeout=1800,
    )  # fmt: skip
    out = attach.stdout + attach.stderr
    assert attach.returncode == 0, out
    assert f"done: run {run_name} finished on all 3 node(s)" in out, out
    assert json.loads((output / "summary.json").read_text())["final_step"] == 50
