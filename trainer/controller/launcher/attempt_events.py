"""What the playbook of one attempt says while it runs, and what the launcher answers: the start
handshake (every node's probe, then the launcher's word to start) and the handlers of Ansible's
events and of the nodes' messages (runner.py's `on_event`, `on_message`, `on_tick`).

start.yml (StartEvents) takes the run's lock, probes every node, starts the trainer on each once all
have passed and follows it; watch.yml (FollowEvents, `trainer attach`) only follows. Each handler
records what happened for the Launcher's verdict (launch.Launcher.attempt) and sets `cancel` when
the playbook must be ended: it would not end by itself while any node is followed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from trainer.controller.launcher.live import JobMonitor, LiveView
from trainer.controller.launcher.runlock import LOCK_TASK, RELEASE_TASK, RunLock
from trainer.controller.launcher.wire import LAUNCH_TASK, WATCH_TASK
from trainer.controller.runner import with_known_fix

FAILED_EVENTS = ("runner_on_failed", "runner_on_unreachable")


class GrowWatch(Protocol):
    """rejoin.Rejoin as the attempt sees it: whether to end now, at a checkpoint, to grow back."""

    def due(self, monitor: JobMonitor) -> bool: ...


class QuietCheck(Protocol):
    """hang_check.HangCheck as the attempt sees it: on each tick, a quiet user's command checked for a
    culprit while it runs (the monitor's suspect confirmed as a stall, or dismissed)."""

    def on_tick(self, monitor: JobMonitor) -> None: ...

    def close(self) -> None: ...


def start_word(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The launcher's word to every probed node once all have passed (launch_node's `launch`): start,
    with NCCL's transport for the whole job: InfiniBand/RoCE only if every node has devices."""
    every = all(probe.get("ib_devices") for probe in probes)
    return {"go": True, "ib_disable": 0 if every else 1}


class StepFailure(NamedTuple):
    """A node's probe or start step (or a task of start.yml's around them) that failed."""

    host: str
    step: str
    """What failed, as the user reads it: "Probe the node", "Start the trainer", or the task's name."""
    text: str
    event: str
    """runner_on_failed, or runner_on_unreachable (the node could not be reached at all: lost)."""


@dataclass
class StartHandshake:
    """The barrier between the nodes' probes and their starts. Each node whose probe passed waits
    for the launcher's word (its `probed` message, answered with `reply`); the word is given once
    every node's probe has passed. After a failed probe or a refused lock every node is told not to
    start, as the play's any_errors_fatal stopped the nodes between two tasks."""

    hosts: list[str]
    """Every node of the attempt, in rank order."""
    on_word: Callable[[dict[str, Any]], None]
    """Called with the word to start just before it is given (to say what NCCL will use)."""
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Host -> its probe's answer, for each node whose probe passed."""
    waiting: list[Any] = field(default_factory=list)
    """The `probed` messages not answered yet."""
    probe_failed: list[str] = field(default_factory=list)
    """Hosts whose probe failed, in the order they did."""
    locked: bool = False
    """The head refused the run's lock: another launcher holds it."""
    told_to_start: set[str] = field(default_factory=set)
    """Hosts given the word to start: from then on a failure of theirs is a failed start."""

    def probed(self, host: str, message: Any) -> None:
        self.probes[host] = message.get("answer") or {}
        self.waiting.append(message)
        self._answer()

    def refuse_lock(self) -> None:
        self.locked = True
        self._answer()

    def fail_probe(self, host: str) -> None:
        self.probe_failed.append(host)
        self._answer()

    def _answer(self) -> None:
        if self.probe_failed or self.locked:
            why = f"the probe failed on {self.probe_failed[0]}" if self.probe_failed else "the run is locked"
            for message in self.waiting:
                message.reply({"go": False, "why": why})
            self.waiting.clear()
            return
        # The head's probe passes only once this launcher holds the run's lock (taken by the play
        # before, by the probe, or by the head's action after it).
        if not all(h in self.probes for h in self.hosts):
            return
        word = start_word([self.probes[h] for h in self.hosts])
        self.on_word(word)
        for message in self.waiting:
            message.reply(word)
            self.told_to_start.add(str(message.get("host")))
        self.waiting.clear()


class FollowEvents:
    """The handlers of a playbook that follows the nodes (watch.yml): the monitor judges the nodes
    from their reports, and the playbook is ended once it says every node must be stopped."""

    def __init__(self, monitor: JobMonitor, lock: RunLock, grow: GrowWatch | None = None) -> None:
        self.monitor = monitor
        self.lock = lock
        #: Asked on every message and tick while nothing failed: end the attempt to grow back (rejoin.py).
        self.grow = grow
        #: The attempt ends to grow back: rank 0 announced a complete checkpoint after a node came back.
        self.growing = False
        #: A user's command gone quiet, checked for a culprit while it runs (hang_check.py).
        self.quiet_check: QuietCheck | None = None
        #: Set to end the playbook (runner.py's cancel).
        self.cancel = threading.Event()
        #: The holders of the run's lock that refused it to this launcher.
        self.lock_refused: list[dict[str, Any]] = []
        #: Handlers of an Ansible event by the name of its task; any other task: _other_task.
        self.by_task: dict[str | None, Callable[[str, dict[str, Any], Any, dict[str, Any]], None]] = {
            LOCK_TASK: self._lock_task,
            RELEASE_TASK: self._lock_task,
            # The watch's end (its result is its last report, already shown) or its failure (the
            # monitor has judged the node from its misses).
            WATCH_TASK: lambda *_: None,
        }

    def on_event(self, event: dict[str, Any]) -> None:
        name, data = event.get("event", ""), event.get("event_data", {})
        task, host, res = data.get("task"), data.get("host"), data.get("res") or {}
        self.by_task.get(task, self._other_task)(name, data, host, res)

    def on_message(self, message: dict[str, Any]) -> None:
        self.monitor.on_message(message)
        self._end_if_due()

    def on_tick(self) -> None:
        self.monitor.tick()
        if self.quiet_check is not None:
            self.quiet_check.on_tick(self.monitor)
        self._end_if_due()

    def must_end(self) -> bool:
        return self.monitor.must_stop or self._grow_due()

    def _grow_due(self) -> bool:
        if not self.growing and self.grow is not None and not self.monitor.failed:
            self.growing = self.grow.due(self.monitor)
        return self.growing

    def _end_if_due(self) -> None:
        if self.must_end():
            self.cancel.set()

    def _lock_task(self, name: str, data: dict[str, Any], host: Any, res: dict[str, Any]) -> None:
        if not data.get("ignore_errors"):
            if name == "runner_on_ok" and data.get("task") == LOCK_TASK:
                self.lock.held = True
            elif name == "runner_on_ok" and res.get("released"):
                self.lock.held = False
            elif name == "runner_on_failed" and data.get("task") == LOCK_TASK and "holder" in res:
                self._refused(res.get("holder") or {})
                return
        self._other_task(name, data, host, res)

    def _refused(self, holder: dict[str, Any]) -> None:
        self.lock_refused.append(holder)

    def _other_task(self, name: str, data: dict[str, Any], host: Any, res: dict[str, Any]) -> None:
        if host in self.monitor.hosts and name == "runner_on_unreachable":
            self.monitor.on_unreachable(host, str(res.get("msg") or "unreachable"))


class StartEvents(FollowEvents):
    """The handlers of start.yml: the lock's answers, the handshake, the nodes that started, and the
    steps that failed. A failed probe ends the attempt before anything starts; a failed start once
    every other node's start has answered (started or failed): ended sooner, a start still on its
    way would start a trainer after the stop, which then held the master port."""

    def __init__(
        self,
        monitor: JobMonitor,
        lock: RunLock,
        handshake: StartHandshake,
        view: LiveView,
        head: str,
        become: dict[str, bool],
        grow: GrowWatch | None = None,
    ) -> None:
        super().__init__(monitor, lock, grow)
        self.handshake = handshake
        self.view = view
        self.head = head
        #: Host -> whether its tasks need become (its probe says so), for every later playbook.
        self.become = become
        #: Hosts whose trainer started.
        self.started: set[str] = set()
        #: Hosts whose start failed.
        self.start_ended: set[str] = set()
        self.failures: list[StepFailure] = []
        self.by_task[LAUNCH_TASK] = self._launch_task

    def on_message(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "probed":
            self._probed(message)
            return
        if kind == "started":
            host, report = str(message.get("host")), message.get("report") or {}
            if host not in self.monitor.hosts:
                return
            self.started.add(host)
            # Only "running": a command that has ended already is judged by the watch's first
            # report, which brings its log lines with its state.
            if report.get("state") == "running":
                self.monitor.apply(self.monitor.hosts[host], report)
                self.view.states(self.monitor.ordered)
        else:
            self.monitor.on_message(message)
        self._end_if_due()

    def must_end(self) -> bool:
        # Before every node started or failed to, a failure is judged when the starts end (a stop now
        # could reach a node before its start does).
        starts_done = len(self.started | self.start_ended) >= len(self.handshake.hosts)
        return starts_done and bool(self.monitor.must_stop or self.start_ended or self._grow_due())

    def _probed(self, message: dict[str, Any]) -> None:
        host, answer = str(message.get("host")), message.get("answer") or {}
        self.become[host] = bool(answer.get("become"))
        if host == self.head and (answer.get("lock") or {}).get("acquired"):
            # The head's probe took the run's lock (lock_in_probe, or after it as the training user).
            self.lock.held = True
        self.handshake.probed(host, message)

    def _refused(self, holder: dict[str, Any]) -> None:
        super()._refused(holder)
        self.handshake.refuse_lock()

    def _launch_task(self, name: str, data: dict[str, Any], host: Any, res: dict[str, Any]) -> None:
        if host == self.head and res.get("lock"):
            # The head's probe took the lock (lock_in_probe), or was refused it and probed nothing.
            if res["lock"].get("acquired"):
                self.lock.held = True
            elif name == "runner_on_failed" and "holder" in res["lock"]:
                self._refused(res["lock"].get("holder") or {})
                return
        if host not in self.monitor.hosts:
            return
        if res.get("phase") == "watch" or host in self.started:
            # The watch's end or its failure, as with watch.yml's task.
            return
        if name not in FAILED_EVENTS or data.get("ignore_errors"):
            return
        # A node told to start fails at its start whatever failed (an error the action did not foresee
        # included): the nodes that started must be stopped, not waited for.
        at_start = res.get("phase") == "start" or host in self.handshake.told_to_start
        step = "Start the trainer" if at_start else "Probe the node"
        self.failures.append(StepFailure(host, step, _failure_text(res), name))
        if at_start:
            # The nodes that started are being followed already (start and watch are one task): the
            # playbook would not end by itself.
            self.start_ended.add(host)
            self._end_if_due()
        else:
            self.handshake.fail_probe(host)

    def _other_task(self, name: str, data: dict[str, Any], host: Any, res: dict[str, Any]) -> None:
        if host in self.monitor.hosts and name in FAILED_EVENTS and not data.get("ignore_errors"):
            self.failures.append(StepFailure(host, str(data.get("task")), _failure_text(res), name))


def _failure_text(res: dict[str, Any]) -> str:
    return with_known_fix(str(res.get("msg") or res.get("stderr") or "failed").strip())
