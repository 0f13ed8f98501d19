"""A rank's exit record is written by the job: whatever it holds, the failure report is made, and a
malformed record is noted and ignored (a `"time": "soon"` raised ValueError in the diagnosis, before
the stop). tests/local/test_launch_stop_unconditional_local.py runs the job that writes one."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from trainer.controller.launcher.failure import diagnose, render
from trainer.controller.launcher.live import JobMonitor, LiveView

MALFORMED = [
    {"rank": 1, "time": "soon", "code": 3},
    {"rank": "one", "code": 3},
    {"rank": 1, "code": "three"},
    {"rank": 1, "time": float("nan")},
    {"rank": 1, "message": ["not", "text"]},
    "not a record",
]


@pytest.mark.parametrize("record", MALFORMED, ids=repr)
def test_a_malformed_exit_record_is_noted_and_the_node_exit_is_the_cause(record):
    out = io.StringIO()
    with LiveView(Console(file=out, force_terminal=False, width=300)) as view:
        monitor = JobMonitor({"head": 0, "w1": 1}, "head", view)
        monitor.on_message({"host": "head", "type": "report", "report": {"state": "running", "lines": []}})
        report = {
            "state": "exited",
            "exit": {"exit_code": 3, "time": 1000.0},
            "lines": [],
            "rank_exits": [record],
            "errors": [{"local_rank": "x", "timestamp": "later", "message": "boom"}],
        }
        monitor.on_message({"host": "w1", "type": "report", "report": report})
        diagnosis = diagnose(monitor, bundled=False, now=2000.0)
        assert diagnosis is not None and diagnosis.cause.host == "w1" and diagnosis.code == 3
        render(diagnosis, monitor, view)
    shown = out.getvalue()
    assert "w1 (node 1) exited with code 3" in shown, shown
    assert (
        "ignored a malformed exit record of w1" in shown and "ignored a malformed error file of w1" in shown
    )
