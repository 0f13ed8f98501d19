"""Why an attempt failed: the first event in time is the cause, what followed is consequence.

The nodes' reports (live.JobMonitor) are turned into events, each with its time, host, rank and its
own exit code:
- `lost`: a node stopped answering (its connection refused or timed out) and was confirmed gone:
  its peers' collectives failed meanwhile, the unreachable grace passed, or its start failed;
- `exit`: a rank's own non-zero exit (trainer.node.exit_record: 2 config, 3 data sizing, 74 disk full,
  75 GPU fault, 1 anything else) with its one-line reason, or for a rank that wrote none (a user's
  command, a rank killed by a signal) the node's exit code with the rank from its error file or
  torchrun's summary;
- `gpu_fault`: the health check's GPU_FAULT line, where no rank's exit record says it;
- `saved`: no failure: a rank's exit record with STOPPED_AT_CHECKPOINT, the trainer saved and stopped
  as a signal asked (trainer.node.save_request: a scheduler's warning before the job's end); the
  restart policy does not restart it, the launch resumes it (a Slurm job is requeued);
- `stall`: no rank advanced (or no node printed) for --stall-timeout;
- `hung`: a stall whose culprit the kernel names (hang.py: a rank stopped, in uninterruptible sleep,
  or gone while its peers wait; exit code HUNG), each other rank a `waiting` consequence.

An exit whose reason says a peer went away (trainer.peer_loss) is a consequence whenever any other
event exists; among the rest the earliest is the cause. `diagnose` decides; `Diagnosis` is data (the
history record is made from it) before it is text (`render`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape

from trainer import exitcodes
from trainer.controller.launcher.hang import (
    Hang,
    Partition,
    RankState,
    behind_hang,
    find_hang,
    find_partition,
    flight_hang,
    rank_states,
    state_lines,
)
from trainer.controller.launcher.live import (
    HostState,
    JobMonitor,
    LiveView,
    describe,
    exit_is_consequence,
    last_frame,
    printable,
)
from trainer.peer_loss import is_peer_loss

#: Exit codes of the bundled trainer that a restart would only repeat: config, data, sizing, a full disk
#: (the restarted trainer's own room check would refuse again).
NOT_RESTARTABLE = frozenset({exitcodes.CONFIG_ERROR, exitcodes.DATA_ERROR, exitcodes.NO_SPACE})
#: How the launcher names each kind of cause in its summary line.
KIND_WORDS = {
    "lost": "node lost",
    "exit": "rank failed",
    "killed": "killed",
    "gpu_fault": "GPU fault",
    "stall": "stalled",
    "hung": "hung",
    "waiting": "waiting",
    "world": "no single job",
    "saved": "stopped at a checkpoint on request",
}


@dataclass(frozen=True)
class Event:
    time: float
    host: str
    node_rank: int
    kind: str
    """lost | exit | killed | gpu_fault | stall | hung | waiting (a hung rank's peer) | world (a user's
    command formed no single job) | saved (a requested stop at a checkpoint: no failure)"""
    code: int
    """The exit code this event stands for: the rank's own, NODE_LOST for a lost node."""
    message: str
    """One line: the rank's reason, or what the launcher saw."""
    rank: int | None = None
    consequence: bool = False
    """The event says a peer went away (a collective broke): it follows from another event."""
    detail: str = ""
    """Where to look further: the traceback's last frame and its error file."""
    node_at_fault: bool = False
    """A hung rank blocked in the kernel (state D): its node, not the job, is at fault (hang.Hang)."""

    @property
    def where(self) -> str:
        rank = f"rank {self.rank} on " if self.rank is not None else ""
        return f"{rank}{self.host} (node {self.node_rank})"

    def as_record(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "host": self.host,
            "node": self.node_rank,
            "rank": self.rank,
            "code": self.code,
            "time": round(self.time, 3),
            "message": self.message,
        }


