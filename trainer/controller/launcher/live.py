"""What `trainer launch` shows while a job runs: rank 0's log lines and one state line per host.

`JobMonitor` turns the nodes' reports (one per poll and host, from the launch_node action plugin
through the runner's channel: state, exit record, new log lines, each rank's progress) and missed
polls into per-host states, keeps each host's last log lines for the failure report, and decides
when the job has failed: a node's trainer failed, a node did not answer for longer than the
unreachable grace, or no rank made progress for the stall timeout. A node that stops answering
while its peers' collectives fail is lost at once, without waiting for the grace; a failure that
only says a peer went away waits a moment (CONFIRM_S) for the event that caused it to arrive. Which
event was the cause is failure.py's to decide.
`LiveView` draws it: on a terminal a live table under the scrolling log; elsewhere (CI, pipes) one
line per state change.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rich.console import Console
from rich.errors import MarkupError
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from trainer.controller.launcher.rank_output import RankOutput
from trainer.controller.launcher.stall import (
    COMPUTING_FRESH_S,
    STALL_FLOOR_S,
    busy,
    stall_bound,
    used_time_or_io,
)
from trainer.controller.launcher.world import WorldCheck
from trainer.exitcodes import STOPPED_AT_CHECKPOINT
from trainer.peer_loss import is_peer_loss

STEP_LINE = re.compile(r"^step (\d+)/(\d+)")
#: The bundled trainer's word that a checkpoint is complete (trainer.node.loop.Trainer._save): printed by
#: rank 0 once `latest` names it, so a stop after this line leaves that checkpoint whole to resume from.
CHECKPOINT_LINE = re.compile(r"^checkpoint (\S*/step-(\d+))\s*$")
#: The job's throughput in the bundled trainer's step line (trainer.node.metrics.step_line).
STEP_TOKENS_PER_S = re.compile(r"\btok/s ([\d,]+)")
GPU_FAULT_LINE = re.compile(
    r"GPU_FAULT host=(?P<host>\S+) rank=(?P<rank>\S+) gpu=(?P<gpu>\S+) uuid=(?P<uuid>\S+) "
    r"metric=(?P<metric>\S+) value=(?P<value>\S+)"
)
#: torchrun's failure summary: "rank      : 1 (local_rank: 0)".
TORCHRUN_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
#: torchrun's failure summary for a worker killed by a signal: "exitcode  : -9 (pid: 123)".
TORCHRUN_SIGNALED = re.compile(r"^\s*exitcode\s*:\s*-(\d+)")
LAST_LINES = 40
#: A failure that only says a peer went away (a broken collective) is a consequence: the launcher waits
#: up to this long for its cause (a node's missed poll, a peer's own exit) before it stops every node.
#: A healthy node answers a poll within --poll-interval; a vanished one fails its poll about as fast.
CONFIRM_S = 4.0
#: A node that does not answer while no rank advances for this long (or twice the longest pause the
#: run has shown, if more) is lost before the unreachable grace: it vanished without resetting its
#: peers' connections, and they wait in a collective.
SILENT_LOSS_S = 30.0

FINAL_STATES = ("done", "failed", "stopped", "lost")
STATE_STYLES = {"failed": "red", "lost": "red", "done": "green", "stopped": "yellow"}
#: C0 controls but tab, DEL and C1 controls (a lone 0x9b is a CSI on some terminals): shown as \xNN.
_CONTROLS = {code: f"\\x{code:02x}" for code in [*range(0x09), *range(0x0A, 0x20), *range(0x7F, 0xA0)]}


def printable(text: str) -> str:
    """Remote output with its control characters spelled out: an ESC sequence in a rank's log cannot
    clear the operator's screen, move the cursor or fake lines (a carriage return included)."""
    return text.translate(_CONTROLS)


# --- what a node reports: written by the job, trusted for nothing ----------------------------------
# The node dir and its records (the exit record, each rank's exit-R.json, torchrun's error files, the
# progress records) are the training account's to write. A record of the wrong shape is noted once and
# ignored: a `"time": "soon"` raised ValueError in the diagnosis, before the stop (issue 37).


