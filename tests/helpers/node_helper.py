"""The node's helper (trainer/controller/launcher/playbooks/files/node_ctl.py) as a module, for tests
that call its functions on this machine's real processes and files. It is a script copied to each node
dir, not a package module, so it is loaded from its file; and the view a JobMonitor talks to, recorded.

Imported by the controller's unit tests (`from helpers.node_helper import ...`); it imports no test
module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

NODE_CTL = Path(__file__).resolve().parents[2] / "trainer/controller/launcher/playbooks/files/node_ctl.py"


def node_ctl() -> ModuleType:
    """A fresh load of node_ctl.py (each test gets its module state new)."""
    spec = importlib.util.spec_from_file_location("node_ctl_under_test", NODE_CTL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Said:
    """What a JobMonitor says to its view (LiveView's message, log and states), kept as lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)

    log = message

    def states(self, states) -> None:
        pass
