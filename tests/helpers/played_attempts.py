"""The restart policy's attempts played by a test (restarts.Attempts, the part every such test shares):
the plans the policy hands over, kept in `plans` as host lists; the lock and launch hooks do nothing.
A test's class adds `attempt`, which plays what its attempts do.

Imported by tests (`from helpers.played_attempts import PlayedAttempts`); it imports no test module.
"""

from __future__ import annotations


class PlayedAttempts:
    def __init__(self, plan) -> None:
        self.plan = plan
        #: The hosts of each plan the policy moved to (a node left out, or one taken back in).
        self.plans: list[list[str]] = []

    def use_plan(self, plan) -> None:
        self.plan = plan
        self.plans.append([n.host for n in plan.topology.nodes])

    def new_launch(self) -> None:
        pass

    def take_over_lock(self, view):
        return None

    def release_lock(self, view) -> None:
        pass
