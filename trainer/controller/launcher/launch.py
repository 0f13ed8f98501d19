"""`trainer launch -i INVENTORY [-- COMMAND]`: start the trainer, or the user's own command, on every
host at once and follow it to the end; stop every host on the first failure, and relaunch from the
latest checkpoint when asked to (`--max-restarts`).

Every step on the nodes goes through trainer.controller.runner (ansible-runner) and the launch_node
action plugin (playbooks/action_plugins/launch_node.py): one round trip per step and node, each
with a timeout, no module built or copied.
- start.yml takes the run's lock on the head (runlock.py: one launcher per run name; a second
  launch is refused before its probe, `--force` takes over a dead launcher's lock), probes every
  node (user, venv, the interface for NCCL/gloo, InfiniBand devices, the master port, no run of the
  same name still running, the command's working directory and program), then on every node at
  once keeps the previous launch's logs, writes the run's files and run.sh and starts it detached
  in its own process group, then follows each node: a long poll that answers as soon as there are
  new lines (rank 0's are shown, plus a state line per host), streamed through the runner's channel
  rather than as Ansible events; after a clean end on every node it releases the lock;
- stop.yml stops the process group on every node (after a stall, with each rank's process state and
  stack first: hang.py names a rank stopped, blocked in the kernel or gone from the states). It
  runs as soon as any host fails, on Ctrl-C, TERM or HUP, and with `--stop` (stop.py, `trainer
  stop`); the last stop of a launch (no restart follows) releases the lock. A run stopped from
  outside (`trainer stop`) ends the attempt as stopped, exit 130, with no restart.

A node that stops answering is shown as `unreachable (Ns)` while its trainer keeps running; it is
lost at once when its peers' collectives fail meanwhile, else after `--unreachable-grace` seconds.
No rank advancing a step (the bundled trainer) or no node printing a line (a user's command) for
`--stall-timeout` seconds stops every node and names the ranks that were behind.

This module runs one attempt (`Launcher.attempt`: probe, start, follow, stop; `Launcher.follow` for
`trainer attach`) and says how it ended (`Outcome`); attempt_events.py handles what the attempt's
playbook says meanwhile (the start handshake, the nodes' events and messages); failure.py names the
cause and its consequences; restarts.py is the policy above it (--max-restarts, --exclude-failed,
--allow-batch-change), shared with `trainer attach`.
"""

from __future__ import annotations

import signal
import time
import uuid
from typing import Any

from trainer import exitcodes
from trainer.controller.launcher.attempt_events import (
    FollowEvents,
    GrowWatch,
    StartEvents,
    StartHandshake,
    StepFailure,
)
from trainer.controller.launcher.failure import Diagnosis, Outcome, diagnose, render
from trainer.controller.launcher.hang_check import HangCheck
from trainer.controller.launcher.launch_record import LaunchRecord, RestartState
from trainer.controller.launcher.launchfiles import launch_files
from trainer.controller.launcher.live import JobMonitor, LiveView, Stall, node_text
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.runlock import (
    RELEASE_TASK,
    LockError,
    RunLock,
    describe_holder,
    holder_state,
    lock_call,
    release_quietly,
)
from trainer.controller.launcher.wire import (
    PLAYBOOKS,
    START_SKIP_TAG,
    STATES_TASK,
    STOP_TASK,
    WatchOptions,
    drop_node_files,
    launch_env,
    launch_vars,
    start_calls,
)
from trainer.controller.launcher.world import WorldCheck
from trainer.controller.runner import PlaybookResult, PrestartedRun, run_playbook
from trainer.controller.training_env import IB_AUTO

INTERRUPTED = exitcodes.INTERRUPTED