def _number(value: Any) -> float | None:
    """A finite int or float (not a bool), as a float; None otherwise."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _optional(record: dict[str, Any], key: str, check: Callable[[Any], Any]) -> bool:
    return record.get(key) is None or check(record[key]) is not None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def well_formed_exit(record: Any) -> bool:
    """A rank's exit record as trainer.node.exit_record writes it: an integer rank; time, code and
    message, where given, a number, an integer and a string."""
    return (
        isinstance(record, dict)
        and _integer(record.get("rank")) is not None
        and _optional(record, "time", _number)
        and _optional(record, "code", _integer)
        and _optional(record, "message", _text)
    )


def well_formed_error(error: Any) -> bool:
    """A rank's error file as torch's @record writes it (node_ctl.rank_errors reads it): local_rank an
    integer; timestamp a number; message and traceback strings (each where given)."""
    return (
        isinstance(error, dict)
        and _optional(error, "local_rank", _integer)
        and _optional(error, "timestamp", _number)
        and _optional(error, "message", _text)
        and _optional(error, "traceback", _text)
    )


def node_text(value: object) -> str:
    """Text from a node (a path, a name, an error, a lock holder's field) for a message with markup:
    its control characters but newlines spelled out (printable) and rich markup escaped, so that
    `[link=...]` or a stray `[/red]` shows as typed. Every node value in a LiveView.message goes
    through here."""
    return escape("\n".join(printable(line) for line in str(value).split("\n")))


def short_duration(seconds: float) -> str:
    """`45s`, `3m12s`, `1h04m`, `2d03h`: an ETA to the nearest unit that matters."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


@dataclass
class StepRate:
    """The live view's step text from rank 0's `step N/M` lines: the trainer's own tokens/s, and an
    ETA from the steps done since the first step line seen, over the time since (so a resumed run's
    rate is its own, and the start-up before the first step does not count)."""

    #: (step, when its line arrived, time.monotonic()): where the rate is counted from.
    first: tuple[int, float] | None = None
    last: tuple[int, float] | None = None
    max_steps: int = 0
    tokens_per_s: str = ""

    def see(self, line: str, now: float) -> str:
        """Take one step line that arrived at `now`; the step text to show."""
        match = STEP_LINE.match(line)
        if match is None:
            return self.text()
        step, self.max_steps = int(match.group(1)), int(match.group(2))
        # Lines of one poll arrive together (an attach brings the last 20 at once): the rate counts
        # from the last of the first batch, not from lines logged long before they arrived.
        if self.first is None or self.first[1] == now or step < self.first[0]:
            self.first = (step, now)
        self.last = (step, now)
        tokens = STEP_TOKENS_PER_S.search(line)
        self.tokens_per_s = f"{tokens.group(1)} tok/s" if tokens else ""
        return self.text()

    @property
    def eta_s(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] >= self.max_steps:
            return None
        steps, seconds = self.last[0] - self.first[0], self.last[1] - self.first[1]
        if steps <= 0 or seconds <= 0:
            return None
        return (self.max_steps - self.last[0]) * seconds / steps

    def text(self) -> str:
        """`step 40/200 · 1,234 tok/s · ETA 3m12s`, each part once it is known."""
        if self.last is None:
            return ""
        parts = [f"step {self.last[0]}/{self.max_steps}", self.tokens_per_s]
        if (eta := self.eta_s) is not None:
            parts.append(f"ETA {short_duration(eta)}")
        return " · ".join(part for part in parts if part)


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
    #: When this host stopped answering polls (time.time()), and the last error; None while it answers.
    missing_since: float | None = None
    miss_error: str = ""
    #: rank -> its last progress record (bundled trainer): {"started": step, "done": step, ...}.
    progress: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: When this host's log last grew (time.monotonic() on the controller).
    last_output_at: float | None = None
    #: The error files of its ranks (torchrun's --log-dir; node_ctl.rank_errors), once it has ended.
    errors: list[dict[str, Any]] = field(default_factory=list)
    #: Each rank's own exit record (trainer.node.exit_record; node_ctl.rank_exits), once it has ended.
    rank_exits: list[dict[str, Any]] = field(default_factory=list)
    #: Since when a lost host has not answered (state "lost").
    lost_since: float | None = None
    #: The signal that killed the rank torchrun names first (its summary's `exitcode : -9`), if any.
    killed_by: int | None = None
    #: Its lines told apart: the ranks' own (and their first error line), a launcher's traceback.
    output: RankOutput = field(default_factory=RankOutput)
    #: At a stall, each rank's process state as the stop found it (node_ctl.process_states; hang.py
    #: names the culprit from them); None until a stop reported them.
    proc_states: list[Any] | None = None
    #: At a stall, whether each peer answered this host's connect on the master port ({"port": N,
    #: "peers": {host: `answers` | `no answer` | an error}}, node_ctl.reach_peers): a partial
    #: partition's evidence (hang.find_partition).
    reach: dict[str, Any] | None = None

    @property
    def failed(self) -> bool:
        return self.state in ("failed", "lost")

    @property
    def only_consequence(self) -> bool:
        """A failed host whose every rank says a peer went away: its failure follows another's."""
        if self.state != "failed":
            return False
        if self.rank_exits:
            return all(exit_is_consequence(record) for record in self.rank_exits)
        return "peer_lost" in self.all_text_flags and "signaled" not in self.all_text_flags

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    def add_lines(self, lines: list[str]) -> list[str]:
        """Take a report's lines; the ones to show (a launcher's traceback is kept in the node log only)."""
        shown = [kept for line in lines for kept in self.output.feed(line)]
        self.lines.extend(shown)
        for line in lines:
            if fault := GPU_FAULT_LINE.search(line):
                self.gpu_fault = fault.groupdict()
            # The first rank torchrun names is its "Root Cause (first observed failure)".
            if (match := TORCHRUN_ROOT_RANK.match(line)) and self.failed_rank is None:
                self.failed_rank = int(match.group(1))
            if is_peer_loss(line):
                self.all_text_flags.add("peer_lost")
            if (signaled := TORCHRUN_SIGNALED.match(line)) and self.killed_by is None:
                self.all_text_flags.add("signaled")
                self.killed_by = int(signaled.group(1))
        return shown


def exit_is_consequence(record: dict[str, Any]) -> bool:
    """A rank's exit record (trainer.node.exit_record) that says it failed because a peer went away."""
    return bool(record.get("consequence")) or is_peer_loss(str(record.get("message") or ""))


class LiveView:
    """Prints rank 0's lines; shows host states live on a terminal, as lines elsewhere.

    A closed terminal (SIGHUP) must not stop the launcher from stopping the nodes: once writing
    fails, or after `detach()`, output goes nowhere."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self._live: Live | None = None
        self._shown: dict[str, str] = {}
        self._table_source: list[HostState] = []

    def __enter__(self) -> LiveView:
        if self.console.is_terminal and self._live is None:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self._guard(self._live.__enter__)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            self._guard(live.update, self._table())
            self._guard(live.__exit__, None, None, None)

    def detach(self) -> None:
        """The terminal is gone: stop drawing and drop all further output."""
        if self._live is not None:
            live, self._live = self._live, None
            with contextlib.suppress(Exception):  # the terminal is gone; nothing to report it on
                live.stop()
        self.console = Console(file=open(os.devnull, "w"), highlight=False)  # noqa: SIM115

    def _guard(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            func(*args, **kwargs)
        except OSError:
            self.detach()

    def _table(self) -> Table:
        table = Table(show_header=True, header_style="bold", box=None)
        table.add_column("node")
        table.add_column("host")
        table.add_column("state")
        for hs in self._table_source:
            style = STATE_STYLES.get(hs.state) or ("red" if hs.missing_since else None)
            text = f"[{style}]{describe(hs)}[/{style}]" if style else describe(hs)
            table.add_row(str(hs.node_rank), hs.host, text)
        return table

    def log(self, line: str) -> None:
        line = printable(line)  # a node's output never drives the operator's terminal
        self._guard(self.console.print, line, markup=False, highlight=False, soft_wrap=True)

    def message(self, text: str) -> None:
        """`text` with its markup (node values in it escaped with node_text). Markup that does not parse
        is printed as plain text, never raised: the launcher's stop comes after many a message."""
        try:
            Text.from_markup(text)
        except MarkupError:
            self._guard(self.console.print, printable(text), markup=False, highlight=False, soft_wrap=True)
            return
        self._guard(self.console.print, text, highlight=False, soft_wrap=True)

    def states(self, hosts: list[HostState]) -> None:
        self._table_source = hosts
        if self._live is not None:
            self._guard(self._live.update, self._table())
            return
        for hs in hosts:
            # Off a terminal a line per state change, not per step (nor per second unreachable).
            shown = "unreachable" if hs.missing_since and not hs.final else hs.state
            if self._shown.get(hs.host) != shown:
                self._shown[hs.host] = shown
                self._guard(
                    self.console.print, f"[{hs.host}] node {hs.node_rank}: {describe(hs)}", markup=False
                )


def describe(hs: HostState) -> str:
    if hs.missing_since is not None and not hs.final:
        return f"unreachable ({time.time() - hs.missing_since:.0f}s)"
    if hs.state == "lost":
        since = time.strftime("%H:%M:%S", time.localtime(hs.lost_since)) if hs.lost_since else "?"
        return f"lost (no answer since {since})"
    if hs.state == "running" and hs.detail:
        return f"running {hs.detail}"
    if (
        hs.state == "failed"
        and hs.rank_exits
        and all(r.get("code") == STOPPED_AT_CHECKPOINT for r in hs.rank_exits)
    ):  # torchrun's own exit is 1 whatever its ranks' codes: theirs say they saved and stopped
        return "stopped at a checkpoint on request"
    if hs.state == "failed":
        return f"failed ({hs.detail})" if hs.detail else "failed"
    return hs.state


def last_frame(traceback_text: str) -> str:
    """`File "...", line N, in f: code` of a Python traceback's innermost frame ('' if none)."""
    lines = traceback_text.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].lstrip().startswith('File "'):
            frame = lines[index].strip()
            following = lines[index + 1] if index + 1 < len(lines) else ""
            # The frame's code line (indented under it), not the exception's own line.
            if following.startswith("    ") and following.strip():
                frame += f": {following.strip()}"
            return frame
    return ""


