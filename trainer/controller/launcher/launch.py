"""`trainer launch -i INVENTORY [-- COMMAND]`: start the trainer, or the user's own command, on every
host at once and follow it to the end.

Three playbooks, all through trainer.controller.runner (ansible-runner):
- start.yml checks every node (venv, the interface for NCCL/gloo, InfiniBand devices, no run of the
  same name still running, the command's working directory and program), writes the run's files on
  the head (config, DeepSpeed JSON, hostfile, accelerate configs), keeps the previous launch's logs
  and starts each node's run.sh (torchrun, or the command) detached in its own process group;
- watch.yml polls every node (state, exit record, new log lines) until its trainer ends, each poll
  streamed as an event: rank 0's lines and a state line per host are shown as they come;
- stop.yml stops the process group on every node. It runs as soon as any host fails, on Ctrl-C,
  and with `--stop`; the command then names the first failing host and rank with its last lines.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from trainer import exitcodes
from trainer.controller.inventory import InventoryError
from trainer.controller.launcher.launchfiles import launch_files
from trainer.controller.launcher.live import JobMonitor, LiveView, describe
from trainer.controller.launcher.plan import (
    COMMAND_EPILOG,
    JobPlan,
    PlanError,
    add_job_arguments,
    plan_from_args,
)
from trainer.controller.launcher.topology import AUTO_IFNAME, TopologyError
from trainer.controller.runner import PlaybookResult, run_playbook
from trainer.controller.training_env import IB_AUTO

PLAYBOOKS = Path(__file__).parent / "playbooks"
START_TASK = "Start the trainer in its own process group"
BECOME_TASK = "Remember the interface and whether to become the training user"
STOP_TASK = "Stop the trainer's process group"
INTERRUPTED = 130
#: cli.py gives this verb what follows `--` as args.command (the user's own command).
TAKES_COMMAND = True


class Launcher:
    def __init__(self, plan: JobPlan, poll_interval_s: float = 2.0, stop_grace_s: float = 10.0) -> None:
        self.plan = plan
        self.poll_interval_s = poll_interval_s
        self.stop_grace_s = stop_grace_s
        topo = plan.topology
        # One fork per host: the watch task polls every host at once (the default of 5 would not).
        self.env = {
            "ANSIBLE_FORKS": str(max(5, topo.nnodes)),
            "ANSIBLE_PIPELINING": "True",
            "ANSIBLE_NOCOLOR": "True",
        }
        self.become: dict[str, bool] = {}
        #: Tags every process this launch starts (see node_ctl.py), so a stop finds them all.
        self.launch_id = f"{plan.run_name}-{uuid.uuid4().hex[:12]}"
        self.files = launch_files(plan)

    def extravars(self) -> dict[str, Any]:
        plan, topo = self.plan, self.plan.topology
        return {
            "launch_run_name": plan.run_name,
            "launch_id": self.launch_id,
            "launch_dir": plan.launch_dir,
            "launch_head": topo.head.host,
            "launch_master_port": topo.master_port,
            "launch_training_user": plan.training_user,
            "launch_nodes": {
                n.host: {
                    "node_rank": n.node_rank,
                    "address": n.address,
                    "ifname_auto": n.nccl_socket_ifname == AUTO_IFNAME,
                    "env": plan.node_env(n),
                    "secret_env": plan.node_secret_env(n),
                    "workdir": plan.workdir(n),
                    "command": plan.node_command(n),
                    # The head's files this node's command reads: wait until the shared dir shows them.
                    "wait_for": [
                        f"{plan.launch_dir}/config.yaml"
                        if plan.runs_bundled_trainer
                        else plan.accelerate_config_path(n)
                    ],
                }
                for n in topo.nodes
            },
            "launch_ib_auto": topo.nccl_ib_disable == IB_AUTO,
            "launch_venv_needs": ["python", "torchrun", "trainer"]
            if plan.runs_bundled_trainer
            else ["python"],
            "launch_files": self.files,
            "launch_has_secrets": plan.has_secrets,
            "launch_become_hosts": self.become,
            "launch_poll_delay": self.poll_interval_s,
            "launch_poll_retries": 10**7,
            "launch_stop_grace_s": self.stop_grace_s,
        }

    def _run(self, playbook: str, **kwargs: Any) -> PlaybookResult:
        extravars = self.extravars()
        if playbook != "start.yml":
            # Only the start needs the files and secrets; the other playbooks never see them.
            extravars["launch_files"] = {}
            for node in extravars["launch_nodes"].values():
                node["secret_env"] = {}
        return run_playbook(
            PLAYBOOKS / playbook, self.plan.topology.inventory, extravars, env=self.env, **kwargs
        )

    def stop(self, monitor: JobMonitor | None = None) -> PlaybookResult:
        """Stop the run on every host. A second Ctrl-C must not cut this short (it would leave
        trainers running), so SIGINT is ignored until the stop playbook is done."""
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            result = self._run("stop.yml")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if monitor is not None:
            for host, items in result.ok.items():
                for item in items:
                    if item.task == STOP_TASK and host in monitor.hosts and item.result.get("stdout"):
                        monitor.apply(monitor.hosts[host], json.loads(item.result["stdout"]))
        return result

    def launch(self, view: LiveView) -> int:
        plan, topo = self.plan, self.plan.topology
        what = f"engine {plan.engine}" if plan.runs_bundled_trainer else "your command"
        view.message(
            f"Launching run [bold]{plan.run_name}[/bold] on {topo.nnodes} node(s) × {topo.gpus_per_node} "
            f"process(es) (world size {topo.world_size}, {what}, master "
            f"{topo.master_addr}:{topo.master_port}); output in {plan.output_dir}, each node's log "
            f"in {plan.launch_dir}/node-N/log"
        )
        monitor = JobMonitor({n.host: n.node_rank for n in topo.nodes}, topo.head.host, view)
        view.states(monitor.ordered)
        try:
            start = self._run("start.yml")
        except KeyboardInterrupt:
            view.message("interrupted while starting: stopping the trainer on every host")
            self.stop()
            return INTERRUPTED
        if not start.succeeded:
            return self._start_failed(start, view)
        for host in monitor.hosts:
            decided = start.task_result(host, BECOME_TASK)
            self.become[host] = bool(decided and decided.result.get("ansible_facts", {}).get("launch_become"))
        if topo.nccl_ib_disable == IB_AUTO:
            decided = start.task_result(topo.head.host, BECOME_TASK)
            value = (decided.result.get("ansible_facts", {}) if decided else {}).get("launch_ib_disable")
            view.message(
                f"NCCL_IB_DISABLE auto: {value} ("
                + (
                    "InfiniBand/RoCE devices on every node"
                    if str(value) == "0"
                    else "not every node lists InfiniBand/RoCE devices in /sys/class/infiniband: TCP sockets"
                )
                + ")"
            )

        cancel = threading.Event()
        interrupted = False

        def on_event(event: dict[str, Any]) -> None:
            monitor.on_watch_event(event)
            if monitor.failed:
                cancel.set()

        with view:
            try:
                watch = self._run("watch.yml", on_event=on_event, cancel=cancel)
            except KeyboardInterrupt:
                interrupted = True
                watch = None
            if interrupted or not monitor.all_done:
                if interrupted:
                    view.message("interrupted: stopping the trainer on every host (wait for it)")
                elif monitor.failed:
                    first = monitor.first_failure()
                    view.message(f"{first.host} failed: stopping the trainer on every other host")
                self.stop(monitor)
                view.states(monitor.ordered)
        return self._outcome(monitor, watch, interrupted, view)

    def _start_failed(self, start: PlaybookResult, view: LiveView) -> int:
        failure = start.first_failure
        if failure is not None:
            view.message(
                f"[red]trainer launch: could not start on {failure.host}[/red] "
                f"({failure.task}): {failure.message}"
            )
        else:
            view.message(f"[red]trainer launch: the start playbook failed[/red] (rc {start.rc})")
            view.log(start.output.strip())
        if any(r.task == START_TASK and r.status == "ok" for r in start.results):
            view.message("stopping the nodes that had started")
            self.stop()
        return exitcodes.FAILURE

    def _outcome(
        self, monitor: JobMonitor, watch: PlaybookResult | None, interrupted: bool, view: LiveView
    ) -> int:
        plan = self.plan
        stopped_in = (
            f" {time.time() - monitor.failed_at:.1f} s after the failure" if monitor.failed_at else ""
        )
        if interrupted:
            view.message(f"interrupted: the trainer is stopped on all hosts (run {plan.run_name})")
            return INTERRUPTED
        if monitor.all_done:
            view.message(
                f"[green]done[/green]: run {plan.run_name} finished on all {len(monitor.hosts)} node(s); "
                f"output in {plan.output_dir}"
            )
            return exitcodes.OK
        fault = monitor.gpu_fault()
        if fault is not None:
            hs, info = fault
            view.message(
                f"[red]GPU_FAULT[/red] on {hs.host} (node {hs.node_rank}, hostname {info['host']}): GPU "
                f"{info['gpu']} (uuid {info['uuid']}) of rank {info['rank']} tripped the health check, "
                f"{info['metric']}={info['value']}. Take the node out or fix its GPU before relaunching; "
                f"the trainer was stopped on every host{stopped_in}."
            )
            self._last_lines(hs.host, monitor, view)
            return exitcodes.GPU_FAULT
        first = monitor.first_failure()
        if first is not None:
            ranks = self.plan.topology.node(first.host).global_ranks(self.plan.topology.gpus_per_node)
            rank = first.failed_rank if first.failed_rank is not None else ranks.start
            rank_text = (
                f"rank {rank}"
                if first.failed_rank is not None or len(ranks) == 1
                else (f"ranks {ranks.start}-{ranks.stop - 1}")
            )
            view.message(
                f"[red]failed[/red]: first failure on host {first.host} (node {first.node_rank}, "
                f"{rank_text}): {describe(first)}; the trainer was stopped on every host{stopped_in}."
            )
            others = [f"{hs.host}: {hs.state}" for hs in monitor.ordered if hs is not first]
            if others:
                view.message("other hosts: " + ", ".join(others))
            self._last_lines(first.host, monitor, view)
            return exitcodes.FAILURE
        view.message("[red]trainer launch: watching the trainer failed[/red]")
        if watch is not None:
            view.log(watch.output.strip()[-2000:])
        return exitcodes.FAILURE

    def _last_lines(self, host: str, monitor: JobMonitor, view: LiveView) -> None:
        lines = list(monitor.hosts[host].lines)[-20:]
        view.message(f"last log lines of {host}:" if lines else f"{host} logged nothing")
        for line in lines:
            view.log(f"  {line}")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    parser.epilog = COMMAND_EPILOG
    parser.add_argument(
        "--stop",
        action="store_true",
        help="stop the run's trainer on every host (e.g. after the launcher died)",
    )
    parser.add_argument(
        "--poll-interval", type=float, default=2.0, help="seconds between status polls (default: %(default)s)"
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=10.0,
        help="seconds a stopped trainer gets between TERM and KILL (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
    except (InventoryError, TopologyError, PlanError) as err:
        print(f"trainer launch: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    launcher = Launcher(plan, poll_interval_s=args.poll_interval, stop_grace_s=args.stop_grace)
    view = LiveView()
    if args.stop:
        result = launcher.stop()
        for host in (n.host for n in plan.topology.nodes):
            item = result.task_result(host, STOP_TASK)
            if item is None or item.status != "ok":
                state = "unreachable" if host in result.unreachable else "nothing to stop"
            else:
                state = "stopped" if json.loads(item.result["stdout"]).get("stopped") else "not running"
            view.log(f"[{host}] {state}")
        return exitcodes.OK if result.succeeded else exitcodes.FAILURE
    # A TERM (a CI job's timeout, a supervisor) stops the hosts' trainers the way Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    return launcher.launch(view)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
