"""A Slurm job's end, warned of (issue 40): Slurm sends SIGUSR2 to every process of the job's steps
(`--signal=USR2@SECONDS` before the time limit; here `scancel --signal=USR2 JOB`, which the scancel
manual gives as the same delivery: the steps, not the batch shell), the bundled trainer saves the step
it is in and stops, and `trainer launch` (guest mode, the job's batch script) requeues the job; the
requeued job runs the same script, resumes from that checkpoint and ends as an uninterrupted run does.

The Slurm is tests/helpers/slurm_cluster.py with two slurmd, each node in a network namespace of its
own, and cred_expire short: a requeued job waits that long before it may start again (Slurm's default
is 120 s). One process per node, DDP on gloo. It needs root and the Debian packages slurmctld, slurmd,
slurm-client and munge; without them it is skipped.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import pytest
from helpers.loopback import VENV
from helpers.slurm_cluster import SlurmCluster, slurm_for_test
from helpers.slurm_site import guest_inventory

REPO = Path(__file__).resolve().parents[2]
#: Long enough to be mid-run when the signal comes; no periodic checkpoint (the only ones are the
#: signal's and the last step's).
STEPS = [
    "--set", "train.max_steps=60", "--set", "train.micro_batch_size=2", "--set", "train.log_every=1",
    "--set", "train.warmup_steps=1", "--set", "checkpoint.save_steps=1000",
]  # fmt: skip
#: Seconds a requeued job waits before it may start again (AuthInfo's cred_expire).
CRED_EXPIRE_S = 10


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with slurm_for_test(
        tmp_path_factory.mktemp("slurm-pre"), nodes=2, cred_expire_s=CRED_EXPIRE_S
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, Path]:
    return guest_inventory(tmp_path_factory.mktemp("guest-pre"), procs_per_node=1, master_port=29535)


def submit(slurm: SlurmCluster, site: tuple[Path, Path], run_name: str) -> str:
    """A 2-node batch job whose script is `trainer launch` of the bundled trainer, as `trainer sbatch`
    asks for it: requeueable, its output appended to across runs."""
    command = [str(VENV / "bin" / "python"), "-m", "trainer", "launch", "-i", str(site[0])]
    command += ["--run-name", run_name, "--poll-interval", "1", *STEPS]
    script = site[1] / f"{run_name}.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --requeue\n"
        f"#SBATCH --open-mode=append\ncd {REPO}\nexec {shlex.join(command)}\n"
    )
    return slurm.submit(script, cwd=site[1])


def steps_logged(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def wait_until(condition, timeout_s: float, what: str, slurm: SlurmCluster) -> float:
    """Poll `condition` every 0.2 s; the time it became true (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {timeout_s:.0f} s:\n{slurm.logs()}"
        time.sleep(0.2)
    return time.monotonic()


def finished(slurm: SlurmCluster, site: tuple[Path, Path], job: str, run_name: str) -> tuple[str, dict]:
    state = slurm.wait(job, 600)
    output = (site[1] / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{output[-6000:]}\n{slurm.logs()}"
    return output, json.loads((site[1] / "runs" / run_name / "summary.json").read_text())


@pytest.mark.slow
def test_slurms_warning_signal_checkpoints_requeues_and_the_run_resumes_to_the_same_loss(slurm, site):
    started = time.monotonic()
    _, straight = finished(slurm, site, submit(slurm, site, "straight"), "straight")
    print(f"slurm preemption: uninterrupted run {time.monotonic() - started:.0f} s")

    run_dir = site[1] / "runs" / "warned"
    job = submit(slurm, site, "warned")
    wait_until(lambda: len(steps_logged(run_dir)) >= 5, 300, "step 5 logged", slurm)
    signalled = time.monotonic()
    # The steps' processes only, as `--signal=USR2@SECONDS` without B: sends it at the time limit.
    subprocess.run(["scancel", "--signal=USR2", job], env=slurm.env, check=True, timeout=30)
    checkpoints = run_dir / "checkpoints"
    saved = wait_until(lambda: (checkpoints / "latest").exists(), 120, "checkpoint", slurm)
    requeued = wait_until(lambda: slurm.job(job).get("Restarts") == "1", 120, "requeue", slurm)
    # Right after the requeue the only checkpoint is the signal's, mid-run (save_steps is 1000).
    written = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-"))
    assert len(written) == 1, written
    step = int(written[0].removeprefix("step-"))
    assert 5 <= step < 60, written
    assert steps_logged(run_dir)[-1] == step, "the last step trained is the one saved"
    resumed = wait_until(
        lambda: steps_logged(run_dir)[-1] > step, 300, "the requeued job's first step", slurm
    )
    print(
        f"slurm preemption: signal -> checkpoint {saved - signalled:.1f} s, -> requeued "
        f"{requeued - signalled:.1f} s, -> the requeued job's first step {resumed - signalled:.1f} s "
        f"(cred_expire {CRED_EXPIRE_S} s)"
    )

    output, summary = finished(slurm, site, job, "warned")
    print(f"slurm preemption: preempted run {time.monotonic() - started:.0f} s in all")
    line = f"checkpointed at step {step} on request (exit code 5); Slurm job {job} requeued"
    assert line in output, output[-6000:]
    # A requested stop, not a failure: the report and each node's line say so.
    assert f"stopped on request: stopped at step {step} after its checkpoint, as SIGUSR2 asked" in output
    for node in ("[sn0] node 0", "[sn1] node 1"):
        assert f"{node}: stopped at a checkpoint on request" in output, output[-6000:]
    assert "failed: " not in output and "node 1: failed" not in output, output[-6000:]
    assert slurm.job(job).get("Restarts") == "1", "requeued once, and only once"
    assert summary["resumed_from"].endswith(f"/{written[0]}") and summary["final_step"] == 60
    assert f"resumed from {checkpoints / written[0]} at step {step}" in output, output[-6000:]
    records = [json.loads(r) for r in (run_dir / "launch" / "history.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["launch", "stopped", "requeued", "launch"], records
    # DDP on the CPU over gloo, two ranks: the resumed run trains exactly as the uninterrupted one.
    assert summary["final_loss"] == straight["final_loss"], (summary["final_loss"], straight["final_loss"])
