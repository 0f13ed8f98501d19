"""`trainer status` shows a node's log lines as the live view does: control characters spelled out, so
a rank (or anyone who can write the node's log) cannot clear the operator's screen, move the cursor,
recolour or erase what is shown. Real `trainer status` on a one-node loopback cluster."""

from __future__ import annotations

from helpers.fake_launch import fake_launch, one_node_cluster, trainer

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

#: Clear the screen, home the cursor, a red "done", backspaces over it and the terminal's bell. (A
#: carriage return is a line break to the node's helper, as a newline is: it fakes nothing more.)
HOSTILE = "step 3 \x1b[2J\x1b[H\x1b[31mdone\x1b[0m\x08\x08 all nodes finished\x07\n"
#: The same line as `trainer status` must show it.
SHOWN = "    step 3 \\x1b[2J\\x1b[H\\x1b[31mdone\\x1b[0m\\x08\\x08 all nodes finished\\x07"


def test_status_spells_out_escape_sequences_of_a_nodes_log(tmp_path):
    inventory, shared = one_node_cluster(tmp_path)
    launch = fake_launch(shared, "ansi", "loading the model\n" + HOSTILE)
    try:
        done = trainer("status", inventory, "--run-name", "ansi")
    finally:
        launch.process.kill()
        launch.process.wait()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[node0] node 0: running" in done.stdout, done.stdout
    # The line is there, readable, and holds no control character that a terminal would act on.
    assert SHOWN in done.stdout.splitlines(), done.stdout
    assert not [c for c in done.stdout if ord(c) < 0x20 and c != "\n"], repr(done.stdout)
