"""`trainer launch` inside a Slurm allocation ("guest mode", issue 40): the batch script of a job runs
`trainer launch -i INVENTORY ...`, which finds the allocation (SLURM_JOB_ID) and runs every node's
run.sh as one srun step on the allocation's nodes, follows them from the shared dir and names a
failure as an SSH launch does; `trainer status`, `logs` and `stop` work on such a run from outside
the allocation (the shared dir and squeue/scancel).

The Slurm is tests/helpers/slurm_cluster.py (slurmctld and two slurmd, each node in a network
namespace of its own: two addresses, the head's address from Slurm's NodeAddr). It needs root and
the Debian packages slurmctld, slurmd, slurm-client and munge; without them these tests are skipped.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.loopback import VENV
from helpers.loopback_launch import TINY
from helpers.slurm_cluster import SlurmCluster, slurm_for_test
from helpers.slurm_site import guest_inventory

from trainer import exitcodes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with slurm_for_test(tmp_path_factory.mktemp("slurm"), nodes=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, Path]:
    """(inventory, shared dir): an inventory whose hosts Slurm replaces with the allocation's nodes; its
    shared dir, venv, processes per node and training_env are the job's."""
    return guest_inventory(tmp_path_factory.mktemp("guest"), procs_per_node=2, master_port=29531)


def launch_command(site: tuple[Path, Path], run_name: str, *args: str) -> list[str]:
    command = [str(VENV / "bin" / "python"), "-m", "trainer", "launch", "-i", str(site[0])]
    return [*command, "--run-name", run_name, "--poll-interval", "1", *TINY, *args]


def launch_job(slurm: SlurmCluster, site: tuple[Path, Path], run_name: str, *args: str) -> str:
    """Submit a 2-node batch job whose script is `trainer launch -i INVENTORY --run-name NAME ARGS`."""
    script = site[1] / f"{run_name}.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
        f"cd {REPO}\nexec {shlex.join(launch_command(site, run_name, *args))}\n"
    )
    return slurm.submit(script, cwd=site[1])


def output_of(site: tuple[Path, Path], job: str) -> str:
    return (site[1] / f"slurm-{job}.out").read_text()


