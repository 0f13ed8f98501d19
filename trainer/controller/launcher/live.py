"""What `trainer launch` shows while a job runs: rank 0's log lines and one state line per host.

`JobMonitor` turns the watch playbook's events (one per poll and host: state, exit record, new log
lines) into per-host states, keeps each host's last log lines for the failure report, and decides
when the job has failed. `LiveView` draws it: on a terminal a live table under the scrolling log;
elsewhere (CI, pipes) one line per state change.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

STEP_LINE = re.compile(r"^step (\d+)/(\d+)")
GPU_FAULT_LINE = re.compile(
    r"GPU_FAULT host=(?P<host>\S+) rank=(?P<rank>\S+) gpu=(?P<gpu>\S+) uuid=(?P<uuid>\S+) "
    r"metric=(?P<metric>\S+) value=(?P<value>\S+)"
)
#: torchrun's failure summary: "rank      : 1 (local_rank: 0)".
TORCHRUN_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
#: Log text of a rank that failed because a peer went away (a consequence, not the cause).
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"Socket Timeout|Connection refused|DistNetworkError|failed to recv|RendezvousClosedError",
    re.IGNORECASE,
)
#: torchrun's failure summary for a worker killed by a signal: "exitcode  : -9 (pid: 123)".
TORCHRUN_SIGNALED = re.compile(r"^\s*exitcode\s*:\s*-\d+")
LAST_LINES = 40

FINAL_STATES = ("done", "failed", "stopped", "unreachable")
STATE_STYLES = {"failed": "red", "unreachable": "red", "done": "green", "stopped": "yellow"}


@dataclass
class HostState:
    host: str
    node_rank: int
    state: str = "starting"
    exit_code: int | None = None
    exit_time: float | None = None
    detail: str = ""
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=LAST_LINES))
    all_text_flags: set[str] = field(default_factory=set)
    gpu_fault: dict[str, str] | None = None
    failed_rank: int | None = None

    @property
    def failed(self) -> bool:
        return self.state in ("failed", "unreachable")

    def add_lines(self, lines: list[str]) -> None:
        for line in lines:
            self.lines.append(line)
            if fault := GPU_FAULT_LINE.search(line):
                self.gpu_fault = fault.groupdict()
            # The first rank torchrun names is its "Root Cause (first observed failure)".
            if (match := TORCHRUN_ROOT_RANK.match(line)) and self.failed_rank is None:
                self.failed_rank = int(match.group(1))
            if PEER_LOST.search(line):
                self.all_text_flags.add("peer_lost")
            if TORCHRUN_SIGNALED.match(line):
                self.all_text_flags.add("signaled")


class LiveView:
    """Prints rank 0's lines; shows host states live on a terminal, as lines elsewhere."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self._live: Live | None = None
        self._shown: dict[str, str] = {}
        self._table_source: list[HostState] = []

    def __enter__(self) -> LiveView:
        if self.console.is_terminal:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(None, None, None)
            self._live = None

    def _table(self) -> Table:
        table = Table(show_header=True, header_style="bold", box=None)
        table.add_column("node")
        table.add_column("host")
        table.add_column("state")
        for hs in self._table_source:
            style = {"failed": "red", "unreachable": "red", "done": "green", "stopped": "yellow"}.get(
                hs.state
            )
            text = f"[{style}]{describe(hs)}[/{style}]" if style else describe(hs)
            table.add_row(str(hs.node_rank), hs.host, text)
        return table

    def log(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def states(self, hosts: list[HostState], step: str = "") -> None:
        self._table_source = hosts
        if self._live is not None:
            self._live.update(self._table())
            return
        for hs in hosts:
            # Off a terminal a line per state change, not per step.
            if self._shown.get(hs.host) != hs.state:
                self._shown[hs.host] = hs.state
                self.console.print(f"[{hs.host}] node {hs.node_rank}: {describe(hs)}", markup=False)


def describe(hs: HostState, step: str = "") -> str:
    if hs.state == "running" and hs.detail:
        return f"running {hs.detail}"
    if hs.state == "failed":
        return f"failed ({hs.detail})" if hs.detail else "failed"
    if hs.state == "unreachable":
        return f"unreachable ({hs.detail})"
    return hs.state


class JobMonitor:
    """Per-host states from the watch playbook's events; sets `failed_at` on the first failure."""

    def __init__(self, hosts: dict[str, int], head_host: str, view: LiveView) -> None:
        self.hosts = {name: HostState(name, rank) for name, rank in sorted(hosts.items(), key=lambda i: i[1])}
        self.rank0_host = head_host
        self.view = view
        self.step = ""
        self.first_step_at: float | None = None
        self.failed_at: float | None = None

    @property
    def ordered(self) -> list[HostState]:
        return list(self.hosts.values())

    def on_watch_event(self, event: dict[str, Any]) -> None:
        name = event.get("event", "")
        data = event.get("event_data", {})
        host = data.get("host")
        if host not in self.hosts:
            return
        hs = self.hosts[host]
        res = data.get("res") or {}
        if name in ("runner_retry", "runner_on_ok", "runner_on_failed") and res.get("stdout"):
            try:
                report = json.loads(res["stdout"])
            except ValueError:
                report = None
            if report is not None:
                self.apply(hs, report)
            elif name == "runner_on_failed":
                self.mark_failed(hs, res.get("msg") or "the status helper failed")
        elif name == "runner_on_failed":
            self.mark_failed(
                hs, str(res.get("msg") or res.get("stderr") or "the status check failed").strip()
            )
        elif name == "runner_on_unreachable":
            hs.state = "unreachable"
            hs.detail = str(res.get("msg") or "unreachable").strip().splitlines()[0][:200]
            self._note_failure()
        self.view.states(self.ordered)

    def apply(self, hs: HostState, report: dict[str, Any]) -> None:
        """Take one node_ctl.py report (status or stop) into the host's state."""
        hs.add_lines(report.get("lines") or [])
        if hs.host == self.rank0_host:
            for line in report.get("lines") or []:
                self.view.log(line)
                if match := STEP_LINE.match(line):
                    self.step = f"step {match.group(1)}/{match.group(2)}"
                    if self.first_step_at is None:
                        self.first_step_at = time.time()
        if hs.state in FINAL_STATES and hs.state != "stopped":
            return
        state = report.get("state")
        exit_record = report.get("exit") or None
        if state == "running":
            hs.state = "running"
            hs.detail = self.step
        elif state == "exited" and exit_record is not None:
            hs.exit_code = int(exit_record.get("exit_code", 1))
            hs.exit_time = float(exit_record.get("time") or time.time())
            if hs.exit_code == 0:
                hs.state, hs.detail = "done", ""
            elif report.get("stop_requested"):
                hs.state, hs.detail = "stopped", ""
            else:
                self.mark_failed(hs, f"exit code {hs.exit_code}")
        elif state == "vanished":
            if report.get("stop_requested"):
                hs.state, hs.detail = "stopped", ""
            else:
                hs.exit_time = hs.exit_time or float(report.get("time") or time.time())
                self.mark_failed(hs, "its processes are gone without an exit code (killed)")
        for running in self.hosts.values():
            if running.state == "running":
                running.detail = self.step

    def mark_failed(self, hs: HostState, detail: str) -> None:
        hs.state = "failed"
        hs.detail = detail
        hs.exit_time = hs.exit_time or time.time()
        self._note_failure()

    def _note_failure(self) -> None:
        if self.failed_at is None:
            self.failed_at = time.time()

    @property
    def failed(self) -> bool:
        return any(hs.failed for hs in self.hosts.values())

    @property
    def all_done(self) -> bool:
        return all(hs.state == "done" for hs in self.hosts.values())

    def gpu_fault(self) -> tuple[HostState, dict[str, str]] | None:
        for hs in self.hosts.values():
            if hs.gpu_fault:
                return hs, hs.gpu_fault
        return None

    def first_failure(self) -> HostState | None:
        """The host whose failure came first; a rank that only lost its peers comes after any other."""
        failed = [hs for hs in self.hosts.values() if hs.failed]
        if not failed:
            return None
        return min(
            failed,
            key=lambda hs: (
                hs.state != "unreachable"
                and "peer_lost" in hs.all_text_flags
                and "signaled" not in hs.all_text_flags,
                hs.exit_time or float("inf"),
                hs.node_rank,
            ),
        )
