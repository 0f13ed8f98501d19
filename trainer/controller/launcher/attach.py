"""`trainer attach -i INVENTORY [--run-name NAME]`: follow a running launch again after its launcher
died (`kill -9`, a lost controller session), to its end.

It reads what started the launch from the head (`launch.json`: the nodes and ranks, the watch
settings, the bundled trainer or your command), then does what the launcher would have done: rank
0's log and a state line per host, `unreachable (Ns)` and the grace, the stall watchdog, and on
the first failure, on Ctrl-C, TERM or HUP, a stop on every node naming the cause. The exit code is
the launch's.

The run's lock (runlock.py): attach needs none to follow. It adopts the lock when its holder is
verifiably dead (a launcher of this controller whose pid no longer runs) or when there is none, so no
second launch of the run starts while it follows, and releases it when the run ends (the next launch
then needs no --force); a holder that still runs, or one on another controller, keeps its lock.

A run submitted from a Slurm login node (`trainer launch --slurm`) is followed as that command follows
it (slurm_follow.py): the job's output and its state, to its end and its exit code; Ctrl-C cancels it.

Restarts: launch.json records the launch's --max-restarts and the restarts used. When attach holds
the lock (the launcher that started the run is dead), it honours what is left: on a failure it
stops every node and starts each node's run.sh again as the launcher wrote it (with its secret
variables and the run's files, as they are on the shared dir: attach has not the launch's config,
--set and --env to write them anew), so the bundled trainer resumes from the latest checkpoint.
The restarts follow the launcher's policy (restarts.RestartPolicy): bad input is never restarted, a
lost head is said plainly. A lost node cannot be left out here (that needs a new plan from the
launch's config): attach says so and what to run. When the lock stays with a launcher that runs, or
one that cannot be checked, attach does not restart (that launcher restarts the run itself, if it
runs); it says what to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from trainer import exitcodes
from trainer.controller.access import add_access_arguments, configure_access
from trainer.controller.inventory import PlanningError, load_cluster
from trainer.controller.launcher.launch import Launcher
from trainer.controller.launcher.launch_cli import (
    add_watch_arguments,
    follow_problem,
    install_signal_handlers,
    watch_options,
)
from trainer.controller.launcher.launch_record import LaunchRecord, RestartState
from trainer.controller.launcher.live import LiveView, node_text, printable
from trainer.controller.launcher.plan import DEFAULT_RUN_NAME, JobPlan, make_plan
from trainer.controller.launcher.restarts import RestartPolicy
from trainer.controller.launcher.runlock import LockError, describe_holder, holder_state
from trainer.controller.launcher.slurm_follow import (
    CurrentJob,
    JobFollower,
    current_job,
    relaunch_advice,
    tail_offset,
)
from trainer.controller.launcher.slurm_login import poll_interval
from trainer.controller.launcher.slurm_runs import slurm_launch
from trainer.controller.launcher.status import MALFORMED, launcher_alive, read_launch_record

#: The lines of a login-submitted job's output shown before its new ones.
ATTACH_TAIL_LINES = 20
EXAMPLES = ("trainer attach -i inventory/mycluster --run-name qwen-lora  # after its launcher died",)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--inventory", required=True, help="inventory directory or file")
    parser.add_argument(
        "--run-name", default=DEFAULT_RUN_NAME, help="the run to follow (default: %(default)s)"
    )
    add_watch_arguments(parser)
    add_access_arguments(parser)


def launch_to_follow(args: argparse.Namespace) -> tuple[JobPlan, LaunchRecord] | int:
    """The running launch's plan (its own nodes and kind of job, from the head's launch.json) and its
    record; or the exit code, said why, when there is none to follow."""
    try:
        configure_access(args)
        cluster = load_cluster(args.inventory)
        plan = make_plan(cluster, run_name=args.run_name)
    except PlanningError as err:
        print(f"trainer attach: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if (job := current_job(plan)) is not None and job.live:
        return follow_submitted(plan, job, args)
    if (slurm_run := slurm_launch(plan)) is not None:
        step = f"Slurm step {slurm_run.step or slurm_run.step_name} of job {slurm_run.job}"
        print(
            f"trainer attach: run {printable(args.run_name)}'s latest launch is {printable(step)}, which "
            "attach does not follow yet: read it with `trainer logs -f` and `trainer status`, stop it with "
            "`trainer stop` (same -i and --run-name)",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    record, _, problem = read_launch_record(plan)
    nodes = record.nodes if record is not None else None
    if record is None or nodes is None:
        print(f"trainer attach: {printable(problem or f'run {args.run_name}: {MALFORMED}')}", file=sys.stderr)
        return exitcodes.FAILURE
    try:
        # The launch's own nodes (--exclude-failed may have left some out) and kind of job.
        cluster = dataclasses.replace(cluster, workers=tuple(h for h in cluster.workers if h.name in nodes))
        plan = make_plan(cluster, run_name=args.run_name, command=record.command)
    except PlanningError as err:
        print(f"trainer attach: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if {n.host: n.node_rank for n in plan.topology.nodes} != nodes:
        print(
            f"trainer attach: the launch's nodes {printable(str(nodes))} no longer match the inventory; "
            "attach with the inventory it was launched with",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    if problem := follow_problem(len(nodes)):
        print(f"trainer attach: {problem}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    return plan, record


def follow_submitted(plan: JobPlan, job: CurrentJob, args: argparse.Namespace) -> int:
    """Follow a run's job submitted from a login node (slurm_login.py) as the `trainer launch --slurm`
    that submitted it does: the last lines of its output, then its new ones, to its end; its exit code.
    Ctrl-C (TERM, HUP) cancels the job, as attach stops an SSH launch's nodes."""
    view = LiveView()
    install_signal_handlers(view)
    record = job.record
    follower = JobFollower(record.job, plan.launch_dir, view, poll_interval(args))
    follower.offset = tail_offset(follower.output, ATTACH_TAIL_LINES)
    view.message(
        f"following run {node_text(plan.run_name)}'s Slurm job {record.job}, submitted from "
        f"{node_text(record.host)} (trainer launch --slurm, pid {record.follower_pid}); Ctrl-C cancels it"
    )
    code = follower.follow()
    if follower.lost_batch_node:  # the launching command resubmits; attach only follows
        view.message(
            f"{node_text(follower.lost_batch_node)} was lost; {relaunch_advice(follower.lost_batch_node)}"
        )
    return code


