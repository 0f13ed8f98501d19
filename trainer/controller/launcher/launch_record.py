"""launch.json: what a launch started, as one typed record. The launcher writes it on every node at each
attempt (start.yml hands `LaunchRecord.to_json()` to node_ctl.py, which writes it as given); `trainer
attach`, `status`, `stop` and `logs` read the head's back with `LaunchRecord.from_json`.

The file lies in the node dir, which is the training account's: a value of the wrong type is read as
absent, never trusted to parse. A key an older launcher did not write is absent too, and reads as that
launcher behaved: the watch settings then take the command line's defaults for the launch's kind of job
(WatchOptions.defaults), the restart policy none.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.wire import WatchOptions

#: The watch settings' keys in launch.json: WatchOptions' fields, written flat beside the rest.
WATCH_KEYS = (
    "poll_interval_s",
    "unreachable_grace_s",
    "stall_timeout_s",
    "stall_adaptive",
    "stop_grace_s",
    "world_timeout_s",
)


@dataclass(frozen=True, kw_only=True)
class RestartState:
    """The restart policy's state (restarts.RestartPolicy.state): `trainer attach` goes on with it."""

    max_restarts: int = 0
    """The launch's --max-restarts."""
    exclude_failed: bool = False
    """The launch's --exclude-failed (with a plan to leave nodes out of)."""
    allow_batch_change: bool = False
    """The launch's --allow-batch-change."""
    restarts: int = 0
    """The restarts used so far."""


