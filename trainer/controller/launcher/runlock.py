"""The run's lock: one launcher per run name at a time.

Two launches of one run name would both pass the probe (nothing runs yet), then the second's start
would clear the first's node state and each would stop the other. So every launch takes
`<run>/launch/lock` on the head (where the run's dir lives; every node sees it through the shared
dir) before its probe, as the training user, through the node helper (playbooks/files/node_ctl.py, op
`lock`: the file is linked into place whole, so of two launches one gets it). The file names its
holder: the controller's host name, the launcher's pid and that process's start time, the user and
when it was taken. The launcher keeps it across its restarts (--max-restarts) and releases it on
every way out: the end of the run (the start playbook's last task on the head), a stop after a
failure or on Ctrl-C, TERM or HUP (the stop playbook's last task), else a last round trip
(lock.yml).

A second launch is refused (exit 2) naming the holder and the fix. A launcher killed with -9 leaves
its lock behind: `--force` takes it over, unless its holder is verifiably alive (a process with its
pid and start time still runs on this controller); a holder on another controller cannot be checked
from here, so `--force` trusts the operator for it. `trainer attach` follows a run without needing
the lock; it adopts a lock whose holder is verifiably dead on this controller (and releases it when
the run ends, so the next launch needs no --force), and leaves any other holder's lock alone.

Inside a Slurm batch job (guest mode) the holder also names the job and its run (SLURM_RESTART_COUNT).
A job Slurm requeued after it lost the node its launcher ran on (NODE_FAIL) runs its script again, and
that launcher finds the dead one's lock: a holder of the same job in an earlier run is taken over
without --force (earlier_run_of_job), since Slurm ended that run before it requeued the job.
"""

from __future__ import annotations

import getpass
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from trainer.controller.launcher.live import printable
from trainer.controller.runner import run_playbook
from trainer.joblock import machine_id, process_alive, process_start

PLAYBOOK = PurePosixPath(__file__).parent / "playbooks" / "lock.yml"
#: start.yml's tasks on the head (the launcher follows them by name; where the head's probe takes
#: the lock, the launcher reads it from the probe's result instead).
LOCK_TASK = "Take the run's lock on the head"
RELEASE_TASK = "Release the run's lock"
#: lock.yml's task.
LOCK_CALL_TASK = "Take, release or read the run's lock"


class LockError(Exception):
    """The lock could not be read or changed (the head did not answer, the helper failed)."""


def holder_state(holder: dict[str, Any] | None) -> str:
    """'alive' or 'dead' for a holder on this controller; 'unknown' for one elsewhere (or unreadable).
    This controller: the same host name, boot id and pid namespace (trainer.joblock.machine_id), so a
    clone or container with this host name is not asked about by its pid here."""
    if (
        not isinstance(holder, dict)
        or holder.get("controller") != socket.gethostname()
        or holder.get("machine") != machine_id()
    ):
        return "unknown"
    # The pid with its start time, as the trainer's job lock judges its holders (trainer.joblock).
    return "alive" if process_alive(holder.get("pid"), holder.get("pid_start")) else "dead"