def run(args: argparse.Namespace) -> int:
    found = launch_to_follow(args)
    if isinstance(found, int):
        return found
    plan, record = found
    launcher = Launcher(
        plan, watch_options(args, plan.runs_bundled_trainer, saved=record.watch), command="trainer attach"
    )
    launcher.adopt(record)
    view = LiveView()
    if launcher_alive(record):
        view.message(
            f"note: the launcher that started this launch (pid {record.launcher_pid}) still runs and "
            "follows it too"
        )
    install_signal_handlers(view)
    adopt_lock(launcher, view)
    kept = record.restart or RestartState()
    max_restarts, used = kept.max_restarts, kept.restarts
    may_restart = launcher.lock.held and used < max_restarts
    policy = RestartPolicy(
        launcher,
        view,
        max_restarts=max_restarts if may_restart else 0,
        restarts_used=used,
        inventory=str(args.inventory),
    )
    try:
        # The lock stays held through the follow's stop when a restart may come.
        outcome = launcher.follow(view, policy=policy.state(), final=not may_restart)
        if outcome.code in (exitcodes.OK, exitcodes.INTERRUPTED) or not outcome.restartable:
            policy.go_on(outcome)  # says why not (bad input, the head lost)
            return outcome.code
        if may_restart:
            launcher.reuse_node_files = True
            if not outcome.lost:
                view.message(
                    f"this launch had --max-restarts {max_restarts} ({used} used): attach restarts each "
                    "node's run.sh as the launcher wrote it"
                )
            return policy.go_on(outcome)
        if used < max_restarts:
            view.message(
                f"not restarted by attach: the run's lock is not this attach's (its launcher may still "
                f"run and restart it); if it is dead, relaunch with `trainer launch -i {args.inventory} "
                f"--run-name {args.run_name} --max-restarts {max_restarts - used}` and the launch's other "
                "options: the bundled trainer resumes from the latest checkpoint"
            )
        return outcome.code
    except KeyboardInterrupt:
        view.message(f"interrupted between two attempts: nothing of run {args.run_name} runs")
        return exitcodes.INTERRUPTED
    except Exception as err:
        launcher.stop_after_error(view, err)  # never left running with its lock released
        raise
    finally:
        launcher.release_lock(view)


def adopt_lock(launcher: Launcher, view: LiveView) -> None:
    """Take the run's lock when nobody holds it or its holder is verifiably dead; else leave it."""
    run_name = launcher.plan.run_name
    try:
        answer = launcher.lock_call("acquire")
        if answer.get("acquired"):
            return
        holder = answer.get("holder") or {}
        if holder_state(holder) != "dead":
            view.log(f"note: run {run_name}'s lock stays with {describe_holder(holder)}")
            return
        answer = launcher.lock_call("acquire", take_over=str(holder.get("token") or ""))
        if answer.get("acquired"):
            view.log(f"took over run {run_name}'s lock from {describe_holder(holder)}, which no longer runs")
    except LockError as err:
        view.log(f"note: following without the run's lock ({err})")
