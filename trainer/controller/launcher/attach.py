"""`trainer attach -i INVENTORY [--run-name NAME]`: follow a running launch again after its launcher
died (`kill -9`, a lost controller session), to its end.

It reads what started the launch from the head (`launch.json`: the nodes and ranks, the watch
settings, the bundled trainer or your command), then does what the launcher would have done: rank
0's log and a state line per host, `unreachable (Ns)` and the grace, the stall watchdog, and on
the first failure, on Ctrl-C, TERM or HUP, a stop on every node naming the cause. The exit code is
the launch's. Restarts are the launcher's (--max-restarts): attach does not relaunch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from trainer import exitcodes
from trainer.controller.access import add_access_arguments, configure_access
from trainer.controller.inventory import InventoryError, load_cluster
from trainer.controller.launcher.launch import (
    Launcher,
    add_watch_arguments,
    install_signal_handlers,
    watch_options,
)
from trainer.controller.launcher.live import LiveView
from trainer.controller.launcher.plan import DEFAULT_RUN_NAME, PlanError, make_plan
from trainer.controller.launcher.status import launch_info, launcher_alive
from trainer.controller.launcher.topology import TopologyError


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--inventory", required=True, help="inventory directory or file")
    parser.add_argument(
        "--run-name", default=DEFAULT_RUN_NAME, help="the run to follow (default: %(default)s)"
    )
    add_watch_arguments(parser)
    add_access_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        configure_access(args)
        cluster = load_cluster(args.inventory)
        plan = make_plan(cluster, run_name=args.run_name)
    except (InventoryError, TopologyError, PlanError) as err:
        print(f"trainer attach: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    info, _, problem = launch_info(plan)
    if info is None:
        print(f"trainer attach: {problem}", file=sys.stderr)
        return exitcodes.FAILURE
    nodes = {str(host): int(rank) for host, rank in (info.get("nodes") or {}).items()}
    try:
        # The launch's own nodes (--exclude-failed may have left some out) and kind of job.
        cluster = dataclasses.replace(cluster, workers=tuple(h for h in cluster.workers if h.name in nodes))
        plan = make_plan(cluster, run_name=args.run_name, command=tuple(info.get("command") or ()))
    except (InventoryError, TopologyError, PlanError) as err:
        print(f"trainer attach: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if {n.host: n.node_rank for n in plan.topology.nodes} != nodes:
        print(
            f"trainer attach: the launch's nodes {nodes} no longer match the inventory; attach with the "
            "inventory it was launched with",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    launcher = Launcher(plan, watch_options(args, plan.runs_bundled_trainer, saved=info))
    launcher.launch_id = str(info.get("launch_id") or launcher.launch_id)
    launcher.attempt_number = int(info.get("attempt") or 1)
    view = LiveView()
    if launcher_alive(info):
        view.message(
            f"note: the launcher that started this launch (pid {info.get('launcher_pid')}) still runs and "
            "follows it too"
        )
    install_signal_handlers(view)
    return launcher.attempt(view, {}, attach=True).code
