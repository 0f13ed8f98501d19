"""Whatever fails in the launcher itself (an exception injected into an attempt here), the run is
stopped on every node before its lock is released (restarts.RestartPolicy.run), and the error is not
swallowed."""

from __future__ import annotations

import io

import pytest
from helpers.loopback import write_inventory
from rich.console import Console

from trainer.controller.inventory import load_cluster
from trainer.controller.launcher.live import LiveView
from trainer.controller.launcher.plan import make_plan
from trainer.controller.launcher.restarts import RestartPolicy


class InjectedError(Exception):
    pass


class FailingLauncher:
    """An attempt that raises where the diagnosis or its rendering would."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.calls: list[str] = []

    def attempt(self, view, record, **kwargs):
        self.calls.append("attempt")
        raise InjectedError("rendering the failure raised")

    def stop_after_error(self, view, error):
        self.calls.append(f"stop after {type(error).__name__}")

    def release_lock(self, view):
        self.calls.append("release_lock")

    def take_over_lock(self, view):
        return None


def test_an_exception_in_an_attempt_stops_the_run_before_its_lock_is_released(tmp_path):
    launcher = FailingLauncher(make_plan(load_cluster(write_inventory(tmp_path)[0]), run_name="injected"))
    view = LiveView(Console(file=io.StringIO(), force_terminal=False))
    with pytest.raises(InjectedError):
        RestartPolicy(launcher, view).run()
    assert launcher.calls == ["attempt", "stop after InjectedError", "release_lock"]
