"""`trainer launch` in the real world, on two loopback "hosts" (ansible_connection local): nodes that
stop answering for a while or for good, a rank stuck outside a collective, a killed trainer with
--max-restarts, a node that fails twice with --exclude-failed, a closed terminal (SIGHUP), a launcher
killed with -9 and followed again with `trainer attach`, and a watch of thousands of polls.

A node that does not answer is played by node1's venv python: a wrapper that fails (exit 255, what
ssh returns when it cannot connect) or hangs (a stalled `hard` NFS mount) while a flag file exists.
Its torchrun and trainer are the real ones, so node1's training is untouched: only the launcher's
calls to the node misbehave.

Six of these (marked bed_twin) make the assertions of a test on simulated nodes
(test_launch_resilience_sim.py: a real sshd per node, its SSH blocked by iptables) and run only where
simulated nodes cannot (`make test-fast`): the short and the long loss of a node, the killed trainer's
restart, SIGHUP, attach after kill -9, and attach's restart within the launch's --max-restarts (one
run on the simulated nodes carries these two). CI runs the simulated-node ones.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.loopback import VENV
from helpers.loopback_launch import TINY, launch_command, launch_processes, run_env, trainer_pids
from helpers.loopback_launch import loopback_cluster as _loopback_cluster  # noqa: F401 - the fixture, by its name

from trainer import exitcodes


@pytest.fixture
def loopback(request) -> tuple[Path, Path]:
    """(inventory, shared dir) of two loopback hosts: helpers.loopback_launch's loopback_cluster."""
    return request.getfixturevalue("_loopback_cluster")


def flaky_venv(tmp_path: Path, inventory: Path, mode: str, host: str = "node1") -> Path:
    """Give `host` a venv whose python fails (mode "fail") or hangs (mode "hang") while the returned
    flag file exists."""
    flag = tmp_path / f"{host}-{mode}"
    venv = tmp_path / "flaky-venv"
    (venv / "bin").mkdir(parents=True)
    action = "exit 255" if mode == "fail" else "sleep 0.2"
    wrapper = venv / "bin" / "python"
    wrapper.write_text(
        f"#!/bin/sh\nwhile [ -e {flag} ]; do {action}; done\n"
        f'echo x >> {tmp_path / "python-calls"}\nexec {VENV / "bin" / "python"} "$@"\n'
    )
    wrapper.chmod(0o755)
    for name in ("torchrun", "trainer"):
        (venv / "bin" / name).symlink_to(VENV / "bin" / name)
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    for group in hosts["cluster"]["children"].values():
        if host in (group.get("hosts") or {}):
            group["hosts"][host]["training_venv"] = str(venv)
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    return flag


def background(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A launcher (or attach) in the background; its output, stdout and stderr together, read at its end."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for(predicate, what: str, timeout: float = 300, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the launcher ended ({proc.returncode}) before {what}: {out}")
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)
    return value


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "launch" / "history.jsonl").read_text().splitlines()]


@pytest.mark.bed_twin("tests/local/test_launch_resilience_sim.py::test_ssh_blocked_for_20_s_the_run_finishes")
def test_a_node_that_stops_answering_for_less_than_the_grace_does_not_stop_the_run(loopback, tmp_path):
    inventory, shared = loopback
    flag = flaky_venv(tmp_path, inventory, "fail")
    run = shared / "runs" / "blip"
    launcher = background(
        launch_command(
            inventory, "--run-name", "blip", "--unreachable-grace", "30", "--set", "train.max_steps=60", *TINY
        ),
        run_env(tmp_path),
    )
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").exists(), "checkpoint", proc=launcher)
        flag.touch()  # node1 stops answering: every call to it fails, as SSH does when it cannot connect
        time.sleep(8)
        flag.unlink()
        out, _ = launcher.communicate(timeout=600)
    finally:
        flag.unlink(missing_ok=True)
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out
    assert "[node1] node 1: unreachable (" in out, "the state line said node1 was unreachable meanwhile"
    assert "node1 answers again after" in out, out
    assert "[node1] node 1: done" in out and "[node0] node 0: done" in out
    assert json.loads((run / "summary.json").read_text())["final_step"] == 60


