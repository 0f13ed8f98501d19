"""Each rank's progress, for the launcher's stall watchdog, and its stack when the launcher asks.

Under `trainer launch`, run.sh sets CLUSTERTRAIN_PROGRESS_DIR (`<run>/launch/node-N/progress`). Each
rank then keeps `rank-R.json` there: the step it is in (`started`) and the last one it finished
(`done`). A background thread writes the file when they change, at most once a second, so a step
costs two assignments. The launcher reads the files with each poll; when no rank advances for
--stall-timeout seconds it stops the job and names the ranks that were behind (a rank still in step
k while its peers wait in step k+1's collective). The rank also registers faulthandler on SIGUSR1,
writing every thread's Python stack to `stack-R.txt` there: the launcher asks for it after a stall,
without ptrace and without root.

The record also says how long steps take and what the rank does between them, for a watchdog that
adapts to the job (issue 39): `slowest_step_s`, the longest step of this run after its first (the
first holds the warm-up: a compile, the first allocation), and `phase`, `train` or an announced
pause (`eval`, `checkpoint`) with `phase_since`, so an evaluation or a save on a slow share is never
taken for a hang. And whether a step that lasts computes: where no step begins or ends for
BUSY_SAMPLE_S, the writer samples the training thread's CPU clock and writes `busy_share`, the share
of that time it spent on a CPU. A rank computing a legitimately slow step keeps it high; a rank that
sleeps, waits in a gloo collective or is stopped does not (a stopped rank writes nothing at all). The
launcher holds its adaptive bound while a rank computes (launcher/stall.py). `device` says whether the
rank trains on a GPU, where a rank waiting for its GPU spins on the CPU and the share tells less.
With the same sample, `collectives`: per process group, the last collective the rank entered and the
last that ended, from torch's flight recorder (flight_recorder.py), so that at a stall the launcher
names the rank that never entered the collective its peers wait in, within one step as well.

Without CLUSTERTRAIN_PROGRESS_DIR (a run by hand) nothing is written.

Test hooks: TRAINER_TEST_STALL=RANK:STEP[:SECONDS] makes global rank RANK sleep SECONDS (default 3600)
before it starts step STEP, as a rank stuck outside a collective would be; TRAINER_TEST_RAISE=RANK:STEP
makes it raise a RuntimeError there instead, as a rank hitting a bug would (the launcher's root-cause
report is tested with it); TRAINER_TEST_COMPUTE=RANK:STEP:SECONDS makes it compute (a busy loop on its
training thread) for SECONDS before it starts step STEP, as a legitimately slow step would;
TRAINER_TEST_STALL_IN=RANK:STEP[:SECONDS] makes it sleep once it started step STEP, before the step's
collectives, as a rank whose data loader never answers would (every rank's record says step STEP).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import IO, Any

from trainer.node.flight_recorder import last_collectives
from trainer.safe_files import umask_mode, write_file

DIRECTORY_VARIABLE = "CLUSTERTRAIN_PROGRESS_DIR"
STALL_VARIABLE = "TRAINER_TEST_STALL"
RAISE_VARIABLE = "TRAINER_TEST_RAISE"
COMPUTE_VARIABLE = "TRAINER_TEST_COMPUTE"
STALL_IN_VARIABLE = "TRAINER_TEST_STALL_IN"
#: Seconds between two writes of a rank's file at most.
WRITE_INTERVAL_S = 1.0
#: A step (or pause) longer than this gets its training thread's CPU share sampled and written, once
#: every this many seconds (a run of short steps never pays for it).
BUSY_SAMPLE_S = 5.0


class ThreadClock:
    """The share of wall time one thread spent on a CPU between two samples (its POSIX CPU clock)."""

    def __init__(self) -> None:
        self.ident: int | None = None
        self._last: tuple[float, float] | None = None

    def _now(self) -> tuple[float, float] | None:
        if self.ident is None:
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.ident)), time.monotonic()
        except (OSError, AttributeError, OverflowError):  # the thread ended; a platform without it
            return None

    def restart(self) -> None:
        """From now on (a step began or ended: the last sample's time is not this step's)."""
        self._last = self._now()

    def share(self) -> float | None:
        """CPU seconds over wall seconds since the last sample (or restart); None without one."""
        now, last = self._now(), self._last
        self._last = now
        if now is None or last is None or now[1] <= last[1]:
            return None
        return max(0.0, (now[0] - last[0]) / (now[1] - last[1]))


class Progress:
    def __init__(self, directory: Path | None, rank: int, local_rank: int = 0, device: str = "cpu") -> None:
        self.directory = directory
        self.rank = rank
        self.local_rank = local_rank
        self.device = device
        #: The training thread's CPU share over the last BUSY_SAMPLE_S of a step that lasts (None: no
        #: sample since the last step began or ended).
        self.busy_share: float | None = None
        #: Per process group, the last collective entered and ended (flight_recorder.last_collectives),
        #: sampled with `busy_share`.
        self.collectives: dict[str, dict[str, Any]] | None = None
        self._clock = ThreadClock()
        self.started_step: int | None = None
        self.done_step: int | None = None
        #: The longest step of this run after its first, in seconds (None before the second is done).
        self.slowest_step_s: float | None = None
        #: `train`, or an announced pause (`eval`, `checkpoint`), since `phase_since` (epoch seconds).
        self.phase = "train"
        self.phase_since = time.time()
        self._step_started_at: float | None = None
        self._steps_done = 0
        self._stall = _parse_stall(os.environ.get(STALL_VARIABLE, ""), rank)
        self._raise = _parse_stall(os.environ.get(RAISE_VARIABLE, ""), rank)
        self._compute = _parse_stall(os.environ.get(COMPUTE_VARIABLE, ""), rank)
        self._stall_in = _parse_stall(os.environ.get(STALL_IN_VARIABLE, ""), rank)
        self._wake = threading.Event()
        self._write_lock = threading.Lock()
        self._closed = False
        self._stack_file: IO[str] | None = None
        self._thread: threading.Thread | None = None
        if directory is None:
            return
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._stack_file = open(directory / f"stack-{rank}.txt", "a")  # noqa: SIM115 - open for the run
            faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)
        except (OSError, RuntimeError, ValueError):
            self._stack_file = None
        self._write()
        self._thread = threading.Thread(target=self._writer, name="progress", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, rank: int, local_rank: int = 0, device: str = "cpu") -> Progress:
        raw = os.environ.get(DIRECTORY_VARIABLE, "")
        return cls(Path(raw) if raw else None, rank, local_rank, device)

    def started(self, step: int) -> None:
        """Called as the rank starts `step` (trainer.node.loop.Trainer.on_step_start)."""
        self._clock.ident = threading.get_ident()  # the thread that trains: its CPU clock is sampled
        self._test_hook(self._compute, step, "computes", "before", COMPUTE_VARIABLE, _busy_for)
        self._test_hook(self._stall, step, "sleeps", "before", STALL_VARIABLE, time.sleep)
        if self._raise is not None and step == self._raise[0]:
            raise RuntimeError(f"rank {self.rank} raises before step {step} ({RAISE_VARIABLE} test hook)")
        self.started_step = step
        self._step_started_at = time.monotonic()
        self._wake.set()
        self._test_hook(self._stall_in, step, "sleeps", "in", STALL_IN_VARIABLE, time.sleep)

    def _test_hook(
        self, hook: tuple[int, float] | None, step: int, does: str, where: str, variable: str, act: Any
    ) -> None:
        """A test hook's `act` for its seconds where `step` is its step, said first."""
        if hook is not None and step == hook[0]:
            said = f"trainer: rank {self.rank} {does} {hook[1]:g} s {where} step {step} ({variable})"
            print(said, flush=True)
            act(hook[1])

    def step_done(self, result: Any) -> None:
        """A per-step hook (trainer.node.loop.StepHook): the step is done; never stops the run."""
        self.done_step = result.step
        self._steps_done += 1
        if self._step_started_at is not None and self._steps_done > 1:
            took = time.monotonic() - self._step_started_at
            self.slowest_step_s = max(self.slowest_step_s or 0.0, took)
        self._wake.set()
        return None

    @contextlib.contextmanager
    def announced(self, phase: str):
        """An announced pause between steps (`eval`, `checkpoint`): written at once, so the watchdog
        gives it a bound of its own instead of the steps' (trainer.node.loop.Trainer.announce)."""
        self.phase, self.phase_since = phase, time.time()
        self._write()
        try:
            yield
        finally:
            self.phase, self.phase_since = "train", time.time()
            self._wake.set()

    def record(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": self.started_step,
            "done": self.done_step,
            "slowest_step_s": None if self.slowest_step_s is None else round(self.slowest_step_s, 3),
            "phase": self.phase,
            "phase_since": self.phase_since,
            "busy_share": None if self.busy_share is None else round(self.busy_share, 3),
            "collectives": self.collectives,
            "device": self.device,
            "time": time.time(),
            "stack_signal": "SIGUSR1" if self._stack_file is not None else None,
            "stack_file": str(self.directory / f"stack-{self.rank}.txt") if self._stack_file else None,
        }

    def _write(self) -> None:
        if self.directory is None:
            return
        target = self.directory / f"rank-{self.rank}.json"
        # An error is let go: the watchdog sees no progress from this rank; training goes on. One writer
        # at a time, the record read inside: the background writer's older record, read before an
        # announced pause began, must not land after the pause's own write.
        with self._write_lock, contextlib.suppress(OSError):
            # Exclusively, never through a link (trainer.safe_files): the dir is on the share.
            write_file(target, json.dumps(self.record()), umask_mode())

    def _writer(self) -> None:
        written: tuple = ()
        while not self._closed:
            woken = self._wake.wait(timeout=BUSY_SAMPLE_S)
            self._wake.clear()
            if (self.started_step, self.done_step, self.phase) != written:
                written = (self.started_step, self.done_step, self.phase)
                self.busy_share, self.collectives = None, None
                self._clock.restart()
                self._write()
            elif not woken and not self._closed:
                # Nothing began or ended for BUSY_SAMPLE_S: whether the training thread computes. Written
                # every time, so the launcher sees the sample is fresh (a stopped rank writes none).
                self.busy_share = self._clock.share()
                self.collectives = last_collectives()
                self._write()
            time.sleep(WRITE_INTERVAL_S)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self.directory is not None:
            self._write()
        if self._stack_file is not None:
            try:
                faulthandler.unregister(signal.SIGUSR1)
            finally:
                self._stack_file.close()


def _busy_for(seconds: float) -> None:
    """TRAINER_TEST_COMPUTE: keep this thread on the CPU for `seconds` of wall time."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(20_000))


def _parse_stall(value: str, rank: int) -> tuple[int, float] | None:
    """TRAINER_TEST_STALL (and _RAISE, _COMPUTE, _STALL_IN) for this rank: (step, seconds), or None."""
    parts = value.split(":") if value else []
    try:
        if len(parts) >= 2 and int(parts[0]) == rank:
            return int(parts[1]), float(parts[2]) if len(parts) > 2 else 3600.0
    except ValueError:
        pass
    return None
