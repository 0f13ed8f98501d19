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
- a rank gone (or a zombie) while its peers wait in their collective;
- a rank outside the collective its peers wait in, by each rank's Python stack (a user's command:
  node_ctl.add_stacks reads them with py-spy): some ranks' stacks are in a torch.distributed
  collective (all_reduce, barrier, ...) and this one's is not (it sleeps, loads, computes elsewhere);
- a rank in another collective than most of its peers (all_gather where they all_reduce, or the same
  call from another line): every rank waits, each for a partner that never comes;
- the bundled trainer's rank behind its peers by its progress record (behind_hang: still in step k, or
  before it, while they are in step k+1 and wait in its collective), where nothing above told and no
  node is cut off from its peers: it sleeps (or computes) outside the collective they wait in;
- with every rank in one step, the bundled trainer's rank that never entered the collective its peers
  wait in, or entered another, by torch's flight recorder (flight_hang: each rank's record says, per
  process group, the sequence number of the last collective it entered and the last that ended).
The first (by that order, then node and rank) is the cause; every other rank is its consequence,
waiting in its collective (or also stopped, blocked, gone or outside). Where no rank is in such a
state and no stack tells (a rank sleeping outside a collective sleeps as its waiting peers do), there
is no culprit here and the stall stays a stall: the progress records name the ranks behind, unless a
node is cut off from its peers (find_partition: a partial partition, its collective port dropped while
SSH works; every rank waits in its collective, state S, so the states alone cannot tell it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer.controller.launcher.live import printable

#: The states that make a culprit, first the strongest (a stop is never a wait's consequence).
CULPRIT_ORDER = {"T": 0, "t": 0, "D": 1, "gone": 2, "Z": 2}
#: torch.distributed's collectives and point-to-point calls (and DeepSpeed's comm wrappers of the same
#: names): a rank whose stack holds one of these, in those packages' files, waits in a collective.
COLLECTIVE_CALLS = frozenset(
    {
        "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
        "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
        "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single",
        "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "send", "recv",
        "batch_isend_irecv", "inference_all_reduce",
    }
)  # fmt: skip
COLLECTIVE_FILES = ("torch/distributed/", "deepspeed/comm/")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any, limit: int = 200) -> str:
    return printable(str(value))[:limit] if isinstance(value, str) else ""


@dataclass(frozen=True)
class Frame:
    """One frame of a rank's Python stack, as node_ctl.thread_stacks reports it."""

    name: str
    file: str
    line: int
    code: str = ""
    """The source line it runs, where the node could read it."""

    @classmethod
    def of(cls, record: Any) -> Frame | None:
        if not isinstance(record, dict) or not isinstance(record.get("name"), str):
            return None
        return cls(
            _text(record["name"], 120), _text(record.get("file"), 400), _int(record.get("line")) or 0,
            _text(record.get("code"), 200),
        )  # fmt: skip

    @property
    def short_file(self) -> str:
        """A package's file from its package on (`torch/distributed/distributed_c10d.py`), else its name."""
        for marker in ("site-packages/", "dist-packages/"):
            if marker in self.file:
                return self.file.rsplit(marker, 1)[1]
        return self.file.rsplit("/", 1)[-1]

    @property
    def collective(self) -> bool:
        return self.name in COLLECTIVE_CALLS and any(part in self.file for part in COLLECTIVE_FILES)

    @property
    def text(self) -> str:
        """`main (hang.py:21: time.sleep(600))`."""
        code = f": {self.code}" if self.code else ""
        return f"{self.name} ({self.short_file}:{self.line}{code})"


#: Where a thread waits on another of its process's threads (a join, a lock, a queue, a future).
THREAD_WAIT_FILES = ("/threading.py", "/queue.py", "/concurrent/futures/")