@pytest.mark.bed_twin(
    "tests/local/test_launch_resilience_sim.py::test_ssh_blocked_past_the_grace_stops_every_node_and_names_it"
)
def test_a_node_silent_past_the_grace_stops_every_node_and_is_named(loopback, tmp_path):
    inventory, shared = loopback
    flag = flaky_venv(tmp_path, inventory, "hang")
    run = shared / "runs" / "lost"
    env = run_env(tmp_path)
    launcher = background(
        launch_command(
            inventory,
            "--run-name",
            "lost",
            "--unreachable-grace",
            "10",
            "--stop-grace",
            "2",
            "--set",
            "train.max_steps=2000",
            *TINY,
        ),
        env,
    )
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").exists(), "checkpoint", proc=launcher)
        # node1's helper hangs from now on (a stalled shared dir): its trainer trains on.
        flag.touch()
        out, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    try:
        assert launcher.returncode == exitcodes.NODE_LOST, out
        assert "failed: node1 (node 1) was lost at step " in out and ": no answer for " in out, out
        assert "[node1] node 1: lost (no answer since " in out, "shown as lost, never as running"
        assert "could not confirm the stop on node1" in out, "the stop on a silent node has a timeout"
        assert "node1 was lost; relaunch with --max-restarts K --exclude-failed to go on without it" in out, (
            out
        )
        assert trainer_pids(run / "launch" / "node-0") == [], "node0's trainer was stopped"
        stopped = [r for r in history(run) if r["event"] == "stopped"]
        assert stopped[-1]["why"] == "lost" and stopped[-1]["hosts"] == ["node1"], stopped[-1]
        assert stopped[-1]["cause"]["code"] == exitcodes.NODE_LOST
    finally:
        flag.unlink(missing_ok=True)
        subprocess.run(launch_command(inventory, "--run-name", "lost", "--stop"), env=env, timeout=300)
    assert trainer_pids(run / "launch" / "node-1") == []


def test_a_rank_stuck_before_a_collective_stops_every_node_naming_the_rank_and_its_stack(loopback, tmp_path):
    """No --stall-timeout: the bound adapts to the job (4 × its slowest step, at least 60 s), where it was
    a fixed 600 s. A checkpoint save that takes 75 s on rank 0 (announced, so given the ceiling) is
    not called a hang; rank 1 then stuck before step 5 is, about a minute later, and named: behind its
    peer by its progress record, sleeping, its stack shown (exit 71, hung)."""
    inventory, shared = loopback
    started = time.monotonic()
    done = subprocess.run(
        launch_command(
            inventory,
            "--run-name",
            "stall",
            "--env",
            "TRAINER_TEST_STALL=1:5:3600",  # rank 1 sleeps before step 5; rank 0 waits in step 5
            "--env",
            "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S=75",  # step-3's save takes 75 s on rank 0
            "--env",
            "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP=3",
            "--set",
            "train.max_steps=400",
            *TINY,
        ),
        capture_output=True,
        text=True,
        timeout=600,
        env=run_env(tmp_path),
    )
    out = done.stdout + done.stderr
    # Rank 1 behind its peer (in step 4 while rank 0 is in step 5): the culprit, with its state.
    assert done.returncode == exitcodes.HUNG, out
    assert "culprit: behind its peers: in step 4 while they are in step 5 — sleeping — state S" in out, out
    assert "(rank 1 on node1 (node 1), exit code 71)" in out, out
    assert "stalled: no rank advanced for" in out, out
    assert "behind: rank 1 on node1 (node 1) in step 4" in out, out
    assert "(bound: 4 × the slowest step" in out, out
    print(f"adaptive stall bound: launch to the stall named in {time.monotonic() - started:.0f} s")
    # py-spy's dump (in the node environment): the stuck rank's own frame, where it sleeps.
    stuck_frame = "Progress.started (trainer/node/progress.py:"
    assert "stack of rank 1 on node1:" in out and stuck_frame in out, "the stuck rank's own stack"
    run = shared / "runs" / "stall"
    for rank in (0, 1):
        assert trainer_pids(run / "launch" / f"node-{rank}") == []
    stopped = history(run)[-1]
    assert stopped["why"] == "hung" and stopped["hosts"] == ["node1"]
    kept = json.loads(next((run / "launch" / "node-1").glob("stacks-*.json")).read_text())
    assert stuck_frame in kept["1"], "the stack is kept next to node1's log"


