"""One job per output dir: `<output_dir>/job.lock`, held by `trainer train` and by `trainer sbatch` jobs.

Two jobs on one output dir destroy each other's work: the second one's start removed the first one's
checkpoint write in flight (`.tmp-step-N`), then both rotate the same `step-*` and rewrite `latest`.
So a job takes this lock before it removes or writes anything there, and a second job is refused
(exit 2) with the holder named and the fix.

The file protocol is the launcher's run lock (trainer/controller/launcher/runlock.py, node_ctl.py's
`lock`): the holder's description is written to a file of its own and linked into place, so the lock
exists whole or not at all and of two takers exactly one wins; a stale lock is moved aside before it
is replaced, and put back if what was moved turns out to be another taker's fresh lock.

Who holds it, so that the processes of one job never compete for it:
- `trainer train`: global rank 0 alone, once the process group is up; the other ranks learn its
  verdict through the group and leave with it (trainer/node/train.py);
- a `trainer sbatch` job: its batch script (`python -m trainer.joblock take ... --pid $$`, `release`
  on exit, a `touch` loop as heartbeat), before it writes the run's files; the bundled trainer its
  nodes start then finds the lock held by its own job and goes on under it ("joined").
A job is named by CLUSTERTRAIN_LAUNCH_ID (`trainer launch`, the same across its restarts) or
CLUSTER_JOB_ID (`trainer sbatch`'s job.env); a process without either is a job of its own.

A stale lock (its job killed with -9, its node lost) is taken over, said once. Stale means: on this
machine, the holding process (pid and start time) is gone; on another machine, which cannot be asked,
its heartbeat stopped: a holder touches the lock every HEARTBEAT_S, and one untouched for STALE_AFTER_S
is dead. A machine is its host name together with its kernel's boot id and its pid namespace
(`machine_id`): cloned images and containers share host names, and a pid is only asked where both
agree. A holder whose heartbeat finds another job's token in the lock (it changed hands under it: a
three-way takeover race, or a lock deleted by hand) stops its own job: two jobs never go on writing
one output dir. The age is read on the file system's own clock (the mtime of a file written just now beside
it), so the nodes' clocks need not agree. Standard library only (with trainer.safe_files, which is
too): batch scripts run it with the venv's python before anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.safe_files import umask_mode, write_file

LOCK_FILE = "job.lock"
#: How often a holder refreshes its lock's mtime (trainer train's thread, the batch script's loop).
HEARTBEAT_S = 15
#: A lock on another host untouched this long belongs to a dead job (several missed heartbeats: a
#: busy NFS server delays a touch, it does not skip eight).
STALE_AFTER_S = 120
#: How long a holder that lost its lock waits for its TERM to end it before it exits.
LOST_GRACE_S = 10
#: The variables that name the job a process belongs to, first found wins.
JOB_VARIABLES = ("CLUSTERTRAIN_LAUNCH_ID", "CLUSTER_JOB_ID")


class Locked(Exception):
    """Another job holds the output dir; the message names it and the fix."""


def job_from_env(env: dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return next((env[name] for name in JOB_VARIABLES if env.get(name)), "")


def machine_id() -> str:
    """This kernel's boot id and this process's pid namespace: where a lock's holder has the same (and
    the same host name), its pid can be asked here."""
    parts = []
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 lambda: os.readlink("/proc/self/ns/pid")):  # fmt: skip
        try:
            parts.append(read())
        except OSError:
            parts.append("?")
    return "/".join(parts)


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot, /proc/PID/stat), or None: with the pid,
    it tells a live holder from a reused pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_alive(pid: Any, started: Any = None) -> bool:
    """Whether process `pid` of this host still runs (and is the one that started at `started`)."""
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        pass  # another account's process: it runs
    return not started or process_start(int(pid)) in (None, str(started))


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unreadable lock (no holder named in it)"
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("taken_at") or 0)))
    except (TypeError, ValueError, OverflowError, OSError):
        since = "?"
    job = f" (job {holder['job']})" if holder.get("job") else ""
    return (
        f"{holder.get('command', 'a job')}{job}, pid {holder.get('pid')} on {holder.get('host')} "
        f"(user {holder.get('user')}), since {since}"
    )


def _read(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else {}
    return None


def why_stale(holder: dict[str, Any], age_s: float) -> str:
    """Why `holder` is dead ('' while it may still run): its process is gone (this machine), or its
    heartbeat stopped `age_s` seconds ago (another machine, or one that does not say which)."""
    if holder.get("host") == socket.gethostname() and holder.get("machine") == machine_id():
        if process_alive(holder.get("pid"), holder.get("pid_start")):
            return ""
        return f"no longer runs (pid {holder.get('pid')} is gone)"
    if age_s > STALE_AFTER_S:
        return f"stopped refreshing it {age_s:.0f} s ago (its heartbeat, every {HEARTBEAT_S} s)"
    return ""


@dataclass
class JobLock:
    """This job's claim on `directory` (see the module's docstring)."""

    directory: Path
    job: str = ""
    command: str = "trainer train"
    pid: int = field(default_factory=os.getpid)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: "held" (ours: refreshed and released by us), "joined" (our job's: left to it), or "".
    state: str = ""
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def path(self) -> Path:
        return Path(self.directory) / LOCK_FILE

    def holder(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "job": self.job,
            "command": self.command,
            "host": socket.gethostname(),
            "machine": machine_id(),
            "pid": self.pid,
            "pid_start": process_start(self.pid),
            "user": getpass.getuser(),
            "taken_at": time.time(),
        }

    def acquire(self) -> str:
        """Take the lock (or join our own job's): '' or the one line to log about a stale lock taken
        over. Locked when another job holds it."""
        directory = Path(self.directory)
        directory.mkdir(parents=True, exist_ok=True)
        candidate = directory / f".{LOCK_FILE}.{self.token}"
        aside = directory / f".{LOCK_FILE}.stale.{self.token}"
        write_file(candidate, json.dumps(self.holder()) + "\n", umask_mode())  # never through a planted link
        try:
            # A few rounds: each one that fails lost a race to another taker, who is then read anew.
            for _ in range(5):
                with contextlib.suppress(FileExistsError):
                    os.link(candidate, self.path)
                    self.state = "held"
                    return ""
                current = _read(self.path)
                try:
                    # The candidate was written just now: its mtime is the file system's "now".
                    age = candidate.stat().st_mtime - self.path.stat().st_mtime
                except FileNotFoundError:
                    continue  # released meanwhile
                if current is None:
                    continue
                stale = why_stale(current, age)
                if current.get("token") == self.token or (self.job and current.get("job") == self.job):
                    if not stale:
                        self.state = "held" if current.get("token") == self.token else "joined"
                        return ""
                elif not stale:
                    raise Locked(self.refusal(current, age))
                # Stale: moved aside whole, and put back if it is not the lock just judged.
                try:
                    os.rename(self.path, aside)
                except FileNotFoundError:
                    continue
                moved = _read(aside) or {}
                if moved.get("token") != current.get("token"):
                    with contextlib.suppress(FileExistsError):
                        os.link(aside, self.path)
                    # Now: a later rename onto a second link of the same file would do nothing.
                    aside.unlink(missing_ok=True)
                    continue
                try:
                    os.link(candidate, self.path)
                except FileExistsError:
                    continue
                self.state = "held"
                return f"took over {self.path} from {describe(current)}, which {stale}"
            raise Locked(f"{self.path} changed hands repeatedly while this job tried to take it; start again")
        finally:
            aside.unlink(missing_ok=True)
            candidate.unlink(missing_ok=True)

    def held_by_live_job(self) -> bool:
        """Whether a live job holds the lock, judged without writing anything (for a full disk, where
        acquire cannot write its candidate): the lock's age on this host's clock."""
        current = _read(self.path)
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return False
        return current is not None and current.get("token") != self.token and not why_stale(current, age)

    def refusal(self, holder: dict[str, Any], age_s: float) -> str:
        here = holder.get("host") == socket.gethostname()
        if here:
            gone = f"if it hangs, stop it (kill {holder.get('pid')}) and start again: its lock is taken over"
        else:
            gone = (
                f"if it is gone, its lock is taken over once it is {STALE_AFTER_S} s without a heartbeat "
                f"(the last {age_s:.0f} s ago), or at once after you delete {self.path}"
            )
        return (
            f"output dir {self.directory} is in use by {describe(holder)}: two jobs on one output dir "
            f"delete each other's checkpoints. Wait for it to end, or give this job another output_dir "
            f"(another --run-name); {gone}"
        )

    def refresh(self) -> dict[str, Any] | None:
        """The heartbeat: touch the lock while it is ours. Another job's holder when the lock changed
        hands (never touched: it is theirs); None otherwise (ours, gone, or unreadable for now)."""
        current = _read(self.path)
        if current is None:
            return None
        if current.get("token") != self.token:
            return current
        with contextlib.suppress(OSError):
            os.utime(self.path)
        return None

    def start_heartbeat(self) -> None:
        """Refresh the lock every HEARTBEAT_S from a daemon thread, until release(); stop this job
        (lost) if the lock changed hands."""
        if self.state != "held":
            return

        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                if (taker := self.refresh()) is not None and not self._stop.is_set():
                    self.lost(taker)
                    return

        threading.Thread(target=beat, name="job-lock-heartbeat", daemon=True).start()

    def lost(self, taker: dict[str, Any]) -> None:
        """The lock is another job's now: say so and end this job (TERM to the holding process, then,
        if it is still there after LOST_GRACE_S, exit), before it writes the other job's output dir."""
        self.state = ""
        print(
            f"trainer: {self.path} was taken over by {describe(taker)} while this job held it: stopping "
            "this job, so that two jobs never write one output dir (start it again once the other ends, "
            "or give it another output_dir)",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGTERM)
        if self.pid == os.getpid() and not self._stop.wait(LOST_GRACE_S):
            os._exit(2)  # the TERM was handled and the job goes on: not this one

    def release(self) -> None:
        """Remove the lock if it is still ours; a joined lock is left to the job that holds it."""
        self._stop.set()
        if self.state == "held" and (_read(self.path) or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)
        self.state = ""


