"""`cluster_problems`: everything wrong with a cluster inventory, as messages a user can act on.

The validate play runs this on the controller before any host is contacted. The rules themselves
live once, in the project's own standard-library-only module trainer.controller.inventory_rules,
which `trainer plan/launch/preflight` apply too (trainer.controller.inventory.load_cluster). This
checkout's copy comes first on the import path, so the playbook checks exactly what the launcher will.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[3]
if (_CHECKOUT / "trainer" / "controller" / "inventory_rules.py").is_file():
    sys.path.insert(0, str(_CHECKOUT))
from trainer.controller import inventory_rules  # noqa: E402


def cluster_problems(hostvars: Mapping, groups: Mapping) -> list[str]:
    """Every problem in the inventory, for provisioning (empty when it describes a usable cluster)."""
    return inventory_rules.cluster_problems(hostvars, groups, inventory_rules.PROVISION)


class FilterModule:
    def filters(self) -> dict[str, Callable]:
        return {"cluster_problems": cluster_problems}