@pytest.mark.bed_twin(
    "tests/local/test_launch_resilience_sim.py::"
    "test_a_killed_worker_trainer_restarts_from_its_checkpoint_with_the_same_final_loss"
)
def test_a_killed_trainer_is_restarted_from_its_checkpoint_and_ends_like_an_uninterrupted_run(
    loopback, tmp_path
):
    inventory, shared = loopback
    env = run_env(tmp_path)
    steps = ["--set", "train.max_steps=24", *TINY]
    reference = subprocess.run(
        launch_command(inventory, "--run-name", "straight", *steps), capture_output=True, text=True, env=env
    )
    assert reference.returncode == 0, reference.stdout + reference.stderr
    run = shared / "runs" / "restarted"
    launcher = background(
        launch_command(inventory, "--run-name", "restarted", "--max-restarts", "1", *steps), env
    )
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").exists(), "checkpoint", proc=launcher)
        victims = wait_for(lambda: trainer_pids(run / "launch" / "node-1"), "node1 trainer", proc=launcher)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        out, _ = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out
    assert (
        "restart 1 of 1: killed by signal 9 (SIGKILL) (rank 1 on node1 (node 1), exit code 137); resuming on "
        "2 nodes from step-" in out
    ), out
    summary = json.loads((run / "summary.json").read_text())
    straight = json.loads((shared / "runs" / "straight" / "summary.json").read_text())
    assert summary["resumed_from"], "the second launch resumed from a checkpoint"
    assert summary["final_step"] == straight["final_step"] == 24
    # The same final loss as an uninterrupted run. Equal to the last bit in most runs; once, on a loaded
    # machine, 3.343552 against 3.343540 (cause not found yet). A wrong resume (data position, learning
    # rate, optimizer state) moves the 24-step loss by far more than this bound.
    assert summary["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-4), (
        "the same final loss as an uninterrupted run"
    )
    events = [r["event"] for r in history(run)]
    assert events == ["launch", "stopped", "restart"], events
    assert (run / "launch" / "node-1" / "log.1").exists(), "the failed launch's log is kept"


