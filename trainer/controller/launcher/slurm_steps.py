"""The Slurm step of `trainer launch` inside an allocation ("guest mode", issue 40): what it runs,
its start, its state, its stop, and its record for `trainer status/logs/stop`.

Inside `salloc` or an `sbatch` script (SLURM_JOB_ID set), Slurm already fans out to the nodes, so
the launch needs no Ansible and no SSH: the topology is the allocation's (slurm_allocation.py), and
one `srun` starts one task per node, each running the same run.sh an SSH launch writes
(runscript.py), from the shared dir. What run.sh writes there (log, exit record, each rank's
progress and exit records) is what the launcher follows, with one Slurm call per poll, never one
per node. Everything here is mechanism; guest.py decides what to start and when to stop.

Every value on a command line here is an argument of its own (no shell); the node names that go
into the step's script are checked against Slurm's host name characters and quoted.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.runscript import IB_DISABLE, IFACE, SAVE_SIGNAL_IGNORED, node_dir, run_script
from trainer.controller.launcher.scheduler import HAS_IB_DEVICES, IFACE_TOWARD_HEAD
from trainer.controller.launcher.slurm_allocation import STEP_SCRIPT, SlurmError, slurm, srun_argv, step_name

#: The launch dir's files of a Slurm launch besides slurm-step.sh: the step's record, srun's output.
RECORD_FILE = "slurm.json"
STEP_LOG = "slurm-step.log"


# --- what the step runs ----------------------------------------------------------------------------


def step_run_script(plan: JobPlan, host: str) -> str:
    """The node's run.sh as an SSH launch writes it, with the two values a probe would have found
    (the interface toward the head, NCCL_IB_DISABLE auto) found by the node itself when it starts."""
    node = plan.topology.node(host)
    text = run_script(plan, node, host)
    resolvers = [
        "# Found on this node as the Slurm step starts it (an SSH launch's probe finds them before).",
        "clustertrain_iface() {",
        *(f"  {line}" for line in IFACE_TOWARD_HEAD),
        '  echo "$iface"',
        "}",
        f"clustertrain_ib_disable() {{ if {HAS_IB_DEVICES}; then echo 0; else echo 1; fi; }}",
    ]
    head, rest = text.split("set -u\n", 1)
    text = head + "set -u\n" + "\n".join(resolvers) + "\n" + rest
    return text.replace(IFACE, "$(clustertrain_iface)").replace(IB_DISABLE, "$(clustertrain_ib_disable)")


def step_script(plan: JobPlan) -> str:
    """slurm-step.sh: what each task of the step runs, picked by the node Slurm put it on."""
    lines = [
        "#!/bin/bash",
        f"# The Slurm step of run {plan.run_name}, written by `trainer launch` in an allocation: one task",
        "# per node; each runs its node's run.sh (the node dir by Slurm's name for the node).",
    ]
    if plan.runs_bundled_trainer:
        lines += SAVE_SIGNAL_IGNORED  # run.sh's own, from the step's first moment
    lines.append('case "${SLURMD_NODENAME:-}" in')
    for node in plan.topology.nodes:
        run_sh = shlex.quote(str(Path(node_dir(plan, node)) / "run.sh"))
        lines.append(f"  {shlex.quote(node.host)}) exec /bin/bash {run_sh} ;;")
    lines += [
        '  *) echo "slurm-step.sh: node ${SLURMD_NODENAME:-?} is not a node of this launch" >&2; exit 2 ;;',
        "esac",
    ]
    return "\n".join(lines) + "\n"


def start_step(plan: JobPlan, job: str, launch_id: str, *, overlap: bool = False) -> subprocess.Popen:
    """srun of slurm-step.sh on every node of the plan, one task each, in a session of its own (a
    Ctrl-C is the launcher's to handle: it cancels the step itself). srun's own messages go to the
    launch dir's slurm-step.log. `overlap`: a restart's step (slurm_allocation.srun_argv)."""
    launch_dir = Path(plan.launch_dir)
    hosts = [n.host for n in plan.topology.nodes]
    argv = srun_argv(job, hosts, step_name(launch_id), str(launch_dir / STEP_SCRIPT), overlap=overlap)
    with open(launch_dir / STEP_LOG, "ab") as log, open(os.devnull, "rb") as null:
        return subprocess.Popen(
            argv, stdin=null, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


# --- the step's state and its stop -----------------------------------------------------------------


def running_steps(job: str) -> dict[str, str]:
    """The job's running steps (name -> JOB.STEP): one squeue call for every node of a launch. An
    ended job has none."""
    try:
        shown = slurm("squeue", "--steps", f"--jobs={job}", "--noheader", "--format=%i %j")
    except SlurmError as err:
        if "Invalid job id" in str(err):
            return {}
        raise
    steps = {}
    for line in shown.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2:
            steps[parts[1].strip()] = parts[0]
    return steps


def cancel_step(step: str) -> bool:
    """scancel of the step: Slurm sends TERM to every process of it on every node (run.sh records how
    its command ended), KILL after the cluster's KillWait. False when the step had ended already
    (between the squeue that listed it and this call)."""
    try:
        slurm("scancel", step)
    except SlurmError as err:
        if "Invalid job id" in str(err):
            return False
        raise
    return True


def write_record(path: Path, data: dict) -> None:
    """A Slurm run's JSON record (slurm.json, slurm-job.json) written whole: readers on the shared dir
    (status, stop, attach, another launcher) never see half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


@dataclass
class SlurmRecord:
    """slurm.json in the launch dir: the Slurm step of a run's latest launch. Written by guest.py when
    the step starts, read by `trainer status`, `logs` and `stop`."""

    job: str
    """The allocation's job id."""
    step: str = ""
    """The step running the nodes' run.sh (JOB.STEP), once Slurm lists it."""
    step_name: str = ""
    """The step's name (clustertrain-<launch id>): how the launcher finds its id."""
    launch_id: str = ""
    """The launch the step runs (each node dir's launch-id)."""
    nodes: dict[str, int] = field(default_factory=dict)
    """Slurm node name -> node rank (node-N in the launch dir)."""
    controller: str = ""
    """The host the launcher runs on (in the allocation: often its first node)."""
    launcher_pid: int = 0
    """The launcher's pid there."""

    def write(self, launch_dir: str | Path) -> None:
        write_record(Path(launch_dir) / RECORD_FILE, asdict(self))

    @classmethod
    def read(cls, launch_dir: str | Path) -> SlurmRecord | None:
        """The record, or None where the run's latest launch was not a Slurm one (or it is unreadable)."""
        try:
            data = json.loads((Path(launch_dir) / RECORD_FILE).read_text())
            nodes = {str(host): int(rank) for host, rank in dict(data.get("nodes") or {}).items()}
            return cls(
                job=str(data["job"]),
                step=str(data.get("step") or ""),
                step_name=str(data.get("step_name") or ""),
                launch_id=str(data.get("launch_id") or ""),
                nodes=nodes,
                controller=str(data.get("controller") or ""),
                launcher_pid=int(data.get("launcher_pid") or 0),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
