"""What `trainer launch` inside a Slurm batch job does once its run stopped at a checkpoint on request
(issue 40): Slurm's warning before the job's end (`#SBATCH --signal=USR2@SECONDS`, which `trainer
sbatch` writes; or `scancel --signal=USR2` before a preemption) reached the ranks, the trainer saved
the step it was in and stopped (exit STOPPED_AT_CHECKPOINT), and the restart policy (restarts.py)
hands the outcome here, after the run's lock is released.

Requeue, not a follow-up job: `scontrol requeue` puts the same job back in the queue, with its id, its
script and its options, so the batch script runs `trainer launch` with the same --run-name again and
the trainer resumes from the checkpoint the signal wrote (checkpoint.resume auto). Slurm requeues only
a batch job that allows it (`--requeue`, or the cluster's JobRequeue=1: scontrol's Requeue=1); an
salloc allocation or a job with --no-requeue is not, and the line says to run the same command again.
Requeueing a running job ends it: Slurm sends TERM to this launcher too, which it ignores from here
(it exits on its own a moment later, with the run's code; Slurm's KILL follows after KillWait).
"""

from __future__ import annotations

import signal
from pathlib import Path

from trainer.controller.launcher.failure import Outcome
from trainer.controller.launcher.live import LiveView
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.restarts import checkpoint_name, saved_line
from trainer.controller.launcher.slurm_allocation import SlurmError, requeue_blocker, slurm
from trainer.controller.launcher.slurm_runs import node_helper


def requeue_after_save(plan: JobPlan, job: str, view: LiveView, outcome: Outcome) -> None:
    """Requeue `job` where Slurm allows it, saying so in one line; else say how to resume."""
    what = saved_line(outcome)
    try:
        blocker = requeue_blocker(job)
    except SlurmError as err:
        blocker = str(err)
    if blocker is None:
        # Slurm ends this job to requeue it: its TERM reaches this launcher, which has nothing left
        # to stop (the step has ended) and exits with the run's code on its own.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            slurm("scontrol", "requeue", job)
        except SlurmError as err:
            blocker = str(err)
    if blocker is not None:
        view.message(
            f"[yellow]{what}[/yellow]; Slurm job {job} is not requeued ({blocker}): run the same "
            "`trainer launch` again (same --run-name) to resume from it"
        )
        return
    node_helper().append_record(
        Path(plan.launch_dir), {"event": "requeued", "job": job, "resume_from": outcome.latest_checkpoint}
    )
    name = checkpoint_name(outcome.latest_checkpoint) or "that checkpoint"
    view.message(
        f"[yellow]{what}[/yellow]; Slurm job {job} requeued: it runs this script again and resumes "
        f"from {name}"
    )
