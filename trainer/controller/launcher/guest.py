"""`trainer launch` inside a Slurm allocation ("guest mode", issue 40): one attempt of the job as a
Slurm step, followed from the shared dir, its failure named as an SSH launch names it.

The same pieces as an SSH launch, with Slurm in place of Ansible: the run's lock and each node's files
are written by the node helper's own functions (playbooks/files/node_ctl.py: `lock`, the start's
writes: the previous launch kept as log.N, launch-id, secret-env mode 0600, run.sh, launch.json, the
run's files and its history record), straight onto the shared dir, which this process sees as the
nodes do; one srun step runs every node's run.sh (slurm_steps.py); the nodes' reports come from
node_ctl's `status` read here, with Slurm's word (one squeue per poll) for whether the step still
runs; JobMonitor, diagnose and render (live.py, failure.py) say what happened and pick the exit code.
A failure stops the step (stop-requested on the nodes still running, then scancel), as the SSH
launcher's stop does, after which the cause is named with its host and rank.

Not yet here (issue 40's later slices): restarts (--max-restarts), leaving a lost node out, the
preemption signal, a launch from a login node that submits its own allocation.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from trainer import exitcodes
from trainer.controller.launcher import slurm_allocation, slurm_steps
from trainer.controller.launcher.failure import diagnose, render
from trainer.controller.launcher.launch import job_monitor
from trainer.controller.launcher.launch_record import LaunchRecord
from trainer.controller.launcher.launchfiles import launch_files
from trainer.controller.launcher.live import JobMonitor, LiveView
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.runlock import RunLock, holder_state
from trainer.controller.launcher.slurm_runs import NODE_CTL_PATH, node_helper, node_reports, request_stop
from trainer.controller.launcher.slurm_steps import SlurmRecord
from trainer.controller.launcher.wire import WatchOptions, launch_vars, start_calls

#: How long a cancelled step may take to end (past the stop grace) before the launcher stops waiting.
STEP_END_S = 60.0


class GuestLaunch:
    """One launch of `plan` as a step of the allocation `job`, followed to its end."""

    plan: JobPlan
    """The job, on the allocation's nodes (slurm_allocation.guest_cluster)."""
    options: WatchOptions
    """--poll-interval, --stall-timeout, --stop-grace, ... as for an SSH launch."""
    job: str
    """The allocation's job id."""
    launch_id: str
    """Tags every process of this launch (run.sh exports it), and names the step."""
    lock: RunLock
    """The run's lock in the launch dir: one launcher per run name, as over SSH."""
    record: SlurmRecord
    """slurm.json: the step, for `trainer status/logs/stop`."""

    def __init__(self, plan: JobPlan, options: WatchOptions, job: str) -> None:
        self.plan = plan
        self.options = options
        self.job = job
        self.launch_id = f"{plan.run_name}-{os.urandom(6).hex()}"
        self.lock = RunLock(plan.run_name, plan.launch_dir, "trainer launch (Slurm allocation)")
        self.record = SlurmRecord(
            job=job,
            step_name=slurm_allocation.step_name(self.launch_id),
            launch_id=self.launch_id,
            nodes={n.host: n.node_rank for n in plan.topology.nodes},
            controller=socket.gethostname(),
            launcher_pid=os.getpid(),
        )

    def run(self, view: LiveView, *, force: bool = False) -> int:
        """The launch, start to end; its exit code. `force`: take over the lock of a launcher that is
        not verifiably alive (as over SSH)."""
        helper = node_helper()
        Path(self.plan.launch_dir).mkdir(parents=True, exist_ok=True)
        answer = helper.lock(self.lock.request("acquire"))
        holder = answer.get("holder") or {}
        if not answer.get("acquired") and force and holder_state(holder) != "alive":
            answer = helper.lock(self.lock.request("acquire", take_over=str(holder.get("token") or "")))
        if not answer.get("acquired"):
            view.message(f"[red]trainer launch: run {self.plan.run_name} is locked[/red]")
            view.log(self.lock.refusal(answer.get("holder"), forced=force))
            return exitcodes.CONFIG_ERROR
        try:
            self._write_nodes(helper)
            step = slurm_steps.start_step(self.plan, self.job, self.launch_id)
            self.record.write(self.plan.launch_dir)
            return self._follow(step, view)
        finally:
            helper.lock(self.lock.request("release"))

    def _write_nodes(self, helper: ModuleType) -> None:
        """Every node's files, as an SSH launch's start writes them (node_ctl's own writes)."""
        plan = self.plan
        extravars = launch_vars(
            plan,
            self.options,
            launch_id=self.launch_id,
            become={},
            lock_request={},
            launch_files=launch_files(plan),
            launch_info=LaunchRecord.of_attempt(
                plan, self.options, launch_id=self.launch_id, attempt=1, restart=None
            ).to_json(),
            launch_record={
                "event": "launch",
                "nodes": [n.host for n in plan.topology.nodes],
                "launch_id": self.launch_id,
                "attempt": 1,
                "slurm_job": self.job,
            },
        )
        for host, node in extravars["launch_nodes"].items():
            node["run_sh"] = slurm_steps.step_run_script(plan, host)
        start_calls(extravars)
        program = NODE_CTL_PATH.read_text()
        for node in extravars["launch_nodes"].values():
            request = node["start"]["request"]
            helper._write_launch(request, program, Path(request["node_dir"]))
        step_script = Path(plan.launch_dir) / slurm_steps.STEP_SCRIPT
        helper.write_file(step_script, slurm_steps.step_script(plan), 0o755)

    def _follow(self, step: subprocess.Popen, view: LiveView) -> int:
        """Poll the nodes until every one is done, one fails (or it stalls), or the step ends."""
        plan, monitor = self.plan, job_monitor(self.plan, self.options, view)
        offsets: dict[str, int | None] = {n.host: 0 for n in plan.topology.nodes}
        view.message(
            f"launching run {plan.run_name} as Slurm step {self.record.step_name} of job {self.job} on "
            f"{len(offsets)} node(s): {', '.join(offsets)}; master {plan.topology.master_addr}"
        )
        with view:
            try:
                while True:
                    ended = step.poll() is not None
                    self._find_step()
                    self._apply(monitor, node_reports(plan, self.record.nodes, offsets, not ended))
                    if monitor.all_done or monitor.must_stop or ended:
                        break
                    time.sleep(self.options.poll_interval_s)
            except KeyboardInterrupt:
                return self._stop(step, monitor, offsets, view, {"why": "interrupted"}, exitcodes.INTERRUPTED)
            return self._conclude(step, monitor, offsets, view)

    def _find_step(self) -> None:
        if not self.record.step:
            self.record.step = slurm_steps.running_steps(self.job).get(self.record.step_name, "")
            if self.record.step:
                self.record.write(self.plan.launch_dir)

    @staticmethod
    def _apply(monitor: JobMonitor, reports: dict[str, dict[str, Any]]) -> None:
        for host, report in reports.items():
            monitor.apply(monitor.hosts[host], report)
        monitor.tick()

    def _conclude(
        self, step: subprocess.Popen, monitor: JobMonitor, offsets: dict[str, int | None], view: LiveView
    ) -> int:
        plan = self.plan
        if monitor.all_done:
            step.wait(timeout=STEP_END_S)
            view.message(
                f"[green]done[/green]: run {plan.run_name} finished on all {len(monitor.hosts)} node(s); "
                f"output in {plan.output_dir}"
            )
            return exitcodes.OK
        stopped = [hs.host for hs in monitor.ordered if hs.state == "stopped"]
        if stopped and not any(hs.failed and not hs.only_consequence for hs in monitor.ordered):
            view.message(
                f"[yellow]stopped[/yellow]: run {plan.run_name} was stopped on {', '.join(stopped)} from "
                f"outside this launcher (trainer stop); Slurm step {self.record.step or '?'} cancelled"
            )
            return exitcodes.INTERRUPTED
        early = diagnose(monitor, bundled=plan.runs_bundled_trainer)
        if early is not None:
            view.message(f"{early.cause_phrase}; cancelling the Slurm step on every node")
        why = (
            {
                "why": early.cause.kind,
                "detail": early.summary,
                "hosts": [early.cause.host],
                **early.as_record(),
            }
            if early
            else {"why": "step_ended"}
        )
        return self._stop(step, monitor, offsets, view, why, None)

    def _stop(
        self,
        step: subprocess.Popen,
        monitor: JobMonitor,
        offsets: dict[str, int | None],
        view: LiveView,
        why: dict[str, Any],
        code: int | None,
    ) -> int:
        """Cancel the step, wait for it, then the nodes' last reports; the diagnosis unless `code`."""
        # The history record of the stop in any case; scancel only while Slurm lists the step.
        request_stop(self.plan, self.record, {"attempt": 1, **why})
        if step.poll() is None:
            try:
                step.wait(timeout=self.options.stop_grace_s + STEP_END_S)
            except subprocess.TimeoutExpired:
                view.message(f"the Slurm step {self.record.step} did not end; see squeue --steps")
        self._apply(monitor, node_reports(self.plan, self.record.nodes, offsets, False))
        if code is not None:
            view.message(f"interrupted: the Slurm step of run {self.plan.run_name} is cancelled")
            return code
        diagnosis = diagnose(monitor, bundled=self.plan.runs_bundled_trainer)
        if diagnosis is None:
            log = Path(self.plan.launch_dir) / slurm_steps.STEP_LOG
            view.message(f"[red]trainer launch: the Slurm step ended early[/red]; srun's output: {log}")
            return exitcodes.FAILURE
        render(diagnosis, monitor, view, stall_timeout_s=self.options.stall_timeout_s)
        return diagnosis.code