@dataclass(frozen=True, kw_only=True)
class LaunchRecord:
    """One launch's launch.json. Absent keys read as None where the readers say so (`?`, `None`)."""

    launch_id: str | None = None
    """Tags every process the launch started (node_ctl.py), so a stop finds them all."""
    run_name: str | None = None
    attempt: int | None = None
    """1 for the launch, one more for each restart."""
    bundled_trainer: bool = False
    """The bundled trainer under torchrun, not the user's own command."""
    command: tuple[str, ...] = ()
    """The user's own command; empty for the bundled trainer."""
    head: str | None = None
    nodes: dict[str, int] | None = None
    """Host -> node rank: the launch's own nodes (--exclude-failed may have left some out); None when
    the file names them otherwise (MALFORMED)."""
    gpus_per_node: int | None = None
    launched_at: float | None = None
    """Unix time of the attempt's start."""
    controller: str | None = None
    """The launcher's machine (its host name)."""
    launcher_pid: int | None = None
    watch: WatchOptions = field(default_factory=WatchOptions)
    """The watch settings the launch was given (`trainer attach` follows with them)."""
    world_check_address: str = ""
    """A user's command on several nodes: the head's address each worker's node_ctl looks for a
    connection to (world.py); empty where there is no world check."""
    micro_batch_size: int | None = None
    """The bundled trainer's; None for a user's command."""
    gradient_accumulation_steps: int | None = None
    restart: RestartState | None = None
    """None where the attempt was given no restart policy (then none is written)."""
    as_read: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The file as read (`trainer status --json` prints what the head holds); empty for a new record."""

    @classmethod
    def of_attempt(
        cls,
        plan: JobPlan,
        options: WatchOptions,
        *,
        launch_id: str,
        attempt: int,
        restart: RestartState | None,
    ) -> LaunchRecord:
        """The record of an attempt of `plan` starting now, from this process."""
        topo, bundled = plan.topology, plan.runs_bundled_trainer
        return cls(
            launch_id=launch_id,
            run_name=plan.run_name,
            attempt=attempt,
            bundled_trainer=bundled,
            command=tuple(plan.user_command),
            head=topo.head.host,
            nodes={n.host: n.node_rank for n in topo.nodes},
            gpus_per_node=topo.gpus_per_node,
            launched_at=time.time(),
            controller=socket.gethostname(),
            launcher_pid=os.getpid(),
            watch=options,
            world_check_address=topo.master_addr if plan.world_checked else "",
            micro_batch_size=plan.micro_batch_size if bundled else None,
            gradient_accumulation_steps=plan.gradient_accumulation_steps if bundled else None,
            restart=restart,
        )

    def to_json(self) -> dict[str, Any]:
        """launch.json's content, in the order and spelling every launcher has written it."""
        watch = self.watch
        record: dict[str, Any] = {
            "launch_id": self.launch_id,
            "run_name": self.run_name,
            "attempt": self.attempt,
            "bundled_trainer": self.bundled_trainer,
            "command": list(self.command),
            "head": self.head,
            "nodes": dict(self.nodes or {}),
            "gpus_per_node": self.gpus_per_node,
            "launched_at": self.launched_at,
            "controller": self.controller,
            "launcher_pid": self.launcher_pid,
            **{key: getattr(watch, key) for key in WATCH_KEYS},
            "world_check": {"head_address": self.world_check_address} if self.world_check_address else {},
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        if self.restart is not None:
            restart = self.restart
            record.update(
                max_restarts=restart.max_restarts,
                exclude_failed=restart.exclude_failed,
                allow_batch_change=restart.allow_batch_change,
                restarts=restart.restarts,
            )
        return record

    @classmethod
    def from_json(cls, raw: Any) -> LaunchRecord:
        """The record a launch.json holds (anything json.loads gave: a file that is not an object
        names no nodes)."""
        if not isinstance(raw, dict):
            return cls(as_read={"nodes": None})
        command = tuple(str(word) for word in raw["command"]) if isinstance(raw.get("command"), list) else ()
        world_check = raw.get("world_check") if isinstance(raw.get("world_check"), dict) else {}
        return cls(
            launch_id=_text(raw.get("launch_id")),
            run_name=_text(raw.get("run_name")),
            attempt=_whole(raw.get("attempt")),
            bundled_trainer=bool(raw.get("bundled_trainer")),
            command=command,
            head=_text(raw.get("head")),
            nodes=_nodes(raw.get("nodes")),
            gpus_per_node=_whole(raw.get("gpus_per_node")),
            launched_at=_number(raw.get("launched_at")),
            controller=_text(raw.get("controller")),
            launcher_pid=_whole(raw.get("launcher_pid")),
            # What `trainer attach` plans the launch as: the bundled trainer unless it names a command.
            watch=_watch(raw, bundled=not command),
            world_check_address=str(world_check.get("head_address") or ""),
            micro_batch_size=_whole(raw.get("micro_batch_size")),
            gradient_accumulation_steps=_whole(raw.get("gradient_accumulation_steps")),
            restart=RestartState(
                max_restarts=_whole(raw.get("max_restarts")) or 0,
                exclude_failed=bool(raw.get("exclude_failed")),
                allow_batch_change=bool(raw.get("allow_batch_change")),
                restarts=_whole(raw.get("restarts")) or 0,
            ),
            as_read=raw,
        )


def _nodes(value: Any) -> dict[str, int] | None:
    """Host -> node rank, or None when the value is not that."""
    if not isinstance(value, dict):
        return None
    if not all(isinstance(rank, int) and not isinstance(rank, bool) for rank in value.values()):
        return None
    return {str(host): rank for host, rank in value.items()}


def _watch(raw: dict[str, Any], bundled: bool) -> WatchOptions:
    """The saved watch settings; a key an older launcher did not write takes today's default."""
    defaults = WatchOptions.defaults(bundled)
    saved: dict[str, Any] = {}
    for key in WATCH_KEYS:
        if key not in raw:
            continue
        value = raw[key]
        if key == "stall_adaptive":
            saved[key] = bool(value)
        elif key == "stall_timeout_s" and value is None:
            saved[key] = None  # a user's command launched without a stall watchdog
        elif (number := _number(value)) is not None:
            saved[key] = number
    if "stall_timeout_s" in saved and saved["stall_timeout_s"] is None:
        saved["stall_adaptive"] = False  # no watchdog: nothing to adapt
    return WatchOptions(**{key: saved.get(key, getattr(defaults, key)) for key in WATCH_KEYS})


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
