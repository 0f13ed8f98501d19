"""The Slurm allocation `trainer launch` runs in ("guest mode", issue 40): whether there is one, its
nodes and their addresses, the inventory's settings on them, and the srun line that runs a launch's
step there. `trainer plan` shows that line; slurm_steps.py starts it.

Inside `salloc` or an `sbatch` script SLURM_JOB_ID is set. The topology is then Slurm's: the nodes of
`scontrol show hostnames $SLURM_JOB_NODELIST` in that order (the first is the head), each at its
NodeAddr resolved to IPv4, with the GPUs of SLURM_GPUS_ON_NODE; everything else (shared dir, venv,
master port, processes per node, training_env, secrets) is the inventory's, as over SSH. Two Slurm
calls in all, whatever the number of nodes. Every command here runs without a shell, each value an
argument of its own; node names are checked against a host name's characters.
"""

from __future__ import annotations

import getpass
import os
import re
import shlex
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.controller.inventory import Cluster, Host, PlanningError, load_cluster
from trainer.controller.inventory_rules import as_int

#: Set by Slurm in an allocation (salloc, sbatch, srun): the launch runs its steps with srun there.
JOB_VARIABLE = "SLURM_JOB_ID"
#: Slurm's node names: a host name's characters.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
#: The launch dir's file each task of the step runs (slurm_steps.step_script).
STEP_SCRIPT = "slurm-step.sh"
#: Host variables that name one inventory host, not the job's settings: a Slurm node has its own.
HOST_ONLY = ("cluster_ip", "ansible_host", "ansible_port", "cluster_node_rank")
SLURM_TIMEOUT_S = 60.0


class SlurmError(PlanningError):
    """A Slurm command failed or answered what the launch cannot use; the message says which."""


