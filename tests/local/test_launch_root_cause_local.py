"""`trainer launch` names the first cause of a failure with its own exit code, and labels what followed
as consequence. Each rank of the bundled trainer writes its own exit record (trainer.node.exit_record:
its code and one-line reason; torchrun's own code is 1 whatever its workers' were), and its entry
point is wrapped in torch's `@record` with torchrun's `--log-dir` under each node's dir, so the failing
rank's exception, host and last frame come from files, not from a regex over torchrun's text. Two
loopback "hosts" (helpers/loopback_launch's fixture); rank 1 raises before step 3 through the trainer's test
hook TRAINER_TEST_RAISE (trainer.node.progress); bad data fails every rank with exit 2."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from helpers.loopback_launch import TINY, launch_command
from helpers.loopback_launch import loopback_cluster as _loopback_cluster  # noqa: F401 - the fixture, by its name

from trainer import exitcodes
from trainer.controller.launcher.failure import diagnose
from trainer.controller.launcher.live import SILENT_LOSS_S, JobMonitor, LiveView

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False


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
    # The cause's one line first: its message, where, its own code; then where the traceback is.
    report = out[out.index("\nfailed: ") + 1 :].splitlines()
    assert report[0] == (
        "failed: RuntimeError: rank 1 raises before step 3 (TRAINER_TEST_RAISE test hook) "
        "(rank 1 on node1 (node 1), exit code 1)"
    ), out
    assert report[1].startswith("  last frame: File ") and "progress.py" in report[1], "the raising frame"
    assert report[2].startswith("then: rank 0 on node0 (node 0): its collective failed after rank 1"), out
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
    stopped = history[-1]
    assert stopped["cause"]["rank"] == 1 and stopped["cause"]["host"] == "node1", stopped
    assert stopped["cause"]["message"].startswith("RuntimeError: rank 1 raises"), stopped
    # node0 followed: its collective broke, or the launcher stopped it first (whichever came first).
    assert [c["host"] for c in stopped["consequences"]] == ["node0"], stopped
    assert "after rank 1 on node1 (node 1) failed" in stopped["consequences"][0]["text"], stopped


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
    for host, errors in (
        ("node0", [{"local_rank": 0, "message": victim, "traceback": "", "timestamp": 100, "file": "/a"}]),
        (
            "node1",
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
        monitor.apply(monitor.hosts[host], {"state": "exited", "exit": {"exit_code": 1}, "errors": errors})
    diagnosis = diagnose(monitor)
    assert diagnosis is not None
    assert (diagnosis.cause.host, diagnosis.cause.rank) == ("node1", 3)
    assert diagnosis.summary == "raised ValueError: bad shape (rank 3 on node1 (node 1), exit code 1)"
    assert diagnosis.cause.detail == (
        'last frame: File "/venv/trainer/node/model.py", line 88, in forward: raise ValueError("bad shape"); '
        "traceback in /b"
    )
    assert [(e.host, e.rank, e.consequence) for e in diagnosis.consequences] == [("node0", 0, True)]


def test_a_node_that_stops_answering_while_its_peers_fail_is_the_cause_and_lost():
    """The dead node's missed poll comes before its peers' broken collectives: it is the cause (exit
    NODE_LOST), lost at once (no grace), never shown as running; the peers' failures are consequences
    even when their ranks' records say nothing of a peer."""
    view = LiveView()
    monitor = JobMonitor({"head": 0, "w1": 1, "w2": 2}, "head", view, unreachable_grace_s=60)
    for host in monitor.hosts:
        monitor.apply(monitor.hosts[host], {"state": "running", "lines": ["step 47/400 loss 3.1"]})
    base = time.time()
    monitor.on_message({"type": "miss", "host": "w2", "since": base, "error": "ssh: connect timed out"})
    assert not monitor.must_stop, "a missed poll alone waits for the grace"
    broken = "trainer: rank 1 stopped: another rank failed first ([pair.cc:553] Connection closed by peer)"
    monitor.apply(monitor.hosts["w1"], {"state": "running", "lines": [broken]})
    assert monitor.must_stop, "a peer's broken collective confirms the loss before its torchrun ends"
    early = diagnose(monitor, now=base + 1.0)
    assert early is not None and early.cause.kind == "lost" and early.cause.host == "w2"
    assert early.running == ["head", "w1"], "the others are stopped because of it"
    reset = "RuntimeError: [pair.cc:553] Read error: Connection reset by peer"
    for host, rank, at in (("w1", 1, base + 1.7), ("head", 0, base + 1.8)):
        record = {"rank": rank, "code": 1, "message": reset, "consequence": False, "time": at}
        monitor.apply(
            monitor.hosts[host],
            {"state": "exited", "exit": {"exit_code": 1, "time": at}, "rank_exits": [record]},
        )
    assert monitor.must_stop, "a node missing while its peers fail: no need to wait"
    diagnosis = diagnose(monitor, now=base + 2.0)
    assert diagnosis is not None
    assert diagnosis.cause.kind == "lost" and diagnosis.cause.host == "w2"
    assert diagnosis.code == exitcodes.NODE_LOST and diagnosis.lost == ["w2"]
    assert monitor.hosts["w2"].state == "lost"
    assert [e.host for e in diagnosis.consequences] == ["w1", "head"]
    assert diagnosis.consequence_text(diagnosis.consequences[0]) == (
        "rank 1 on w1 (node 1): its collective failed after w2 was lost (exit code 1)"
    )
    assert diagnosis.restartable and not diagnosis.head_lost