def main(argv: list[str] | None = None) -> int:
    """For batch scripts: `take DIR --pid PID [--job ID] [--command TEXT]` prints the token (the note
    about a stale lock taken over, or the refusal with exit 2, on stderr); `release DIR --token T`."""
    parser = argparse.ArgumentParser(prog="python -m trainer.joblock")
    parser.add_argument("action", choices=("take", "release"))
    parser.add_argument("directory", type=Path, help="the output dir")
    parser.add_argument("--pid", type=int, default=os.getpid(), help="the holding process (the batch shell)")
    parser.add_argument("--job", default="", help="the job's id (its trainer joins the lock)")
    parser.add_argument("--command", default="a batch job", help="what holds it, for the refusal")
    parser.add_argument("--token", default="", help="release: the token take printed")
    args = parser.parse_args(argv)
    lock = JobLock(args.directory, job=args.job, command=args.command, pid=args.pid)
    if args.action == "release":
        lock.token, lock.state = args.token, "held"
        lock.release()
        return 0
    try:
        note = lock.acquire()
    except (Locked, OSError) as err:
        print(f"trainer: {err}", file=sys.stderr, flush=True)
        return 2
    if note:
        print(f"[clustertrain] {note}", file=sys.stderr, flush=True)
    print(lock.token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
