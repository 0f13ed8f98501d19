"""`trainer launch` names the rank whose exception ended the job, from torchrun's error files: the
trainer's entry point is wrapped in torch's `@record` and torchrun gets `--log-dir` under each node's
dir, so the failing rank's exception, its host and its last frame come from `error.json`, not from a
regex over torchrun's text. Two loopback "hosts" (test_launch_local's fixture); rank 1 raises before
step 3 through the trainer's test hook TRAINER_TEST_RAISE (trainer.node.progress)."""

from __future__ import annotations

import json
import subprocess

import pytest
from test_launch_local import TINY, launch_command
from test_launch_local import loopback_cluster as _loopback_cluster  # noqa: F401 - the fixture, by its name

from trainer.controller.launcher.live import JobMonitor, LiveView, root_cause


@pytest.mark.slow
def test_a_rank_that_raises_is_named_with_its_exception_host_and_last_frame(request):
    inventory, shared = request.getfixturevalue("_loopback_cluster")
    done = subprocess.run(
        launch_command(
            inventory,
            "--run-name",
            "raises",
            "--env",
            "TRAINER_TEST_RAISE=1:3",  # rank 1 (node1) raises before step 3
            "--set",
            "train.max_steps=40",
            *TINY,
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "first failure on host node1 (node 1, rank 1)" in out, out
    assert (
        "root cause: rank 1 on node1 (node 1) raised RuntimeError: rank 1 raises before step 3 "
        "(TRAINER_TEST_RAISE test hook); last frame: File " in out
    ), out
    assert "progress.py" in out.split("root cause:")[1].split("\n")[0], "the last frame is the raising one"
    # The evidence stays with node1's logs: this launch's error file under torchrun's --log-dir.
    launch_id = json.loads((shared / "runs" / "raises" / "launch" / "node-1" / "launch.json").read_text())[
        "launch_id"
    ]
    files = list(
        (shared / "runs" / "raises" / "launch" / "node-1" / "torchrun").glob(f"{launch_id}_*/*/0/error.json")
    )
    assert len(files) == 1, files
    assert str(files[0]) in out, "the report points at the error file"
    assert json.loads(files[0].read_text())["message"]["message"].startswith("RuntimeError: rank 1 raises")
    # The stop record names the cause too (history.jsonl: what a restart or a later reader sees).
    history = [json.loads(line) for line in (shared / "runs" / "raises" / "launch" / "history.jsonl").open()]
    assert "rank 1 raised RuntimeError" in history[-1]["detail"], history[-1]


def test_the_rank_that_raised_is_the_root_cause_not_the_peer_that_lost_it():
    """A rank whose peer died raises too (gloo's "Connection closed by peer"), in the same second or
    even first by the clock: the launcher names the rank that raised on its own."""
    monitor = JobMonitor(
        {"node0": 0, "node1": 1}, "node0", LiveView(), ranks={"node0": range(0, 2), "node1": range(2, 4)}
    )
    victim = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29583"
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "/venv/trainer/node/loop.py", line 120, in step\n'
        "    loss = self.engine.step(batch)\n"
        '  File "/venv/trainer/node/model.py", line 88, in forward\n'
        '    raise ValueError("bad shape")\n'
        "ValueError: bad shape\n"
    )
    for host, state, errors in (
        ("node0", 1, [{"local_rank": 0, "message": victim, "traceback": "", "timestamp": 100, "file": "/a"}]),
        (
            "node1",
            1,
            [
                {
                    "local_rank": 1,
                    "message": "ValueError: bad shape",
                    "traceback": traceback,
                    "timestamp": 101,
                    "file": "/b",
                }
            ],
        ),
    ):
        monitor.apply(
            monitor.hosts[host], {"state": "exited", "exit": {"exit_code": state}, "errors": errors}
        )
    cause = root_cause(monitor)
    assert cause is not None and (cause.host, cause.rank) == ("node1", 3)
    assert cause.describe() == (
        "rank 3 on node1 (node 1) raised ValueError: bad shape; last frame: "
        'File "/venv/trainer/node/model.py", line 88, in forward: raise ValueError("bad shape") '
        "(traceback in /b)"
    )