def time_text(value: Any) -> str:
    """A record's Unix time as local `YYYY-mm-dd HH:MM:SS`; `?` for anything that is not one (the
    records are the training account's to write)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(value)))
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"


def describe_holder(holder: dict[str, Any] | None) -> str:
    """The lock's holder in words, as plain text: each field the training account could have written
    has its control characters spelled out (a view.message still escapes it: live.node_text)."""
    if not isinstance(holder, dict) or not holder:
        return "an unreadable lock file (no holder named in it)"
    command, pid = printable(str(holder.get("command", "trainer launch"))), printable(str(holder.get("pid")))
    controller, user = printable(str(holder.get("controller"))), printable(str(holder.get("user")))
    return f"{command} pid {pid} on {controller} (user {user}), since {time_text(holder.get('taken_at'))}"


@dataclass
class RunLock:
    """This launcher's claim on one run name (see the module's docstring)."""

    run_name: str
    launch_dir: str
    command: str = "trainer launch"
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    held: bool = False
    slurm_run: tuple[str, int] | None = None
    """Guest mode: the Slurm job this launcher runs in and that job's run (SLURM_RESTART_COUNT)."""

    @property
    def path(self) -> str:
        return str(PurePosixPath(self.launch_dir) / "lock")

    def holder(self) -> dict[str, Any]:
        holder = {
            "run_name": self.run_name,
            "controller": socket.gethostname(),
            "machine": machine_id(),
            "pid": os.getpid(),
            "pid_start": process_start(os.getpid()),
            "user": getpass.getuser(),
            "command": self.command,
        }
        if self.slurm_run is not None:
            holder["slurm_job"], holder["slurm_restart"] = self.slurm_run
        return holder

    def earlier_run_of_job(self, holder: dict[str, Any] | None) -> bool:
        """Whether `holder` is this launcher's own Slurm job in an earlier run (the same job id, a lower
        SLURM_RESTART_COUNT): Slurm ended that run before requeueing the job, so its lock is stale."""
        if self.slurm_run is None or not isinstance(holder, dict):
            return False
        job, restart = self.slurm_run
        theirs = holder.get("slurm_restart")
        return (
            holder.get("slurm_job") == job
            and isinstance(theirs, int)
            and not isinstance(theirs, bool)
            and theirs < restart
        )

    def request(self, action: str = "acquire", take_over: str | None = None) -> dict[str, Any]:
        """The node helper's lock request (playbooks/files/node_ctl.py, `lock`)."""
        request: dict[str, Any] = {
            "launch_dir": self.launch_dir,
            "action": action,
            "token": self.token,
            "holder": self.holder(),
        }
        if take_over is not None:
            request["take_over"] = take_over
        return request

    def refusal(self, holder: dict[str, Any] | None, *, forced: bool = False) -> str:
        """Why this launch may not go on, and the fix."""
        state = holder_state(holder)
        who = describe_holder(holder)
        stop = f"`trainer launch -i INVENTORY --run-name {self.run_name} --stop`"
        if forced and state == "alive":
            return (
                f"run {self.run_name} is locked by {who}, which still runs on this controller: --force "
                f"takes over only a dead launcher's lock. Wait for it, stop it (kill {holder.get('pid')}; "  # type: ignore[union-attr]
                f"it stops its nodes), or pick another --run-name (lock: {self.path})"
            )
        if state == "dead":
            return (
                f"run {self.run_name} is locked by {who}, which no longer runs (killed?). Stop what it "
                f"may have left running with {stop}, then launch again with --force to take its lock "
                f"over (lock: {self.path})"
            )
        where = "on this controller" if state == "alive" else "elsewhere: it cannot be checked from here"
        return (
            f"run {self.run_name} is locked by {who} ({where}). Wait for that launch to end, follow it "
            f"with `trainer attach`, or pick another --run-name; if its launcher is dead, stop its nodes "
            f"with {stop} and launch again with --force (lock: {self.path})"
        )


def lock_call(
    lock: RunLock,
    inventory: str,
    head: str,
    extravars: dict[str, Any],
    env: dict[str, str],
    action: str,
    take_over: str | None = None,
) -> dict[str, Any]:
    """One round trip to the head (lock.yml): the helper's answer. `extravars` carries what every
    launcher playbook gets (training_user, who needs become, timeouts)."""
    result = run_playbook(
        PLAYBOOK,
        inventory,
        {**extravars, "launch_lock_request": lock.request(action, take_over)},
        env=env,
        limit=head,
    )
    item = result.task_result(head, LOCK_CALL_TASK)
    # A refused acquire is an answer too (the task fails with the holder in its result).
    if item is None or (item.status != "ok" and "holder" not in item.result):
        problems = [*result.unreachable.get(head, []), *result.failed.get(head, [])]
        text = (problems[-1].message if problems else "") or (result.output or "no answer").strip()[-300:]
        raise LockError(f"the run's lock on {head} could not be read or changed: {text}")
    answer = dict(item.result)
    if action == "acquire" and answer.get("acquired"):
        lock.held = True
    elif action == "release" and answer.get("released"):
        lock.held = False
    return answer


def release_quietly(lock: RunLock, *args: Any) -> str:
    """Release the lock if held, with Ctrl-C, TERM and HUP ignored meanwhile; '' or the problem."""
    if not lock.held:
        return ""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        answer = lock_call(lock, *args, action="release")
        if not answer.get("released"):
            lock.held = False  # someone took it over (--force): it is not ours to remove
        return ""
    except LockError as err:
        return str(err)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