def job_monitor(plan: JobPlan, options: WatchOptions, view: LiveView) -> JobMonitor:
    """The per-node states of one attempt of `plan`, watched with `options` (also a Slurm step's:
    guest.py)."""
    topo = plan.topology
    world = None
    if plan.world_checked:
        world = WorldCheck(
            workers=tuple(n.host for n in topo.nodes[1:]),
            head=topo.head.host,
            endpoint=f"{topo.master_addr}:{topo.master_port}",
            strict=plan.user_launcher is not None,
            launcher=plan.user_launcher or "",
            timeout_s=options.world_timeout_s,
        )
    return JobMonitor(
        {n.host: n.node_rank for n in topo.nodes},
        topo.head.host,
        view,
        unreachable_grace_s=options.unreachable_grace_s,
        stall_timeout_s=options.stall_timeout_s,
        stall_adaptive=options.stall_adaptive,
        progress_from_steps=plan.runs_bundled_trainer,
        ranks={n.host: n.global_ranks(topo.gpus_per_node) for n in topo.nodes},
        world=world,
    )


class Launcher:
    """One attempt at a time of a launch (attempt, or follow for `trainer attach`), its stops and the
    run's lock. Its whole state is declared here; the restart policy (restarts.py) drives it."""

    plan: JobPlan
    """The job the next attempt runs (use_plan: the restart policy left nodes out of it)."""
    options: WatchOptions
    """How the attempt is followed (--poll-interval, --unreachable-grace, --stall-timeout, ...)."""
    lock: RunLock
    """The run's lock on the head (runlock.py): taken before the first probe, kept across restarts."""
    env: dict[str, str]
    """ansible-playbook's environment for every playbook of the launch (wire.launch_env)."""
    prestarted: PrestartedRun | None
    """start.yml, started while the plan was made (launch_cli.run), for the first attempt to use."""
    launch_id: str
    """Tags every process this launch starts (node_ctl.py), so a stop finds them all; new_launch makes
    one, adopt takes the launch.json's of a launch already running."""
    attempt_number: int
    """1 for the first attempt, one more for each restart (in launch.json and the history records)."""
    files: dict[str, str]
    """The run's files (launchfiles.py: config, DeepSpeed JSON, hostfile, ...) that start.yml writes."""
    become: dict[str, bool]
    """Host -> whether Ansible becomes the training user there, as each node's probe found it."""
    policy: RestartState | None
    """The restart policy's state (restarts.RestartPolicy.state): in launch.json, for `trainer attach`."""
    reuse_node_files: bool
    """Restart with the run.sh, secret variables and run files the nodes already have (`trainer
    attach`, which has not the launch's config, --set and --env): nothing is written but the new
    launch id, the launch record and the node helper."""

    def __init__(
        self,
        plan: JobPlan,
        options: WatchOptions | None = None,
        *,
        command: str = "trainer launch",
        prestarted: PrestartedRun | None = None,
    ) -> None:
        self.plan = plan
        self.options = options or WatchOptions()
        self.lock = RunLock(plan.run_name, plan.launch_dir, command)
        self.env = launch_env()
        self.prestarted = prestarted
        self.attempt_number = 0
        self.become = {}
        self.policy = None
        self.reuse_node_files = False
        self.new_launch()

    def adopt(self, record: LaunchRecord | None) -> None:
        """Go on with the launch `record` (its launch.json) describes, already running: its launch id
        and attempt number. None (no launch.json to read): this launcher's own are kept."""
        if record is None:
            return
        self.launch_id = record.launch_id or self.launch_id
        self.attempt_number = record.attempt or 1

    def use_plan(self, plan: JobPlan) -> None:
        """The next attempt runs `plan` (the restart policy left nodes out of it)."""
        hosts = {n.host for n in plan.topology.nodes}
        self.plan = plan
        self.become = {h: b for h, b in self.become.items() if h in hosts}
        self.files = launch_files(plan)

    def new_launch(self) -> None:
        """A launch of its own: a new launch id, the plan's files."""
        self.launch_id = f"{self.plan.run_name}-{uuid.uuid4().hex[:12]}"
        self.files = launch_files(self.plan)

    @property
    def hosts(self) -> list[str]:
        return [n.host for n in self.plan.topology.nodes]

    # --- what the playbooks get ---------------------------------------------------------------

    def record(self) -> LaunchRecord:
        """launch.json on every node: what `trainer status` and `trainer attach` read back."""
        return LaunchRecord.of_attempt(
            self.plan,
            self.options,
            launch_id=self.launch_id,
            attempt=self.attempt_number,
            restart=self.policy,
        )

    def extravars(self, **extra: Any) -> dict[str, Any]:
        """The variables of this launch's playbooks (wire.launch_vars); `extra` as there."""
        return launch_vars(
            self.plan,
            self.options,
            launch_id=self.launch_id,
            become=self.become,
            lock_request=self.lock.request("acquire"),
            **extra,
        )

    def _run(
        self, playbook: str, extravars: dict[str, Any], *, skip: set[str] = frozenset(), **kwargs: Any
    ) -> PlaybookResult:
        if playbook != "start.yml":
            # Only the start needs the files and secrets; the other playbooks never see them.
            drop_node_files(extravars)
        # start.yml's plays run on launch_hosts (no --limit), and it skips what the launch has no use
        # for by one tag: its command line is the same for every plan, so it may be prestarted.
        start = playbook == "start.yml"
        prestarted = None
        if start:
            start_calls(extravars)
            prestarted, self.prestarted = self.prestarted, None
        return run_playbook(
            PLAYBOOKS / playbook,
            self.plan.topology.inventory,
            extravars,
            env=self.env,
            limit=None if start else ",".join(h for h in self.hosts if h not in skip),
            skip_tags=START_SKIP_TAG if start else None,
            prestarted=prestarted,
            **kwargs,
        )

    # --- stop ---------------------------------------------------------------------------------

    def stop(
        self,
        monitor: JobMonitor | None = None,
        *,
        stacks: bool = False,
        states: bool = False,
        record: dict | None = None,
        release: bool = False,
        skip: set[str] = frozenset(),
    ) -> PlaybookResult:
        """Stop the run on every host but `skip` (hosts known lost: a stop there would only wait for
        their connection to time out), and release the run's lock with `release`, when no restart
        follows. A second Ctrl-C (or TERM, or HUP) must not cut this short (it would leave trainers
        running), so they are ignored until the stop playbook is done."""
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
        try:
            result = self._run(
                "stop.yml",
                self.extravars(
                    launch_stacks=stacks,
                    launch_states=states,
                    launch_stop_record=record or {},
                    # Not only when known to be held: an interrupt can come between the lock's
                    # taking and its report. The head removes it only for this launcher's token.
                    launch_release_lock=release,
                ),
                skip=skip,
            )
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        released = result.task_result(self.plan.topology.head.host, RELEASE_TASK)
        if released is not None and released.status == "ok" and released.result.get("released"):
            self.lock.held = False
        if monitor is not None:
            for host, items in result.ok.items():
                for item in items:
                    if item.task == STOP_TASK and host in monitor.hosts and "state" in item.result:
                        monitor.apply(monitor.hosts[host], item.result)
            for host, items in result.unreachable.items():
                if host in monitor.hosts:
                    monitor.on_unreachable(host, items[-1].message)
        return result

    def stop_after_error(self, view: LiveView, error: Exception) -> None:
        """The launcher failed with `error` (restarts.RestartPolicy.run): stop the run everywhere."""
        view.log(f"trainer launch: {error!r}: stopping the run on every node")
        self._report_stop_problems(
            self.stop(record=self._stop_record(None, "launcher_error", repr(error))), view
        )

    @staticmethod
    def stop_problems(result: PlaybookResult) -> list[str]:
        """Hosts where the stop could not be confirmed, with why."""
        problems = []
        for host, items in {**result.failed, **result.unreachable}.items():
            problems.append(f"{host} ({(items[-1].message.splitlines() or [items[-1].status])[0][:200]})")
        return problems

    # --- one attempt --------------------------------------------------------------------------

    def monitor(self, view: LiveView) -> JobMonitor:
        return job_monitor(self.plan, self.options, view)

    def attempt(
        self,
        view: LiveView,
        record: dict[str, Any],
        *,
        policy: RestartState | None = None,
        final: bool = True,
        leave_lost: bool = False,
        grow: GrowWatch | None = None,
    ) -> Outcome:
        """Start the job on every node and follow it until it ends, fails or stalls. `record`: the
        history record the start writes (a launch, a restart); `policy`: the restart policy's state,
        for launch.json; `final`: no restart can follow, so the stop releases the run's lock;
        `leave_lost`: the next attempt goes on without a lost node, so its stop does not wait for it
        (a vanished node's connection would only time out), else it is tried like any other; `grow`:
        asked whether to end the attempt at a checkpoint, a node left out being back (rejoin.py)."""
        self.policy = policy
        self.attempt_number += 1
        monitor = self.monitor(view)
        view.states(monitor.ordered)
        handshake = StartHandshake(self.hosts, on_word=lambda word: self._say_transport(view, word))
        events = StartEvents(
            monitor, self.lock, handshake, view, self.plan.topology.head.host, self.become, grow
        )
        self._say_launching(view)
        extravars = self._start_vars(record)
        return self._play("start.yml", extravars, events, view, final=final, leave_lost=leave_lost)

    def follow(self, view: LiveView, *, policy: RestartState | None = None, final: bool = True) -> Outcome:
        """`trainer attach`: follow the launch that is already running (its launch_id and
        attempt_number are launch.json's) until it ends, fails or stalls, as `attempt` does once its
        nodes have started. `policy` and `final` as for `attempt`."""
        self.policy = policy
        plan, topo = self.plan, self.plan.topology
        monitor = self.monitor(view)
        view.states(monitor.ordered)
        view.message(
            f"Following run [bold]{plan.run_name}[/bold] (launch {self.launch_id}) on {topo.nnodes} "
            f"node(s); each node's log in {plan.paths.node_log('N')}"
        )
        events = FollowEvents(monitor, self.lock)
        return self._play("watch.yml", self.extravars(), events, view, final=final, leave_lost=False)

    def _say_launching(self, view: LiveView) -> None:
        plan, topo = self.plan, self.plan.topology
        what = f"engine {plan.engine}" if plan.runs_bundled_trainer else "your command"
        view.message(
            f"Launching run [bold]{plan.run_name}[/bold] on {topo.nnodes} node(s) × {topo.gpus_per_node} "
            f"process(es) (world size {topo.world_size}, {what}, master "
            f"{topo.master_addr}:{topo.master_port}); output in {plan.output_dir}, each node's log "
            f"in {plan.paths.node_log('N')}"
        )
        # What the plan says too: a value the user set that another one overrules, one line each.
        from rich.markup import escape

        for line in plan.overruled:
            view.message(f"overruled: {escape(line)}")

    def _say_transport(self, view: LiveView, word: dict[str, Any]) -> None:
        """NCCL_IB_DISABLE auto: what the word to start chose, and why."""
        if self.plan.topology.nccl_ib_disable != IB_AUTO:
            return
        every = word["ib_disable"] == 0
        view.message(
            f"NCCL_IB_DISABLE auto: {0 if every else 1} ("
            + (
                "InfiniBand/RoCE devices on every node"
                if every
                else "not every node lists InfiniBand/RoCE devices in /sys/class/infiniband: TCP sockets"
            )
            + ")"
        )

    def _start_vars(self, record: dict[str, Any]) -> dict[str, Any]:
        """start.yml's variables: the run's files, launch.json and the history record written anew, or
        (reuse_node_files) the nodes' own kept."""
        extravars = self.extravars(
            launch_files={} if self.reuse_node_files else self.files,
            launch_info=self.record().to_json(),
            launch_record={**record, "launch_id": self.launch_id, "attempt": self.attempt_number},
            launch_reuse=self.reuse_node_files,
        )
        if self.reuse_node_files:
            drop_node_files(extravars)
        return extravars

    def _play(
        self,
        playbook: str,
        extravars: dict[str, Any],
        events: FollowEvents,
        view: LiveView,
        *,
        final: bool,
        leave_lost: bool,
    ) -> Outcome:
        """Run the attempt's playbook with `events` handling what it says, then conclude: an ending
        that needs no stop of this launcher's (_settled), else the stop and the diagnosis."""
        monitor = events.monitor
        events.quiet_check = self._quiet_check(monitor, view)
        with view:
            try:
                result: PlaybookResult | None = self._run(
                    playbook,
                    extravars,
                    on_event=events.on_event,
                    on_message=events.on_message,
                    on_tick=events.on_tick,
                    cancel=events.cancel,
                )
            except KeyboardInterrupt:
                result = None  # Ctrl-C, TERM or HUP (install_signal_handlers)
            finally:
                if events.quiet_check is not None:
                    events.quiet_check.close()  # a states read under way ends before what follows
            if result is None:
                return self._interrupted(monitor, view)
            if (settled := self._settled(events, view)) is not None:
                return settled
            stall = monitor.stall
            skipped, stopped = self._stop_failed(monitor, result, view, final=final, leave_lost=leave_lost)
        return self._diagnosed(monitor, stall, stopped, skipped, view)

    def _interrupted(self, monitor: JobMonitor, view: LiveView) -> Outcome:
        view.message("interrupted: stopping the trainer on every host (wait for it)")
        stopped = self.stop(
            monitor,
            record=self._stop_record(None, "interrupted", "Ctrl-C, TERM or HUP"),
            release=True,
        )
        view.states(monitor.ordered)
        self._report_stop_problems(stopped, view)
        view.message(f"interrupted: the trainer is stopped on all hosts (run {self.plan.run_name})")
        return Outcome(INTERRUPTED, "interrupted")

    def _settled(self, events: FollowEvents, view: LiveView) -> Outcome | None:
        """How the attempt ended when no stop of this launcher's is needed to say it: the run's lock
        refused, a failed probe or start (stopped by _start_failed), every node done, or the run
        stopped from outside; None when it failed or stalled."""
        plan, monitor = self.plan, events.monitor
        if events.lock_refused:
            view.message(f"[red]trainer launch: run {plan.run_name} is locked[/red]")
            view.log(self.lock.refusal(events.lock_refused[0]))
            return Outcome(exitcodes.CONFIG_ERROR, "locked", [], "the run is locked by another launch")
        if isinstance(events, StartEvents) and events.failures:
            # Every node told to start may run its trainer (a start that failed by timing out may have
            # started it after all): each is stopped, a node with nothing running answers so.
            may_run = events.started | events.handshake.told_to_start
            return self._start_failed(events.failures, may_run, view, monitor)
        if monitor.all_done:
            view.message(
                f"[green]done[/green]: run {plan.run_name} finished on all {len(monitor.hosts)} node(s); "
                f"output in {plan.output_dir}"
            )
            return Outcome(exitcodes.OK, "done")
        if events.growing and not monitor.failed:
            return self._stop_to_grow(monitor, view)
        stopped = [hs.host for hs in monitor.ordered if hs.state == "stopped"]
        if stopped and not any(hs.failed and not hs.only_consequence for hs in monitor.ordered):
            # This launcher has stopped nothing yet: `trainer stop` (or another follower's stop) did,
            # and a peer that failed meanwhile lost its collective to that stop.
            view.message(
                f"[yellow]stopped[/yellow]: run {plan.run_name} was stopped on {', '.join(stopped)} from "
                f"outside this launcher (trainer stop); nothing is restarted. Who stopped it: "
                f"{plan.paths.history}"
            )
            return Outcome(INTERRUPTED, "stopped", [], "stopped by trainer stop")
        return None

    def _stop_to_grow(self, monitor: JobMonitor, view: LiveView) -> Outcome:
        """A node left out is back and rank 0 announced a complete checkpoint: stop every node (the
        checkpoint stays whole: `latest` names it, and a later save replaces it atomically), so that the
        next attempt resumes from it on all the nodes (restarts.py). Outcome `rejoin`, with the latest
        checkpoint the head reports."""
        view.message(
            f"stopping run {self.plan.run_name} after its checkpoint "
            f"{node_text(monitor.last_checkpoint.rsplit('/', 1)[-1])} to grow back"
        )
        stopped = self.stop(monitor, record=self._stop_record(None, "rejoin", monitor.last_checkpoint))
        view.states(monitor.ordered)
        self._report_stop_problems(stopped, view)
        head = stopped.task_result(self.plan.topology.head.host, STOP_TASK)
        latest = str((head.result if head is not None else {}).get("latest_checkpoint") or "")
        return Outcome(
            exitcodes.OK,
            "rejoin",
            [],
            "grow back at a checkpoint",
            latest_checkpoint=latest or monitor.last_checkpoint,
        )

    def _stop_failed(
        self, monitor: JobMonitor, result: PlaybookResult, view: LiveView, *, final: bool, leave_lost: bool
    ) -> tuple[set[str], PlaybookResult]:
        """A node failed or the job stalled: say so, then stop every node (a stall's with the stacks
        first) but the lost ones with `leave_lost`. The hosts left alone, and the stop's result."""
        plan, stall = self.plan, monitor.stall
        early = None
        try:  # nothing the nodes reported may keep the stop below from happening
            if not monitor.must_stop and result.output.strip():
                view.message("[red]trainer launch: the launch playbook ended early[/red]")
                view.log(result.output.strip()[-2000:])
            # What is known now names the cause in the history record the stop writes; the stop's own
            # answers (a node that does not answer it) complete it for the report (_diagnosed).
            early = diagnose(monitor, bundled=plan.runs_bundled_trainer)
            if stall is not None:
                # A user's command: its ranks' Python stacks too (py-spy), in the same read.
                what = "process state" if plan.runs_bundled_trainer else "process state and Python stack"
                view.message(f"stalled ({stall.summary}): reading each rank's {what}")
                early = self._stall_culprit(monitor, view, set(early.lost) if early is not None else set())
            elif early is not None:
                view.message(f"{early.cause_phrase}; stopping the trainer on every host that answers")
        except Exception as err:  # reported, then the stop
            view.log(f"trainer launch: the failure could not be diagnosed before the stop: {err!r}")
        skipped = set(early.lost) if early is not None and leave_lost else set()
        stopped = self.stop(
            monitor,
            stacks=stall is not None and plan.runs_bundled_trainer,
            # A node whose states did not come before the stop reads them in it (before its TERM).
            states=stall is not None
            and any(hs.proc_states is None for hs in monitor.ordered if hs.host not in skipped),
            record=self._stop_record(early),
            release=final,
            skip=skipped,
        )
        view.states(monitor.ordered)
        return skipped, stopped

    def _read_states(self, lost: set[str]) -> PlaybookResult:
        """states.yml on every node but `lost`: its ranks' process states (a user's command: with their
        Python stacks) and its connects to its peers on the master port."""
        nodes = self.plan.topology.nodes
        peers = {n.host: [[p.host, p.address] for p in nodes if p.host != n.host] for n in nodes}
        return self._run("states.yml", self.extravars(launch_peers=peers), skip=lost)

    def _quiet_check(self, monitor: JobMonitor, view: LiveView) -> HangCheck | None:
        """A user's command followed with the adaptive bound: its quiet spells checked for a culprit."""
        adaptive = self.options.stall_adaptive and self.options.stall_timeout_s
        if self.plan.runs_bundled_trainer or not adaptive:
            return None
        return HangCheck(lambda: self._read_states(set()), lambda result: apply_states(monitor, result), view)

    def _stall_culprit(self, monitor: JobMonitor, view: LiveView, lost: set[str]) -> Diagnosis | None:
        """At a stall, before the stop: every node's ranks' process states (states.yml, /proc only),
        so the culprit is named before the stacks and the TERM (seconds sooner: bench/hangs.py) and the
        stop's history record names it (kind `hung`, host, rank) instead of `stall`. The diagnosis."""
        apply_states(monitor, self._read_states(lost))
        early = diagnose(monitor, bundled=self.plan.runs_bundled_trainer)
        then = (
            "collecting stacks, then stopping every host"
            if self.plan.runs_bundled_trainer
            else "stopping every host"
        )
        if early is not None and early.cause.kind == "hung":
            view.message(f"culprit: {node_text(early.summary)}; {then}")
        else:
            view.message(f"no rank stopped, blocked or gone; {then}")
        return early

    def _diagnosed(
        self,
        monitor: JobMonitor,
        stall: Stall | None,
        stopped: PlaybookResult,
        skipped: set[str],
        view: LiveView,
    ) -> Outcome:
        """The failed attempt's cause and consequences (failure.py), shown, as its Outcome."""
        plan = self.plan
        diagnosis = diagnose(monitor, bundled=plan.runs_bundled_trainer)
        # Each host's stop report: the head's names the latest checkpoint; a stall's carry the stacks.
        reports = {
            host: item.result
            for host, items in stopped.ok.items()
            for item in items
            if item.task == STOP_TASK
        }
        latest = str(reports.get(plan.topology.head.host, {}).get("latest_checkpoint") or "")
        self._report_stop_problems(stopped, view, skipped=sorted(skipped))
        if diagnosis is None:
            view.message("[red]trainer launch: watching the trainer failed[/red]")
            return Outcome(
                exitcodes.FAILURE, "watch_failed", [], "watching the trainer failed", latest_checkpoint=latest
            )
        stacks = {host: report.get("stacks") or {} for host, report in reports.items()}
        stopped_in = (
            f" {time.time() - monitor.failed_at:.1f} s after the failure" if monitor.failed_at else ""
        )
        render(
            diagnosis,
            monitor,
            view,
            stopped_in=stopped_in,
            stall_timeout_s=self.options.stall_timeout_s,
            stacks=stacks,
        )
        cause = diagnosis.cause
        return Outcome(
            diagnosis.code,
            "saved" if diagnosis.requested_stop else "failed",
            sorted({host for host, _, _ in stall.behind})
            if stall is not None and cause.kind == "stall"
            else [cause.host],
            diagnosis.summary,
            restartable=diagnosis.restartable,
            latest_checkpoint=latest,
            lost=list(diagnosis.lost),
            diagnosis=diagnosis,
        )

    def _stop_record(
        self, diagnosis: Diagnosis | None, why: str = "failed", detail: str = ""
    ) -> dict[str, Any]:
        """The history record a stop writes on the head: why, and for a failure its cause and what
        followed from it (failure.Diagnosis)."""
        record = {
            "event": "stopped",
            "launch_id": self.launch_id,
            "attempt": self.attempt_number,
            "why": why,
            "detail": detail,
            "hosts": [],
        }
        if diagnosis is not None:
            record.update(
                why=diagnosis.cause.kind,
                detail=diagnosis.summary,
                hosts=[diagnosis.cause.host],
                **diagnosis.as_record(),
            )
        return record

    def _start_failed(
        self,
        failures: list[StepFailure],
        started: set[str],
        view: LiveView,
        monitor: JobMonitor,
    ) -> Outcome:
        """A probe or start step failed on some node. One that could not be reached at all is lost
        (restarts.py leaves it out with --exclude-failed); any other failure is the job's."""
        # Each unreachable host with its first error's text.
        unreachable: dict[str, str] = {}
        for failed_host, _, failed_text, name in failures:
            if name == "runner_on_unreachable":
                unreachable.setdefault(failed_host, failed_text)
        host, task, text, _ = next((f for f in failures if f[0] not in unreachable), failures[0])
        reachable_failure = host not in unreachable
        try:  # whatever fails in reporting, the started nodes are stopped
            for lost, lost_text in unreachable.items():
                monitor.on_unreachable(lost, lost_text)
                first = lost_text.splitlines()[0][:200] if lost_text.strip() else "no answer"
                view.message(f"[red]{lost} does not answer[/red] ({node_text(first)}): it is lost")
            if reachable_failure:
                view.message(
                    f"[red]trainer launch: could not start on {host}[/red] ({node_text(task)}): "
                    + node_text(text)
                )
            if started:
                view.message("stopping the nodes that had started")
        finally:
            if started:
                record = {"why": "start_failed", "detail": text, "hosts": [host], "lost": list(unreachable)}
                self.stop(record={**self._stop_record(None), **record}, skip=set(unreachable))
        return Outcome(
            exitcodes.FAILURE if reachable_failure else exitcodes.NODE_LOST,
            "start_failed",
            [host] if reachable_failure else list(unreachable),
            f"could not start on {host}: {text.splitlines()[0][:200] if text else task}"
            if reachable_failure
            else f"{', '.join(unreachable)} did not answer its probe",
            restartable=not reachable_failure,
            lost=[] if reachable_failure else list(unreachable),
        )

    def _report_stop_problems(self, stopped: PlaybookResult, view: LiveView, skipped: list[str] = ()) -> None:
        for host in skipped:
            view.message(
                f"{host} was not stopped: it is lost. If it comes back with its trainer still running, "
                f"the next launch of run {self.plan.run_name} there refuses to start and names it"
            )
        for problem in self.stop_problems(stopped):
            view.message(
                f"[red]could not confirm the stop on {problem}[/red]: its trainer may still be running; "
                f"stop it with `trainer stop -i INVENTORY --run-name {self.plan.run_name}` once it "
                "answers"
            )

    # --- the run's lock (runlock.py) -------------------------------------------------------------

    def lock_call(self, action: str, take_over: str | None = None) -> dict[str, Any]:
        """One round trip to the head's lock (lock.yml)."""
        return lock_call(self.lock, *self._lock_call_args(), action, take_over)

    def take_over_lock(self, view: LiveView) -> int | None:
        """--force: take the lock, over a holder that is not verifiably alive; None, or the exit code."""
        try:
            answer = self.lock_call("acquire")
            if answer.get("acquired"):
                return None
            holder = answer.get("holder") or {}
            if holder_state(holder) == "alive":
                view.message(f"[red]trainer launch: run {self.plan.run_name} is locked[/red]")
                view.log(self.lock.refusal(holder, forced=True))
                return exitcodes.CONFIG_ERROR
            answer = self.lock_call("acquire", take_over=str(holder.get("token") or ""))
        except LockError as err:
            view.log(f"trainer launch: {err}")
            return exitcodes.FAILURE
        if not answer.get("acquired"):
            view.message(f"[red]trainer launch: run {self.plan.run_name} is locked[/red]")
            view.log(self.lock.refusal(answer.get("holder"), forced=True) + " (it changed hands just now)")
            return exitcodes.CONFIG_ERROR
        view.log(f"--force: took over the lock of run {self.plan.run_name} from {describe_holder(holder)}")
        return None

    def release_lock(self, view: LiveView) -> None:
        """The run's lock, if still held here (a failure with no restart left, an interrupt between
        attempts): released with one more round trip."""
        if problem := release_quietly(self.lock, *self._lock_call_args()):
            view.log(
                f"{problem}; it names this launcher, which has ended: the next launch of run "
                f"{self.plan.run_name} needs --force"
            )

    def _lock_call_args(self) -> tuple[Any, ...]:
        return (
            str(self.plan.topology.inventory),
            self.plan.topology.head.host,
            {
                "launch_training_user": self.plan.training_user,
                "launch_become_hosts": self.become,
                "launch_command_timeout_s": self.options.command_timeout_s,
            },
            self.env,
        )


def apply_states(monitor: JobMonitor, result: PlaybookResult) -> None:
    """states.yml's answers into the monitor: each node's ranks' process states and reach of its peers."""
    for host, items in result.ok.items():
        for item in items:
            if item.task != STATES_TASK or host not in monitor.hosts:
                continue
            if isinstance(states := item.result.get("proc_states"), list):
                monitor.hosts[host].proc_states = states
            if isinstance(reach := item.result.get("reach"), dict):
                monitor.hosts[host].reach = reach
