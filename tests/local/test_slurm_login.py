"""`trainer launch --slurm` from a Slurm login node (issue 40): the test process, outside any allocation,
is the login node. The launch submits one batch job whose script runs `trainer launch` inside the
allocation (guest mode), follows it from here (one squeue a poll, the job's output on the shared dir)
and ends with the job's launcher's own exit code; `trainer status` and `trainer stop` work on it from
here too.

The Slurm is tests/helpers/slurm_cluster.py (slurmctld and two slurmd, each node in a network namespace
of its own); one process per node, the tiny model, a few steps. It needs root and the Debian packages
slurmctld, slurmd, slurm-client and munge; without them these tests are skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.loopback_launch import TINY
from helpers.slurm_cluster import slurm_for_test
from helpers.slurm_site import guest_inventory

from trainer import exitcodes

REPO = Path(__file__).resolve().parents[2]
#: A secret --env variable: it reaches the nodes, and never the script, Slurm's state or a command line.
SECRET_NAME, SECRET = "CT_LOGIN_TOKEN", "tok-9c2e-login-node-secret"


#: Seconds before Slurm marks a node whose slurmd does not answer gone (its default is 300): the last
#: three tests of the module each kill a node.
SLURMD_TIMEOUT_S = 15


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-login")
    # Four nodes for jobs of two: the requeue test loses one (its job runs again on two of the three
    # left), the batch-node test another, and the last test has two.
    with slurm_for_test(root, nodes=4, slurmd_timeout_s=SLURMD_TIMEOUT_S) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, Path]:
    return guest_inventory(tmp_path_factory.mktemp("login"), procs_per_node=1, master_port=29537)


def login_env(slurm) -> dict[str, str]:
    """This machine as a login node: the test Slurm's config, no allocation, the secret exported."""
    env = {k: v for k, v in slurm.env.items() if not k.startswith("SLURM_JOB")}
    return {**env, SECRET_NAME: SECRET}


def launch_argv(site: tuple[Path, Path], run_name: str, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "trainer", "launch", "--slurm", "-i", str(site[0]), "--run-name", run_name,
        "--poll-interval", "1", *TINY, *args,
    ]  # fmt: skip


def trainer(verb: str, site: tuple[Path, Path], *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", verb, "-i", str(site[0]), *args],
        capture_output=True, text=True, timeout=180, env=env, cwd=REPO,
    )  # fmt: skip


@pytest.fixture(scope="module")
def trained(slurm, site) -> tuple[subprocess.CompletedProcess, float]:
    """`trainer launch --slurm` of the bundled trainer, 4 steps on 2 nodes, followed to its end."""
    started = time.monotonic()
    done = subprocess.run(
        launch_argv(site, "login", "--set", "train.max_steps=4", "--env", SECRET_NAME),
        capture_output=True, text=True, timeout=600, env=login_env(slurm), cwd=REPO,
    )  # fmt: skip
    took = time.monotonic() - started
    print(f"slurm login: submitted, trained 4 steps and followed to the end in {took:.1f} s")
    return done, took


