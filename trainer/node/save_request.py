"""SIGUSR2 to a rank: write a checkpoint at the end of this step, then stop (exit STOPPED_AT_CHECKPOINT).

A scheduler warns a job before it ends it: Slurm's `--signal=USR2@SECONDS` (`trainer sbatch` asks for
it) sends SIGUSR2 to every process of the job's steps SECONDS before the time limit, and `scancel
--signal=USR2` does it by hand, before a preemption. Without this, the steps since the last periodic
checkpoint are lost when the job is killed.

A module of its own because the handler must do almost nothing: Python runs it on the main thread
between two bytecodes of whatever the rank is doing (a collective, a save), so it only sets a flag.
The step loop reads the flag through a per-step check (`hook`, a trainer.node.loop.StepHook) whose
code every rank votes on (loop._StopVote: the highest code any rank raised), so one rank receiving
the signal is enough, and every rank saves at the same step and stops there. `signal.siginterrupt
(SIGUSR2, False)` restarts a system call the signal lands in (a socket read of gloo, a file write)
instead of failing it with EINTR in some thread of the rank. SIGUSR1 is taken: trainer.node.progress
registers faulthandler on it for the launcher's stack dumps.

run.sh ignores SIGUSR2 before it starts torchrun (runscript.py), so the shell and torchrun survive it
and a rank ignores it until `install` runs: a signal that comes before the loop is lost, not fatal.
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING

from trainer import exitcodes

if TYPE_CHECKING:
    from trainer.node.loop import StepResult

SIGNAL = signal.SIGUSR2

#: Set by the handler: this rank was asked to save and stop.
_requested = False


def install() -> None:
    """Take SIGUSR2 in this process (the main thread only: Python allows no handler elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(SIGNAL, _on_signal)
    signal.siginterrupt(SIGNAL, False)


def _on_signal(signum: int, frame: object) -> None:
    global _requested
    _requested = True


def requested() -> bool:
    """Whether this rank received the signal (another rank's request stops it too, by the vote)."""
    return _requested


def hook(result: StepResult) -> int | None:
    """The per-step check: STOPPED_AT_CHECKPOINT once the signal came, else None (go on)."""
    return exitcodes.STOPPED_AT_CHECKPOINT if _requested else None


def clear() -> None:
    """Forget a request (a test that trains twice in one process)."""
    global _requested
    _requested = False
