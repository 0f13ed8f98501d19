"""A batch job `trainer launch --slurm` submitted from a login node (issue 40), followed from there:
its state, its output, its end, its cancel; and its record, for `trainer status`, `stop` and
`attach` on the login node.

Following costs one `squeue` call per poll for the whole job, never one per node: the nodes' lines
are the guest launcher's own, which it prints in the job (rank 0's log, a line per node, the failure
report) to the job's output file on the shared dir; this side prints that file's new lines as they
come. The job ends with the guest launcher's own exit code, which the batch script writes to the
launch dir (slurm_batch.BATCH_EXIT): bad data exits 2 here as in the job. A job that ends without one
(cancelled before its launcher ended, killed at its time limit, its node failed) ends with Slurm's
word for it. A requeued job (Slurm's warning signal: guest mode saved and requeued it; or a node of the
job failed, NODE_FAIL, and Slurm requeued it, as it does a batch job that allows it) is followed on
through its next run: the same job id, its output appended to the same file; the launcher in it
resumes the run from its latest checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer import exitcodes
from trainer.controller.launcher.live import LiveView, node_text, printable
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.slurm_allocation import SlurmError, requeue_blocker, slurm
from trainer.controller.launcher.slurm_batch import BATCH_EXIT, BATCH_OUTPUT
from trainer.controller.launcher.slurm_runs import slurm_launch
from trainer.controller.launcher.slurm_steps import SlurmRecord, write_record

#: The launch dir's record of the job a login node submitted for the run.
SUBMITTED_FILE = "slurm-job.json"
#: Slurm's states of a job that will not run again (squeue's %T). Not PREEMPTED: a preempted job that
#: may be requeued passes through it; one that is not ends as Slurm forgets it (MinJobAge).
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
     "SPECIAL_EXIT", "REVOKED"}
)  # fmt: skip
#: How long a cancelled job may take to end before the follower stops waiting for it.
CANCEL_END_S = 60.0
#: How long a job that failed with a node (NODE_FAIL) and allows a requeue may take to be requeued.
REQUEUE_WAIT_S = 60.0
#: squeue's states of a job back in the queue.
QUEUED_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
#: How long an ended job's exit code file may take to show on the login node's view of the shared dir.
EXIT_FILE_WAIT_S = 5.0
#: A follower's read of the job's output: at most this much a poll (a fast rank 0 is not a flood).
READ_CHUNK = 1 << 20


@dataclass
class SubmittedJob:
    """slurm-job.json in the launch dir: the batch job a login node submitted for the run."""

    job: str
    """Slurm's job id."""
    submitted_at: float = 0.0
    """When (time.time()) it was submitted."""
    host: str = ""
    """The login node it was submitted from."""
    follower_pid: int = 0
    """The `trainer launch --slurm` following it there."""

    def write(self, launch_dir: str | Path) -> None:
        write_record(Path(launch_dir) / SUBMITTED_FILE, asdict(self))

    @classmethod
    def read(cls, launch_dir: str | Path) -> SubmittedJob | None:
        """The record, or None where no login node submitted this run (or it is unreadable)."""
        try:
            data = json.loads((Path(launch_dir) / SUBMITTED_FILE).read_text())
            return cls(
                job=str(data["job"]),
                submitted_at=float(data.get("submitted_at") or 0),
                host=str(data.get("host") or ""),
                follower_pid=int(data.get("follower_pid") or 0),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    @classmethod
    def now(cls, job: str) -> SubmittedJob:
        return cls(job=job, submitted_at=time.time(), host=socket.gethostname(), follower_pid=os.getpid())


@dataclass(frozen=True)
class JobState:
    """Slurm's word on a job: one squeue call."""

    state: str
    """squeue's %T (PENDING, RUNNING, COMPLETED, ...); "" once Slurm no longer knows the job."""
    reason: str = ""
    """Why it waits or ended (squeue's %r), "None" when there is none."""
    nodes: str = ""
    """Its nodes (%N), once it runs."""
    batch_host: str = ""
    """The node its batch script (the launcher in the job) runs on (%B), once it runs."""

    @property
    def final(self) -> bool:
        return not self.state or self.state in FINAL_STATES

    @property
    def live(self) -> bool:
        """Pending or running: a second job of the run would wait for its lock or be refused."""
        return not self.final

    def describe(self) -> str:
        if not self.state:
            return "no longer known to Slurm"
        text = self.state.lower()
        if self.nodes and self.state in ("RUNNING", "COMPLETING"):
            text += f" on {self.nodes}"
        if self.reason and self.reason != "None":
            text += f" ({self.reason})"
        return text


def job_state(job: str) -> JobState:
    """The job's state: one squeue call (finished jobs too, while slurmctld keeps them: MinJobAge)."""
    try:
        shown = slurm("squeue", f"--jobs={job}", "--states=all", "--noheader", "--format=%T|%r|%N|%B")
    except SlurmError as err:
        if "Invalid job id" in str(err):
            return JobState("")
        raise
    for line in shown.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            batch_host = parts[3] if parts[3] not in ("", "n/a", "(null)") else ""
            return JobState(parts[0], parts[1], parts[2], batch_host)
    return JobState("")


def exit_code_of(launch_dir: str | Path, job: str) -> int | None:
    """The guest launcher's exit code in `job`, as the batch script wrote it; None without one."""
    try:
        data = json.loads((Path(launch_dir) / BATCH_EXIT).read_text())
        return int(data["code"]) if str(data.get("job")) == job else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


class JobFollower:
    """Follows one batch job from the login node: its state changes and its output, to its end."""

    job: str
    """Slurm's job id."""
    launch_dir: Path
    """The run's launch dir on the shared dir: the job's output and exit code file."""
    view: LiveView
    """Where the job's lines and this side's own go."""
    poll_s: float
    """Seconds between two squeue calls (--poll-interval)."""
    offset: int
    """How far the job's output has been printed."""
    shown: str
    """The last state line printed (each change is one line)."""
    cancelled_by_us: bool
    """Whether this follower cancelled the job (Ctrl-C): its end is then an interrupt, not a failure."""
    nodes_seen: str
    """The job's nodes (%N) when the batch node was last looked for among them."""
    lost_batch_node: str
    """The job's batch node once Slurm took it out of the job ("" while it has not)."""
    ran: bool
    """Whether the job ran since it was last queued (a later PENDING is a requeue)."""
    node_failed_at: float | None
    """When (time.monotonic()) the job was first seen failed with a node, while its requeue is awaited."""

    def __init__(
        self, job: str, launch_dir: str | Path, view: LiveView, poll_s: float, offset: int = 0
    ) -> None:
        self.job = job
        self.launch_dir = Path(launch_dir)
        self.view = view
        self.poll_s = poll_s
        self.offset = offset
        self.shown = ""
        self.cancelled_by_us = False
        self.nodes_seen = ""
        self.lost_batch_node = ""
        self.ran = False
        self.node_failed_at = None

    @property
    def output(self) -> Path:
        return self.launch_dir / BATCH_OUTPUT.format(job=self.job)

    def follow(self) -> int:
        """Poll until the job ends; its launcher's exit code. Ctrl-C (TERM, HUP) cancels the job."""
        try:
            return self._until_end()
        except KeyboardInterrupt:
            self.cancel("interrupted")
            return exitcodes.INTERRUPTED

    def cancel(self, why: str) -> None:
        """scancel of the job, said so; its end (or CANCEL_END_S) waited for, its last lines shown."""
        self.cancelled_by_us = True
        try:
            slurm("scancel", self.job)
        except SlurmError as err:
            self.view.message(f"[red]{why}: scancel {self.job} failed[/red]: {node_text(str(err))}")
            return
        self.view.message(f"[yellow]{why}[/yellow]: Slurm job {self.job} cancelled (scancel {self.job})")
        deadline = time.monotonic() + CANCEL_END_S
        try:
            while time.monotonic() < deadline:
                self._print_new()
                if job_state(self.job).final:
                    break
                time.sleep(self.poll_s)
            self._print_new(final=True)
        except (KeyboardInterrupt, SlurmError):
            pass  # a second Ctrl-C: the job is cancelled already

    def _until_end(self) -> int:
        while True:
            try:
                state = job_state(self.job)
            except SlurmError as err:
                # slurmctld busy or restarting: said once, asked again at the next poll.
                self._say(
                    f"[yellow]Slurm job {self.job}: squeue failed[/yellow] ({node_text(str(err))}); retrying"
                )
                time.sleep(self.poll_s)
                continue
            self._print_new()
            self._say_state(state)
            if state.final and not self._requeue_coming(state):
                self._print_new(final=True)
                return self._ended(state)
            self._note_requeue(state)
            if (lost := self._batch_node_lost(state)) is not None:
                return self._without_its_batch_node(lost)
            time.sleep(self.poll_s)

    def _requeue_coming(self, state: JobState) -> bool:
        """A job failed with a node (NODE_FAIL) that allows a requeue: Slurm puts it back in the queue a
        moment later, with its id (followed on); for REQUEUE_WAIT_S at most. One scontrol call a poll,
        while it shows that state only."""
        if state.state != "NODE_FAIL":
            self.node_failed_at = None
            return False
        now = time.monotonic()
        self.node_failed_at = self.node_failed_at or now
        if now - self.node_failed_at > REQUEUE_WAIT_S:
            return False
        try:
            return requeue_blocker(self.job) is None
        except SlurmError:
            return True  # asked again at the next poll

    def _note_requeue(self, state: JobState) -> None:
        """Once a job that ran is back in the queue: what happens next, in one line."""
        if state.state == "RUNNING":
            self.ran = True
        elif self.ran and state.state in QUEUED_STATES:
            self.ran = False
            reason = f" ({node_text(state.reason)})" if state.reason and state.reason != "None" else ""
            self.view.message(
                f"[yellow]Slurm requeued job {self.job}[/yellow]{reason}: it runs its script again once "
                "Slurm gives it nodes, and the run resumes from its latest checkpoint (Ctrl-C cancels "
                "the job)"
            )

    def _batch_node_lost(self, state: JobState) -> str | None:
        """The job's batch node once Slurm has taken it out of the running job (marked DOWN), else None.

        The launcher in the job runs on that node: with it gone the job cannot go on, yet a job that
        asked for --no-kill (--exclude-failed) stays RUNNING on its other nodes for ever. One scontrol
        call each time the job's nodes change, none otherwise."""
        if (
            state.state != "RUNNING"
            or not state.batch_host
            or not state.nodes
            or state.nodes == self.nodes_seen
        ):
            return None
        self.nodes_seen = state.nodes
        try:
            names = slurm("scontrol", "show", "hostnames", state.nodes).split()
        except SlurmError:
            return None  # asked again when the nodes change again
        return state.batch_host if names and state.batch_host not in names else None

    def _without_its_batch_node(self, host: str) -> int:
        """The job lost the node its launcher ran on: said, the job cancelled, NODE_LOST (the caller
        resubmits the run without it, or says how to go on)."""
        self.lost_batch_node = host
        self._print_new(final=True)
        self.view.message(
            f"[red]failed[/red]: {node_text(host)} was lost: Slurm took it out of job {self.job}, and the "
            "job's trainer launch ran there (its batch node); the job cannot go on without it"
        )
        self.cancel("the job's batch node was lost")
        return exitcodes.NODE_LOST

    def _say_state(self, state: JobState) -> None:
        # A line per change of state (or of the reason it waits), not one per poll.
        self._say(node_text(f"Slurm job {self.job}: {state.describe()}"))

    def _say(self, line: str) -> None:
        if line != self.shown:
            self.shown = line
            self.view.message(line)

    def _print_new(self, final: bool = False) -> None:
        """The output's new whole lines (and, at the end, a last line without its newline)."""
        try:
            with open(self.output, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read(READ_CHUNK)
        except FileNotFoundError:
            return
        end = len(data) if final else data.rfind(b"\n") + 1
        for line in data[:end].decode(errors="replace").splitlines():
            self.view.log(line)
        self.offset += end

    def _ended(self, state: JobState) -> int:
        """The exit code of an ended job: its launcher's own, else Slurm's state for it."""
        code = exit_code_of(self.launch_dir, self.job)
        deadline = time.monotonic() + EXIT_FILE_WAIT_S
        while code is None and state.state != "CANCELLED" and time.monotonic() < deadline:
            # Written just before the job ended: a shared dir's attribute cache may show it late here.
            time.sleep(0.5)
            code = exit_code_of(self.launch_dir, self.job)
        if code is not None:
            self.view.message(
                f"Slurm job {self.job} ended ({state.describe()}); trainer launch in it exited {code}"
            )
            return code
        if state.state == "CANCELLED" or self.cancelled_by_us:
            self.view.message(
                f"[yellow]Slurm job {self.job} was cancelled[/yellow] (scancel: trainer stop, Ctrl-C, or by "
                "hand) before trainer launch in it ended"
            )
            return exitcodes.INTERRUPTED
        self.view.message(
            f"[red]Slurm job {self.job} ended {node_text(state.describe())}[/red] without trainer launch's "
            f"exit code; the job's output: {self.output}"
        )
        return exitcodes.FAILURE


def relaunch_advice(host: str) -> str:
    """How to go on after the job lost its batch node `host` and was not resubmitted."""
    return (
        f"run the same `trainer launch --slurm` again to resume from the latest checkpoint without "
        f"{node_text(host)} (Slurm places no job on a DOWN node; give --nodes where fewer are left)"
    )


def cancel_job(job: str) -> bool:
    """scancel of a live job; False when Slurm no longer had it."""
    try:
        slurm("scancel", job)
    except SlurmError as err:
        if "Invalid job id" in str(err):
            return False
        raise
    return True


def wait_for_end(job: str, timeout_s: float) -> JobState:
    """The job's state once it ended, or the last seen after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    state = job_state(job)
    while state.live and time.monotonic() < deadline:
        time.sleep(0.5)
        state = job_state(job)
    return state


def describe_submitted(record: SubmittedJob, state: JobState | None) -> str:
    """One line on the run's job for `trainer status`."""
    stamp = time.localtime(record.submitted_at)
    when = time.strftime("%Y-%m-%d %H:%M:%S", stamp) if record.submitted_at else "?"
    shown = state.describe() if state is not None else "state unknown"
    return printable(
        f"Slurm job {record.job}, submitted {when} from {record.host} (trainer launch --slurm, pid "
        f"{record.follower_pid}): {shown}"
    )


def summary(record: SubmittedJob, state: JobState | None) -> dict[str, Any]:
    """The job for `trainer status --json`."""
    if state is None:
        return {**asdict(record), "state": None, "reason": None}
    return {**asdict(record), "state": state.state, "reason": state.reason}


@dataclass(frozen=True)
class CurrentJob:
    """The run's job from a login node, where it is the run's latest: live, or its step the latest."""

    record: SubmittedJob
    """slurm-job.json: the job, and where and by whom it was submitted."""
    state: JobState | None
    """Slurm's word (one squeue call); None where Slurm did not answer."""
    step: SlurmRecord | None
    """The guest launcher's step record (slurm.json) when it is this job's; None before it runs."""

    @property
    def live(self) -> bool:
        return self.state is None or self.state.live


def current_job(plan: JobPlan) -> CurrentJob | None:
    """The run's job submitted from a login node, or None where there is none, or it is older than the
    run's latest launch (neither live nor the job of the latest Slurm step)."""
    record = SubmittedJob.read(plan.launch_dir)
    if record is None:
        return None
    try:
        state: JobState | None = job_state(record.job)
    except SlurmError:
        state = None
    step = slurm_launch(plan)
    ours = step if step is not None and step.job == record.job else None
    if ours is None and state is not None and not state.live:
        return None
    return CurrentJob(record, state, ours)


def tail_offset(path: Path, lines: int) -> int:
    """Where the last `lines` lines of `path` start (0 for a short or missing file)."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - READ_CHUNK)
            handle.seek(start)
            data = handle.read()
    except OSError:
        return 0
    cut = len(data) - 1 if data.endswith(b"\n") else len(data)
    for _ in range(lines):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            return start
    return start + cut + 1
