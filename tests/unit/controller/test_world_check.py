"""The world check's verdicts (world.py) as the launcher shows them: every worker joined; a worker
that ran past the timeout without connecting to the head (fails a recognised launcher's job with exit
2 and names the host, warns for any other command); a job that ended before it could be told."""

from __future__ import annotations

from trainer import exitcodes
from trainer.controller.launcher.failure import diagnose
from trainer.controller.launcher.live import JobMonitor
from trainer.controller.launcher.world import WorldCheck


class Recorder:
    """The LiveView calls JobMonitor makes, kept as text."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def message(self, text: str) -> None:
        self.messages.append(text)

    def log(self, text: str) -> None:
        self.messages.append(text)

    def states(self, states) -> None:
        pass


def check(strict: bool = True) -> WorldCheck:
    return WorldCheck(
        workers=("w1", "w2"),
        head="head",
        endpoint="10.0.0.1:29500",
        strict=strict,
        launcher="torchrun",
        timeout_s=30,
    )


def test_every_worker_joined_is_said_once():
    world = check()
    for host in ("head", "w1", "w2"):
        world.note(host, "running", None if host == "head" else False)
    assert world.judge(set(), now=0) == []
    world.note("w1", "running", True)
    world.note("w2", "running", True)
    assert world.judge(set()) == ["world check: all 3 nodes joined the job on 10.0.0.1:29500"]
    assert world.judge(set()) == []


def test_a_worker_that_never_connects_fails_a_recognised_launchers_job():
    world = check(strict=True)
    for host in ("head", "w1", "w2"):
        world.note(host, "running", False)
    world.note("w1", "running", True)
    start = world.running_since["w2"]
    assert world.judge(set(), now=start + 29) == [], "inside the timeout nothing is said"
    [line] = world.judge(set(), now=start + 31)
    assert "world check failed" in line and "w2 did not connect to the head within 30 s" in line
    assert "torchrun formed a separate job" in line and "--world-timeout" in line
    assert world.failure is not None and world.failure[0] == "w2"


def test_any_other_command_gets_a_warning_and_goes_on():
    world = check(strict=False)
    for host in ("head", "w1", "w2"):
        world.note(host, "running", False)
    world.running_since["w2"] += 10  # started later: named in a warning of its own
    [line] = world.judge(set(), now=world.running_since["w1"] + 31)
    assert "w1 did not connect to the head (10.0.0.1:29500) within 30 s" in line
    [line] = world.judge(set(), now=world.running_since["w2"] + 31)
    assert "w2 did not connect" in line and "w1" not in line
    assert world.failure is None and world.done


def test_a_job_that_ended_before_it_was_seen_connected_is_not_called_separate():
    world = check()
    world.note("head", "running", None)
    world.note("w1", "running", True)
    [line] = world.judge({"head", "w1", "w2"})
    assert "w2 ended before it was seen connected" in line
    assert world.failure is None


def test_the_monitor_stops_the_job_and_names_the_world_check_as_the_cause_with_exit_2():
    view = Recorder()
    world = check()
    world.timeout_s = 0.0
    monitor = JobMonitor({"head": 0, "w1": 1, "w2": 2}, "head", view, progress_from_steps=False, world=world)
    for host, joined in (("head", None), ("w1", True), ("w2", False)):
        monitor.on_message({"host": host, "type": "report", "report": {"state": "running", "joined": joined}})
    monitor.tick()
    assert monitor.must_stop
    diagnosis = diagnose(monitor, bundled=False)
    assert diagnosis is not None
    assert diagnosis.code == exitcodes.CONFIG_ERROR and diagnosis.cause.host == "w2"
    assert not diagnosis.restartable, "the same command would form separate jobs again"
    assert any("world check failed" in m for m in view.messages)