@dataclass
class Diagnosis:
    cause: Event
    consequences: list[Event] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    """Every host confirmed lost (the cause's and any other), in node order."""
    head: str = ""
    running: list[str] = field(default_factory=list)
    """Hosts still running when it was decided: the launcher stops them because of the cause."""
    at_step: int | None = None
    """The last step rank 0 logged before the cause."""
    bundled: bool = True

    @property
    def code(self) -> int:
        return self.cause.code

    @property
    def at_fault(self) -> list[str]:
        """The cause's host when the node is at fault but answers (a rank in state D): the restart
        policy leaves it out with --exclude-failed, as a lost node."""
        return [self.cause.host] if self.cause.node_at_fault else []

    @property
    def head_lost(self) -> bool:
        return self.head in self.lost

    @property
    def requested_stop(self) -> bool:
        """The run saved and stopped as a signal asked (STOPPED_AT_CHECKPOINT): no rank failed."""
        return self.cause.kind == "saved"

    @property
    def restartable(self) -> bool:
        """A restart could succeed: not bad input (config, data, sizing, disk full), not the head gone."""
        if self.head_lost or self.cause.kind in ("world", "saved"):
            return False
        return not (self.bundled and self.cause.kind == "exit" and self.cause.code in NOT_RESTARTABLE)

    @property
    def summary(self) -> str:
        """The cause in one line: its own message first, then where, then its exit code."""
        cause = self.cause
        if cause.kind == "lost":
            step = f" at step {self.at_step}" if self.at_step is not None else ""
            return f"{cause.host} (node {cause.node_rank}) was lost{step}: {cause.message}"
        if cause.message == f"exit code {cause.code}":  # no rank said more (a user's command)
            return f"{cause.where} exited with code {cause.code}"
        return f"{cause.message} ({cause.where}, exit code {cause.code})"

    def consequence_text(self, event: Event) -> str:
        after = self.cause_phrase
        if event.kind == "lost":
            return f"{event.host} (node {event.node_rank}) was lost too ({event.message})"
        if event.kind == "waiting":
            return f"{event.where}: {event.message}, after {after}"
        if is_peer_loss(event.message) or (event.consequence and not event.message):
            return f"{event.where}: its collective failed after {after} (exit code {event.code})"
        return f"{event.where}: {event.message}, after {after} (exit code {event.code})"

    @property
    def cause_phrase(self) -> str:
        cause = self.cause
        if cause.kind == "lost":
            return f"{cause.host} was lost"
        if cause.kind == "stall":
            return "the stall"
        if cause.kind == "hung":
            return f"{cause.where} hung"
        if cause.kind == "world":
            return "the world check"
        if cause.kind == "saved":
            return f"{cause.where} stopped at a checkpoint on request"
        return f"{cause.where} {'was killed' if cause.kind == 'killed' else 'failed'}"

    def as_record(self) -> dict[str, Any]:
        return {
            "cause": self.cause.as_record(),
            "consequences": [
                {**event.as_record(), "text": self.consequence_text(event)} for event in self.consequences
            ]
            + [
                {
                    "kind": "stopped",
                    "host": host,
                    "text": f"{host}: stopped by the launcher after {self.cause_phrase}",
                }
                for host in self.running
            ],
            "lost": self.lost,
            "at_step": self.at_step,
            "exit_code": self.code,
            "summary": self.summary,
        }


@dataclass
class Outcome:
    """How one attempt ended."""

    code: int
    """The cause's own exit code (failure.Diagnosis.code), 0 when done."""
    kind: str
    """done | failed | interrupted | stopped (by `trainer stop`) | locked | start_failed | watch_failed |
    rejoin (stopped at a checkpoint to grow back to nodes left out: rejoin.py) | saved (the trainer
    saved and stopped as a signal asked, exit STOPPED_AT_CHECKPOINT: no failure)"""
    hosts: list[str] = field(default_factory=list)
    """The hosts to blame (the cause's host; a stall's hosts that were behind)."""
    reason: str = ""
    restartable: bool = False
    latest_checkpoint: str = ""
    lost: list[str] = field(default_factory=list)
    """Hosts confirmed lost: they stopped answering while their peers failed, past the grace, or at
    their probe (restarts.py leaves them out with --exclude-failed)."""
    diagnosis: Diagnosis | None = None


