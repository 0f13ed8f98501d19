"""A tiny DeepSpeed job (ZeRO-2, a few steps) whose checkpoint must land in the head's shared dir."""

from __future__ import annotations

from trainer.inventory import Cluster
from trainer.preflight.report import SKIP, Result

CHECK = "deepspeed"


def run_check(cluster: Cluster) -> list[Result]:
    return [Result(CHECK, cluster.head.name, SKIP, "not implemented yet")]