def test_a_node_failing_twice_is_left_out_and_the_batch_is_kept(loopback, tmp_path):
    inventory, shared = loopback
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    workers = hosts["cluster"]["children"]["workers"]["hosts"]
    workers["node2"] = dict(workers["node1"], cluster_ip="127.0.0.3")  # each host its own address
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    # Rank 2's "GPU" faults at step 5 on every attempt (the trainer's test hook): node2 fails twice.
    faults = tmp_path / "faults.jsonl"
    faults.write_text(
        json.dumps({"step": 5, "gpu": 0, "rank": 2, "metrics": {"ecc_uncorrectable": 3}}) + "\n"
    )
    done = subprocess.run(
        launch_command(
            inventory,
            "--run-name",
            "exclude",
            "--max-restarts",
            "2",
            "--exclude-failed",
            "--set",
            "train.max_steps=8",
            "--set",
            "train.gradient_accumulation_steps=2",
            "--set",
            f"health.fault_source=file:{faults}",
            # Read often: at the default 5 s a loaded machine can run steps 5-8 between two readings.
            "--set",
            "health.poll_interval_s=0.2",
            *TINY,
        ),
        capture_output=True,
        text=True,
        timeout=900,
        env=run_env(tmp_path),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "restart 1 of 2: GPU fault: GPU 0 (uuid " in out and "of rank 2 tripped the health check" in out, (
        out
    )
    assert "(rank 2 on node2 (node 2), exit code 75)" in out, "the faulting rank, not the first to exit"
    assert "restart 2 of 2: GPU fault: " in out, out
    assert (
        "resuming on 2 nodes from step-" in out and "(accumulation 2 -> 3, effective batch 96 kept)" in out
    ), out
    assert "node2 left out: 3 -> 2 nodes, world size 3 -> 2" in out, out
    summary = json.loads((shared / "runs" / "exclude" / "summary.json").read_text())
    assert summary["final_step"] == 8 and summary["world_size"] == 2
    restarts = [r for r in history(shared / "runs" / "exclude") if r["event"] == "restart"]
    assert [r["nodes"] for r in restarts][-1] == {"node0": 0, "node1": 1}


@pytest.mark.bed_twin(
    "tests/testbed/test_node_loss_testbed.py::"
    "test_a_killed_worker_node_is_left_out_and_the_survivors_finish_like_a_run_started_there"
)
def test_a_lost_node_is_left_out_at_once_and_the_survivor_finishes_like_a_run_started_there(
    loopback, tmp_path
):
    """node1 vanishes (its trainer killed and every call to it failing, as when a spot instance is
    reclaimed): it is named as the cause, left out at once, and node0 goes on alone from the latest
    checkpoint with accumulation 1 -> 2; its final loss equals a run started on node0 alone from the
    same checkpoint with the same batch split, to the bit."""
    inventory, shared = loopback
    single = tmp_path / "single"
    shutil.copytree(inventory, single)
    hosts = yaml.safe_load((single / "hosts.yml").read_text())
    hosts["cluster"]["children"]["workers"]["hosts"] = {}
    (single / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    flag = flaky_venv(tmp_path, inventory, "fail")
    env = run_env(tmp_path)
    run = shared / "runs" / "survive"
    # Every checkpoint kept: the one the restart resumed from is copied for the reference run.
    steps = ["--set", "train.max_steps=24", "--set", "checkpoint.save_total_limit=0", *TINY]
    launcher = background(
        launch_command(inventory, "--run-name", "survive", "--max-restarts", "1", "--exclude-failed", *steps),
        env,
    )
    try:
        wait_for(lambda: (run / "checkpoints" / "step-6").exists(), "checkpoint step-6", proc=launcher)
        victims = wait_for(lambda: trainer_pids(run / "launch" / "node-1"), "node1 trainer", proc=launcher)
        flag.touch()  # node1 answers no more...
        for pid in victims:  # ...and its trainer is gone
            os.kill(pid, signal.SIGKILL)
        out, _ = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        flag.unlink(missing_ok=True)
    assert launcher.returncode == 0, out
    assert "failed: node1 (node 1) was lost at step " in out, out
    assert "then: rank 0 on node0 (node 0): its collective failed after node1 was lost" in out, out
    restart = next(r for r in history(run) if r["event"] == "restart")
    resumed_from = restart["resume_from"].rstrip("/").rsplit("/", 1)[-1]
    assert (
        f"restart 1 of 1: node1 lost at step {restart['cause']['at_step']}; resuming on 1 node from "
        f"{resumed_from} (accumulation 1 -> 2, effective batch 32 kept)" in out
    ), out
    assert restart["lost"] == ["node1"] and restart["excluded"] == ["node1"], restart
    assert restart["cause"]["cause"]["kind"] == "lost" and restart["nodes"] == {"node0": 0}, restart
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 24 and summary["world_size"] == 1, summary

    # The same checkpoint, started on node0 alone with the restart's batch split.
    reference = shared / "runs" / "reference"
    (reference / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / resumed_from, reference / "checkpoints" / resumed_from)
    (reference / "checkpoints" / "latest").write_text(resumed_from + "\n")
    done = subprocess.run(
        launch_command(
            single, "--run-name", "reference", "--set", "train.gradient_accumulation_steps=2", *steps
        ),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    straight = json.loads((reference / "summary.json").read_text())
    assert straight["final_step"] == 24 and straight["resumed_from"], straight
    assert summary["final_loss"] == straight["final_loss"], (summary["final_loss"], straight["final_loss"])


def test_a_lost_head_is_said_plainly_with_what_to_run_once_it_is_back(loopback, tmp_path):
    """The head (rank 0, the master, the shared dir's server) vanishes: no restart can go on without
    it, even with --exclude-failed; the launcher names it and the command to run once it is back."""
    inventory, shared = loopback
    flag = flaky_venv(tmp_path, inventory, "fail", host="node0")
    env = run_env(tmp_path)
    run = shared / "runs" / "headloss"
    launcher = background(
        launch_command(
            inventory, "--run-name", "headloss", "--max-restarts", "2", "--exclude-failed",
            "--set", "train.max_steps=2000", *TINY,
        ),
        env,
    )  # fmt: skip
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").exists(), "checkpoint", proc=launcher)
        victims = wait_for(lambda: trainer_pids(run / "launch" / "node-0"), "node0 trainer", proc=launcher)
        flag.touch()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        out, _ = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        flag.unlink(missing_ok=True)
        subprocess.run(launch_command(inventory, "--run-name", "headloss", "--stop"), env=env, timeout=300)
    assert launcher.returncode == exitcodes.NODE_LOST, out
    assert "failed: node0 (node 0) was lost at step " in out, out
    assert (
        "not restarted: the head node0 (rank 0, the master and the server of the shared dir) was lost; the "
        f"run cannot go on without it. Once node0 is back, run `trainer launch -i {inventory} --run-name "
        "headloss` with this launch's options: it resumes from the latest complete checkpoint" in out
    ), out
    assert "restart 1 of 2" not in out, out
    assert trainer_pids(run / "launch" / "node-1") == [], "node1's trainer was stopped"


@pytest.mark.bed_twin(
    "tests/local/test_launch_resilience_sim.py::test_sighup_to_the_launcher_stops_every_node"
)
def test_sighup_stops_every_node(loopback, tmp_path):
    inventory, shared = loopback
    run = shared / "runs" / "hup"
    launcher = background(
        launch_command(inventory, "--run-name", "hup", "--set", "train.max_steps=400", *TINY),
        run_env(tmp_path),
    )
    try:
        for line in launcher.stdout:
            if line.startswith("step "):
                launcher.send_signal(signal.SIGHUP)  # the terminal closed
                break
        launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130
    for rank in (0, 1):
        assert trainer_pids(run / "launch" / f"node-{rank}") == []
    assert history(run)[-1]["why"] == "interrupted"
    assert not list((tmp_path / "tmpdir").glob("clustertrain-runner-*")), "the private dirs were removed"


@pytest.mark.bed_twin(
    "tests/local/test_launch_resilience_sim.py::test_attach_after_kill_9_follows_the_run_and_restarts_it_within_the_launchs_max_restarts"
)
def test_attach_follows_a_launch_whose_launcher_was_killed(loopback, tmp_path):
    inventory, shared = loopback
    env = run_env(tmp_path)
    run = shared / "runs" / "orphan"
    launcher = subprocess.Popen(
        launch_command(inventory, "--run-name", "orphan", "--set", "train.max_steps=80", *TINY),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").exists(), "checkpoint", proc=launcher)
    finally:
        launcher.kill()  # -9: nothing of the launcher runs any more
        launcher.wait()
    status = subprocess.run(
        [sys.executable, "-m", "trainer", "status", "-i", str(inventory), "--run-name", "orphan"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert "[node0] node 0: running" in status.stdout and "[node1] node 1: running" in status.stdout
    assert "launch orphan-" in status.stdout
    assert f"lock: held by trainer launch pid {launcher.pid} on " in status.stdout, status.stdout
    assert "(no longer running: a new launch needs --force)" in status.stdout, status.stdout
    attach = subprocess.run(
        [sys.executable, "-m", "trainer", "attach", "-i", str(inventory), "--run-name", "orphan"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    out = attach.stdout + attach.stderr
    assert attach.returncode == 0, out
    assert "step 80/80" in out and "done: run orphan finished on all 2 node(s)" in out, out
    assert json.loads((run / "summary.json").read_text())["final_step"] == 80
    # The dead launcher's lock was adopted and released at the end: the next launch needs no --force.
    assert f"took over run orphan's lock from trainer launch pid {launcher.pid}" in out, out
    assert not (run / "launch" / "lock").exists()
    # The killed launcher's private dir (the run's files and secrets) was removed by a later run.
    assert not list((tmp_path / "tmpdir").glob("clustertrain-runner-*"))


@pytest.mark.bed_twin(
    "tests/local/test_launch_resilience_sim.py::test_attach_after_kill_9_follows_the_run_and_restarts_it_within_the_launchs_max_restarts"
)
def test_attach_restarts_a_failed_run_within_the_launchs_max_restarts(loopback, tmp_path):
    inventory, shared = loopback
    env = run_env(tmp_path)
    run = shared / "runs" / "adopted"
    steps = ["--set", "train.max_steps=30", *TINY]
    launcher = subprocess.Popen(
        launch_command(inventory, "--run-name", "adopted", "--max-restarts", "1", *steps),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").exists(), "checkpoint", proc=launcher)
        # node1's trainer held still until attach has adopted the run: on a loaded machine the 30 steps
        # could otherwise end before attach is up, leaving nothing to kill (the other rank waits in
        # its next all-reduce meanwhile).
        victims = wait_for(lambda: trainer_pids(run / "launch" / "node-1"), "node1 trainer", proc=launcher)
        for pid in victims:
            os.kill(pid, signal.SIGSTOP)
    finally:
        launcher.kill()  # -9: the launch's --max-restarts 1 is left to attach
        launcher.wait()
    attach = background(
        [sys.executable, "-m", "trainer", "attach", "-i", str(inventory), "--run-name", "adopted"],
        env,
    )
    try:
        lock = run / "launch" / "lock"
        wait_for(
            lambda: lock.exists() and json.loads(lock.read_text())["pid"] == attach.pid,
            "adoption",
            proc=attach,
        )
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        out, _ = attach.communicate(timeout=600)
    finally:
        if attach.poll() is None:
            attach.kill()
    assert attach.returncode == 0, out
    assert "this launch had --max-restarts 1 (0 used): attach restarts each node's run.sh" in out, out
    assert "restart 1 of 1: killed by signal 9 (SIGKILL) (rank 1 on node1" in out and "from step-" in out, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] and summary["final_step"] == 30
    assert [r["event"] for r in history(run)][-2:] == ["stopped", "restart"], history(run)
    assert not (run / "launch" / "lock").exists(), "attach released the lock at the end"


def _tree_rss_kb(pid: int) -> int:
    """Resident memory of the launcher and its ansible-playbook processes (not the short-lived
    commands each poll runs)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            command = Path(f"/proc/{current}/cmdline").read_bytes()
            if current != pid and b"ansible-playbook" not in command:
                continue
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def test_a_long_watch_writes_no_event_files_and_keeps_flat_memory(loopback, tmp_path):
    inventory, shared = loopback
    shared.mkdir()  # the command's working dir (training_workdir's default)
    flaky_venv(tmp_path, inventory, "fail")  # counts the calls to the nodes (the flag never exists)
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    node1 = hosts["cluster"]["children"]["workers"]["hosts"]["node1"]
    hosts["cluster"]["children"]["head"]["hosts"]["node0"]["training_venv"] = node1["training_venv"]
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    env = run_env(tmp_path)
    calls = tmp_path / "python-calls"
    calls.touch()
    # A line every 0.05 s: rank 0's watch answers on each new line (a worker's waits on its node up
    # to 10 s), so new lines are what make the many polls whose memory this test watches. Until the
    # nodes were polled 400 times (1400 lines, a fixed 70 s, gave 254 polls at load 15-20 in CI, too
    # few for the check below), and 4000 lines at most.
    until_polled = f"[ $i -lt 4000 ] && [ $(wc -l < {calls}) -lt 400 ]"
    command = ["bash", "-c", f"i=0; while {until_polled}; do i=$((i+1)); echo line $i; sleep 0.05; done"]
    launcher = background(
        [*launch_command(inventory, "--run-name", "long", "--poll-interval", "0.02"), "--", *command],
        env,
    )
    files, rss = [], []
    try:
        wait_for(lambda: calls.exists() and len(calls.read_text().split()) > 100, "100 polls", proc=launcher)
        time.sleep(5)
        early = _tree_rss_kb(launcher.pid)
        while launcher.poll() is None:
            files.append(sum(1 for p in (tmp_path / "tmpdir").rglob("*") if p.is_file()))
            rss.append(_tree_rss_kb(launcher.pid))
            time.sleep(2)
        out = launcher.stdout.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    polls = len(calls.read_text().split())
    assert launcher.returncode == 0, out
    assert polls > 300, f"only {polls} polls of the two nodes"
    # The private dir holds its fixed files only (extravars, inventory link, command, owner, channel).
    assert max(files) < 20, f"files under TMPDIR while watching: {files}"
    late = sorted(rss[-10:])[len(rss[-10:]) // 2]
    print(f"{polls} polls; launcher + ansible-playbook {early} kB early, {late} kB late; files {max(files)}")
    assert late - early < 8 * 1024, (
        f"the launcher's process tree grew from {early} to {late} kB over {polls} polls"
    )


def test_a_silent_command_is_a_stall_when_asked_for(loopback, tmp_path):
    inventory, shared = loopback
    shared.mkdir()  # the command's working dir (training_workdir's default)
    command = ["bash", "-c", 'echo "node $NODE_RANK ready"; sleep 600']
    done = subprocess.run(
        [*launch_command(inventory, "--run-name", "quiet", "--stall-timeout", "10"), "--", *command],
        capture_output=True,
        text=True,
        timeout=300,
        env=run_env(tmp_path),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "stalled: no node printed a line and no rank used CPU or I/O for" in out, out
    assert "(--stall-timeout 10)" in out, out
    assert "node 1 ready" in out, "each node's last lines are shown"
    for rank in (0, 1):
        assert launch_processes(shared / "runs" / "quiet" / "launch" / f"node-{rank}") == []


def test_exclude_failed_needs_restarts(loopback):
    inventory, shared = loopback
    done = subprocess.run(
        launch_command(inventory, "--exclude-failed"), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "--exclude-failed needs --max-restarts" in done.stderr
    assert not shared.exists(), "nothing was started"