@dataclass(frozen=True)
class ThreadStack:
    """Another thread of a rank than its main one, as node_ctl.thread_stacks reports it."""

    name: str
    frames: tuple[Frame, ...]

    @classmethod
    def of(cls, record: Any) -> ThreadStack | None:
        if not isinstance(record, dict) or not isinstance(record.get("frames"), list):
            return None
        frames = tuple(f for f in map(Frame.of, record["frames"][:8]) if f is not None)
        return cls(_text(record.get("name"), 80) or "?", frames) if frames else None


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
    frames: tuple[Frame, ...] = ()
    """Its main thread's Python stack, innermost first (py-spy; a user's command only)."""
    stack_error: str = ""
    """Why its stack could not be read, where it was asked."""
    threads: tuple[ThreadStack, ...] = ()
    """Its other threads' stacks, where it has some with Python frames (py-spy; a user's command only)."""

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
            tuple(f for f in map(Frame.of, stack[:32]) if f is not None)
            if isinstance(stack := record.get("stack"), list)
            else (),
            _text(record.get("stack_error"), 500),
            tuple(t for t in map(ThreadStack.of, threads[:8]) if t is not None)
            if isinstance(threads := record.get("threads"), list)
            else (),
        )

    @property
    def telling(self) -> bool:
        return self.state in CULPRIT_ORDER

    @property
    def collective(self) -> str:
        """`all_reduce, called at main (script.py:14: dist.all_reduce(t))`: the collective its stack is
        in (the outermost of torch's own frames of that name) and the caller's frame; '' if none."""
        inside = [i for i, frame in enumerate(self.frames) if frame.collective]
        if not inside:
            return ""
        outermost = inside[-1]
        caller = next(
            (f for f in self.frames[outermost + 1 :] if not any(p in f.file for p in COLLECTIVE_FILES)), None
        )
        name = self.frames[outermost].name
        return f"{name}, called at {caller.text}" if caller is not None else name

    @property
    def waits_on_threads(self) -> str:
        """`; its main thread waits on its thread loader, at load (x.py:15: time.sleep(3600))`: where
        its main thread's innermost frame is a wait on another thread (a join, a lock, a queue) and it
        has other threads, each one's innermost frame; else ''."""
        if (
            not self.frames
            or not self.threads
            or not any(part in self.frames[0].file for part in THREAD_WAIT_FILES)
        ):
            return ""
        waited = "; ".join(f"{t.name}, at {t.frames[0].text}" for t in self.threads)
        return f"; its main thread waits on its thread{'s' if len(self.threads) > 1 else ''} {waited}"

    @property
    def top_frames(self) -> str:
        """Its two innermost frames, innermost first: `main (hang.py:21: time.sleep(600)) ← ...`."""
        return " ← ".join(frame.text for frame in self.frames[:2])

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
    waited_in: str = ""
    """Named by the stacks: the collective the other ranks wait in (the culprit's is not one, or with
    `diverged`, is another)."""
    diverged: bool = False
    """The culprit waits in a collective too, but another one than most of its peers."""
    behind: Mapping[tuple[str, int | None], int | None] | None = None
    """Named by the progress records (behind_hang): each rank behind, (host, rank) -> the step its record
    says it is in (None: none reported); with `leading`, the step its peers are in."""
    leading: int | None = None
    entered: Mapping[tuple[str, int | None], Entered] | None = None
    """By torch's flight recorder (the bundled trainer's records): each rank's last collective entered,
    in the process group the hang is in; where `behind` is None, it named the culprit (flight_hang)."""

    @property
    def node_at_fault(self) -> bool:
        """Blocked in the kernel (a hung mount, a device): the node, not the job, is at fault."""
        return self.culprit.state == "D"

    @property
    def culprit_text(self) -> str:
        """What the culprit was doing: its state, or (named by the stacks) where its Python was."""
        culprit = self.culprit
        last = (self.entered or {}).get((culprit.host, culprit.rank))
        if self.diverged:
            return (
                f"in another collective than its peers: {culprit.collective or last}, while they wait in "
                f"{self.waited_in} — {culprit.what}"
            )
        if self.behind is not None:
            at = f": at {culprit.top_frames}" if culprit.frames else ""
            where = f"{self._step_text(culprit)} while they are in step {self.leading}"
            flight = f"; its last collective: {last.ended_text}" if last is not None else ""
            return f"behind its peers: {where}{at} — {culprit.what}{flight}"
        if last is not None:
            return (
                f"not in the collective its peers wait in ({self.waited_in}): its last collective: "
                f"{last.ended_text} — {culprit.what}"
            )
        if self.waited_in and not culprit.telling:
            return (
                f"not in the collective its peers wait in ({self.waited_in.split(',')[0]}): at "
                f"{culprit.top_frames}{culprit.waits_on_threads} — {culprit.what}"
            )
        return culprit.what if culprit.rank is not None else f"{culprit.label}: {culprit.what}"

    def _step_text(self, state: RankState) -> str:
        step = (self.behind or {}).get((state.host, state.rank))
        return f"in step {step}" if step is not None else "in no step yet"

    def consequence_text(self, other: RankState) -> str:
        entered = (self.entered or {}).get((other.host, other.rank))
        if self.behind is not None and (other.host, other.rank) in self.behind:
            text = f"also behind, {self._step_text(other)} ({other.what})"
        elif other.telling:
            text = f"also {other.what}"
        elif entered is not None and not entered.done:
            text = f"waiting in {entered} ({other.what})"
        elif entered is not None:
            text = f"not in a collective either: its last, {entered.ended_text} ({other.what})"
        elif other.collective:
            text = f"waiting in {other.collective} ({other.what})"
        elif other.frames:  # its stack is read, and outside any collective
            text = f"not in a collective either: at {other.top_frames} ({other.what})"
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
        return stack_hang(states)
    culprit = min(
        telling,
        key=lambda s: (CULPRIT_ORDER[s.state], s.node_rank, s.rank if s.rank is not None else 1 << 30),
    )
    return Hang(culprit, [s for s in states if s is not culprit])


