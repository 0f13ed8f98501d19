"""A user's command gone quiet, checked for a hang while it runs (issue 39).

A user's command writes no progress records: the launcher knows it works by its lines and by what its
ranks use (each quiet poll's `activity`, node_ctl.activity: CPU time, bytes read and written). Quiet
for a minute (live.JobMonitor's suspect) is not yet a hang: a job may wait on something on purpose.
So every node's ranks' process states and Python stacks, and each node's reach of its peers, are
read (states.yml, on a thread of its own: the follow goes on meanwhile), and only a culprit makes it
a stall, then stopped and reported as any stall is: a rank stopped, blocked in the kernel or gone, one
outside the collective its peers wait in or in another collective than theirs (hang.py), or a node
its peers cannot reach while SSH works. Without one the command goes on being followed, and the
launcher says so; only the ceiling's quiet (600 s) is a stall without a culprit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from trainer.controller.launcher.failure import stall_hang, stall_partition
from trainer.controller.launcher.live import JobMonitor, LiveView
from trainer.controller.runner import PlaybookResult


class HangCheck:
    """The check of one attempt's quiet spells (attempt_events.QuietCheck), one read at a time.
    `read_states` runs states.yml and returns its result (on the check's thread); `apply_states` takes
    that result into the monitor (on the attempt's thread, as every report is)."""

    def __init__(
        self,
        read_states: Callable[[], PlaybookResult],
        apply_states: Callable[[PlaybookResult], None],
        view: LiveView,
    ) -> None:
        self.read_states = read_states
        self.apply_states = apply_states
        self.view = view
        self._thread: threading.Thread | None = None
        self._result: PlaybookResult | None = None
        self._error = ""

    def on_tick(self, monitor: JobMonitor) -> None:
        suspect = monitor.suspect
        if suspect is None or monitor.stall is not None:
            return
        if self._thread is None:
            self._result, self._error = None, ""
            self._thread = threading.Thread(target=self._read, name="hang-check", daemon=True)
            self._thread.start()
            self.view.message(
                f"quiet: {suspect.summary} (bound: {suspect.bound}); reading each rank's process state "
                "and Python stack while it runs"
            )
            return
        if self._thread.is_alive():
            return
        self._thread = None
        if self._result is None:
            self.view.log(f"trainer launch: the quiet command's states could not be read: {self._error}")
            monitor.dismiss_suspect()
            return
        self.apply_states(self._result)
        if not monitor.still_quiet:
            monitor.dismiss_suspect()  # it printed or worked again while its states were read
            return
        if stall_hang(monitor) is not None or stall_partition(monitor) is not None:
            monitor.confirm_suspect()  # the stop names the culprit (launch.Launcher._stop_failed)
            return
        monitor.dismiss_suspect()
        self.view.message(
            "no culprit: no rank is stopped, blocked, gone or outside the collective its peers wait in, "
            f"and every node reaches its peers; still following (a stall only after "
            f"{monitor.stall_timeout_s:g} s of quiet)"
        )

    def close(self, timeout_s: float = 120.0) -> None:
        """The attempt's follow ended: wait for a states read under way (one playbook run, its own
        timeouts), so no playbook of this attempt outlives it."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _read(self) -> None:
        try:
            self._result = self.read_states()
        except Exception as err:  # said on the attempt's thread; the follow goes on
            self._error = repr(err)
