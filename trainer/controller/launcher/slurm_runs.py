"""A run whose latest launch is a Slurm step (guest.py), read and stopped from the shared dir: what
`trainer status`, `trainer logs` and `trainer stop` do for it instead of their playbooks.

The nodes' files are on the shared dir, which a login node and the allocation's nodes see alike, so
each node's report is node_ctl's own `status` read here; whether the step still runs is one squeue
call for every node (slurm_steps.running_steps). A stop marks the nodes still running
stop-requested (their end reads as stopped, not failed, for the launcher that follows them) and
cancels the step with scancel.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from trainer.controller.launcher import slurm_steps
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.slurm_steps import SlurmRecord

NODE_CTL_PATH = Path(__file__).resolve().parent / "playbooks" / "files" / "node_ctl.py"


@functools.cache
def node_helper() -> ModuleType:
    """node_ctl.py, the nodes' helper, as a module of this process (it is standard library only);
    loaded once, not at every poll."""
    spec = importlib.util.spec_from_file_location("clustertrain_node_ctl", NODE_CTL_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slurm_launch(plan: JobPlan) -> SlurmRecord | None:
    """The Slurm step of the run's latest launch, or None where that launch was not a Slurm one (its
    slurm.json names another launch than the head's node dir, or there is none)."""
    record = SlurmRecord.read(plan.launch_dir)
    if record is None or not record.nodes:
        return None
    try:
        head_launch = (Path(plan.paths.node_dir(0)) / "launch-id").read_text().strip()
    except OSError:
        return None
    return record if head_launch == record.launch_id else None


def step_running(record: SlurmRecord) -> bool:
    """Whether the record's step still runs: one squeue call for all its nodes."""
    steps = slurm_steps.running_steps(record.job)
    return record.step_name in steps or (bool(record.step) and record.step in steps.values())


def node_reports(
    plan: JobPlan,
    nodes: dict[str, int],
    offsets: dict[str, int | None],
    running: bool,
    tail: int = 0,
) -> dict[str, dict[str, Any]]:
    """Each node's report (node_ctl `status`) from the shared dir, by host; `offsets`: host -> log
    offset (None: the last `tail` lines), moved on. Whether run.sh still runs is Slurm's word for the
    step (`running`): the pid in a node dir is that node's, not this host's."""
    helper = node_helper()
    reports = {}
    for host, rank in sorted(nodes.items(), key=lambda item: item[1]):
        offset = offsets.get(host)
        report = helper.status(Path(plan.paths.node_dir(rank)), offset, tail, quiet=rank > 0, alive=running)
        if offset is not None:
            offsets[host] = report["offset"]
        reports[host] = report
    return reports


def request_stop(plan: JobPlan, record: SlurmRecord, why: dict[str, Any]) -> bool:
    """Stop the record's step: each node still running marked stop-requested (its end is then a stop,
    not a failure, as node_ctl's stop marks it), a history record, then scancel of the step. Whether
    a running step was cancelled."""
    helper = node_helper()
    for rank in record.nodes.values():
        node_dir = Path(plan.paths.node_dir(rank))
        if node_dir.is_dir() and not (node_dir / "exit").exists():
            (node_dir / "stop-requested").write_text(f"{time.time()}\n")
    helper.append_record(Path(plan.launch_dir), {**why, "event": "stopped", "launch_id": record.launch_id})
    step = slurm_steps.running_steps(record.job).get(record.step_name) or ""
    return bool(step) and slurm_steps.cancel_step(step)
