"""The watchdog's bound for the bundled trainer without --stall-timeout (launcher/stall.py): what the
ranks' progress records make it, and what it never is (shorter than a minute, or shorter than an
announced evaluation or checkpoint save may take)."""

from __future__ import annotations

import argparse

import pytest
from helpers.node_helper import Said

from trainer.controller.launcher.launch_cli import STALL_CEILING_S, watch_options
from trainer.controller.launcher.launch_record import LaunchRecord
from trainer.controller.launcher.stall import STALL_FLOOR_S, stall_bound


def records(*slowest, phase="train"):
    return [
        {"rank": i, "started": 9, "done": 8, "slowest_step_s": s, "phase": phase}
        for i, s in enumerate(slowest)
    ]


@pytest.mark.parametrize(
    ("ranks", "bound"),
    [
        (records(None, None), 600.0),  # steps' times not known yet: loading, ops, the first compile
        (records(0.4, 2.0), STALL_FLOOR_S),  # fast steps: the floor
        (records(30.0, 12.0), 120.0),  # 4 × the slowest rank's slowest step
        (records(400.0), 600.0),  # never past the ceiling
        (records(0.4, 0.5, phase="checkpoint"), 600.0),  # an announced save: the ceiling
        (records("soon", float("nan"), -3, True), 600.0),  # what the training account wrote, not numbers
    ],
)
def test_the_adaptive_bound(ranks, bound):
    seconds, why = stall_bound(ranks, 600.0, adaptive=True)
    assert seconds == bound and why, why


@pytest.mark.parametrize(
    ("device", "computing", "bound"),
    [
        ("cpu", ["rank 1 on w1"], 600.0),  # one rank computes, its peers wait asleep: a slow step
        ("cpu", [], STALL_FLOOR_S),  # nobody computes: the steps' bound
        ("cuda:0", ["rank 1 on w1"], STALL_FLOOR_S),  # on a GPU a waiting peer spins: one says nothing
        ("cuda:0", ["rank 0 on head", "rank 1 on w1"], 600.0),  # every rank computes
    ],
)
def test_a_rank_computing_its_step_holds_the_ceiling(device, computing, bound):
    ranks = [{**r, "device": device} for r in records(0.4, 0.5)]
    seconds, why = stall_bound(ranks, 600.0, adaptive=True, computing=computing)
    assert seconds == bound, why
    assert ("computing" in why) == (bound == 600.0), why
    # A fixed --stall-timeout is the bound, computing or not.
    assert stall_bound(ranks, 30.0, adaptive=False, computing=computing) == (30.0, "")


def report(host, rank, share, at):
    record = {"rank": rank, "started": 5, "done": 4, "slowest_step_s": 0.5, "phase": "train"}
    return {"host": host, "type": "report", "report": {"state": "running", "progress": [
        {**record, "busy_share": share, "device": "cpu", "time": at}
    ]}}  # fmt: skip


def test_the_monitor_calls_a_computed_step_slow_and_a_silent_one_a_hang(monkeypatch):
    from trainer.controller.launcher import live

    view = Said()
    monitor = live.JobMonitor({"head": 0, "w1": 1}, "head", view, stall_timeout_s=600.0, stall_adaptive=True)
    monitor.on_message(report("head", 0, None, 1.0))
    monitor.on_message(report("w1", 1, 0.9, 1.0))
    monitor.last_progress_at -= STALL_FLOOR_S + 1  # no rank advanced for a minute
    monitor.tick()
    assert monitor.stall is None, monitor.stall
    [said] = [line for line in view.lines if "not a hang" in line]
    assert "rank 1 on w1 computing its step" in said, said
    monitor.tick()
    assert sum("not a hang" in line for line in view.lines) == 1  # said once a step
    # Its next sample says it sleeps (it waits, or sleeps outside its collective): a stall.
    monitor.on_message(report("w1", 1, 0.01, 6.0))
    assert monitor.stall is not None and "60 s" in monitor.stall.bound, monitor.stall


def test_a_busy_sample_that_is_not_renewed_no_longer_holds_the_bound(monkeypatch):
    from trainer.controller.launcher import live

    monitor = live.JobMonitor(
        {"head": 0, "w1": 1}, "head", Said(), stall_timeout_s=600.0, stall_adaptive=True
    )
    monitor.on_message(report("w1", 1, 0.9, 1.0))
    monitor.last_progress_at -= STALL_FLOOR_S + 1
    monitor.on_message(report("w1", 1, 0.9, 1.0))  # the same record read again: not a new sample
    assert monitor.stall is None
    monkeypatch.setattr(live, "COMPUTING_FRESH_S", 0.0)  # the rank stopped writing (stopped, gone)
    monitor.tick()
    assert monitor.stall is not None


def test_a_given_stall_timeout_is_the_bound_whatever_the_steps_take():
    assert stall_bound(records(0.1), 30.0, adaptive=False) == (30.0, "")


def parsed(*argv):
    parser = argparse.ArgumentParser()
    for name in (
        "--poll-interval",
        "--unreachable-grace",
        "--stall-timeout",
        "--stop-grace",
        "--world-timeout",
    ):
        parser.add_argument(name, type=float, default=None)
    return parser.parse_args(argv)


def test_the_watchdog_adapts_unless_a_bound_is_given_or_it_is_turned_off():
    bundled = watch_options(parsed(), bundled=True)
    assert bundled.stall_adaptive and bundled.stall_timeout_s == STALL_CEILING_S
    given = watch_options(parsed("--stall-timeout", "90"), bundled=True)
    assert not given.stall_adaptive and given.stall_timeout_s == 90
    own = watch_options(parsed(), bundled=False)  # a user's command: its quiet, under the same ceiling
    assert own.stall_adaptive and own.stall_timeout_s == STALL_CEILING_S
    off = watch_options(parsed("--stall-timeout", "0"), bundled=False)
    assert not off.stall_adaptive and off.stall_timeout_s is None
    # `trainer attach` keeps what the launch it follows was given.
    saved = LaunchRecord.from_json({"command": [], "stall_timeout_s": 90.0, "stall_adaptive": False}).watch
    assert not watch_options(parsed(), bundled=True, saved=saved).stall_adaptive