def _reported_lost(hs: HostState, now: float) -> float | None:
    """When `hs` stopped answering, if it has not answered since (a miss, the grace passed, the start's
    or the stop's connection failing); None while it answers."""
    if hs.state == "lost":
        return hs.lost_since or now
    if hs.missing_since is not None and not hs.final:
        return hs.missing_since
    return None


def host_events(hs: HostState, ranks: range | None, now: float) -> list[Event]:
    """What `hs` tells of the failure: its loss, its ranks' own exits, or its node's exit."""
    events: list[Event] = []
    lost_at = _reported_lost(hs, now)
    if lost_at is not None:
        events.append(
            Event(lost_at, hs.host, hs.node_rank, "lost", exitcodes.NODE_LOST, hs.miss_error or "no answer")
        )
    events += _rank_events(hs, ranks, now)
    if hs.gpu_fault and not any(e.code == exitcodes.GPU_FAULT for e in events):
        info = hs.gpu_fault
        events.append(
            Event(
                hs.exit_time or now,
                hs.host,
                hs.node_rank,
                "gpu_fault",
                exitcodes.GPU_FAULT,
                f"GPU {info['gpu']} (uuid {info['uuid']}) tripped the health check, "
                f"{info['metric']}={info['value']}",
                _int_or_none(info.get("rank")),
            )
        )
    if not any(e.kind in ("exit", "gpu_fault") for e in events) and hs.state == "failed":
        events.append(_node_exit_event(hs, now))
    return events


def _rank_events(hs: HostState, ranks: range | None, now: float) -> list[Event]:
    """The exits of `hs`'s ranks: each exit record with the error file of its rank, then each error
    file with no exit record (your command)."""
    events: list[Event] = []
    errors = {}
    for error in hs.errors:
        local = int(error.get("local_rank", 0))
        rank = ranks[local] if ranks is not None and local < len(ranks) else local
        errors[rank] = error
    for record in hs.rank_exits:
        rank = int(record["rank"])
        message = printable(str(record.get("message") or f"exit code {record.get('code')}"))
        error = errors.pop(rank, None)
        code = int(record.get("code") or exitcodes.FAILURE)
        events.append(
            Event(
                float(record.get("time") or hs.exit_time or now),
                hs.host,
                hs.node_rank,
                "saved" if code == exitcodes.STOPPED_AT_CHECKPOINT else "exit",
                code,
                message,
                rank,
                consequence=exit_is_consequence(record),
                detail=_error_detail(error),
            )
        )
    for rank, error in errors.items():  # an exception in an error file with no exit record (your command)
        message = printable(str(error.get("message") or ""))
        events.append(
            Event(
                float(error.get("timestamp") or hs.exit_time or now),
                hs.host,
                hs.node_rank,
                "exit",
                exitcodes.FAILURE,
                f"raised {message}",
                rank,
                consequence=is_peer_loss(message),
                detail=_error_detail(error),
            )
        )
    return events


def _node_exit_event(hs: HostState, now: float) -> Event:
    """No rank said why (a user's command, a rank killed by a signal): the node's own exit, or the
    signal torchrun's summary names (its code as a shell gives it: 128 + the signal's number)."""
    if hs.killed_by is not None:
        kind, code, message = "killed", 128 + hs.killed_by, f"killed by {_signal_name(hs.killed_by)}"
    elif hs.exit_code is None:
        kind, code, message = "killed", exitcodes.FAILURE, hs.detail or "killed"
    else:
        # The rank's own error line where it printed one (`can't open file ...`, an exception's
        # last line): what the operator needs first, not the launcher's exit code.
        message = hs.output.own_error or hs.detail or f"exit code {hs.exit_code}"
        kind, code = "exit", hs.exit_code
    return Event(
        hs.exit_time or now,
        hs.host,
        hs.node_rank,
        kind,
        code,
        message,
        hs.failed_rank,
        consequence=hs.only_consequence,
    )


