"""The bundled trainer's engines, named once.

The trainer's config (`distributed.engine`, trainer.node.engines), the launcher's `--engine` choices
(trainer.controller.launcher.plan) and the inventory rules' `training_engine` check
(trainer.controller.inventory_rules, which Ansible's validate filter imports from the checkout) all
take them from here. Standard library only, so each of them may import it.
"""

from __future__ import annotations

from typing import Literal, get_args

EngineName = Literal["ddp", "deepspeed", "accelerate"]
ENGINES: tuple[str, ...] = get_args(EngineName)
