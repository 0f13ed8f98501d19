"""`trainer logs -i INVENTORY [--run-name NAME] [--node K] [--lines N] [-f]`: a run's node logs.

Each node's `<run>/launch/node-N/log` (the output of its run.sh: torchrun and the trainer, or your
command), read on the nodes of the run's last launch (named by the head's launch.json, as `trainer
status` reads them) through the launcher's own node helper and playbooks: status.yml for the last
lines, watch.yml (the long poll `trainer attach` follows with) for `-f`, which returns when the run
has ended on every node shown.

Every node by default, each line prefixed with its host (`[node1] ...`): node by node in rank order,
or as the lines come with -f. `--node K` (a node rank or a host name) prints that node's lines as
they are, for grep or a file. The log lines go to stdout, what this command says itself to stderr.
Control characters of the nodes' output are spelled out (live.printable), as the launcher shows them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from trainer import exitcodes
from trainer.controller.access import add_access_arguments
from trainer.controller.forks import limits as forks_limits
from trainer.controller.inventory import PlanningError
from trainer.controller.launcher.live import printable
from trainer.controller.launcher.plan import DEFAULT_RUN_NAME, JobPlan
from trainer.controller.launcher.slurm_allocation import SlurmError
from trainer.controller.launcher.slurm_follow import current_job, describe_submitted
from trainer.controller.launcher.slurm_runs import node_reports, slurm_launch, step_running
from trainer.controller.launcher.slurm_steps import SlurmRecord
from trainer.controller.launcher.status import (
    MALFORMED,
    PLAYBOOKS,
    describe_report,
    plan_for_status,
    problem_of,
    read_launch_record,
    read_nodes,
    reading_env,
    reading_vars,
    report_of,
)
from trainer.controller.runner import run_playbook

EXAMPLES = (
    "trainer logs -i inventory/mycluster --run-name qwen-lora  # the last 100 lines of every node",
    "trainer logs -i inventory/mycluster --run-name qwen-lora --node 0 -f  # follow the head to the end",
    "trainer logs -i inventory/local --node node1 --lines 0 -f  # only what node1 prints from now on",
)
DEFAULT_LINES = 100
#: node_ctl.read_log takes the last lines from this much of the end of a log.
TAIL_WINDOW_BYTES = 64 * 1024
#: Seconds between two polls of a quiet node with -f (a poll answers at once when there are new lines).
POLL_S = 2.0
#: With -f, a node that has not answered for this long is given up on (named, exit 1).
GIVE_UP_S = 300.0


class LogsError(Exception):
    """Bad input (a node the launch does not have); the message names it and the fix."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--inventory", required=True, help="inventory directory or file")
    parser.add_argument(
        "--run-name", default=DEFAULT_RUN_NAME, help="the run whose logs to print (default: %(default)s)"
    )
    parser.add_argument(
        "--node",
        metavar="K",
        help="one node only, by node rank (0 is the head) or host name; its lines as they are. Default: "
        "every node of the launch, each line prefixed with [host]",
    )
    parser.add_argument(
        "--lines",
        type=int,
        default=DEFAULT_LINES,
        metavar="N",
        help=f"the last N lines of each log, from its last {TAIL_WINDOW_BYTES // 1024} KiB (the whole "
        "log is <cluster_shared_dir>/runs/<run name>/launch/node-N/log on the nodes); with -f, 0 shows "
        "only new lines (default: %(default)s)",
    )
    parser.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="then print new lines as they come, until the run has ended on every node shown (Ctrl-C "
        "stops following and leaves the run alone, exit 130)",
    )
    add_access_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.lines < 0:
        print(f"trainer logs: --lines must be 0 or more, not {args.lines}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if args.lines == 0 and not args.follow:
        print("trainer logs: --lines 0 prints nothing without -f: give N >= 1, or add -f", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    try:
        plan = plan_for_status(args)
    except PlanningError as err:
        print(f"trainer logs: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if (job := current_job(plan)) is not None and job.step is None:
        # Submitted from a login node, its trainer launch has started no step yet: no node has a log.
        note(f"run {plan.run_name}: {describe_submitted(job.record, job.state)}; no node log yet")
        return exitcodes.OK
    if (slurm_run := slurm_launch(plan)) is not None:
        try:
            return slurm_logs(plan, slurm_run, pick_nodes(slurm_run.nodes, args.node, plan.run_name), args)
        except LogsError as err:
            note(str(err))
            return exitcodes.CONFIG_ERROR
    # The head first: its launch.json names the launch's nodes (after --exclude-failed, not the
    # inventory's). With -f the watch brings the head's last lines itself.
    record, head_report, problem = read_launch_record(plan, 0 if args.follow else args.lines)
    if record is None:
        note(problem)
        # The head answered and has no such run: the name is wrong. Else the head is out of reach.
        return exitcodes.CONFIG_ERROR if head_report is not None else exitcodes.FAILURE
    launched = record.nodes
    if launched is None:
        note(f"run {plan.run_name}: {MALFORMED}")
        return exitcodes.FAILURE
    try:
        nodes = pick_nodes(launched, args.node, plan.run_name)
    except LogsError as err:
        note(str(err))
        return exitcodes.CONFIG_ERROR
    printer = LinePrinter(prefixed=args.node is None)
    try:
        if args.follow:
            return follow(plan, nodes, args.lines, printer)
        return print_last_lines(plan, nodes, args.lines, head_report, printer)
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say, and nothing to say it on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exitcodes.OK


def slurm_logs(plan: JobPlan, slurm_run: SlurmRecord, nodes: dict[str, int], args: argparse.Namespace) -> int:
    """`trainer logs` of a run whose latest launch is a Slurm step (guest.py): the logs read from the
    shared dir; with -f, new lines until Slurm no longer lists the step (one squeue call per poll)."""
    printer = LinePrinter(prefixed=args.node is None)
    offsets: dict[str, int | None] = dict.fromkeys(nodes)
    try:
        while True:
            running = step_running(slurm_run) if args.follow else False
            for host, report in node_reports(plan, nodes, offsets, running, args.lines).items():
                printer.lines(host, report.get("lines") or [])
                offsets[host] = int(report.get("offset") or 0)
            if not running:
                return exitcodes.OK
            time.sleep(1.0)
    except SlurmError as err:
        note(str(err))
        return exitcodes.FAILURE
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED


def pick_nodes(launched: dict[str, int], wanted: str | None, run_name: str) -> dict[str, int]:
    """host -> node rank of the nodes to show: all of the launch's, or the one `wanted` names."""
    if wanted is None:
        return dict(sorted(launched.items(), key=lambda item: item[1]))
    for host, rank in launched.items():
        if wanted in (host, str(rank)):
            return {host: rank}
    known = ", ".join(f"{rank} ({host})" for host, rank in sorted(launched.items(), key=lambda item: item[1]))
    raise LogsError(
        f"run {run_name}'s last launch has no node {wanted!r}: give --node one of its node ranks or hosts: "
        f"{known}"
    )


class LinePrinter:
    """Log lines to stdout, with their host in front when several nodes are shown."""

    def __init__(self, *, prefixed: bool) -> None:
        self.prefixed = prefixed

    def lines(self, host: str, lines: list[Any]) -> None:
        prefix = f"[{host}] " if self.prefixed else ""
        text = "".join(f"{prefix}{printable(str(line))}\n" for line in lines)
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()


def note(text: str) -> None:
    """A line on stderr; what it says of the nodes (a run dir's name, an error) has its control
    characters spelled out."""
    print(f"trainer logs: {printable(text)}", file=sys.stderr, flush=True)


def print_last_lines(
    plan: JobPlan, nodes: dict[str, int], tail: int, head_report: dict[str, Any] | None, printer: LinePrinter
) -> int:
    head = plan.topology.head.host
    others = {host: rank for host, rank in nodes.items() if host != head}
    result = read_nodes(plan, others, tail) if others and tail else None
    code = exitcodes.OK
    cut = False
    for host, rank in nodes.items():
        report = head_report if host == head else report_of(result, host) if result else {}
        if report is None:
            note(f"[{host}] node {rank}: cannot read its log: {problem_of(result, host)}")
            code = exitcodes.FAILURE
            continue
        lines = report.get("lines") or []
        printer.lines(host, lines)
        cut = cut or (len(lines) < tail and int(report.get("offset") or 0) > TAIL_WINDOW_BYTES)
    if cut:
        note(
            f"fewer than {tail} lines: only the last {TAIL_WINDOW_BYTES // 1024} KiB of a log are read; "
            f"the whole log is {plan.paths.node_log('N')} on the nodes"
        )
    return code


def follow(plan: JobPlan, nodes: dict[str, int], tail: int, printer: LinePrinter) -> int:
    """Each node's last `tail` lines, then its new lines as they come, until its run has ended."""
    if problem := forks_limits().follow_problem(len(nodes)):
        note(problem)
        return exitcodes.CONFIG_ERROR
    last: dict[str, dict[str, Any]] = {}
    missing: set[str] = set()

    def on_message(message: dict[str, Any]) -> None:
        host = str(message.get("host"))
        if host not in nodes:
            return
        if message.get("type") == "miss":
            if host not in missing:
                missing.add(host)
                note(f"[{host}] does not answer ({message.get('error') or 'no answer'}); still trying")
            return
        if host in missing:
            missing.discard(host)
            note(f"[{host}] answers again")
        report = message.get("report") or {}
        last[host] = report
        printer.lines(host, report.get("lines") or [])

    extravars = {
        **reading_vars(plan, nodes, tail),
        "launch_become_hosts": {},
        "launch_poll_s": POLL_S,
        "launch_status_timeout_s": 20,
        "launch_give_up_s": GIVE_UP_S,
        "launch_activity": False,  # its lines only: what the ranks use is the launcher's concern
    }
    restore = _interrupt_on_term()
    try:
        result = run_playbook(
            PLAYBOOKS / "watch.yml",
            plan.topology.inventory,
            extravars,
            env=reading_env(nodes),
            limit=",".join(nodes),
            on_message=on_message,
        )
    except KeyboardInterrupt:
        note(f"stopped following run {plan.run_name}; it goes on (trainer stop -i INVENTORY to stop it)")
        return exitcodes.INTERRUPTED
    finally:
        restore()
    code = exitcodes.OK
    for host, rank in nodes.items():
        if host in last and last[host].get("state") not in ("running", "starting"):
            note(f"[{host}] node {rank}: {describe_report(last[host])}")
        else:
            note(f"[{host}] node {rank}: stopped following: {problem_of(result, host)}")
            code = exitcodes.FAILURE
    return code


def _interrupt_on_term() -> Any:
    """TERM and HUP end the follow as Ctrl-C does (the runner's ansible-playbook is ended with it);
    returns what puts the previous handlers back."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]