def allocation_job(env: Mapping[str, str] = os.environ) -> str | None:
    """The job id of the allocation this process runs in, or None outside one."""
    job = env.get(JOB_VARIABLE, "").strip()
    return job or None


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How many times Slurm requeued this batch job (SLURM_RESTART_COUNT; 0 in its first run)."""
    try:
        return max(0, int(env.get("SLURM_RESTART_COUNT") or 0))
    except ValueError:
        return 0


def slurm(*argv: str, timeout_s: float = SLURM_TIMEOUT_S, env: Mapping[str, str] | None = None) -> str:
    """One Slurm command's output; SlurmError with its message when it fails. `env`: the command's
    environment (default: this process's)."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmError(f"{argv[0]} could not run: {err}") from err
    if done.returncode != 0:
        raise SlurmError(f"`{shlex.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()[:500]}")
    return done.stdout


@dataclass(frozen=True)
class SlurmNode:
    """One node of the allocation: Slurm's name for it and the IPv4 address the job uses."""

    name: str
    address: str


def allocation_nodes(env: Mapping[str, str] = os.environ) -> list[SlurmNode]:
    """The allocation's nodes in Slurm's order (the first is the head), each with its address:
    NodeAddr (often the name itself) resolved to IPv4, which NCCL and gloo need on every node."""
    nodelist = env.get("SLURM_JOB_NODELIST", "").strip()
    if not nodelist:
        raise SlurmError(
            f"{JOB_VARIABLE} is set but SLURM_JOB_NODELIST is not: run trainer launch in the allocation's "
            "shell (salloc) or its batch script, not in a step of it"
        )
    names = slurm("scontrol", "show", "hostnames", nodelist).split()
    for name in names:
        if not NODE_NAME.fullmatch(name):
            raise SlurmError(f"Slurm names a node {name!r}, which is not a host name")
    if not names:
        raise SlurmError(f"scontrol show hostnames {nodelist} names no node")
    # One call for every node (not one per node): each line is `NodeName=... NodeAddr=... ...`.
    addresses = {}
    for line in slurm("scontrol", "show", "node", "--oneliner", ",".join(names)).splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "NodeName" in fields:
            addresses[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return [SlurmNode(name, _ipv4(addresses.get(name, name))) for name in names]


def node_states(names: list[str]) -> dict[str, str]:
    """Slurm's state of each of `names` (scontrol's State=, e.g. ALLOCATED, DOWN+NOT_RESPONDING): one
    call for all of them."""
    states = {}
    for line in slurm("scontrol", "show", "node", "--oneliner", ",".join(names)).splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "NodeName" in fields:
            states[fields["NodeName"]] = fields.get("State", "")
    return states


def requeue_blocker(job: str) -> str | None:
    """Why Slurm would not requeue `job` (an interactive allocation, --no-requeue), or None: one
    scontrol call."""
    shown = slurm("scontrol", "show", "job", job, "--oneliner")
    fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
    if fields.get("BatchFlag") != "1":
        return "it is an interactive allocation (salloc), not a batch job"
    if fields.get("Requeue") != "1":
        return "it does not allow a requeue (--no-requeue, or the cluster's JobRequeue=0)"
    return None


def _ipv4(address: str) -> str:
    try:
        return socket.gethostbyname(address)
    except OSError as err:
        raise SlurmError(f"cannot resolve the Slurm node address {address} to IPv4: {err}") from err


def guest_cluster(cluster: Cluster, nodes: list[SlurmNode], env: Mapping[str, str] = os.environ) -> Cluster:
    """The inventory's job settings (its head's variables: shared dir, venv, port, training_env, ...)
    on the allocation's nodes instead of the inventory's hosts; a cluster_training_user other than
    this account is refused (the step runs as the allocation's owner). With GPUs in the allocation
    (SLURM_GPUS_ON_NODE), they are the nodes' accelerators; processes per node stay the inventory's
    training_procs_per_node when it sets them, else one per GPU."""
    user = str(cluster.head.get("cluster_training_user") or "")
    if user and user != getpass.getuser():
        # srun starts the step as the allocation's owner: no become, no other account.
        raise SlurmError(
            f"the inventory's cluster_training_user is {user}, but a Slurm step runs as the allocation's "
            f"owner ({getpass.getuser()}): run salloc/sbatch as {user}, or add --over-ssh to launch over SSH"
        )
    common = {key: value for key, value in cluster.head.vars.items() if key not in HOST_ONLY}
    gpus = as_int(env.get("SLURM_GPUS_ON_NODE") or 0) or 0
    if gpus > 0:
        common["cluster_accelerators"] = gpus
    hosts = [Host(node.name, {**common, "cluster_ip": node.address}) for node in nodes]
    return Cluster(inventory=cluster.inventory, head=hosts[0], workers=tuple(hosts[1:]))


def allocation_cluster(inventory: str) -> Cluster:
    """The job `trainer launch` and `trainer plan` run inside this allocation: the inventory's settings
    on the allocation's nodes (guest_cluster over allocation_nodes)."""
    return guest_cluster(load_cluster(inventory), allocation_nodes())


def step_name(launch_id: str) -> str:
    """The Slurm step's name for a launch: how the launcher, status and stop find its step id."""
    return f"clustertrain-{launch_id}"


def srun_argv(job: str, hosts: list[str], step_name: str, script: str, *, overlap: bool = False) -> list[str]:
    """The srun that runs `script` once on each of `hosts` (one task per node) as a step of `job`.
    `overlap`: a restart's step, which may share the allocation's CPUs with the step before it."""
    return [
        "srun",
        f"--jobid={job}",
        f"--job-name={step_name}",
        f"--nodes={len(hosts)}",
        f"--ntasks={len(hosts)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(hosts)}",
        # A task that ends is not a reason for Slurm to end the others: run.sh records every node's
        # end and the launcher decides (its failure diagnosis names the cause, then it cancels).
        "--kill-on-bad-exit=0",
        # A step with a task on a lost node stays listed (holding its CPUs on every node) after its
        # other tasks ended, even once Slurm marks the node DOWN: without --overlap the restart's step
        # waits for it for ever ("Requested nodes are busy"). Its tasks on the survivors have ended
        # (the launcher waited for their exit records), and the run's lock keeps a second launch out.
        *(["--overlap"] if overlap else []),
        "/bin/bash",
        script,
    ]