def _signal_name(number: int) -> str:
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _error_detail(error: Mapping[str, Any] | None) -> str:
    if not error:
        return ""
    frame = last_frame(str(error.get("traceback") or ""))
    text = f"last frame: {printable(frame)}; " if frame else ""
    return text + f"traceback in {error.get('file')}"


def diagnose(monitor: JobMonitor, *, bundled: bool = True, now: float | None = None) -> Diagnosis | None:
    """The cause and its consequences from what the monitor holds; None when nothing failed."""
    now = time.time() if now is None else now
    events: list[Event] = []
    for hs in monitor.hosts.values():
        events += host_events(hs, monitor.ranks.get(hs.host), now)
    if monitor.stall is not None:
        events += _stall_events(monitor, now)
    if monitor.world is not None and monitor.world.failure is not None:
        host, message = monitor.world.failure
        # Bad input, as a config error is: the same command would form separate jobs again.
        events.append(
            Event(
                monitor.failed_at or now,
                host,
                monitor.hosts[host].node_rank,
                "world",
                exitcodes.CONFIG_ERROR,
                message,
            )
        )
    if not events:
        return None
    roots = [e for e in events if not e.consequence] or events
    cause = min(
        roots, key=lambda e: (e.time, e.kind != "lost", e.node_rank, e.rank if e.rank is not None else -1)
    )
    lost = [
        hs.host
        for hs in monitor.hosts.values()
        if any(e.kind == "lost" and e.host == hs.host for e in events)
    ]
    for host in lost:  # a node that stopped answering while its peers failed is gone, not merely slow
        monitor.mark_lost(monitor.hosts[host])
    consequences = sorted((e for e in events if e is not cause), key=lambda e: (e.time, e.node_rank))
    named = {e.host for e in events}
    running = [hs.host for hs in monitor.hosts.values() if not hs.final and hs.host not in named]
    return Diagnosis(
        cause,
        consequences,
        lost,
        head=monitor.rank0_host,
        running=running,
        at_step=monitor.last_step,
        bundled=bundled,
    )


def _reports(monitor: JobMonitor) -> tuple[dict[str, Any], dict[str, int], dict[str, range]]:
    """What hang.py reads of the monitor: each node's process states, its node rank, its ranks."""
    return (
        {hs.host: hs.proc_states for hs in monitor.hosts.values()},
        {hs.host: hs.node_rank for hs in monitor.hosts.values()},
        monitor.ranks,
    )


def stall_hang(monitor: JobMonitor) -> Hang | None:
    """The culprit of the monitor's stall by its ranks' process states (hang.py), None without one (or
    before the stop's reports brought the states)."""
    return find_hang(*_reports(monitor))


def stall_partition(monitor: JobMonitor) -> Partition | None:
    """The node its peers cannot reach while SSH works, by each node's connects at the stall."""
    return find_partition({hs.host: hs.reach for hs in monitor.hosts.values()})


def _states(monitor: JobMonitor) -> list[RankState]:
    return rank_states(*_reports(monitor))


def _progress_records(monitor: JobMonitor) -> dict[tuple[str, int], Any]:
    """Each rank's last progress record, by (host, rank): the bundled trainer's (flight_hang reads them)."""
    return {(hs.host, rank): record for hs in monitor.hosts.values() for rank, record in hs.progress.items()}


def bundled_stall(monitor: JobMonitor) -> bool:
    """A stall of the bundled trainer, whose ranks' progress records say which is behind, with every
    node's process states read (the rank behind is named with its state, never on the records alone)."""
    return monitor.progress_from_steps and all(
        hs.proc_states is not None for hs in monitor.hosts.values() if not hs.final
    )


