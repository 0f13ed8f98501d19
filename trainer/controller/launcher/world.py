"""The world check of a user's command: did the nodes form one job, or one job each?

The bundled trainer knows its world. A user's command is judged from the outside: every worker's
node_ctl reports whether a process of the launch holds a TCP connection to the head (node_ctl.joined:
the job's store on MASTER_ADDR, the collectives' peers). A worker whose launcher formed a job of its
own never connects there.

- Every worker joined: one line, `world check: all N nodes joined the job on ADDR:PORT`.
- A worker running for `timeout_s` (counted from when both it and the head run) without joining:
  with a launcher the launcher recognises (command_forms) the job is stopped with exit 2 (a silent
  N separate jobs is never left running); with any other command (a script, a per-node tool) a
  warning says so and the job goes on.
- A worker that ended before it was seen joined: a note that it could not be confirmed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.markup import escape

#: How long a worker may run before it must have connected to the head (its launcher's start, the
#: import of torch, the rendezvous). DeepSpeed's launcher took 55 s from start to its ranks on the
#: loaded 3-container bed (it imports deepspeed twice before a rank runs). --world-timeout changes it.
WORLD_TIMEOUT_S = 120.0


@dataclass
class WorldCheck:
    workers: tuple[str, ...]
    """The hosts that must join the head's job (node rank > 0), in node order."""
    head: str
    endpoint: str
    """MASTER_ADDR:MASTER_PORT, for the messages."""
    strict: bool
    """A recognised launcher: a node that never joins fails the job."""
    launcher: str = ""
    timeout_s: float = WORLD_TIMEOUT_S
    joined: set[str] = field(default_factory=set)
    running_since: dict[str, float] = field(default_factory=dict)
    """Host -> when it was first seen running (the head included)."""
    warned: set[str] = field(default_factory=set)
    """Workers a warning named (a command the launcher does not recognise): not named again."""
    done: bool = False
    """Every worker was judged (joined, failed, warned or unconfirmed): nothing more is said."""
    failure: tuple[str, str] | None = None
    """(host, message) of a strict failure: the cause the launcher stops the job for."""

    def note(self, host: str, state: str | None, joined: bool | None) -> None:
        if state == "running":
            self.running_since.setdefault(host, time.time())
        if joined:
            self.joined.add(host)

    def judge(self, final: set[str], now: float | None = None) -> list[str]:
        """The check's lines to show, each once: when every worker joined, when workers are overdue,
        or when the job ended before it could be told. `final`: the hosts whose command has ended."""
        if self.done:
            return []
        now = time.time() if now is None else now
        if set(self.workers) <= self.joined:
            self.done = True
            return [f"world check: all {len(self.workers) + 1} nodes joined the job on {self.endpoint}"]
        head_since = self.running_since.get(self.head)
        overdue = [
            host
            for host in self.workers
            if host not in self.joined | self.warned
            and host not in final
            and head_since is not None
            and host in self.running_since
            and now - max(head_since, self.running_since[host]) > self.timeout_s
        ]
        lines = []
        if overdue and self.strict:
            # Every worker not connected yet is named: they run the same command.
            missing = [h for h in self.workers if h not in self.joined and h not in final]
            names = ", ".join(missing)
            message = (
                f"{names} did not connect to the head within {self.timeout_s:g} s: {self.launcher} formed "
                f"a separate job there instead of joining the job on {self.endpoint}; fix: leave the node "
                "count, rank and master to the launcher's environment (NNODES, NODE_RANK, MASTER_ADDR, "
                "MASTER_PORT, PET_*; `trainer plan` shows them), or raise --world-timeout if the start "
                "is this slow"
            )
            self.failure = (missing[0], message)
            self.done = True
            return [f"[red]world check failed[/red]: {escape(message)}"]
        if overdue:
            self.warned.update(overdue)
            lines.append(
                f"[yellow]world check[/yellow]: {escape(', '.join(overdue))} did not connect to the head "
                f"({self.endpoint}) within {self.timeout_s:g} s; if your command is one distributed job, "
                "those nodes started jobs of their own (`trainer plan` shows the environment each node gets)"
            )
        pending = [h for h in self.workers if h not in self.joined | self.warned]
        if not pending:
            self.done = True
        elif all(host in final for host in pending):
            self.done = True
            lines.append(
                f"world check: {', '.join(pending)} ended before it was seen connected to the head: "
                "whether they joined one job could not be told"
            )
        return lines