@dataclass(frozen=True)
class Stall:
    """No progress for the stall timeout: who was behind, and where every rank was."""

    silent_s: float
    behind: list[tuple[str, int | None, int | None]]
    """(host, rank or None for a whole node, the step it was in or None)."""
    leading_step: int | None
    summary: str
    bound: str = ""
    """What the bound that was passed rests on (stall.stall_bound), for the report."""


class JobMonitor:
    """Per-host states from the nodes' reports; sets `failed_at` on the first failure.

    `unreachable_grace_s`: a host that misses polls for longer is failed (its trainer may live on);
    `stall_timeout_s` (None: off): no rank advancing a step (`progress_from_steps`, the bundled
    trainer: counted from its first rank's record) or no node printing a line (a user's command)
    for that long is a stall."""

    def __init__(
        self,
        hosts: dict[str, int],
        head_host: str,
        view: LiveView,
        *,
        unreachable_grace_s: float = 60.0,
        stall_timeout_s: float | None = None,
        stall_adaptive: bool = False,
        progress_from_steps: bool = True,
        ranks: dict[str, range] | None = None,
        world: WorldCheck | None = None,
    ) -> None:
        self.hosts = {name: HostState(name, rank) for name, rank in sorted(hosts.items(), key=lambda i: i[1])}
        self.rank0_host = head_host
        self.view = view
        self.unreachable_grace_s = unreachable_grace_s
        self.stall_timeout_s = stall_timeout_s
        #: Without --stall-timeout, stall_timeout_s is the ceiling of a bound that adapts: for the bundled
        #: trainer to its steps' times (stall.stall_bound); for a user's command to its quiet (below).
        self.stall_adaptive = stall_adaptive
        self.progress_from_steps = progress_from_steps
        self.ranks = ranks or {}
        #: A user's command on several nodes: whether every worker joined the head's job (world.py).
        self.world = world
        #: What the state line shows of rank 0's last `step N/M` line: tokens/s and the ETA with it.
        self.step = ""
        self.step_rate = StepRate()
        #: The last step rank 0 logged (`step N/M`).
        self.last_step: int | None = None
        self.first_step_at: float | None = None
        #: How many complete checkpoints rank 0 announced in this attempt, the last one's path and step.
        self.checkpoints_seen = 0
        self.last_checkpoint = ""
        self.last_checkpoint_step: int | None = None
        self.failed_at: float | None = None
        self.stall: Stall | None = None
        self.stalled_at: float | None = None
        self.last_progress_at = time.monotonic()
        #: The longest wait between two progress changes seen so far (a checkpoint write, an eval).
        self.longest_progress_gap_s = 0.0
        self._progress_key: tuple = ()
        #: (host, rank) -> (its record's `time`, when a busy sample of it arrived, by this clock): the
        #: ranks computing a step that lasts (stall.computing_text).
        self._busy_at: dict[tuple[str, int], tuple[Any, float]] = {}
        #: The progress at which the launcher said a slow step was being computed (once per step).
        self._said_computing: tuple | None = None
        #: A user's command, adaptive: no line and no rank using CPU or I/O (node_ctl's `activity`) for
        #: a minute (quiet_bound) makes it a suspect, which the launcher checks
        #: for a culprit while it runs (hang_check.py): a culprit confirms it as a stall, none dismisses
        #: it. Only the ceiling's quiet is a stall without one.
        self.suspect: Stall | None = None
        self._suspected_for: float | None = None
        #: Whether the nodes say what the ranks use (a watch whose node_ctl samples it): without it, a
        #: quiet command cannot be told from a hung one, and nothing is judged.
        self.activity_seen = False
        #: (host, kind, record) of each malformed record already noted (_well_formed).
        self._ignored: set[tuple[str, str, str]] = set()
        # The bundled trainer's watchdog starts with its first rank's progress record (written once
        # the process group is up): loading a model or building DeepSpeed ops may take long before.
        self.watchdog_armed = not progress_from_steps

    @property
    def ordered(self) -> list[HostState]:
        return list(self.hosts.values())

    def on_message(self, message: dict[str, Any]) -> None:
        """One message of the watch (launch_node.py): a node's report, or a missed poll."""
        hs = self.hosts.get(str(message.get("host")))
        if hs is None:
            return
        if message.get("type") == "report":
            if hs.missing_since is not None:
                self.view.message(
                    f"{hs.host} answers again after {time.time() - hs.missing_since:.0f} s without an answer"
                )
            hs.missing_since, hs.miss_error = None, ""
            self.apply(hs, message.get("report") or {})
        elif message.get("type") == "miss" and not hs.final:
            hs.missing_since = float(message.get("since") or time.time())
            hs.miss_error = str(message.get("error") or "")
        self.check_time()
        self.view.states(self.ordered)

    def on_unreachable(self, host: str, message: str) -> None:
        """Ansible could not reach `host` at all (a start or stop step, attach's watch): it is lost."""
        hs = self.hosts.get(host)
        if hs is not None and not hs.final:
            first_line = message.strip().splitlines()[0][:200] if message.strip() else ""
            hs.miss_error = hs.miss_error or printable(first_line)
            self.mark_lost(hs)
            self.view.states(self.ordered)

    def mark_lost(self, hs: HostState) -> None:
        """`hs` is gone: it stopped answering while its peers failed, or for longer than the grace."""
        if hs.state == "lost":
            return
        hs.lost_since = hs.missing_since or hs.lost_since or time.time()
        hs.state, hs.detail = "lost", hs.miss_error
        hs.exit_time = hs.exit_time or hs.lost_since
        self._note_failure()

    def apply(self, hs: HostState, report: dict[str, Any]) -> None:
        """Take one node_ctl.py report (status or stop) into the host's state."""
        lines = [printable(str(line)) for line in report.get("lines") or []]
        shown = hs.add_lines(lines)
        if lines:
            hs.last_output_at = time.monotonic()
            if not self.progress_from_steps:  # a user's command: a line printed is progress
                self.last_progress_at = hs.last_output_at
        if not self.progress_from_steps and isinstance(used := report.get("activity"), dict):
            self.activity_seen = True
            if used_time_or_io(used):  # ... and so is a rank using CPU or I/O
                self.last_progress_at = time.monotonic()
        for record in report.get("progress") or []:
            if isinstance(record, dict) and _integer(record.get("rank", 0)) is not None:
                hs.progress[record.get("rank", 0)] = record
                self._note_busy(hs.host, record)
        if isinstance(report.get("proc_states"), list):
            hs.proc_states = report["proc_states"]
        if self.world is not None:
            self.world.note(hs.host, report.get("state"), report.get("joined"))
        if report.get("errors"):
            hs.errors = self._well_formed(hs, report["errors"], well_formed_error, "error file")
        if report.get("rank_exits"):
            hs.rank_exits = self._well_formed(hs, report["rank_exits"], well_formed_exit, "exit record")
        if self.progress_from_steps:
            self._step_progress()
        if hs.host == self.rank0_host:
            arrived = time.monotonic()
            for line in shown:
                self.view.log(line)
            for line in lines:
                if match := STEP_LINE.match(line):
                    self.step = self.step_rate.see(line, arrived)
                    self.last_step = int(match.group(1))
                    if self.first_step_at is None:
                        self.first_step_at = time.time()
                elif saved := CHECKPOINT_LINE.match(line):
                    self.checkpoints_seen += 1
                    self.last_checkpoint = saved.group(1)
                    self.last_checkpoint_step = int(saved.group(2))
        if hs.final and hs.state != "stopped":
            return
        state = report.get("state")
        exit_record = report.get("exit") or None
        if state == "running":
            hs.state = "running"
            hs.detail = self.step
        elif state == "exited" and exit_record is not None:
            if not isinstance(exit_record, dict):
                exit_record = {}
            code = _integer(exit_record.get("exit_code", 1))
            hs.exit_code = 1 if code is None else code
            hs.exit_time = _number(exit_record.get("time")) or time.time()
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
                hs.exit_time = hs.exit_time or _number(report.get("time")) or time.time()
                self.mark_failed(hs, "its processes are gone without an exit code (killed)")
        elif state == "none":
            self.mark_failed(hs, "nothing of this launch is on this node")
        for running in self.hosts.values():
            if running.state == "running":
                running.detail = self.step

    def _well_formed(
        self, hs: HostState, records: Any, check: Callable[[Any], bool], what: str
    ) -> list[dict[str, Any]]:
        """The records of `records` that pass `check`; each other one noted once (reports repeat)."""
        kept = []
        for record in records if isinstance(records, list) else [records]:
            if check(record):
                kept.append(record)
            elif (key := (hs.host, what, repr(record))) not in self._ignored:
                self._ignored.add(key)
                self.view.log(f"ignored a malformed {what} of {hs.host}: {printable(repr(record))[:300]}")
        return kept

    def check_time(self) -> None:
        """The clock's part: a host past the unreachable grace fails; a job without progress stalls."""
        now = time.time()
        for hs in self.hosts.values():
            if (
                hs.missing_since is not None
                and not hs.final
                and now - hs.missing_since > self.unreachable_grace_s
            ):
                hs.miss_error = f"no answer for {now - hs.missing_since:.0f} s: {hs.miss_error}".rstrip(": ")
                self.mark_lost(hs)
        if self.world is not None and not self.failed:
            final = {hs.host for hs in self.hosts.values() if hs.final}
            for line in self.world.judge(final, now):
                self.view.message(line)
            if self.world.failure is not None:
                self._note_failure()
        silent = time.monotonic() - self.last_progress_at
        # A node gone silently (no reset connections: its peers wait in their collective instead of
        # failing): it does not answer and no rank has advanced since, for longer than any pause this
        # run has shown (a checkpoint write). Lost then, before the unreachable grace.
        quiet_s = max(SILENT_LOSS_S, 2 * self.longest_progress_gap_s)
        if self.progress_from_steps and self.watchdog_armed and silent > quiet_s:
            for hs in self.hosts.values():
                if hs.missing_since is not None and not hs.final and now - hs.missing_since > quiet_s:
                    waited = now - hs.missing_since
                    hs.miss_error = f"no answer for {waited:.0f} s while no rank advanced: {hs.miss_error}"
                    hs.miss_error = hs.miss_error.rstrip(": ")
                    self.mark_lost(hs)
        if (
            self.stall_timeout_s
            and self.watchdog_armed
            and self.stall is None
            and not self.failed
            and not all(hs.final for hs in self.hosts.values())
        ):
            if self.stall_adaptive and not self.progress_from_steps:
                self._check_quiet_command(silent, now)
                return
            bound, why = self.stall_bound()
            if silent > bound:
                self.stall = replace(self._stall(silent), bound=why)
                self.stalled_at = now
                self._note_failure()
            elif self._said_computing != self._progress_key and silent > self.stall_bound(computing=False)[0]:
                # Past the steps' bound, held by a rank computing: said once a step, so a slow step
                # shows as one rather than as nothing (or, after the ceiling, as a hang).
                self._said_computing = self._progress_key
                self.view.message(f"no rank advanced for {silent:.0f} s: {why}; a slow step, not a hang")

    def _step_progress(self) -> None:
        """The bundled trainer: a rank began or ended a step. An announced pause beginning or ending is
        progress too: the bound changes with it."""
        key = tuple(
            (h.host, rank, r.get("started"), r.get("done"), r.get("phase"))
            for h in self.hosts.values()
            for rank, r in sorted(h.progress.items())
        )
        if key != self._progress_key:
            now = time.monotonic()
            if self.watchdog_armed:
                self.longest_progress_gap_s = max(self.longest_progress_gap_s, now - self.last_progress_at)
            self._progress_key = key
            self.last_progress_at = now
            self.watchdog_armed = bool(key)

    def quiet_bound(self) -> float:
        """A user's command: the quiet that makes it a suspect. Not stretched by the quiet spells it had
        (as the bundled trainer's bound is by its steps): a suspect without a culprit costs one read of
        the states, and a job that waits a minute on purpose once must not hide a hang for minutes."""
        return min(float(self.stall_timeout_s or 0), STALL_FLOOR_S)

    def _check_quiet_command(self, silent: float, now: float) -> None:
        """A user's command without --stall-timeout: quiet for the ceiling is a stall; quiet for
        quiet_bound() a suspect, once per quiet spell. Nothing without activity reports."""
        if not self.activity_seen:
            return
        ceiling = float(self.stall_timeout_s or 0)
        if silent > ceiling:
            self.stall = replace(
                self._stall(silent), bound=f"the ceiling, {ceiling:g} s, with no culprit named before"
            )
            self.stalled_at = now
            self._note_failure()
        elif (
            silent > self.quiet_bound()
            and self.suspect is None
            and self._suspected_for != self.last_progress_at
        ):
            self._suspected_for = self.last_progress_at
            why = f"{self.quiet_bound():g} s of quiet; a wait this long on purpose: --stall-timeout S, or 0"
            self.suspect = replace(self._stall(silent), bound=why)

    @property
    def still_quiet(self) -> bool:
        """The suspect's quiet spell goes on: no line and no rank working since it was suspected."""
        return self.suspect is not None and self._suspected_for == self.last_progress_at

    def confirm_suspect(self) -> None:
        """The suspect's culprit is named (hang_check.py): it is the stall."""
        if self.suspect is not None and self.stall is None:
            self.stall, self.suspect = self.suspect, None
            self.stalled_at = time.time()
            self._note_failure()

    def dismiss_suspect(self) -> None:
        """No culprit: the command goes on being followed, and its states are forgotten (a later stall
        reads them again)."""
        self.suspect = None
        for hs in self.hosts.values():
            hs.proc_states, hs.reach = None, None

    def stall_bound(self, computing: bool = True) -> tuple[float, str]:
        """(seconds without progress that make a stall now, what that rests on): stall.stall_bound over
        every rank's last progress record and (`computing`) the ranks computing now."""
        records = [r for hs in self.hosts.values() for r in hs.progress.values()]
        ranks = self.computing_ranks() if computing else []
        return stall_bound(records, float(self.stall_timeout_s or 0), self.stall_adaptive, ranks)

    def _note_busy(self, host: str, record: dict[str, Any]) -> None:
        """A rank's record: a new busy sample (its `time` changed) makes the rank computing from now."""
        key = (host, int(record.get("rank", 0)))
        if key in self._busy_at and self._busy_at[key][0] == record.get("time"):
            return  # the same record read again
        if busy(record):
            self._busy_at[key] = (record.get("time"), time.monotonic())
        else:
            self._busy_at.pop(key, None)

    def computing_ranks(self) -> list[str]:
        """`rank 1 on node1`, ...: the ranks whose last busy sample is fresh (stall.COMPUTING_FRESH_S)."""
        now = time.monotonic()
        fresh = [key for key, (_, at) in self._busy_at.items() if now - at <= COMPUTING_FRESH_S]
        fresh.sort(key=lambda key: (self.hosts[key[0]].node_rank if key[0] in self.hosts else 0, key[1]))
        return [f"rank {rank} on {host}" for host, rank in fresh]

    def tick(self) -> None:
        self.check_time()
        self.view.states(self.ordered)

    def _stall(self, silent_s: float) -> Stall:
        if not self.progress_from_steps:
            # A user's command: every node was silent; the one silent longest first.
            order = sorted(self.hosts.values(), key=lambda hs: hs.last_output_at or 0.0)
            behind = [(hs.host, None, None) for hs in order]
            used = " and no rank used CPU or I/O" if self.activity_seen else ""
            return Stall(silent_s, behind, None, f"no node printed a line{used} for {silent_s:.0f} s")
        started: dict[tuple[str, int], int | None] = {}
        for hs in self.hosts.values():
            expected = self.ranks.get(hs.host) or range(0)
            for rank in sorted(set(expected) | set(hs.progress)):
                record = hs.progress.get(rank)
                # None: no record, or a rank in no step yet (its record before its first step).
                started[(hs.host, rank)] = _integer(record.get("started")) if record else None
        known = [step for step in started.values() if step is not None]
        leading = max(known) if known else None
        behind = [
            (host, rank, step)
            for (host, rank), step in started.items()
            if leading is not None and (step is None or step < leading)
        ]
        if leading is None:
            summary = f"no rank reported a step for {silent_s:.0f} s"
        elif not behind:
            summary = f"no rank advanced for {silent_s:.0f} s; every rank is in step {leading}"
        else:
            summary = f"no rank advanced for {silent_s:.0f} s; the others are in step {leading}"
        return Stall(silent_s, behind, leading, summary)

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
    def must_stop(self) -> bool:
        """Stop every node now: a stall; a node that does not answer while a peer logs that its
        collective broke; a failure that is a cause (not only a broken collective); or one that is,
        once its cause showed (a node that does not answer) or CONFIRM_S passed."""
        if self.stall is not None or (self.world is not None and self.world.failure is not None):
            return True
        missing = [hs for hs in self.hosts.values() if hs.missing_since is not None and not hs.final]
        if missing and any(
            "peer_lost" in hs.all_text_flags for hs in self.hosts.values() if hs.missing_since is None
        ):
            # A node that stopped answering while its peers say their collectives broke is gone: no
            # need to wait for the peers' torchrun to tear down (seconds) or for the grace.
            return True
        failed = [hs for hs in self.hosts.values() if hs.failed]
        if not failed:
            return False
        if any(not hs.only_consequence for hs in failed):
            return True
        waiting = [hs for hs in self.hosts.values() if not hs.final]
        return bool(missing) or not waiting or time.time() - (self.failed_at or 0.0) >= CONFIRM_S

    @property
    def all_done(self) -> bool:
        return all(hs.state == "done" for hs in self.hosts.values())