def _stall_events(monitor: JobMonitor, now: float) -> list[Event]:
    """A stall as events: a hung rank (the cause) and its peers waiting (consequences), where the
    kernel names one; else the stall itself, at the first rank behind."""
    stall, at = monitor.stall, monitor.stalled_at or now
    assert stall is not None
    hang = stall_hang(monitor)
    partition = stall_partition(monitor) if hang is None else None
    if partition is not None:
        return _partition_events(monitor, partition, at, stall.summary)
    if hang is None and bundled_stall(monitor):
        states, records = _states(monitor), _progress_records(monitor)
        hang = behind_hang(states, stall.behind, stall.leading_step, records) or flight_hang(states, records)
    if hang is None:
        behind = stall.behind[0] if stall.behind else (monitor.rank0_host, None, None)
        host = monitor.hosts[behind[0]]
        return [Event(at, host.host, host.node_rank, "stall", exitcodes.FAILURE, stall.summary, behind[1])]
    culprit = hang.culprit
    events = [
        Event(
            at,
            culprit.host,
            culprit.node_rank,
            "hung",
            exitcodes.HUNG,
            hang.culprit_text,
            culprit.rank,
            node_at_fault=hang.node_at_fault,
            detail=f"found by the stall watchdog: {stall.summary}",
        )
    ]
    for other in hang.others:
        text = hang.consequence_text(other)
        events.append(
            Event(
                at, other.host, other.node_rank, "waiting", exitcodes.HUNG, text, other.rank, consequence=True
            )
        )
    return events


def _partition_events(monitor: JobMonitor, partition: Partition, at: float, summary: str) -> list[Event]:
    """A partial partition as events: the node cut off (the cause: its node at fault, left out by
    --exclude-failed as a lost one) and each peer that could not reach it (consequences)."""
    cut = monitor.hosts[partition.host]
    events = [
        Event(
            at,
            cut.host,
            cut.node_rank,
            "hung",
            exitcodes.HUNG,
            partition.what,
            node_at_fault=True,
            detail=f"found by the stall watchdog: {summary}",
        )
    ]
    for host in partition.unanswered:
        peer = monitor.hosts[host]
        text = f"waiting in its collective: no answer from {cut.host} on port {partition.port}"
        events.append(Event(at, host, peer.node_rank, "waiting", exitcodes.HUNG, text, consequence=True))
    return events