def stack_hang(states: list[RankState]) -> Hang | None:
    """The rank outside the collective its peers wait in, by their stacks (states in node and rank
    order): where some ranks' stacks are in a collective and others' are not, the first of those is
    the culprit. Where every stack read is in one, the rank in another than most (diverged_hang).
    None where none is (no collective to be outside of)."""
    stacked = [s for s in states if s.rank is not None and s.frames]
    waiting = [s for s in stacked if s.collective]
    outside = [s for s in stacked if not s.collective]
    if waiting and not outside:
        return diverged_hang(states, waiting)
    if not waiting or not outside:
        return None
    culprit = outside[0]
    return Hang(culprit, [s for s in states if s is not culprit], waited_in=waiting[0].collective)


def diverged_hang(states: list[RankState], waiting: list[RankState]) -> Hang | None:
    """The rank in another collective than its peers (another call, or the same call from another
    line: the ranks' code took different paths), where every stack read is in one: the collective
    most ranks wait in is the one the job meant, the first rank in any other is the culprit. None where
    they all wait in the same one (a lost peer, a partition), or no collective holds a majority (two
    ranks, one in each: either may be the one that went astray)."""
    counts = Counter(state.collective for state in waiting)
    if len(counts) < 2:
        return None
    (meant, most), (_, next_most) = counts.most_common(2)
    if most == next_most:
        return None
    culprit = next(s for s in waiting if s.collective != meant)
    return Hang(culprit, [s for s in states if s is not culprit], waited_in=meant, diverged=True)


def behind_hang(
    states: list[RankState],
    behind: Iterable[tuple[str, int | None, int | None]],
    leading: int | None,
    records: Mapping[tuple[str, int], Any] | None = None,
) -> Hang | None:
    """The bundled trainer's stall where no state, stack or partition told: the first rank its progress
    record shows behind the step its peers are in (`behind`: (host, rank, its step), the stall's, in
    node and rank order; `leading`: their step). Its peers wait in that step's collective for it; it is
    the one not where the others are. None where no rank is behind (every rank in the same step: a
    collective that never ends, say) or the ranks behind are whole nodes that reported no state."""
    behind = [(host, rank, step) for host, rank, step in behind if rank is not None]
    if leading is None or not behind:
        return None
    by_rank = {(s.host, s.rank): s for s in states}
    host, rank, _ = behind[0]
    culprit = by_rank.get((host, rank))
    if culprit is None:
        return None
    steps = {(h, r): step for h, r, step in behind}
    others = [s for s in states if s is not culprit]
    entered = _group_of(collectives(records or {}), (host, rank))
    return Hang(culprit, others, behind=steps, leading=leading, entered=entered)


