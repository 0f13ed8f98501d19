"""The watchdog's bound for the bundled trainer without --stall-timeout (launcher/stall.py): what the
ranks' progress records make it, and what it never is (shorter than a minute, or shorter than an
announced evaluation or checkpoint save may take)."""

from __future__ import annotations

import argparse

import pytest

from trainer.controller.launcher.launch_cli import BUNDLED_STALL_TIMEOUT_S, watch_options
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


def test_the_bundled_trainer_adapts_unless_a_bound_is_given_and_a_users_command_has_none():
    bundled = watch_options(parsed(), bundled=True)
    assert bundled.stall_adaptive and bundled.stall_timeout_s == BUNDLED_STALL_TIMEOUT_S
    given = watch_options(parsed("--stall-timeout", "90"), bundled=True)
    assert not given.stall_adaptive and given.stall_timeout_s == 90
    own = watch_options(parsed(), bundled=False)
    assert not own.stall_adaptive and own.stall_timeout_s is None
    # `trainer attach` keeps what the launch it follows was given.
    saved = LaunchRecord.from_json({"command": [], "stall_timeout_s": 90.0, "stall_adaptive": False}).watch
    assert not watch_options(parsed(), bundled=True, saved=saved).stall_adaptive