def trainer(verb: str, site: tuple[Path, Path], *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", verb, "-i", str(site[0]), *args],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def trained(slurm, site) -> tuple[str, str]:
    """(job id, the launcher's output) of a guest launch of the bundled trainer, 4 steps on 2 nodes."""
    job = launch_job(slurm, site, "guest", "--set", "train.max_steps=4")
    state = slurm.wait(job, 600)
    output = output_of(site, job)
    assert state == "COMPLETED", f"job {job} ended {state}:\n{output[-6000:]}\n{slurm.logs()}"
    return job, output


@pytest.mark.slow
def test_a_guest_launch_trains_on_the_allocations_nodes_with_ranks_agreeing(slurm, site, trained):
    job, output = trained
    run_dir = site[1] / "runs" / "guest"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["final_step"] == 4, output
    assert len(set(map(str, summary["param_checksums"]))) == 1, "every rank holds the same weights"
    # The topology is Slurm's: its node names, the head's NodeAddr, the step of this job.
    assert "as Slurm step clustertrain-guest-" in output and f"of job {job} on 2 node(s): sn0, sn1" in output
    assert f"master {slurm.addresses['sn0']}" in output, output
    assert "done: run guest finished on all 2 node(s)" in output, output
    launch = run_dir / "launch"
    record = json.loads((launch / "slurm.json").read_text())
    assert (
        record["job"] == job
        and record["step"].startswith(f"{job}.")
        and record["nodes"] == {"sn0": 0, "sn1": 1}
    )
    for rank in (0, 1):
        node_dir = launch / f"node-{rank}"
        assert json.loads((node_dir / "exit").read_text())["exit_code"] == 0
        assert json.loads((node_dir / "launch.json").read_text())["nodes"] == {"sn0": 0, "sn1": 1}
        # The interface toward the head, found on each node as the step started it.
        assert "NCCL_SOCKET_IFNAME==$(clustertrain_iface)" in (node_dir / "run.sh").read_text()
    assert "step 4/4" in (launch / "node-0" / "log").read_text()
    history = [json.loads(line) for line in (launch / "history.jsonl").open()]
    assert [r["event"] for r in history] == ["launch"] and history[0]["slurm_job"] == job


@pytest.mark.slow
def test_a_ranks_bad_data_is_named_with_its_host_and_rank_and_exits_2(slurm, site):
    # Inside salloc: the launcher runs where salloc does (a login node's place), the step on the nodes.
    short = site[1] / "short.txt"
    short.write_text("too short for one sample\n")
    done = subprocess.run(
        # --max-restarts: bad input is never restarted (a restart would fail the same way).
        ["salloc", "--nodes=2", *launch_command(site, "baddata", "--set", f"data.path={short}", "--max-restarts", "1")],  # noqa: E501
        capture_output=True, text=True, timeout=300, env=slurm.env, cwd=REPO,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == exitcodes.CONFIG_ERROR, output[-6000:]
    report = output[output.index("\nfailed: ") + 1 :].splitlines()
    assert report[0].startswith("failed: config error: data.block_size"), output[-6000:]
    assert " on sn" in report[0] and "(node " in report[0] and "exit code 2)" in report[0], report[0]
    history = [
        json.loads(line) for line in (site[1] / "runs" / "baddata" / "launch" / "history.jsonl").open()
    ]
    assert [r["event"] for r in history] == ["launch", "stopped"], history
    assert "not restarted: config error" in output and "restart 1 of 1" not in output, output[-6000:]
    cause = history[-1]["cause"]
    records = site[1] / "runs" / "baddata" / "launch" / f"node-{cause['node']}" / "progress"
    assert json.loads((records / f"exit-{cause['rank']}.json").read_text())["code"] == 2, (
        "the rank's own code"
    )


@pytest.mark.slow
def test_status_logs_and_stop_of_a_running_slurm_run(slurm, site, trained):
    env = {**slurm.env}
    env.pop("SLURM_JOB_ID", None)
    job = launch_job(slurm, site, "live", "--set", "train.max_steps=100000")
    log = site[1] / "runs" / "live" / "launch" / "node-0" / "log"
    deadline = time.monotonic() + 300
    while "step 2/" not in (log.read_text() if log.exists() else ""):
        assert slurm.job(job).get("JobState") in ("PENDING", "RUNNING"), output_of(site, job)[-4000:]
        assert time.monotonic() < deadline, f"no step 2 in 300 s: {output_of(site, job)[-4000:]}"
        time.sleep(1)

    status = trainer("status", site, "--run-name", "live", env=env)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"of job {job} (running)" in status.stdout, status.stdout
    assert "[sn0] node 0: running" in status.stdout and "[sn1] node 1: running" in status.stdout

    logs = trainer("logs", site, "--run-name", "live", "--lines", "5", env=env)
    assert logs.returncode == 0 and "[sn0] " in logs.stdout and "[sn1] " in logs.stdout, logs.stdout

    started = time.monotonic()
    stop = trainer("stop", site, "--run-name", "live", env=env)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert f"stopped its Slurm step {job}." in stop.stdout and "on sn0, sn1 (scancel)" in stop.stdout
    assert slurm.wait(job, 120) == "FAILED" and slurm.job(job).get("ExitCode") == f"{exitcodes.INTERRUPTED}:0"
    output = output_of(site, job)
    assert "stopped: run live was stopped on sn0, sn1 from outside this launcher" in output, output[-4000:]
    assert time.monotonic() - started < 60
    after = trainer("status", site, "--run-name", "live", env=env)
    assert "(ended)" in after.stdout and "[sn1] node 1: stopped" in after.stdout, after.stdout
    history = [json.loads(line) for line in (site[1] / "runs" / "live" / "launch" / "history.jsonl").open()]
    assert history[-1]["event"] == "stopped" and history[-1]["why"] == "stop_command", history


#: A user's own torchrun script: every rank all-reduces a 1 and says the sum (the world size), then leaves
#: once all have (os._exit: gloo's teardown under a static rendezvous can abort after the barrier).
OWN_SCRIPT = """import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {total.item():.0f}", flush=True)
dist.barrier()
os._exit(0)
"""


@pytest.mark.slow
def test_your_own_torchrun_command_runs_as_one_step_whose_ranks_join_one_world(slurm, site):
    """`salloc --nodes=2 trainer launch -i INVENTORY -- torchrun own.py`: your command runs on the
    allocation's nodes as one srun step, torchrun on each node with the topology in its environment
    (two processes a node: world size 4, the head at Slurm's address), and the launcher follows it to
    its end on both nodes as over SSH."""
    script = site[1] / "own_allreduce.py"
    script.write_text(OWN_SCRIPT)
    command = [str(VENV / "bin" / "python"), "-m", "trainer", "launch", "-i", str(site[0]),
               "--run-name", "own", "--poll-interval", "1", "--", "torchrun", str(script)]  # fmt: skip
    done = subprocess.run(
        ["salloc", "--nodes=2", *command],
        capture_output=True,
        text=True,
        timeout=300,
        env=slurm.env,
        cwd=REPO,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:] + slurm.logs()
    assert "as Slurm step clustertrain-" in output and "on 2 node(s): sn0, sn1" in output, output[-4000:]
    assert "done: run own finished on all 2 node(s)" in output, output[-4000:]
    launch = site[1] / "runs" / "own" / "launch"
    said = "".join((launch / f"node-{node}" / "log").read_text() for node in (0, 1))
    for rank in range(4):
        assert f"rank {rank} of 4: sum 4" in said, said
    for node in (0, 1):
        assert json.loads((launch / f"node-{node}" / "exit").read_text())["exit_code"] == 0
        assert "torchrun" in (launch / f"node-{node}" / "run.sh").read_text()


@pytest.mark.slow
def test_plan_inside_salloc_says_what_slurm_is_asked_for(slurm, site):
    inventory, _ = site
    done = subprocess.run(
        ["salloc", "--nodes=2", sys.executable, "-m", "trainer", "plan", "-i", str(inventory), "--run-name", "p"],  # noqa: E501
        capture_output=True, text=True, timeout=180, env=slurm.env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = " ".join(done.stdout.split())  # rich wraps the table's lines
    job = done.stderr.split("Granted job allocation ")[1].split()[0]
    # The topology is the allocation's: its nodes, the head at Slurm's address for sn0.
    assert f"│ MASTER_ADDR │ {slurm.addresses['sn0']} │" in out, out
    assert f"│ 1 │ sn1 │ {slurm.addresses['sn1']} │ 2-3 │" in out, out
    assert f"Slurm: inside allocation {job}, `trainer launch` runs one step on its 2 node(s)" in out, out
    # salloc's allocation is no batch job: Slurm cannot requeue it, and the plan says so.
    assert "At the time limit: with `--signal=USR2@SECONDS`" in out, out
    assert f"job {job} is not requeued (it is an interactive allocation (salloc)" in out, out
    assert f"srun --jobid={job} --job-name=clustertrain-LAUNCH_ID --nodes=2 --ntasks=2" in out, out
    assert "--nodelist=sn0,sn1 --kill-on-bad-exit=0 /bin/bash" in out, out
