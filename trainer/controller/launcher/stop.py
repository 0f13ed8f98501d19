"""`trainer stop -i INVENTORY [--run-name NAME]`: stop a run on every node of its last launch.

The launch's nodes are read from the head first (`launch.json`): after `--exclude-failed` they are
fewer than the inventory's and numbered anew, so the inventory alone would stop the wrong node dirs.
Then stop.yml stops each node's trainer (node_ctl.py `stop`: TERM to its process group, KILL to what
is left after --stop-grace) and the head's history.jsonl records who stopped it. A launcher or
`trainer attach` that follows the run sees every node stopped and ends. `trainer launch --stop` is
this same stop.

The run's lock is left alone: a launcher that still runs releases its own as it ends; the lock of
one that died stays, and the stop says so and what the next launch needs (`--force`).
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import socket
import sys
import time
from typing import Any

from trainer import exitcodes
from trainer.controller.access import add_access_arguments, configure_access
from trainer.controller.inventory import Cluster, PlanningError, load_cluster
from trainer.controller.launcher.launch import Launcher
from trainer.controller.launcher.launch_record import LaunchRecord
from trainer.controller.launcher.live import LiveView, node_text, printable
from trainer.controller.launcher.plan import DEFAULT_RUN_NAME, JobPlan, make_plan
from trainer.controller.launcher.runlock import describe_holder, holder_state
from trainer.controller.launcher.slurm_allocation import SlurmError
from trainer.controller.launcher.slurm_follow import (
    CANCEL_END_S,
    CurrentJob,
    cancel_job,
    current_job,
    job_state,
    wait_for_end,
)
from trainer.controller.launcher.slurm_runs import request_stop, slurm_launch, step_running
from trainer.controller.launcher.slurm_steps import SlurmRecord
from trainer.controller.launcher.status import MALFORMED, read_launch_record
from trainer.controller.launcher.wire import STOP_TASK, WatchOptions
from trainer.controller.runner import PlaybookResult

EXAMPLES = (
    "trainer stop -i inventory/mycluster --run-name qwen-lora",
    "trainer stop -i inventory/local --stop-grace 60  # the default run; 60 s to exit before KILL",
)


class StopError(Exception):
    """The stop cannot go ahead (bad input); nothing was stopped. The message says why and the fix."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--inventory", required=True, help="inventory directory or file")
    parser.add_argument("--run-name", default=DEFAULT_RUN_NAME, help="the run to stop (default: %(default)s)")
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds each node's trainer gets between TERM and KILL (default: %(default)g)",
    )
    add_access_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.stop_grace < 0:
        print("trainer stop: --stop-grace must be 0 or more seconds", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    try:
        configure_access(args)
        cluster = load_cluster(args.inventory)
    except PlanningError as err:
        print(f"trainer stop: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    return stop_run(cluster, args.run_name, WatchOptions(stop_grace_s=args.stop_grace), "trainer stop")


def stop_run(cluster: Cluster, run_name: str, options: WatchOptions, verb: str) -> int:
    """Stop run `run_name` on every node of its last launch, a line per node; the exit code."""
    view = LiveView()
    try:
        plan = make_plan(cluster, run_name=run_name)
        if (job := current_job(plan)) is not None and job.live:
            return stop_submitted_job(plan, job, options, verb)
        if (slurm_run := slurm_launch(plan)) is not None:
            return stop_slurm_run(plan, slurm_run, options, verb)
        record, head_report, problem = read_launch_record(plan)
        if record is not None and record.nodes is None:
            # A stop goes on whatever the head's records say: every node of the inventory.
            view.message(f"run {run_name}: {MALFORMED}: stopping the run on every node of the inventory")
        elif record is not None:
            plan = launched_plan(cluster, run_name, record.nodes)
        elif head_report is not None and run_name not in (head_report.get("runs") or []):
            raise StopError(problem)
        else:
            # The head does not answer, or started nothing of a run that exists (its start failed):
            # the inventory's nodes are the best guess of where the launch runs.
            view.message(f"{node_text(problem)}: stopping the run on every node of the inventory")
    except (PlanningError, StopError) as err:
        print(f"{verb}: {printable(str(err))}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    launcher = Launcher(plan, options, command=verb)
    launcher.adopt(record)
    result = launcher.stop(record=stop_record(record, verb))
    report_stop(launcher, result, view)
    holder = (head_report or {}).get("lock")
    if holder and holder_state(holder) == "dead":
        view.message(
            f"run {run_name} stays locked by {node_text(describe_holder(holder))}, which no longer runs: "
            "the next `trainer launch` of it needs --force (or `trainer attach` takes the lock and ends at "
            "once)"
        )
    return exitcodes.OK if result.succeeded else exitcodes.FAILURE


def stop_slurm_run(plan: JobPlan, record: SlurmRecord, options: WatchOptions, verb: str) -> int:
    """Stop a run whose latest launch is a Slurm step (guest.py): scancel of the step, after marking
    its nodes stop-requested; back once Slurm no longer lists the step (or after the stop grace and a
    minute more)."""
    try:
        cancelled = request_stop(plan, record, stop_record(None, verb))
        deadline = time.monotonic() + options.stop_grace_s + 60.0
        while cancelled and step_running(record) and time.monotonic() < deadline:
            time.sleep(0.5)
        still = cancelled and step_running(record)
    except SlurmError as err:
        print(f"{verb}: run {plan.run_name}: {printable(str(err))}", file=sys.stderr)
        return exitcodes.FAILURE
    step = f"Slurm step {record.step or record.step_name} of job {record.job}"
    nodes = ", ".join(sorted(record.nodes, key=lambda host: record.nodes[host]))
    if not cancelled:
        print(f"run {plan.run_name}: its {step} is not running; nothing to stop")
    elif still:
        print(f"{verb}: run {plan.run_name}: the {step} was cancelled but still runs; see squeue --steps")
        return exitcodes.FAILURE
    else:
        print(f"run {plan.run_name}: stopped its {step} on {nodes} (scancel)")
    return exitcodes.OK


def stop_submitted_job(plan: JobPlan, job: CurrentJob, options: WatchOptions, verb: str) -> int:
    """Stop a run submitted from a login node (slurm_login.py): its step cancelled as stop_slurm_run
    does, so that the job's launcher names the stop and ends with it (its code goes to the follower);
    then scancel of the job itself if it still runs after the stop grace (or at once while it waits)."""
    name = f"Slurm job {job.record.job}"
    try:
        if job.step is not None:
            request_stop(plan, job.step, stop_record(None, verb))
            state = wait_for_end(job.record.job, options.stop_grace_s + CANCEL_END_S / 2)
        else:
            state = job_state(job.record.job)
        cancelled = state.live and cancel_job(job.record.job)
        if cancelled:
            state = wait_for_end(job.record.job, options.stop_grace_s + CANCEL_END_S)
    except SlurmError as err:
        print(f"{verb}: run {plan.run_name}: {printable(str(err))}", file=sys.stderr)
        return exitcodes.FAILURE
    if job.step is None:
        how = "scancel of the job"
    elif cancelled:
        how = "scancel of its step, then of the job, which still ran"
    else:
        how = "scancel of its step; the job's trainer launch ended with it"
    if state.live:
        print(f"{verb}: run {plan.run_name}: {name} is still {state.describe()} after {how}; see squeue")
        return exitcodes.FAILURE
    print(f"run {plan.run_name}: stopped its {name} ({how}); it is {state.describe()}")
    return exitcodes.OK


def launched_plan(cluster: Cluster, run_name: str, nodes: dict[str, int]) -> JobPlan:
    """The plan of the launch on `nodes` (launch.json's host -> node rank): its own nodes, with their own
    ranks."""
    plan = make_plan(
        dataclasses.replace(cluster, workers=tuple(h for h in cluster.workers if h.name in nodes)),
        run_name=run_name,
    )
    if {n.host: n.node_rank for n in plan.topology.nodes} != nodes:
        raise StopError(
            f"run {run_name}'s last launch ran on {nodes} (node -> rank), which the inventory no longer "
            "matches; give the inventory it was launched with"
        )
    return plan


def stop_record(launch: LaunchRecord | None, verb: str) -> dict[str, Any]:
    """The head's history record of this stop: who asked for it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return {
        "event": "stopped",
        "launch_id": launch.launch_id if launch else None,
        "attempt": launch.attempt if launch else None,
        "why": "stop_command",
        "detail": f"{verb} by {user} on {socket.gethostname()}",
        "hosts": [],
    }


def report_stop(launcher: Launcher, result: PlaybookResult, view: LiveView) -> None:
    """One line per node: stopped, not running, or why the stop could not be confirmed there."""
    for node in launcher.plan.topology.nodes:
        item = result.task_result(node.host, STOP_TASK)
        if item is not None and item.status == "ok":
            state = "stopped" if item.result.get("stopped") else "not running"
        elif node.host in result.unreachable:
            message = result.unreachable[node.host][-1].message.splitlines()
            state = f"unreachable ({message[0][:200] if message else 'no answer'}): its trainer may still run"
        else:
            state = f"could not stop: {item.message if item else 'no answer'}"
        view.log(f"[{node.host}] node {node.node_rank}: {state}")