def render(
    diagnosis: Diagnosis,
    monitor: JobMonitor,
    view: LiveView,
    *,
    stopped_in: str = "",
    stall_timeout_s: float | None = None,
    stacks: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """The failure as the operator reads it: the cause's one line first, then what followed, then
    the cause's traceback pointer and log lines (and a stall's stacks)."""
    cause = diagnosis.cause
    fault = monitor.hosts[cause.host].gpu_fault if cause.code == exitcodes.GPU_FAULT else None
    if diagnosis.requested_stop:  # no failure: the restart policy says what follows
        view.message(f"[yellow]stopped on request[/yellow]: {escape(diagnosis.summary)}")
        return
    if cause.kind in ("stall", "hung"):
        _render_stall(diagnosis, monitor, view, stall_timeout_s, stacks or {})
    elif fault:
        gpu, uuid, rank = escape(fault["gpu"]), escape(fault["uuid"]), escape(fault["rank"])
        hostname = escape(fault["host"])
        view.message(
            f"[red]GPU_FAULT[/red] on {cause.host} (node {cause.node_rank}, hostname {hostname}): "
            f"GPU {gpu} (uuid {uuid}) of rank {rank} tripped the health check, "
            f"{escape(fault['metric'])}={escape(fault['value'])} (exit code {cause.code}). "
            "Take the node out or fix its GPU before relaunching."
        )
    else:
        view.message(f"[red]failed[/red]: {escape(diagnosis.summary)}")
        if cause.detail:
            view.log(f"  {cause.detail}")
    for event in diagnosis.consequences:
        view.log(f"then: {diagnosis.consequence_text(event)}")
    others = [
        f"{hs.host}: {describe(hs)}"
        for hs in monitor.ordered
        if hs.host != cause.host and not any(e.host == hs.host for e in diagnosis.consequences)
    ]
    if others:
        view.log("other hosts: " + ", ".join(others))
    if stopped_in:
        view.message(f"the trainer was stopped on every host that answers{stopped_in}")
    if cause.kind not in ("stall", "hung"):
        last_lines(cause.host, monitor, view)


def _render_stall(
    diagnosis: Diagnosis,
    monitor: JobMonitor,
    view: LiveView,
    timeout: float | None,
    stacks: Mapping[str, Mapping[str, str]],
) -> None:
    stall = monitor.stall
    assert stall is not None
    # The bound that was passed: a fixed --stall-timeout, or what the adaptive one rested on.
    timeout_text = (
        f" (bound: {stall.bound})" if stall.bound else f" (--stall-timeout {timeout:g})" if timeout else ""
    )
    if diagnosis.cause.kind == "hung":
        view.message(f"[red]hung[/red]: {escape(diagnosis.summary)}")
    else:
        for line in state_lines(
            {hs.host: hs.proc_states for hs in monitor.ordered},
            {hs.host: hs.node_rank for hs in monitor.ordered},
        ):
            view.log(f"process state: {line}")
    if not diagnosis.bundled:
        view.message(
            f"[red]stalled[/red]: {stall.summary}{timeout_text}; every node was stopped. "
            "Each node's last lines:"
        )
        for host, _, _ in stall.behind:
            last_lines(host, monitor, view, count=10)
        if (hang := stall_hang(monitor)) is not None and hang.culprit.frames:
            view.message(f"stack of {escape(hang.culprit.where)} (py-spy, innermost first):")
            for frame in hang.culprit.frames[:20]:
                view.log(f"  {frame.text}")
            for thread in hang.culprit.threads:
                view.message(f"its thread {escape(thread.name)} (py-spy, innermost first):")
                for frame in thread.frames:
                    view.log(f"  {frame.text}")
        return
    behind = stall.behind
    if behind:
        names = ", ".join(
            f"rank {rank} on {host} (node {monitor.hosts[host].node_rank}) "
            + (f"in step {step}" if step is not None else "with no step reported")
            for host, rank, step in behind
        )
        view.message(
            f"[red]stalled[/red]: {stall.summary}{timeout_text}; behind: {names}; every node was stopped."
        )
    elif diagnosis.cause.kind == "hung":  # the hung rank is where the others are, by its step
        view.message(f"[red]stalled[/red]: {stall.summary}{timeout_text}; every node was stopped.")
    else:
        view.message(
            f"[red]stalled[/red]: {stall.summary}{timeout_text}; none was behind the others (a collective "
            "that never completes); every node was stopped."
        )
    shown = behind or [(host, None, None) for host in monitor.hosts]
    for host in dict.fromkeys(host for host, _, _ in shown):
        last_lines(host, monitor, view, count=10)
    for host, rank, _ in shown:
        for stack_rank, text in sorted(stacks.get(host, {}).items()):
            if rank is None or str(rank) == stack_rank:
                view.message(f"stack of rank {stack_rank} on {host}:")
                for line in text.splitlines()[:60]:
                    view.log(f"  {line}")
    if not any(stacks.values()):
        view.message("(no stacks: the ranks had ended, or could not be asked)")


def last_lines(host: str, monitor: JobMonitor, view: LiveView, count: int = 20) -> None:
    lines = list(monitor.hosts[host].lines)[-count:]
    view.message(f"last log lines of {host}:" if lines else f"{host} logged nothing")
    for line in lines:
        view.log(f"  {line}")
