"""`trainer launch --slurm` on a Slurm cluster's login node (issue 40): plan the job here, submit ONE
batch job whose script runs the same `trainer launch` inside the allocation (guest mode: guest.py runs
the nodes as steps, with the same diagnosis, restarts and lost-node exclusion), and follow it from here
to its end (slurm_follow.py), ending with the guest launcher's own exit code.

Checked here before anything is submitted: the options, the run name, the trainer config (the same
plan as in the job, on placeholder nodes that Slurm names when the job starts), the shared dir (the
script, its output and the secrets go there: this machine must see it at the nodes' path), and that no
job of the run is pending or running already. The secrets of `--env NAME` go to a file of the launch
dir, mode 0600, and are removed from the environment sbatch hands the job (Slurm keeps a job's
environment in its state); the script sources the file.

The one thing the job cannot survive is the loss of its batch node, where its launcher runs: the
follower sees it, cancels the job, and (--exclude-failed, a restart left) this module submits the run
again on one node fewer without it, the effective batch kept; the new job resumes from the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from trainer import exitcodes
from trainer.controller.inventory import PlanningError
from trainer.controller.launcher.live import LiveView, node_text
from trainer.controller.launcher.plan import JobPlan, slurm_login_plan
from trainer.controller.launcher.restarts import split_for_world
from trainer.controller.launcher.sbatch import write_private
from trainer.controller.launcher.slurm_allocation import SlurmError, slurm
from trainer.controller.launcher.slurm_batch import (
    BATCH_SCRIPT,
    CONFIG_COPY,
    SECRET_ENV,
    BatchJob,
    secret_lines,
)
from trainer.controller.launcher.slurm_follow import JobFollower, SubmittedJob, job_state, relaunch_advice
from trainer.controller.launcher.wire import WatchOptions


def run_from_login(args: argparse.Namespace, view: LiveView) -> int:
    """`trainer launch --slurm`: submit, follow, and exit with the job's launcher's code. `view` has
    the launch's signal handlers (TERM and HUP as Ctrl-C): the job is cancelled on them."""
    try:
        plan, job, secrets = slurm_login_plan(args)
        if problem := submit_problem(plan):
            raise PlanningError(problem)
    except (PlanningError, ValueError) as err:
        print(f"trainer launch: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED  # nothing submitted yet
    try:
        write_job_files(plan, job, args.config, secrets)
        submitted = submit(job, secrets)
    except (OSError, SlurmError) as err:
        print(f"trainer launch: cannot submit run {plan.run_name}: {err}", file=sys.stderr)
        return exitcodes.FAILURE
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED  # sbatch did not answer: no job id to cancel
    resubmits = 0
    while True:
        SubmittedJob.now(submitted).write(plan.launch_dir)
        follower = JobFollower(submitted, plan.launch_dir, view, poll_interval(args))
        view.message(
            f"submitted run {plan.run_name} as Slurm job {submitted}: {job.nodes} node(s), one task each, "
            f"{plan.topology.gpus_per_node} process(es) per node; following it here (one squeue a poll; "
            f"the job's output: {node_text(follower.output)}); Ctrl-C cancels it"
        )
        code = follower.follow()
        lost = follower.lost_batch_node
        if not lost:
            return code
        resubmission = without_lost_node(plan, job, args, lost, resubmits)
        if isinstance(resubmission, str):
            view.message(
                f"{node_text(lost)} was lost; not resubmitted: {resubmission}; {relaunch_advice(lost)}"
            )
            return code
        job, batch_text = resubmission
        resubmits += 1
        try:
            write_job_files(plan, job, args.config, secrets)
            submitted = submit(job, secrets)
        except (OSError, SlurmError) as err:
            view.message(f"[red]cannot resubmit run {plan.run_name}[/red]: {node_text(str(err))}")
            return code
        except KeyboardInterrupt:
            return exitcodes.INTERRUPTED
        view.message(
            f"[yellow]restart {resubmits} of {args.max_restarts}[/yellow]: {node_text(lost)} (the job's "
            f"batch node) lost; resubmitted on {job.nodes} node(s) without it "
            f"(--exclude={','.join(job.exclude)}; {batch_text}); the run resumes from its latest checkpoint"
        )


def without_lost_node(
    plan: JobPlan, job: BatchJob, args: argparse.Namespace, lost: str, resubmits: int
) -> tuple[BatchJob, str] | str:
    """The job again, on one node fewer and never on `lost`, the effective batch kept (or changed where
    --allow-batch-change allows); with what changed in the batch. Or why it is not resubmitted."""
    if not getattr(args, "exclude_failed", False):
        return "without --exclude-failed a lost node ends the run"
    if resubmits >= getattr(args, "max_restarts", 0):
        return f"every restart is used (--max-restarts {getattr(args, 'max_restarts', 0)})"
    nodes = job.nodes - 1
    if nodes < 1:
        return "no node of the job is left"
    options: list[str] = []
    batch_text = "the batch as before: your own command"
    if plan.runs_bundled_trainer:
        world = nodes * plan.topology.gpus_per_node
        split = split_for_world(plan, world, args.allow_batch_change)
        if split is None:
            return (
                f"the effective batch {plan.effective_batch_size} cannot be kept on {world} process(es) "
                "(--allow-batch-change goes on with the nearest)"
            )
        options += [arg for setting in split.overrides() for arg in ("--set", setting)]
        batch_text = split.change_from(plan)
    # The lost job's launcher held the run's lock and died with its node (the job is cancelled and
    # ended): the next one takes the lock over (--force).
    if "--force" not in job.guest_argv:
        options.append("--force")
    # After the job's own options (the later --set wins) and before your command's `--`, if any.
    guest = list(job.guest_argv)
    cut = guest.index("--") if "--" in guest else len(guest)
    guest[cut:cut] = options
    exclude = tuple(sorted({*job.exclude, lost}))
    return replace(job, nodes=nodes, exclude=exclude, guest_argv=tuple(guest)), batch_text


def poll_interval(args: argparse.Namespace) -> float:
    """Seconds between two squeue calls of a follower: --poll-interval, else a launch's own default."""
    given = getattr(args, "poll_interval", None)
    return float(given) if given is not None else WatchOptions.poll_interval_s


def submit_problem(plan: JobPlan) -> str | None:
    """Why this machine cannot submit the run (no shared dir here, a job of the run still live), or
    None: one squeue call where the run had a job."""
    if not Path(plan.shared_dir).is_dir():
        return (
            f"the shared dir {plan.shared_dir} is not on this machine: the job's script, its output and "
            "secrets go there; run trainer launch --slurm on a login node that mounts it at that path"
        )
    previous = SubmittedJob.read(plan.launch_dir)
    if previous is None:
        return None
    try:
        state = job_state(previous.job)
    except SlurmError as err:
        return f"Slurm does not answer: {err}"
    if state.live:
        return (
            f"run {plan.run_name} already has Slurm job {previous.job} ({state.describe()}): follow it with "
            "`trainer attach`, stop it with `trainer stop` (same -i and --run-name), or pick another "
            "--run-name"
        )
    return None


def write_job_files(plan: JobPlan, job: BatchJob, config: str | None, secrets: dict[str, str]) -> None:
    """The script (0755), the config copy and the secrets (0600) into the launch dir."""
    launch = Path(plan.launch_dir)
    launch.mkdir(parents=True, exist_ok=True)
    if config:
        write_private(launch / CONFIG_COPY, Path(config).read_text())
    if secrets:
        write_private(launch / SECRET_ENV, secret_lines(secrets))
    else:
        (launch / SECRET_ENV).unlink(missing_ok=True)
    script = launch / BATCH_SCRIPT
    tmp = script.with_name(f".{BATCH_SCRIPT}.{os.getpid()}")
    tmp.write_text(job.script())
    tmp.chmod(0o755)
    os.replace(tmp, script)


def submit(job: BatchJob, secrets: dict[str, str]) -> str:
    """sbatch of the script; the job id. The job's environment is this one's (sbatch's default)
    without the secret variables, which reach the job through SECRET_ENV only."""
    if shutil.which("sbatch") is None:
        raise SlurmError("sbatch is not on PATH: run trainer launch --slurm on a Slurm login node")
    env = {name: value for name, value in os.environ.items() if name not in secrets}
    answer = slurm(*job.sbatch_argv(), env=env)
    job_id = answer.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {answer.strip()!r}, not a job id")
    return job_id
