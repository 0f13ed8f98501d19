"""A stall's culprit by what the kernel says of each rank: the rank that is not where the others are.

When the stall watchdog fires (live.JobMonitor, stall.py), the stop asks every node for its ranks'
process states before it stops them (node_ctl.process_states: /proc/<pid>/stat's state, the kernel
function it sleeps in, and for state D the system call and the file it waits on). No progress file is
needed, so this names the culprit of your own command as well as the bundled trainer's. The cause is,
in this order:
- a rank stopped (state T: SIGSTOP, or another stop signal; t: held by a debugger);
- a rank in uninterruptible sleep (state D: blocked in the kernel, on a hung mount or device), with
  what it waits on when the kernel says: its node is at fault (the restart policy leaves such a node
  out with --exclude-failed, as a lost one);
- a rank gone (or a zombie) while its peers wait in their collective.
The first (by that order, then node and rank) is the cause; every other rank is its consequence,
waiting in its collective (or also stopped, blocked or gone). Where no rank is in such a state (a rank
sleeping outside a collective sleeps as its waiting peers do), there is no culprit here and the stall
stays a stall: the progress records name the ranks behind, unless a node is cut off from its peers
(find_partition: a partial partition, its collective port dropped while SSH works; every rank waits
in its collective, state S, so the states alone cannot tell it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer.controller.launcher.live import printable

#: The states that make a culprit, first the strongest (a stop is never a wait's consequence).
CULPRIT_ORDER = {"T": 0, "t": 0, "D": 1, "gone": 2, "Z": 2}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any, limit: int = 200) -> str:
    return printable(str(value))[:limit] if isinstance(value, str) else ""


@dataclass(frozen=True)
class RankState:
    """One rank (or a process without a rank: torchrun's agent, a command without torchrun) as its
    node reported it at the stall."""

    host: str
    node_rank: int
    rank: int | None
    pid: int | None
    state: str
    """/proc/<pid>/stat's letter (R, S, D, T, t, Z, ...), or `gone`: a rank of the node's range missing."""
    wchan: str = ""
    syscall: str = ""
    waits_on: str = ""
    command: str = ""
    of_rank_pid: int | None = None
    """Set when the state is a process of the rank's other than its main one (a data loader's, say)."""

    @classmethod
    def of(cls, host: str, node_rank: int, record: Any) -> RankState | None:
        """From a node's record (node_ctl.process_record; untrusted: checked, made printable)."""
        if not isinstance(record, dict) or not isinstance(record.get("state"), str):
            return None
        return cls(
            host,
            node_rank,
            _int(record.get("rank")),
            _int(record.get("pid")),
            _text(record["state"], 4),
            _text(record.get("wchan"), 80),
            _text(record.get("syscall"), 40),
            _text(record.get("waits_on"), 400),
            _text(record.get("command")),
            _int(record.get("of_rank_pid")),
        )

    @property
    def telling(self) -> bool:
        return self.state in CULPRIT_ORDER

    @property
    def label(self) -> str:
        """`rank 1`, or for a process without a rank its program and pid: `cat (pid 812)`."""
        if self.rank is not None:
            return f"rank {self.rank}"
        program = (self.command.split() or ["a process"])[0].rsplit("/", 1)[-1]
        return f"{program} (pid {self.pid})"

    @property
    def where(self) -> str:
        return f"{self.label} on {self.host} (node {self.node_rank})"

    @property
    def what(self) -> str:
        """The state in words: `stopped (SIGSTOP or another stop signal) — state T`."""
        child = f" (its process {self.pid}: {self.command})" if self.of_rank_pid is not None else ""
        if self.state == "T":
            return f"stopped (SIGSTOP or another stop signal) — state T{child}"
        if self.state == "t":
            return f"stopped by a debugger (traced) — state t{child}"
        if self.state == "D":
            call = f", blocked in {self.syscall}" if self.syscall else ""
            on = f" on {self.waits_on}" if self.waits_on else ""
            kernel = f" in {self.wchan}" if self.wchan else ""
            return f"in uninterruptible sleep — state D{kernel}{call}{on}{child}"
        if self.state == "gone":
            return "exited while its peers wait (its process is gone)"
        if self.state == "Z":
            return f"exited while its peers wait — state Z{child}"
        kernel = f", in {self.wchan}" if self.wchan else ""
        return f"{'running' if self.state == 'R' else 'sleeping'} — state {self.state}{kernel}"

    def as_record(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "rank": self.rank,
            "pid": self.pid,
            "state": self.state,
            "wchan": self.wchan,
            "syscall": self.syscall,
            "waits_on": self.waits_on,
        }


