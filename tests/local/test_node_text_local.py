"""Text the training account writes on the head reaches the operator's terminal as text.

On a one-node loopback cluster the job leaves a lock whose holder fields carry rich markup (a stray
`[/red]`, a `[link=...]`), an OSC 8 hyperlink and a time that is not one, and a run dir whose name
carries markup and an escape sequence, and launch.json's nodes are not host -> rank. `trainer stop`
and `trainer logs` run for real: neither fails on that text (a stray `[/red]` raised rich's
MarkupError, a `"taken_at": "soon"` ValueError, a rank that is not a number another), the stop stops
the node, no escape sequence reaches the output, and the markup shows as typed."""

from __future__ import annotations

import json
import socket

from helpers.fake_launch import fake_launch, one_node_cluster, trainer

from trainer.joblock import machine_id

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

LINK = "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\"
HOLDER = {
    "token": "planted",
    "pid": 2**22 + 7,  # no such process: a dead holder on this controller, so stop names it
    "pid_start": 1,
    "controller": socket.gethostname(),
    "machine": machine_id(),
    "user": f"[/red]{LINK}",
    "command": "[link=https://evil.example/]trainer launch[/link]",
    "taken_at": "soon",
}
RUN_DIR_NAME = "[bold]run\x1b[2J"  # a file name holds no "/": no closing tag here


def test_lock_fields_and_run_dir_names_from_the_head_are_shown_as_text(tmp_path):
    inventory, shared = one_node_cluster(tmp_path)
    launch = fake_launch(shared, "hostile", "step 1\n")
    try:
        (launch.node_dir.parent / "lock").write_text(json.dumps(HOLDER))
        info = json.loads((launch.node_dir / "launch.json").read_text())
        (launch.node_dir / "launch.json").write_text(json.dumps({**info, "nodes": {"node0": "zero"}}))
        (shared / "runs" / RUN_DIR_NAME / "launch").mkdir(parents=True)
        stop = trainer("stop", inventory, "--run-name", "hostile", "--stop-grace", "5")
        assert launch.process.wait(timeout=30) == -15, stop.stdout + stop.stderr
        logs = trainer("logs", inventory, "--run-name", "nothere")
    finally:
        if launch.process.poll() is None:
            launch.process.kill()
            launch.process.wait()
    assert stop.returncode == 0, stop.stdout + stop.stderr
    shown = stop.stdout + stop.stderr
    assert "launch.json on the head names no nodes" in shown and "[node0] node 0: stopped" in shown, shown
    assert "stays locked by [link=https://evil.example/]trainer launch[/link] pid" in shown, shown
    assert "(user [/red]\\x1b]8;;https://evil.example/\\x1b\\click" in shown, shown
    assert logs.returncode == 2, logs.stdout + logs.stderr
    assert "runs launched there: [bold]run\\x1b[2J" in logs.stderr, logs.stderr
    for done in (stop, logs):
        assert "\x1b" not in done.stdout + done.stderr and "Traceback" not in done.stderr, done.stderr
