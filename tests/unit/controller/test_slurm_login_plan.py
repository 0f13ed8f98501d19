"""`trainer plan/launch --slurm` on a login node (issue 40), the parts that need no Slurm: what the plan
says Slurm will be asked for (the sbatch line and the batch script, which runs `trainer launch` in the
allocation with the same options and no secret), and the Slurm options' mistakes, each refused with
its fix. The submission and its following, on a real Slurm: tests/local/test_slurm_login.py."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
from pathlib import Path

from helpers.plan_inventory import three_nodes

REPO = Path(__file__).resolve().parents[3]
SECRET = "tok-4f1d-never-in-a-script"


def trainer(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # Outside any allocation, as on a login node, unless the case sets one.
    env = {**{k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "trainer", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )


def test_plan_slurm_shows_the_job_slurm_is_asked_for_and_its_script_without_the_secret(tmp_path):
    shared = tmp_path / "shared"
    inventory = three_nodes(tmp_path, cluster_training_user=getpass.getuser(), cluster_shared_dir=str(shared))
    done = trainer(
        "plan", "-i", str(inventory), "--run-name", "p", "--slurm", "--nodes", "2", "--time", "00:30:00",
        "--partition", "gpu", "--env", "CT_API_TOKEN", "--set", "train.max_steps=7",
        env={"CT_API_TOKEN": SECRET},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "2 node(s), one task per node, 2 process(es) per node, time 00:30:00, partition gpu" in out, out
    assert "slurm-node-N above stand for them" in out and "slurm-node-1" in out, out
    launch = shared / "runs" / "p" / "launch"
    assert (
        f"Submitted as: sbatch --parsable --output={launch}/slurm-batch-%j.out {launch}/slurm-batch.sh" in out
    )
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--time=00:30:00", "--partition=gpu"):
        assert f"#SBATCH {directive}\n" in out, directive
    # The bundled trainer: Slurm's warning signal saves, and the job may be requeued.
    assert "#SBATCH --signal=USR2@120\n#SBATCH --requeue\n" in out, out
    # The job's trainer launch: the same options, the secret by name only, read from a 0600 file.
    assert (
        f"-m trainer launch -i {inventory.resolve()} --run-name p --set train.max_steps=7 --env CT_API_TOKEN"
        in out
    )
    assert f". {launch}/slurm-secret-env || exit 2" in out, out
    assert SECRET not in out + done.stderr
    assert not launch.exists(), "a plan writes nothing"


def test_the_slurm_options_mistakes_are_refused_with_the_fix(tmp_path):
    inventory = three_nodes(tmp_path, cluster_training_user=getpass.getuser())
    base = ("launch", "-i", str(inventory))
    cases = [
        ((*base, "--time", "1:00"), {}, "--time: only with --slurm (a batch job from a login node)"),
        ((*base, "--slurm", "--warning-seconds", "70000"), {}, "--warning-seconds must be 0 to 65535"),
        ((*base, "--slurm", "--nodes", "0"), {}, "--nodes must be 1 or more, not 0"),
        ((*base, "--slurm"), {"SLURM_JOB_ID": "77"}, "this runs inside Slurm job 77: leave --slurm out"),
        (("plan", "-i", str(inventory), "--slurm", "--over-ssh"), {}, "--slurm and --over-ssh: give one"),
    ]
    for argv, env, message in cases:
        done = trainer(*argv, env=env)
        assert done.returncode == 2 and message in done.stderr, (argv, done.stderr)
