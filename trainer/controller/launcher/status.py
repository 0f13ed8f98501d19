"""`trainer status -i INVENTORY [--run-name NAME]`: where a launch stands, read from the nodes.

Each node's state (running, exited with its code, killed, nothing started), the step its ranks are
in (the bundled trainer), its last log lines, what started it (`launch.json` on every node: launch
id, attempt, the controller and launcher pid, the watch settings), and who holds the run's lock
(runlock.py) if anyone does. Nothing on the nodes changes. The head is read first: after
`--exclude-failed` the launch's nodes and ranks are the ones it recorded there, not the inventory's.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

from trainer import exitcodes
from trainer.controller.access import add_access_arguments, configure_access
from trainer.controller.forks import forks_for
from trainer.controller.inventory import PlanningError
from trainer.controller.launcher.launch_record import LaunchRecord
from trainer.controller.launcher.live import printable
from trainer.controller.launcher.plan import DEFAULT_RUN_NAME, JobPlan, make_plan
from trainer.controller.launcher.runlock import describe_holder, holder_state, time_text
from trainer.controller.launcher.slurm_allocation import SlurmError
from trainer.controller.launcher.slurm_follow import CurrentJob, current_job, describe_submitted
from trainer.controller.launcher.slurm_follow import summary as job_summary
from trainer.controller.launcher.slurm_runs import node_reports, slurm_launch, step_running
from trainer.controller.launcher.slurm_steps import SlurmRecord
from trainer.controller.runner import PlaybookResult, run_playbook

PLAYBOOKS = Path(__file__).parent / "playbooks"
STATUS_TASK = "Read the node's state"
COMMAND_TIMEOUT_S = 60
EXAMPLES = (
    "trainer status -i inventory/mycluster --run-name qwen-lora",
    "trainer status -i inventory/mycluster --run-name qwen-lora --lines 0 --json  # for tools",
)


def reading_vars(plan: JobPlan, nodes: dict[str, int], tail: int) -> dict[str, Any]:
    """The variables status.yml and watch.yml read a node's state with (`trainer status`, `logs`):
    `nodes` (host -> node rank), the training account, `tail` log lines."""
    return {
        "launch_nodes": {host: {"node_dir": str(plan.paths.node_dir(rank))} for host, rank in nodes.items()},
        "launch_training_user": plan.training_user,
        "launch_command_timeout_s": COMMAND_TIMEOUT_S,
        "launch_tail": tail,
    }


def reading_env(nodes: dict[str, int]) -> dict[str, str]:
    """ansible-playbook's environment for reading `nodes` (a worker per node at once)."""
    return {
        "ANSIBLE_FORKS": str(forks_for(len(nodes))),
        "ANSIBLE_NOCOLOR": "True",
        "ANSIBLE_GATHERING": "explicit",
    }


def read_nodes(plan: JobPlan, nodes: dict[str, int], tail: int) -> PlaybookResult:
    """status.yml on `nodes` (host -> node rank): each node's report, `tail` log lines."""
    return run_playbook(
        PLAYBOOKS / "status.yml",
        plan.topology.inventory,
        reading_vars(plan, nodes, tail),
        env=reading_env(nodes),
        limit=",".join(nodes),
    )


def report_of(result: PlaybookResult, host: str) -> dict[str, Any] | None:
    item = result.task_result(host, STATUS_TASK)
    return item.result if item is not None and item.status == "ok" else None


def problem_of(result: PlaybookResult, host: str) -> str:
    for items in (result.unreachable.get(host), result.failed.get(host)):
        if items:
            return (items[-1].message.splitlines() or [items[-1].status])[0][:200]
    return "no answer"


