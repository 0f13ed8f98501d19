"""`trainer launch` through ansible-runner on this machine: two loopback "hosts" (ansible_connection
local) with node ranks 0 and 1, one process each, gloo. Real torchrun, real trainer, real playbooks.

The plain launch and the killed rank (marked bed_twin) make the assertions of the tests on simulated
nodes (test_launch_sim.py: three nodes with a real sshd each), which CI runs; they run only where
simulated nodes cannot (`make test-fast`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from helpers.loopback_launch import TINY, launch_command, trainer_pids

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.bed_twin("tests/local/test_launch_sim.py::test_three_node_launch_trains_with_agreeing_ranks")
def test_two_node_loopback_launch_trains_and_writes_outputs(loopback_cluster):
    inventory, shared = loopback_cluster
    done = subprocess.run(
        launch_command(inventory, "--run-name", "two", "--set", "train.max_steps=6", *TINY),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "step 6/6" in out, "rank 0's log lines are shown"
    assert "[node1] node 1: done" in out and "[node0] node 0: done" in out
    run = shared / "runs" / "two"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 6 and metrics[-1]["world_size"] == 2
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-6"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(set(map(str, summary["param_checksums"]))) == 1
    launch = run / "launch"
    assert (launch / "hostfile").read_text() == "127.0.0.1 slots=1\n127.0.0.2 slots=1\n"
    assert yaml.safe_load((launch / "accelerate-node1.yaml").read_text())["machine_rank"] == 1
    assert json.loads((launch / "deepspeed.json").read_text())["train_batch_size"] == 2 * summary.get(
        "micro_batch_size", yaml.safe_load((launch / "config.yaml").read_text())["train"]["micro_batch_size"]
    )
    node1 = (launch / "node-1" / "run.sh").read_text()
    assert "export NODE_RANK=1" in node1 and "export NCCL_SOCKET_IFNAME==lo" in node1


@pytest.mark.bed_twin(
    "tests/local/test_launch_sim.py::test_killed_worker_stops_all_hosts_then_relaunch_resumes"
)
def test_a_killed_rank_stops_the_other_host_and_is_named_then_relaunch_resumes(loopback_cluster):
    inventory, shared = loopback_cluster
    run = shared / "runs" / "kill"
    launcher = subprocess.Popen(
        launch_command(inventory, "--run-name", "kill", "--set", "train.max_steps=400", *TINY),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "latest").exists():
            assert launcher.poll() is None, launcher.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.5)
        victims = trainer_pids(run / "launch" / "node-1")
        assert victims, "node1's trainer process is running"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        out, _ = launcher.communicate(timeout=120)
        stopped_after = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # The cause with its own code (a shell's 128 + SIGKILL), not torchrun's 1; node0's broken collective
    # is what followed from it.
    assert launcher.returncode == 137, out
    assert "failed: killed by signal 9 (SIGKILL) (rank 1 on node1 (node 1), exit code 137)" in out, out
    assert (
        "then: rank 0 on node0 (node 0): its collective failed after rank 1 on node1 (node 1) was killed"
        in out
    )
    assert stopped_after < 60, f"the launcher took {stopped_after:.0f} s to stop everything"
    assert trainer_pids(run / "launch" / "node-0") == [], "node0's trainer was stopped"
    assert trainer_pids(run / "launch" / "node-1") == []
    latest = (run / "checkpoints" / "latest").read_text().strip()
    finish_at = int(latest.removeprefix("step-")) + 2

    done = subprocess.run(
        launch_command(inventory, "--run-name", "kill", "--set", f"train.max_steps={finish_at}", *TINY),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == finish_at
    assert latest in str(summary["resumed_from"]), "the relaunch resumed from the latest checkpoint"


def test_config_errors_are_refused_before_anything_starts(loopback_cluster):
    inventory, shared = loopback_cluster
    done = subprocess.run(
        launch_command(inventory, "--set", "train.max_stepz=3"), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "train.max_stepz" in done.stderr
    assert not shared.exists(), "nothing was written"


def test_a_gpu_fault_names_the_host_and_gpu_and_exits_75(loopback_cluster, tmp_path):
    inventory, shared = loopback_cluster
    # The trainer's documented test hook: on the CPU each rank plays the GPU of its LOCAL_RANK.
    faults = tmp_path / "faults.jsonl"
    faults.write_text(
        json.dumps({"step": 3, "gpu": 0, "rank": 1, "metrics": {"ecc_uncorrectable": 3}}) + "\n"
    )
    done = subprocess.run(
        launch_command(
            inventory,
            "--run-name",
            "fault",
            "--set",
            "train.max_steps=200",
            "--set",
            f"health.fault_source=file:{faults}",
            *TINY,
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 75, out
    assert "GPU_FAULT on node1 (node 1" in out and "GPU 0" in out and "ecc_uncorrectable=3" in out, out
    assert trainer_pids(shared / "runs" / "fault" / "launch" / "node-0") == []


def test_a_node_without_the_trainer_stops_the_launch_before_any_node_starts(loopback_cluster):
    inventory, shared = loopback_cluster
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    hosts["cluster"]["children"]["workers"]["hosts"]["node1"]["training_venv"] = "/nonexistent/venv"
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    done = subprocess.run(
        launch_command(inventory, "--run-name", "novenv"), capture_output=True, text=True, timeout=300
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "could not start on node1" in out and "/nonexistent/venv" in out and "make provision" in out, out
    assert not (shared / "runs" / "novenv" / "launch" / "node-0").exists(), "node0 did not start either"


def test_the_launch_says_which_value_of_the_config_file_it_overrides(loopback_cluster, tmp_path):
    inventory, _ = loopback_cluster
    config = tmp_path / "mine.yaml"
    config.write_text("train:\n  max_steps: 500\n")
    # node1 cannot start (no venv): the launch stops at its probe, after saying what it starts.
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    hosts["cluster"]["children"]["workers"]["hosts"]["node1"]["training_venv"] = "/nonexistent/venv"
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    done = subprocess.run(
        launch_command(inventory, "--config", str(config), "--set", "train.max_steps=6"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "overruled: train.max_steps: 6 from --set (your --config file says 500)" in out, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "term"])
def test_ctrl_c_or_term_stops_every_host(loopback_cluster, sig):
    inventory, shared = loopback_cluster
    launcher = subprocess.Popen(
        launch_command(inventory, "--run-name", "ctrlc", "--set", "train.max_steps=400", *TINY),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As a terminal's Ctrl-C would find it: SIGINT not ignored (a background shell job ignores it).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = []
    try:
        for line in launcher.stdout:
            seen.append(line)
            if line.startswith("step "):
                launcher.send_signal(sig)
                break
        out = "".join(seen) + launcher.communicate(timeout=120)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, out
    assert "interrupted: the trainer is stopped on all hosts" in out, out
    for rank in (0, 1):
        assert trainer_pids(shared / "runs" / "ctrlc" / "launch" / f"node-{rank}") == []
