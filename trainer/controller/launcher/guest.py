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

GuestLaunch is one attempt, as launch.Launcher is over SSH, behind the same small interface
(restarts.Attempts): restarts.RestartPolicy drives both, so --max-restarts and --exclude-failed are
one policy. A restart is a new srun step; a node left out is left off the next step's --nodelist. A
node is lost when Slurm says so: after the stop, a node that never recorded its end while Slurm marks
it DOWN, NOT_RESPONDING or FAIL (its slurmd gone: Slurm's own SlurmdTimeout decides when).

A run that stopped at a checkpoint as Slurm's warning signal asked (--signal=USR2@SECONDS: the
trainer's exit STOPPED_AT_CHECKPOINT) ends the attempt as `saved`, no failure; the restart policy
hands it to slurm_requeue.py, which requeues the job.

A launch from a login node (`trainer launch --slurm`, slurm_login.py) submits a batch job whose script
runs this same launch inside the allocation, and follows the job from the login node.

Not yet here (issue 40's later slices): taking a lost node back (rejoin).
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
from trainer.controller.launcher.failure import Outcome, diagnose, render
from trainer.controller.launcher.launch import job_monitor
from trainer.controller.launcher.launch_record import LaunchRecord, RestartState
from trainer.controller.launcher.launchfiles import launch_files
from trainer.controller.launcher.live import JobMonitor, LiveView
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.runlock import RunLock, describe_holder, holder_state
from trainer.controller.launcher.slurm_runs import NODE_CTL_PATH, node_helper, node_reports, request_stop
from trainer.controller.launcher.slurm_steps import SlurmRecord
from trainer.controller.launcher.wire import WatchOptions, launch_vars, start_calls

#: How long a cancelled step may take to end (past the stop grace) before the launcher stops waiting.
STEP_END_S = 60.0
#: Slurm's node states that mean the node is gone (scontrol's State=, e.g. ALLOCATED+NOT_RESPONDING).
LOST_STATES = ("DOWN", "NOT_RESPONDING", "FAIL")


class GuestLaunch:
    """Attempts of `plan` as steps of the allocation `job`, each followed to its end (restarts.Attempts)."""

    plan: JobPlan
    """The job, on the allocation's nodes (slurm_allocation.guest_cluster); fewer once a node is left out."""
    options: WatchOptions
    """--poll-interval, --stall-timeout, --stop-grace, ... as for an SSH launch."""
    job: str
    """The allocation's job id."""
    launch_id: str
    """Tags every process of this attempt (run.sh exports it), and names the step."""
    lock: RunLock
    """The run's lock in the launch dir: one launcher per run name, as over SSH; held across attempts."""
    record: SlurmRecord
    """slurm.json: the current attempt's step, for `trainer status/logs/stop`."""
    attempt_number: int
    """Attempts made so far (launch.json's and the history's `attempt`)."""
    policy: RestartState | None
    """The restart policy's state, for launch.json."""

    def __init__(self, plan: JobPlan, options: WatchOptions, job: str) -> None:
        self.plan = plan
        self.options = options
        self.job = job
        self.lock = RunLock(
            plan.run_name,
            plan.launch_dir,
            "trainer launch (Slurm allocation)",
            slurm_run=(job, slurm_allocation.restart_count()),
        )
        self.attempt_number = 0
        self.policy = None
        self.new_launch()

    # --- restarts.Attempts ---------------------------------------------------------------------------

    def use_plan(self, plan: JobPlan) -> None:
        """The next attempt runs `plan` (the restart policy left nodes out of it)."""
        self.plan = plan

    def new_launch(self) -> None:
        """A launch of its own: a new launch id, so a new step name and slurm.json."""
        self.launch_id = f"{self.plan.run_name}-{os.urandom(6).hex()}"
        self.record = SlurmRecord(
            job=self.job,
            step_name=slurm_allocation.step_name(self.launch_id),
            launch_id=self.launch_id,
            nodes={n.host: n.node_rank for n in self.plan.topology.nodes},
            controller=socket.gethostname(),
            launcher_pid=os.getpid(),
        )

    def take_over_lock(self, view: LiveView) -> int | None:
        """--force: take the lock over from a launcher that is not verifiably alive; None, or the exit
        code."""
        helper = node_helper()
        Path(self.plan.launch_dir).mkdir(parents=True, exist_ok=True)
        answer = helper.lock(self.lock.request("acquire"))
        holder = answer.get("holder") or {}
        if not answer.get("acquired") and holder_state(holder) != "alive":
            answer = helper.lock(self.lock.request("acquire", take_over=str(holder.get("token") or "")))
            if answer.get("acquired"):
                view.log(
                    f"--force: took over the lock of run {self.plan.run_name} from {describe_holder(holder)}"
                )
        if not answer.get("acquired"):
            view.message(f"[red]trainer launch: run {self.plan.run_name} is locked[/red]")
            view.log(self.lock.refusal(answer.get("holder"), forced=True))
            return exitcodes.CONFIG_ERROR
        self.lock.held = True
        return None

    def release_lock(self, view: LiveView) -> None:
        if self.lock.held:
            node_helper().lock(self.lock.request("release"))
            self.lock.held = False

    def stop_after_error(self, view: LiveView, error: Exception) -> None:
        """The launcher failed with `error`: the step is cancelled, never left running unlocked."""
        view.log(f"trainer launch: {error!r}: cancelling the Slurm step")
        request_stop(self.plan, self.record, {"attempt": self.attempt_number, "why": "launcher_error"})

    def attempt(
        self,
        view: LiveView,
        record: dict[str, Any],
        *,
        policy: RestartState | None = None,
        final: bool = True,
        leave_lost: bool = False,
        grow: Any = None,
    ) -> Outcome:
        """One step of the job on the plan's nodes, followed to its end. `record`: the history record
        the start writes (a launch, a restart). `final`, `leave_lost` and `grow` are the SSH launcher's
        (restarts.Attempts): here the lock is released by the policy, a lost node's part of the step
        ends with it, and a node left out is not taken back (no rejoin in an allocation yet)."""
        self.policy = policy
        self.attempt_number += 1
        helper = node_helper()
        if not self.lock.held:
            Path(self.plan.launch_dir).mkdir(parents=True, exist_ok=True)
            answer = helper.lock(self.lock.request("acquire"))
            if not answer.get("acquired") and self.lock.earlier_run_of_job(answer.get("holder")):
                answer = self._take_over_from_before_the_requeue(helper, answer["holder"], view)
            if not answer.get("acquired"):
                view.message(f"[red]trainer launch: run {self.plan.run_name} is locked[/red]")
                view.log(self.lock.refusal(answer.get("holder")))
                return Outcome(exitcodes.CONFIG_ERROR, "locked", [], "the run is locked by another launch")
            self.lock.held = True
        self._write_nodes(helper, record)
        # A restart's step overlaps the one before it, which a lost node may keep listed.
        step = slurm_steps.start_step(self.plan, self.job, self.launch_id, overlap=self.attempt_number > 1)
        self.record.write(self.plan.launch_dir)
        return self._follow(step, view)

    def _take_over_from_before_the_requeue(
        self, helper: ModuleType, holder: dict[str, Any], view: LiveView
    ) -> dict[str, Any]:
        """The lock of this job's launcher before Slurm requeued the job (it died with its node): taken
        over, said so; the helper's answer."""
        answer = helper.lock(self.lock.request("acquire", take_over=str(holder.get("token") or "")))
        if answer.get("acquired"):
            view.log(
                f"took over the lock of run {self.plan.run_name} from this Slurm job's launcher before Slurm "
                f"requeued the job ({describe_holder(holder)}, its run {holder.get('slurm_restart')})"
            )
        return answer

    # --- one attempt ---------------------------------------------------------------------------------

    def _write_nodes(self, helper: ModuleType, record: dict[str, Any]) -> None:
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
                plan, self.options, launch_id=self.launch_id, attempt=self.attempt_number, restart=self.policy
            ).to_json(),
            launch_record={
                **record,
                "launch_id": self.launch_id,
                "attempt": self.attempt_number,
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

    def _follow(self, step: subprocess.Popen, view: LiveView) -> Outcome:
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
                self._stop(step, monitor, offsets, view, {"why": "interrupted"})
                view.message(f"interrupted: the Slurm step of run {plan.run_name} is cancelled")
                return Outcome(exitcodes.INTERRUPTED, "interrupted")
            return self._conclude(step, monitor, offsets, view)

    def _find_step(self) -> None:
        if not self.record.step:
            self.record.step = slurm_steps.running_steps(self.job).get(self.record.step_name, "")
            if self.record.step:
                self.record.write(self.plan.launch_dir)

    @staticmethod
    def _apply(monitor: JobMonitor, reports: dict[str, dict[str, Any]]) -> None:
        for host, report in reports.items():
            if host in monitor.hosts and monitor.hosts[host].state != "lost":
                monitor.apply(monitor.hosts[host], report)
        monitor.tick()

    def _conclude(
        self, step: subprocess.Popen, monitor: JobMonitor, offsets: dict[str, int | None], view: LiveView
    ) -> Outcome:
        plan = self.plan
        if monitor.all_done:
            step.wait(timeout=STEP_END_S)
            view.message(
                f"[green]done[/green]: run {plan.run_name} finished on all {len(monitor.hosts)} node(s); "
                f"output in {plan.output_dir}"
            )
            return Outcome(exitcodes.OK, "done")
        stopped = [hs.host for hs in monitor.ordered if hs.state == "stopped"]
        if stopped and not any(hs.failed and not hs.only_consequence for hs in monitor.ordered):
            view.message(
                f"[yellow]stopped[/yellow]: run {plan.run_name} was stopped on {', '.join(stopped)} from "
                f"outside this launcher (trainer stop); Slurm step {self.record.step or '?'} cancelled"
            )
            return Outcome(exitcodes.INTERRUPTED, "stopped", [], "stopped by trainer stop")
        early = diagnose(monitor, bundled=plan.runs_bundled_trainer)
        if early is not None and early.requested_stop:
            self._let_end(step, monitor, offsets)
        elif early is not None:
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
        self._stop(step, monitor, offsets, view, why)
        return self._diagnosed(monitor, view)

    def _let_end(self, step: subprocess.Popen, monitor: JobMonitor, offsets: dict[str, int | None]) -> None:
        """A stop on request (the trainer saved and stopped): every rank stops at the same step, so the
        nodes still running are let end on their own (up to the stop grace) before the step is cancelled,
        never stopped while their ranks leave the process group."""
        deadline = time.monotonic() + self.options.stop_grace_s
        while step.poll() is None and time.monotonic() < deadline:
            if all(hs.final for hs in monitor.ordered):
                break
            time.sleep(self.options.poll_interval_s)
            self._apply(monitor, node_reports(self.plan, self.record.nodes, offsets, True))

    def _stop(
        self,
        step: subprocess.Popen,
        monitor: JobMonitor,
        offsets: dict[str, int | None],
        view: LiveView,
        why: dict[str, Any],
    ) -> None:
        """Cancel the step and wait for it; the nodes Slurm says are gone marked lost; the others'
        last reports."""
        # The history record of the stop in any case; scancel only while Slurm lists the step.
        request_stop(self.plan, self.record, {"attempt": self.attempt_number, **why})
        unended = [hs.host for hs in monitor.ordered if not hs.final]
        deadline = time.monotonic() + self.options.stop_grace_s + STEP_END_S
        lost: dict[str, str] = {}
        # A node whose slurmd is gone holds the step until Slurm marks it (its SlurmdTimeout): asked
        # once per poll for all the nodes that have not recorded their end, not once per node.
        while step.poll() is None and time.monotonic() < deadline:
            lost.update(self._slurm_lost([h for h in unended if h not in lost]))
            # The step may end only when Slurm gives up on the lost node (SlurmdTimeout): the attempt
            # is over once every other node has recorded its end.
            if lost and all(self._ended(h) for h in unended if h not in lost):
                break
            time.sleep(self.options.poll_interval_s)
        if step.poll() is None and not lost:
            try:
                step.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                view.message(f"the Slurm step {self.record.step} did not end; see squeue --steps")
                # Cancelled already: its srun is not left behind this launcher, waiting on it.
                step.kill()
                step.wait(timeout=STEP_END_S)
        lost.update(self._slurm_lost([h for h in unended if h not in lost]))
        if lost and step.poll() is None:
            # srun waits for the lost node's task while Slurm lists the step, which may be for ever:
            # the step is cancelled and its other tasks have ended, so this srun is let go.
            step.kill()
            step.wait(timeout=STEP_END_S)
        for host, state in lost.items():
            monitor.on_unreachable(host, f"Slurm marks {host} {state}")
        self._apply(monitor, node_reports(self.plan, self.record.nodes, offsets, False))

    def _ended(self, host: str) -> bool:
        """Whether `host`'s run.sh recorded its end (its node dir's exit record)."""
        return (Path(self.plan.paths.node_dir(self.record.nodes[host])) / "exit").exists()

    def _slurm_lost(self, hosts: list[str]) -> dict[str, str]:
        """Of `hosts` (nodes that have not recorded their end), those Slurm marks gone, with its state;
        one scontrol call."""
        if not hosts:
            return {}
        gone = {}
        for name, state in slurm_allocation.node_states(hosts).items():
            if any(word in state.split("+") for word in LOST_STATES) or state.rstrip("*") != state:
                gone[name] = state
        return gone

    def _diagnosed(self, monitor: JobMonitor, view: LiveView) -> Outcome:
        """The failed attempt's cause and consequences (failure.py), shown, as its Outcome."""
        plan = self.plan
        latest = self._latest_checkpoint()
        diagnosis = diagnose(monitor, bundled=plan.runs_bundled_trainer)
        if diagnosis is None:
            log = Path(plan.launch_dir) / slurm_steps.STEP_LOG
            view.message(f"[red]trainer launch: the Slurm step ended early[/red]; srun's output: {log}")
            return Outcome(
                exitcodes.FAILURE, "watch_failed", [], "the Slurm step ended early", latest_checkpoint=latest
            )
        render(diagnosis, monitor, view, stall_timeout_s=self.options.stall_timeout_s)
        stall = monitor.stall
        return Outcome(
            diagnosis.code,
            "saved" if diagnosis.requested_stop else "failed",
            sorted({host for host, _, _ in stall.behind})
            if stall is not None and diagnosis.cause.kind == "stall"
            else [diagnosis.cause.host],
            diagnosis.summary,
            restartable=diagnosis.restartable,
            latest_checkpoint=latest,
            lost=list(diagnosis.lost),
            diagnosis=diagnosis,
        )

    def _latest_checkpoint(self) -> str:
        """The latest complete checkpoint, read from the shared dir (the SSH stop asks the head)."""
        if not self.plan.runs_bundled_trainer:
            return ""
        try:
            return node_helper().latest_checkpoint_file(Path(self.plan.output_dir)).read_text().strip()
        except OSError:
            return ""