def read_launch_record(
    plan: JobPlan, tail: int = 0
) -> tuple[LaunchRecord | None, dict[str, Any] | None, str]:
    """(launch.json, the head's report, a problem): what the head says about the run's last launch."""
    head = plan.topology.head
    result = read_nodes(plan, {head.host: 0}, tail)
    report = report_of(result, head.host)
    if report is None:
        return None, None, f"cannot read the head {head.host}: {problem_of(result, head.host)}"
    if not report.get("info"):
        runs = [name for name in report.get("runs") or [] if name != plan.run_name]
        known = f"; runs launched there: {', '.join(runs)} (--run-name NAME)" if runs else ""
        return None, report, f"run {plan.run_name} has no launch on {head.host} ({plan.launch_dir}){known}"
    return LaunchRecord.from_json(report["info"]), report, ""


MALFORMED = "its launch.json on the head names no nodes as host -> node rank (it was changed there)"


def launcher_alive(record: LaunchRecord) -> bool:
    """Whether the launcher that started this launch still runs (known only on its own machine)."""
    if record.controller != socket.gethostname() or record.launcher_pid is None:
        return False
    try:
        command = Path(f"/proc/{record.launcher_pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"trainer" in command and (b"launch" in command or b"attach" in command)


def plan_for_status(args: argparse.Namespace) -> JobPlan:
    configure_access(args)
    return make_plan(args.inventory, run_name=args.run_name)


def describe_report(report: dict[str, Any] | None, problem: str = "") -> str:
    if report is None:
        return f"unreachable ({problem})"
    state = report.get("state")
    if state == "exited":
        code = (report.get("exit") or {}).get("exit_code")
        return f"stopped (exit code {code})" if report.get("stop_requested") else f"exited (exit code {code})"
    if state == "vanished":
        return "stopped" if report.get("stop_requested") else "killed (gone without an exit code)"
    if state == "none":
        return "not started here"
    return str(state)


def step_of(report: dict[str, Any] | None) -> str:
    ranks = (report or {}).get("progress") or []
    done = [r.get("done") for r in ranks if r.get("done") is not None]
    if not done:
        return ""
    return f"step {min(done)}" if min(done) == max(done) else f"steps {min(done)}-{max(done)}"


def say(text: str, file: Any = None) -> None:
    """Print one line of the report. Most of it comes from the nodes (their log lines, launch.json, the
    lock's holder, a failure's message), written by the training account or its ranks: control
    characters are spelled out (live.printable), as the live view and `trainer logs` show them."""
    print(printable(text), file=file or sys.stdout)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--inventory", required=True, help="inventory directory or file")
    parser.add_argument(
        "--run-name", default=DEFAULT_RUN_NAME, help="the run to report on (default: %(default)s)"
    )
    parser.add_argument("--lines", type=int, default=5, help="last log lines per node (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the nodes' reports as JSON")
    add_access_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_for_status(args)
    except PlanningError as err:
        print(f"trainer status: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if (job := current_job(plan)) is not None:
        return submitted_status(plan, job, args.lines, as_json=args.json)
    if (slurm_run := slurm_launch(plan)) is not None:
        return slurm_status(plan, slurm_run, args.lines, as_json=args.json)
    record, head_report, problem = read_launch_record(plan, args.lines)
    if record is None:
        say(f"trainer status: {problem}", file=sys.stderr)
        # The head answered and has no such run: the name is wrong (exit 2, as stop and logs). Else the
        # head is out of reach.
        return exitcodes.CONFIG_ERROR if head_report is not None else exitcodes.FAILURE
    nodes = record.nodes
    if nodes is None:
        say(f"trainer status: run {plan.run_name}: {MALFORMED}", file=sys.stderr)
        return exitcodes.FAILURE
    others = {host: rank for host, rank in nodes.items() if host != plan.topology.head.host}
    result = read_nodes(plan, others, args.lines) if others else None
    reports = {plan.topology.head.host: head_report}
    reports.update({host: report_of(result, host) for host in others} if result else {})
    if args.json:
        print(json.dumps({"info": record.as_read, "reports": reports}, indent=2))
        return exitcodes.OK if all(reports.values()) else exitcodes.FAILURE
    started = time_text(record.launched_at)
    follower = f"launcher pid {record.launcher_pid} on {record.controller}" + (
        " (still running)" if launcher_alive(record) else ""
    )
    what = "the bundled trainer" if record.bundled_trainer else "your command"
    say(
        f"run {plan.run_name}: launch {record.launch_id} (attempt {record.attempt or 1}) of {what} "
        f"on {len(nodes)} node(s), started {started} by {follower}"
    )
    lock = (head_report or {}).get("lock")
    if lock:
        state = holder_state(lock)
        say(
            f"lock: held by {describe_holder(lock)}"
            + {"alive": " (still running)", "dead": " (no longer running: a new launch needs --force)"}.get(
                state, ""
            )
        )
    left_out = [n.host for n in plan.topology.nodes if n.host not in nodes]
    if left_out:
        say(f"left out of this launch: {', '.join(left_out)}")
    for host, rank in sorted(nodes.items(), key=lambda item: item[1]):
        report = reports.get(host)
        state = describe_report(report, problem_of(result, host) if result and report is None else "")
        step = step_of(report)
        say(f"[{host}] node {rank}: {state}" + (f", {step}" if step else ""))
        for line in (report or {}).get("lines") or []:
            say(f"    {line}")
    say(
        f"each node's full log: {plan.paths.node_log('N')}; launches, restarts and stops: "
        f"{plan.paths.history}"
    )
    return exitcodes.OK if all(reports.get(host) for host in nodes) else exitcodes.FAILURE


def submitted_status(plan: JobPlan, job: CurrentJob, lines: int, *, as_json: bool) -> int:
    """`trainer status` of a run submitted from a login node (slurm_login.py): the job's line, then its
    step's nodes (slurm_status) once the job's launcher runs them."""
    if as_json and job.step is None:
        print(json.dumps({"job": job_summary(job.record, job.state), "reports": {}}, indent=2))
        return exitcodes.OK
    if not as_json:
        say(f"run {plan.run_name}: {describe_submitted(job.record, job.state)}")
    if job.step is None:
        say("no step of it runs yet: its nodes' lines come once the job's trainer launch starts them")
        return exitcodes.OK
    return slurm_status(plan, job.step, lines, as_json=as_json, job=job)


def slurm_status(
    plan: JobPlan, slurm_run: SlurmRecord, lines: int, *, as_json: bool, job: CurrentJob | None = None
) -> int:
    """`trainer status` of a run whose latest launch is a Slurm step (guest.py): the nodes' reports
    read from the shared dir, the step's state from one squeue call."""
    try:
        running: bool | None = step_running(slurm_run)
    except SlurmError as err:
        say(f"trainer status: {err}", file=sys.stderr)
        running = None  # each node's pid, as far as this host can tell
    offsets: dict[str, int | None] = dict.fromkeys(slurm_run.nodes)
    reports = node_reports(plan, slurm_run.nodes, offsets, bool(running), lines)
    info = next(iter(reports.values())).get("info") or {}
    if as_json:
        shown = {"info": info, "slurm": slurm_run.__dict__, "reports": reports}
        if job is not None:
            shown["job"] = job_summary(job.record, job.state)
        print(json.dumps(shown, indent=2))
        return exitcodes.OK
    record = LaunchRecord.from_json(info)
    step = f"Slurm step {slurm_run.step or slurm_run.step_name} of job {slurm_run.job}"
    state = {True: "running", False: "ended", None: "state unknown"}[running]
    what = "the bundled trainer" if record.bundled_trainer else "your command"
    say(
        f"run {plan.run_name}: launch {slurm_run.launch_id} of {what} on {len(slurm_run.nodes)} node(s) as "
        f"{step} ({state}), started {time_text(record.launched_at)} by launcher pid "
        f"{slurm_run.launcher_pid} on {slurm_run.controller}"
    )
    for host, report in reports.items():
        step_text = step_of(report)
        say(
            f"[{host}] node {slurm_run.nodes[host]}: {describe_report(report)}"
            + (f", {step_text}" if step_text else "")
        )
        for line in report.get("lines") or []:
            say(f"    {line}")
    say(f"each node's full log: {plan.paths.node_log('N')}; launches and stops: {plan.paths.history}")
    return exitcodes.OK