@dataclass(frozen=True)
class Entered:
    """A rank's last collective in one process group, as torch's flight recorder counts them."""

    group: str
    seq: int
    """The sequence number of the last collective the rank entered in this group."""
    ended: int
    """The last that ended (the one entered, where the rank is not waiting in it)."""
    op: str = ""

    @classmethod
    def of(cls, record: Any) -> Entered | None:
        if not isinstance(record, dict):
            return None
        seq, ended = _int(record.get("entered")), _int(record.get("ended"))
        if seq is None or ended is None:
            return None
        return cls(_text(record.get("group"), 80), seq, ended, _text(record.get("op"), 60))

    @property
    def done(self) -> bool:
        return self.ended >= self.seq

    def __str__(self) -> str:
        """`all_reduce #58`, with the group where it is not the default one."""
        group = f" of group {self.group}" if self.group and self.group != "default_pg" else ""
        return f"{self.op or 'collective'} #{self.seq}{group}"

    @property
    def ended_text(self) -> str:
        return f"{self}, {'ended' if self.done else 'not ended'}"


def collectives(records: Mapping[tuple[str, int], Any]) -> dict[str, dict[tuple[str, int], Entered]]:
    """Process group id -> each rank's Entered, from the ranks' progress records ((host, rank) -> its
    record; untrusted: checked) where they hold `collectives` (trainer/node/flight_recorder.py)."""
    groups: dict[str, dict[tuple[str, int], Entered]] = {}
    for key, record in records.items():
        held = record.get("collectives") if isinstance(record, dict) else None
        if not isinstance(held, dict):
            continue
        for pg_id, summary in list(held.items())[:64]:
            if (entered := Entered.of(summary)) is not None:
                groups.setdefault(_text(str(pg_id), 40), {})[key] = entered
    return groups


def _group_of(
    groups: Mapping[str, Mapping[tuple[str, int], Entered]], key: tuple[str, int | None]
) -> dict[tuple[str, int | None], Entered] | None:
    """The group whose sequence numbers differ most among the ranks that hold `key` (where the hang
    is: the group the others wait in), or None."""
    held = [g for g in groups.values() if key in g and len(g) > 1]
    if not held:
        return None
    best = max(held, key=lambda g: max(e.seq for e in g.values()) - min(e.seq for e in g.values()))
    return dict(best)


def flight_hang(states: list[RankState], records: Mapping[tuple[str, int], Any]) -> Hang | None:
    """The bundled trainer's stall with every rank in one step, by torch's flight recorder (`records`:
    (host, rank) -> its progress record): in a process group where some ranks wait in collective #N
    (entered, not ended), the first rank whose last entered is before N never entered it: the culprit.
    Where every rank entered #N, the one that entered another collective than most (a strict majority)
    is. None where the records hold no recorder's counts, or every rank waits in the same one."""
    by_rank = {(s.host, s.rank): s for s in states}
    order = {(s.host, s.rank): i for i, s in enumerate(states)}
    for _, group in sorted(collectives(records).items()):
        ranks = {key: e for key, e in group.items() if key in by_rank}
        if len(ranks) < 2:
            continue
        top = max(e.seq for e in ranks.values())
        waiting = [e for e in ranks.values() if e.seq == top and not e.done]
        outside = sorted((key for key, e in ranks.items() if e.seq < top), key=order.__getitem__)
        if waiting and outside:
            culprit = by_rank[outside[0]]
            others = [s for s in states if s is not culprit]
            return Hang(culprit, others, waited_in=str(waiting[0]), entered=ranks)
        ops = Counter(e.op for e in ranks.values() if e.seq == top)
        if len(ops) >= 2 and (common := ops.most_common(2))[0][1] > common[1][1]:
            meant = common[0][0]
            key = min((k for k, e in ranks.items() if e.op != meant), key=order.__getitem__)
            culprit = by_rank[key]
            waited = next(str(e) for e in ranks.values() if e.op == meant)
            others = [s for s in states if s is not culprit]
            return Hang(culprit, others, waited_in=waited, diverged=True, entered=ranks)
    return None


def state_lines(reports: Mapping[str, list[Any] | None], node_ranks: Mapping[str, int]) -> list[str]:
    """One line per reported rank, for a stall without a culprit (where each one was, by the kernel,
    and by its stack where read)."""
    lines = []
    for s in rank_states(reports, node_ranks, {}):
        at = f"; at {s.top_frames}" if s.frames else f"; no stack: {s.stack_error}" if s.stack_error else ""
        lines.append(f"{s.where}: {s.what}{at}")
    return lines


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