@dataclass(frozen=True)
class Hang:
    culprit: RankState
    others: list[RankState]
    """Every other rank reported, in node and rank order: each a consequence of the culprit."""

    @property
    def node_at_fault(self) -> bool:
        """Blocked in the kernel (a hung mount, a device): the node, not the job, is at fault."""
        return self.culprit.state == "D"

    def consequence_text(self, other: RankState) -> str:
        if other.telling:
            text = f"also {other.what}"
        else:
            text = f"waiting in its collective ({other.what})" if other.rank is not None else other.what
        # Event.where names a rank, not a process without one: its label goes first.
        return text if other.rank is not None else f"{other.label}: {text}"


def rank_states(
    reports: Mapping[str, list[Any] | None],
    node_ranks: Mapping[str, int],
    expected: Mapping[str, Iterable[int]],
) -> list[RankState]:
    """Every node's reported processes as RankStates, plus a `gone` one for each rank missing from a
    node's expected ranks, where the ranks the nodes reported are numbered as the launcher expects
    (a command that numbers its ranks otherwise, or none: nothing is taken for gone)."""
    states = [
        state
        for host, records in reports.items()
        if records is not None
        for record in records
        if (state := RankState.of(host, node_ranks[host], record)) is not None
    ]
    ranked = [s for s in states if s.rank is not None]
    expected_ranks = {host: set(expected.get(host) or ()) for host in reports}
    if ranked and all(s.rank in expected_ranks[s.host] for s in ranked):
        seen = {s.rank for s in ranked}
        states += [
            RankState(host, node_ranks[host], rank, None, "gone")
            for host, records in reports.items()
            if records is not None
            for rank in sorted(expected_ranks[host] - seen)
        ]
    return sorted(states, key=lambda s: (s.node_rank, s.rank if s.rank is not None else 1 << 30, s.pid or 0))


def find_hang(
    reports: Mapping[str, list[Any] | None],
    node_ranks: Mapping[str, int],
    expected: Mapping[str, Iterable[int]],
) -> Hang | None:
    """The culprit among the nodes' reports (host -> node_ctl.process_states' list, None where the node
    did not report), or None where no rank is stopped, blocked or gone."""
    states = rank_states(reports, node_ranks, expected)
    telling = [s for s in states if s.telling]
    if not telling:
        return None
    culprit = min(
        telling,
        key=lambda s: (CULPRIT_ORDER[s.state], s.node_rank, s.rank if s.rank is not None else 1 << 30),
    )
    return Hang(culprit, [s for s in states if s is not culprit])


def state_lines(reports: Mapping[str, list[Any] | None], node_ranks: Mapping[str, int]) -> list[str]:
    """One line per reported rank, for a stall without a culprit (where each one was, by the kernel)."""
    return [f"{s.where}: {s.what}" for s in rank_states(reports, node_ranks, {})]


@dataclass(frozen=True)
class Partition:
    """A node its peers' connects on the collective's port get no answer from, while the peers answer
    each other and the node answered the launcher over SSH: its firewall (or link) drops the port."""

    host: str
    port: int
    unanswered: list[str]
    """The peers whose connect to `host` got no answer."""

    @property
    def what(self) -> str:
        return (
            f"{self.host} does not answer its peers on port {self.port} while SSH works "
            f"({', '.join(self.unanswered)} got no answer; the other nodes answer each other): "
            "a firewall or link drops the collective's traffic"
        )


def find_partition(reach: Mapping[str, Any]) -> Partition | None:
    """The node cut off from its peers, from each node's connects at the stall (host -> its
    node_ctl reach answer, {"port": N, "peers": {peer: `answers` | `no answer` | error}}, None where
    it did not report): the one host that no reporting peer reached while at least one pair of the
    others reached each other. With two nodes (or where the others do not answer each other) either
    side may be the one at fault: None."""
    answers = {
        host: {str(k): str(v) for k, v in report["peers"].items()}
        for host, report in reach.items()
        if isinstance(report, dict) and isinstance(report.get("peers"), dict)
    }
    if len(answers) < 2:
        return None
    port = next((r.get("port") for r in reach.values() if isinstance(r, dict)), None)
    cut_off = []
    for host in reach:
        peers = [p for p in answers if p != host and host in answers[p]]
        if peers and all(answers[p][host] == "no answer" for p in peers):
            others_meet = any(answers[a].get(b) == "answers" for a in peers for b in peers if a != b)
            if others_meet:
                cut_off.append(Partition(host, _int(port) or 0, sorted(peers)))
    return cut_off[0] if len(cut_off) == 1 else None