def test_a_node_gone_silently_is_lost_once_no_rank_advances_not_after_the_grace():
    """A node that vanishes without resetting its peers' connections (they wait in a collective): it does
    not answer and no rank advances for SILENT_LOSS_S (or twice the longest pause seen), so it is lost
    well before the 60 s grace. A node that only misses polls while the ranks go on stays unreachable."""
    monitor = JobMonitor({"head": 0, "w1": 1}, "head", LiveView(), unreachable_grace_s=300)
    for step in (1, 2):
        for host, rank in (("head", 0), ("w1", 1)):
            report = {"state": "running", "progress": [{"rank": rank, "started": step, "done": step - 1}]}
            monitor.apply(monitor.hosts[host], report)
    since = time.time() - (SILENT_LOSS_S + 5)
    monitor.on_message({"type": "miss", "host": "w1", "since": since, "error": "ssh: connection timed out"})
    monitor.check_time()
    assert monitor.hosts["w1"].state == "running" and not monitor.must_stop, "the ranks advanced just now"
    monitor.last_progress_at -= SILENT_LOSS_S + 5  # ...and then none advanced since it went missing
    monitor.check_time()
    assert monitor.hosts["w1"].state == "lost" and monitor.must_stop
    diagnosis = diagnose(monitor)
    assert diagnosis is not None and diagnosis.cause.kind == "lost" and diagnosis.cause.host == "w1"
    assert "while no rank advanced" in diagnosis.summary, diagnosis.summary


def test_a_broken_collective_alone_waits_for_its_cause_then_bad_input_is_not_restartable():
    """A peer-loss failure is a consequence: the launcher does not stop on it before the cause shows
    (here: a rank's own data error a moment later), and exit 2 is never restartable."""
    monitor = JobMonitor({"head": 0, "w1": 1}, "head", LiveView())
    for host in monitor.hosts:
        monitor.apply(monitor.hosts[host], {"state": "running"})
    peer = {"rank": 0, "code": 1, "message": "rank 0 stopped: another rank failed first", "consequence": True}
    monitor.apply(monitor.hosts["head"], {"state": "exited", "exit": {"exit_code": 1}, "rank_exits": [peer]})
    assert monitor.failed and not monitor.must_stop, "waits for the cause (CONFIRM_S)"
    own = {"rank": 1, "code": 2, "message": "config error: data.path: no such file", "time": 0.0}
    monitor.apply(monitor.hosts["w1"], {"state": "exited", "exit": {"exit_code": 1}, "rank_exits": [own]})
    assert monitor.must_stop
    diagnosis = diagnose(monitor)
    assert diagnosis is not None and diagnosis.cause.rank == 1 and diagnosis.code == exitcodes.CONFIG_ERROR
    assert diagnosis.summary.startswith("config error: data.path: no such file (rank 1 on w1 (node 1)")
    assert not diagnosis.restartable


@pytest.mark.slow
def test_bad_data_under_launch_exits_2_names_the_rank_and_is_never_restarted(request, tmp_path):
    """Every rank refuses the data (exit 2 under `trainer train`): the launch exits 2, not torchrun's 1,
    with the rank's one-line reason first, and --max-restarts does not restart it."""
    inventory, shared = request.getfixturevalue("_loopback_cluster")
    tiny_text = tmp_path / "tiny.txt"
    tiny_text.write_text("too short for one sample\n")
    done = subprocess.run(
        launch_command(
            inventory,
            "--run-name",
            "baddata",
            "--max-restarts",
            "1",
            "--set",
            f"data.path={tiny_text}",
            *TINY,
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == exitcodes.CONFIG_ERROR, out
    report = out[out.index("\nfailed: ") + 1 :].splitlines()
    assert report[0].startswith("failed: config error: data.block_size"), out
    assert "exit code 2)" in report[0], out
    assert "restart 1" not in out and "not restarted: config error" in out, out
    history = [json.loads(line) for line in (shared / "runs" / "baddata" / "launch" / "history.jsonl").open()]
    assert [r["event"] for r in history] == ["launch", "stopped"], history
    cause = history[-1]["cause"]
    records = shared / "runs" / "baddata" / "launch" / f"node-{cause['node']}" / "progress"
    assert json.loads((records / f"exit-{cause['rank']}.json").read_text())["code"] == 2, (
        "the rank's own code"
    )
