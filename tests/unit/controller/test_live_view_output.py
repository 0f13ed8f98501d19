"""What a node prints reaches the operator's terminal as text: escape sequences in a rank's log cannot
clear the screen, retitle the window, move the cursor or fake a line."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from trainer.controller.launcher.live import JobMonitor, LiveView

HOSTILE = [
    "step 1/10 loss 4.2\x1b[2J\x1b[H",  # clear the screen, cursor home
    "\x1b]0;owned\x07hello",  # set the window title
    "loss ok\rstep 10/10 done: all good",  # carriage return: overwrite the line with a fake one
    "csi \x9b31m in C1 form",
]


@pytest.mark.parametrize("terminal", [True, False])
def test_escape_sequences_in_a_rank_log_are_shown_as_text(terminal):
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=200, color_system=None)
    with LiveView(console) as view:
        monitor = JobMonitor({"head": 0, "w1": 1}, "head", view)
        monitor.on_message(
            {"host": "head", "type": "report", "report": {"state": "running", "lines": HOSTILE}}
        )
        monitor.on_message({"host": "w1", "type": "report", "report": {"state": "running", "lines": HOSTILE}})
    shown = out.getvalue()
    # (Rich's own live table uses \r and cursor moves of its own: the rank's sequences are the test.)
    for sequence in ("\x1b[2J\x1b[H", "\x1b]0;", "\x07", "\rstep 10/10", "\x9b"):
        assert sequence not in shown, f"{sequence!r} reached the terminal"
    assert "step 1/10 loss 4.2\\x1b[2J\\x1b[H" in shown  # the text is kept, readable
    assert "loss ok\\x0dstep 10/10 done: all good" in shown
    # The failure report shows a host's last lines: they are stored spelled out too.
    assert list(monitor.hosts["w1"].lines)[1] == "\\x1b]0;owned\\x07hello"
    if not terminal:
        assert "\x1b" not in shown


def test_an_unreachable_message_with_escapes_is_shown_as_text():
    out = io.StringIO()
    with LiveView(Console(file=out, force_terminal=False, width=200)) as view:
        monitor = JobMonitor({"head": 0}, "head", view)
        monitor.on_unreachable("head", "ssh: \x1b[31mfake\x1b[0m refused\nsecond line")
    assert monitor.hosts["head"].detail == "ssh: \\x1b[31mfake\\x1b[0m refused"
    assert "\x1b" not in out.getvalue()
