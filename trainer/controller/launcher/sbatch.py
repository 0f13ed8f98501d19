"""`trainer sbatch -i INVENTORY [-- COMMAND]` (or `--nodes N --gpus-per-node G` without an inventory):
write the job `trainer launch` would start as a Slurm batch script (`--pbs`: a PBS/Torque one).

With an inventory the script is the same job: the shared dir, venv, master port, NCCL settings,
training_env and working directory come from it; the scheduler picks the hosts. Without one,
the command line describes the job and the current directory stands in for the shared dir.
Nothing is contacted or started: the script is written to a file. It never holds a secret (the
scheduler keeps every script it is given): secrets go to the run's launch dir on the shared dir, mode
0600, read by the job at run time (scheduler.private_files), so a job with secrets is written where
the shared dir is mounted (a login node).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

from trainer import exitcodes
from trainer.controller.access import configure_access
from trainer.controller.inventory import Cluster, Host, PlanningError
from trainer.controller.launcher.plan import (
    COMMAND_EPILOG,
    JobPlan,
    PlanError,
    add_job_arguments,
    plan_from_args,
)
from trainer.controller.launcher.scheduler import pbs_script, private_files, slurm_script
from trainer.controller.launcher.slurm_batch import add_batch_options, batch_options
from trainer.controller.launcher.topology import DEFAULT_MASTER_PORT

#: cli.py gives this verb what follows `--` as args.command (the user's own command).
TAKES_COMMAND = True
DESCRIBED_BY_OPTIONS = Path("(trainer sbatch options)")
EXAMPLES = (
    "trainer sbatch -i inventory/mycluster --run-name qwen-lora --time 24:00:00  # writes qwen-lora.sbatch",
    "trainer sbatch --nodes 4 --gpus-per-node 8 --partition gpu -o job.sbatch -- bash finetune/train.sh",
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser, inventory_required=False)
    parser.epilog = COMMAND_EPILOG.replace("on every node", "on every node of the job")
    without = parser.add_argument_group("without an inventory")
    without.add_argument("--nodes", type=int, help="number of nodes (instead of -i)")
    without.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: CPU nodes)")
    without.add_argument(
        "--procs-per-node",
        type=int,
        help="processes per node (default: --gpus-per-node; needed on CPU nodes)",
    )
    without.add_argument(
        "--shared-dir",
        default=os.getcwd(),
        help="a directory every node sees at the same path; runs go to <shared dir>/runs/<run name> "
        "(default: the current directory)",
    )
    without.add_argument(
        "--venv",
        default=sys.prefix,
        help="the Python environment with torchrun and trainer, at this path on every node "
        "(default: this one, %(default)s)",
    )
    without.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, help="rendezvous port")
    batch = parser.add_argument_group("scheduler")
    batch.add_argument("--pbs", action="store_true", help="write a PBS/Torque script (qsub) instead")
    add_batch_options(batch)
    parser.add_argument(
        "-o", "--output", help="file to write (default: <run name>.sbatch, or .pbs, in the current directory)"
    )


def cluster_from_options(args: argparse.Namespace) -> Cluster:
    """The cluster `--nodes N --gpus-per-node G` describes: N hosts the scheduler will name."""
    if args.nodes is None or args.nodes < 1:
        raise PlanError("give -i INVENTORY, or --nodes N (1 or more) with --gpus-per-node G")
    procs = args.procs_per_node or args.gpus_per_node
    if args.gpus_per_node < 0 or procs < 1:
        raise PlanError(
            "--gpus-per-node must be 0 or more, and CPU nodes need --procs-per-node (processes per node)"
        )
    shared_dir = str(Path(args.shared_dir).resolve())
    common = {
        "cluster_accelerators": args.gpus_per_node,
        "training_procs_per_node": procs,
        "cluster_master_port": args.master_port,
        "cluster_shared_dir": shared_dir,
        "training_venv": str(Path(args.venv).resolve()),
        "cluster_nccl_socket_ifname": "auto",
        "cluster_nccl_ib_disable": "auto",
    }
    hosts = [Host(f"node{rank}", dict(common)) for rank in range(args.nodes)]
    return Cluster(inventory=DESCRIBED_BY_OPTIONS, head=hosts[0], workers=tuple(hosts[1:]))


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by this user only from the moment it exists: a new file (0600,
    never through a link someone left in its place) renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with open(os.open(tmp, flags, 0o600), "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def batch_plan(args: argparse.Namespace) -> JobPlan:
    """The job from -i INVENTORY, or from --nodes N and --gpus-per-node G without one."""
    if args.inventory and args.nodes is not None:
        raise PlanError("give either -i INVENTORY or --nodes N, not both")
    configure_access(args)  # vault passwords for a vaulted inventory (trainer.controller.access)
    return plan_from_args(args, None if args.inventory else cluster_from_options(args))


def run(args: argparse.Namespace) -> int:
    try:
        plan = batch_plan(args)
        options = batch_options(args)
    except (PlanningError, ValueError) as err:
        print(f"trainer sbatch: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    script = pbs_script(plan, options) if args.pbs else slurm_script(plan, options)
    target = Path(args.output or f"{plan.run_name}.{'pbs' if args.pbs else 'sbatch'}")
    private = private_files(plan)
    if private and not Path(plan.shared_dir).is_dir():
        print(
            f"trainer sbatch: this job has secrets ({', '.join(private)}); they go to a file on the "
            f"shared dir, {plan.shared_dir}, which this machine does not have: run trainer sbatch where "
            "the shared dir is mounted (a login node), never with the secrets in the script",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    try:
        for name, text in private.items():
            write_private(Path(plan.launch_dir) / name, text)
    except OSError as err:
        print(
            f"trainer sbatch: cannot write the job's secrets to {err.filename}: {err.strerror}",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    target.unlink(missing_ok=True)
    with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755), "w") as handle:
        handle.write(script)
    submit = "qsub" if args.pbs else "sbatch"
    secrets_note = (
        f"; its secrets are in {', '.join(f'{plan.launch_dir}/{name}' for name in private)} (mode 0600), "
        "not in the script"
        if private
        else ""
    )
    print(
        f"wrote {target} ({plan.topology.nnodes} nodes x {plan.topology.gpus_per_node} processes, run "
        f"{plan.run_name}, output {plan.output_dir}){secrets_note}"
    )
    print(f"submit it with: {submit} {target}")
    return exitcodes.OK