@pytest.mark.slow
def test_a_launch_from_the_login_node_submits_follows_and_exits_with_the_jobs_code(slurm, site, trained):
    done, _ = trained
    output = done.stdout + done.stderr
    assert done.returncode == exitcodes.OK, output[-6000:] + slurm.logs()
    job = output.split("submitted run login as Slurm job ")[1].split(":")[0]
    assert f"Slurm job {job}: " in output, "the job's state, from squeue"
    # The job's own launcher, as this side shows it: rank 0's steps, a line per node, its end.
    assert "step 4/4 loss " in output, output[-6000:]
    assert "as Slurm step clustertrain-login-" in output and "on 2 node(s): sn0, sn1" in output, output
    assert "[sn1] node 1: " in output and "done: run login finished on all 2 node(s)" in output, output
    assert f"Slurm job {job} ended (completed); trainer launch in it exited 0" in output, output[-3000:]
    run_dir = site[1] / "runs" / "login"
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 4
    assert (run_dir / "checkpoints" / "latest").read_text().strip().endswith("step-4")
    assert (run_dir / "checkpoints" / "step-4").is_dir(), "the checkpoint is on the shared dir"
    # The secret reached the nodes (their secret-env, 0600) through a 0600 file, and nothing Slurm keeps.
    launch = run_dir / "launch"
    assert SECRET in (launch / "node-1" / "secret-env").read_text()
    assert (launch / "slurm-secret-env").stat().st_mode & 0o777 == 0o600
    assert SECRET not in (launch / "slurm-batch.sh").read_text()
    kept = [p for p in (slurm.root / "state").rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert kept == [], f"Slurm's state holds the secret: {kept}"


@pytest.mark.slow
def test_bad_data_exits_2_on_the_login_node_with_the_cause_named(slurm, site):
    short = site[1] / "short.txt"
    short.write_text("too short for one sample\n")
    started = time.monotonic()
    done = subprocess.run(
        launch_argv(site, "baddata", "--set", f"data.path={short}"),
        capture_output=True, text=True, timeout=300, env=login_env(slurm), cwd=REPO,
    )  # fmt: skip
    print(f"slurm login: bad data, submitted to exit {time.monotonic() - started:.1f} s")
    output = done.stdout + done.stderr
    assert done.returncode == exitcodes.CONFIG_ERROR, output[-6000:]
    assert "failed: config error: data.block_size" in output, output[-6000:]
    assert "trainer launch in it exited 2" in output, output[-3000:]


@pytest.mark.slow
def test_status_and_stop_from_the_login_node_cancel_the_job(slurm, site):
    env = login_env(slurm)
    started = time.monotonic()
    follower = subprocess.Popen(
        launch_argv(site, "live", "--set", "train.max_steps=100000"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    try:
        log = site[1] / "runs" / "live" / "launch" / "node-0" / "log"
        deadline = time.monotonic() + 300
        while "step 2/" not in (log.read_text() if log.exists() else ""):
            assert follower.poll() is None, follower.stdout.read()[-4000:] if follower.stdout else ""
            assert time.monotonic() < deadline, "no step 2 in 300 s"
            time.sleep(1)
        job = json.loads((log.parents[1] / "slurm-job.json").read_text())["job"]

        status = trainer("status", site, "--run-name", "live", env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"run live: Slurm job {job}, submitted " in status.stdout, status.stdout
        assert "running on sn0,sn1" in status.stdout or "running on sn[0-1]" in status.stdout, status.stdout
        assert "[sn1] node 1: running" in status.stdout, status.stdout

        stop = trainer("stop", site, "--run-name", "live", env=env)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert f"run live: stopped its Slurm job {job} (scancel of its step" in stop.stdout, stop.stdout
        output, _ = follower.communicate(timeout=120)
    finally:
        if follower.poll() is None:
            os.kill(follower.pid, signal.SIGTERM)  # cancels the job (scancel), as Ctrl-C does
            follower.wait(timeout=120)
    print(f"slurm login: launch, status and stop in {time.monotonic() - started:.1f} s")
    assert follower.returncode == exitcodes.INTERRUPTED, output[-4000:]
    assert "stopped: run live was stopped on sn0, sn1 from outside this launcher" in output, output[-4000:]
    assert f"trainer launch in it exited {exitcodes.INTERRUPTED}" in output, output[-4000:]
    assert slurm.job(job).get("JobState") in ("FAILED", "CANCELLED"), slurm.job(job)


def wait_for_checkpoint(follower: subprocess.Popen, run_dir: Path) -> None:
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not latest.exists():
        assert follower.poll() is None, follower.stdout.read()[-4000:] if follower.stdout else ""
        assert time.monotonic() < deadline, "no checkpoint in 300 s"
        time.sleep(0.2)


def the_batch_node(slurm, job: str) -> str:
    """The node a running job's batch script (its launcher) runs on."""
    return slurm.job(job)["BatchHost"]


def the_other_node(slurm, job: str) -> str:
    """The node of a running 2-node job that is not its batch node."""
    fields = slurm.job(job)
    names = subprocess.run(
        ["scontrol", "show", "hostnames", fields["NodeList"]], capture_output=True, text=True, env=slurm.env,
        check=True,
    ).stdout.split()  # fmt: skip
    (other,) = [name for name in names if name != fields["BatchHost"]]
    return other


LEAVE_OUT = ("--max-restarts", "1", "--exclude-failed")


def release_when_requeued(slurm, job: str, deadline_s: float = 240) -> None:
    """Slurm holds a job it requeued for about two minutes (`pending (BeginTime)`); an administrator may
    release it at once (`scontrol update JobId=J StartTime=now`), as this does, to keep the test short.
    Nothing else about the requeue changes."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        fields = slurm.job(job)
        if fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm.env, check=True)
            return
        time.sleep(1)


def lose_a_node_mid_run(
    slurm, site, run_name: str, pick, *args: str, policy: tuple[str, ...] = LEAVE_OUT, requeued: bool = False
) -> tuple[int, str, str, str]:
    """`trainer launch --slurm` of the run (`policy`: --max-restarts 1 --exclude-failed), followed; at
    its first checkpoint the node `pick(slurm, job)` is killed (its slurmd and processes), for good;
    with `requeued`, Slurm's requeue of the job is released at once (release_when_requeued).
    (The login node's exit code, its output, the job, the node killed.)"""
    follower = subprocess.Popen(
        launch_argv(site, run_name, *args, *policy),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=login_env(slurm), cwd=REPO,
    )  # fmt: skip
    run_dir = site[1] / "runs" / run_name
    try:
        wait_for_checkpoint(follower, run_dir)
        job = json.loads((run_dir / "launch" / "slurm-job.json").read_text())["job"]
        node = pick(slurm, job)
        assert slurm.kill_node(node) > 0, f"{node}'s slurmd and its processes"
        killed_at = time.monotonic()
        if requeued:
            threading.Thread(target=release_when_requeued, args=(slurm, job), daemon=True).start()
        output, _ = follower.communicate(timeout=300)
    finally:
        if follower.poll() is None:
            os.kill(follower.pid, signal.SIGTERM)  # cancels the job (scancel)
            follower.wait(timeout=120)
    print(f"slurm login: {node} killed, the follower's end {time.monotonic() - killed_at:.1f} s later")
    return follower.returncode, output, job, node


# Third to last of the module: the node it kills stays lost (the test Slurm has no way back for one).
@pytest.mark.slow
def test_without_exclude_failed_a_job_that_lost_its_batch_node_is_requeued_and_resumes(slurm, site):
    """No --exclude-failed: the job asks Slurm for nothing of its own. Its batch node lost (the launcher
    in it dies with it), Slurm ends the job (NODE_FAIL) and requeues it, as it does a batch job; the
    job runs its script again on two of the nodes left, its launcher takes over the lock the dead one
    held, and the run resumes from its latest checkpoint and finishes. The login node follows the same
    job through, and says what happened."""
    sets = ("--set", "train.max_steps=40", "--set", "train.micro_batch_size=2")
    code, output, job, node = lose_a_node_mid_run(
        slurm, site, "requeued", the_batch_node, *sets, policy=(), requeued=True
    )
    assert code == exitcodes.OK, output[-6000:] + slurm.logs()
    assert f"Slurm requeued job {job}" in output and "resumes from its latest checkpoint" in output, output[
        -6000:
    ]
    took_over = (
        "took over the lock of run requeued from this Slurm job's launcher before Slurm requeued the job"
    )
    assert took_over in output and "its run 0)" in output, output[-6000:]
    assert f"Slurm job {job} ended (completed); trainer launch in it exited 0" in output, output[-3000:]
    run_dir = site[1] / "runs" / "requeued"
    assert json.loads((run_dir / "launch" / "slurm-job.json").read_text())["job"] == job, "the same job"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 40 and summary["world_size"] == 2 and summary["resumed_from"], summary
    assert node not in slurm.job(job).get("NodeList", ""), slurm.job(job)


# Next to last of the module: the node it kills stays lost (the test Slurm has no way back for one).
@pytest.mark.slow
def test_a_lost_batch_node_is_left_out_of_a_resubmitted_job_that_resumes_the_run(slurm, site):
    """The job's launcher runs on its batch node: with that node lost the job cannot go on (and with
    --no-kill Slurm keeps it RUNNING on the others for ever). The login node cancels it and submits the
    run again on one node fewer, never on the lost one, the effective batch kept; it resumes from its
    latest checkpoint and finishes."""
    sets = ("--set", "train.max_steps=40", "--set", "train.micro_batch_size=2")
    code, output, job, node = lose_a_node_mid_run(slurm, site, "batchlost", the_batch_node, *sets)
    assert code == exitcodes.OK, output[-6000:] + slurm.logs()
    assert f"failed: {node} was lost: Slurm took it out of job {job}" in output, output[-4000:]
    assert f"Slurm job {job} cancelled (scancel {job})" in output, output[-4000:]
    resubmitted = (
        f"restart 1 of 1: {node} (the job's batch node) lost; resubmitted on 1 node(s) without it "
        f"(--exclude={node}; accumulation 1 -> 2, effective batch 4 kept); the run resumes from its latest "
        "checkpoint"
    )
    assert resubmitted in output, output[-6000:]
    run_dir = site[1] / "runs" / "batchlost"
    second = json.loads((run_dir / "launch" / "slurm-job.json").read_text())["job"]
    assert second != job and f"submitted run batchlost as Slurm job {second}: 1 node(s)" in output, output[
        -4000:
    ]
    script = (run_dir / "launch" / "slurm-batch.sh").read_text()
    assert "#SBATCH --nodes=1\n" in script and f"#SBATCH --exclude={node}\n" in script, script
    assert f"Slurm job {second} ended (completed); trainer launch in it exited 0" in output, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 40 and summary["world_size"] == 1 and summary["resumed_from"], summary
    assert slurm.job(job).get("JobState") in ("CANCELLED", "FAILED", "NODE_FAIL"), slurm.job(job)


# Last of the module: the node it kills stays lost.
@pytest.mark.slow
def test_a_lost_node_is_left_out_inside_the_job_and_the_run_finishes_on_the_other(slurm, site):
    """--exclude-failed from a login node: the job asks Slurm to keep its allocation when a node is lost
    (--no-kill; by default Slurm ends the whole job once the node is DOWN, and requeues it), and the
    launcher in the job resumes on the node that is left."""
    # Rank 0 sleeps 25 s before step 20: the job is still running when Slurm marks the node DOWN
    # (SLURMD_TIMEOUT_S after the kill), which ends the whole job unless it asked for --no-kill (the
    # launcher in it leaves the node out earlier, once Slurm says NOT_RESPONDING).
    sets = ("--set", "train.max_steps=40", "--set", "train.micro_batch_size=2")
    slow = ("--env", "TRAINER_TEST_STALL=0:20:25")
    code, output, _, node = lose_a_node_mid_run(slurm, site, "lost", the_other_node, *sets, *slow)
    run_dir = site[1] / "runs" / "lost"
    assert "#SBATCH --no-kill\n" in (run_dir / "launch" / "slurm-batch.sh").read_text()
    assert code == exitcodes.OK, output[-6000:] + slurm.logs()
    assert f"restart 1 of 1: {node} lost at step " in output, output[-6000:]
    assert "resuming on 1 node from step-" in output, output[-6000:]
    assert f"{node} lost: 2 -> 1 nodes, world size 2 -> 1" in output, output[-6000:]
    assert "effective batch 4 kept" in output, output[-6000:]
    assert "trainer launch in it exited 0" in output, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 40 and summary["world_size"] == 1, summary
    assert "DOWN" in slurm.node(node).get("State", ""), f"Slurm marked {node} down while the job ran on"
