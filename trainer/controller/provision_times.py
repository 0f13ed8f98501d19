"""Where a site.yml run's time went, from its events: each play's wall time, and the node environment's
phases (roles/trainer_env: the source node's start from the controller's kept pack, its build, the
pack, its publication, each node's unpack, and the controller keeping a new pack).

`trainer up` prints these lines after its provision phase, so a slow first step can be read by phase
instead of guessed at. The environment's phases come from the role's own tasks: the task file a task
lives in (`install.yml`, `wheelhouse.yml`, `deepspeed_ops.yml`: the build) or its name (the pack,
the publish, the unpack, whose outputs also say what each node did).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

#: roles/trainer_env's task files that build the environment on its source node.
BUILD_FILES = tuple(f"trainer_env/tasks/{name}.yml" for name in ("install", "wheelhouse", "deepspeed_ops"))
#: roles/trainer_env/tasks/environment.yml's tasks, by name prefix -> phase.
ENV_TASKS = {
    "Copy the controller's kept pack to the source node": "seed",
    "Unpack it, checked against the sha256 the controller kept": "seed",
    "Pack the environment on its source node": "pack",
    "Publish each new pack on the shared dir": "publish",
    "Unpack the environment, checked against": "unpack",
    "Fetch each new pack from its source node": "keep",
}
_RESULT_EVENTS = ("runner_on_ok", "runner_on_failed", "runner_on_skipped", "runner_on_unreachable")


@dataclass
class ProvisionClock:
    """Fed every event of one site.yml run (`on_event`), in order as they arrive."""

    plays: list[tuple[str, float]] = field(default_factory=list)
    """(play name, monotonic start) for each play."""
    ended: float | None = None
    env: dict[str, dict[str, float]] = field(default_factory=dict)
    """phase -> host -> seconds."""
    did: dict[tuple[str, str], str] = field(default_factory=dict)
    """(phase, host) -> what node_env.py did there (pack, unpack, restore) with its own seconds."""

    def on_event(self, event: dict[str, Any]) -> None:
        name = event.get("event")
        data = event.get("event_data") or {}
        if name == "playbook_on_play_start":
            self.plays.append((str(data.get("play", "")), time.monotonic()))
        elif name == "playbook_on_stats":
            self.ended = time.monotonic()
        elif name in _RESULT_EVENTS and name != "runner_on_skipped":
            phase = self._phase(data)
            if phase:
                host = str(data.get("host", ""))
                into = self.env.setdefault(phase, {})
                into[host] = into.get(host, 0.0) + float(data.get("duration") or 0.0)
                self._note(phase, host, data.get("res") or {})

    @staticmethod
    def _phase(data: dict[str, Any]) -> str:
        path = str(data.get("task_path", ""))
        if any(part in path for part in BUILD_FILES):
            return "build"
        task = str(data.get("task", ""))
        return next((phase for prefix, phase in ENV_TASKS.items() if task.startswith(prefix)), "")

    def _note(self, phase: str, host: str, res: dict[str, Any]) -> None:
        try:
            out = json.loads(str(res.get("stdout") or ""))
        except ValueError:
            return
        if isinstance(out, dict) and out.get("did"):
            parts = ", ".join(f"{k} {v:.1f} s" for k, v in (out.get("seconds") or {}).items())
            self.did[phase, host] = f"{out['did']}" + (f" ({parts})" if parts else "")

    def play_seconds(self) -> list[tuple[str, float]]:
        end = self.ended if self.ended is not None else time.monotonic()
        starts = [start for _, start in self.plays[1:]] + [end]
        return [(play, max(0.0, nxt - start)) for (play, start), nxt in zip(self.plays, starts, strict=True)]

    def lines(self) -> list[str]:
        """The breakdown, one line each: the plays over a second, then the environment's phases."""
        shown = [f"{seconds:7.1f} s  {play}" for play, seconds in self.play_seconds() if seconds >= 1.0]
        for phase in ("seed", "build", "pack", "publish", "unpack", "keep"):
            hosts = self.env.get(phase)
            if not hosts:
                continue
            said = {host: f" [{self.did[phase, host]}]" for host in hosts if (phase, host) in self.did}
            per_host = ", ".join(f"{host} {took:.1f} s{said.get(host, '')}" for host, took in hosts.items())
            shown.append(f"{max(hosts.values()):7.1f} s  environment {phase}: {per_host}")
        return shown
