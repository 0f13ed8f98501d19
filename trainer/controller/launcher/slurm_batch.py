"""The batch job `trainer launch --slurm` submits from a Slurm login node (issue 40): its options, its
script and the `trainer launch` it runs inside the allocation ("guest mode", guest.py).

One job, whose script runs `trainer launch` with the same options as the login node's, without
--slurm: inside the allocation it finds SLURM_JOB_ID and runs the nodes as a step of it, with the
same diagnosis, restarts and lost-node exclusion as there. Nothing secret is in the script or on its
command line (Slurm keeps both in its state): a secret `--env NAME` is written beside it, mode 0600,
and sourced by the script; a trainer config file is copied into the launch dir, mode 0600, since it
may hold the webhook URL. The script writes the guest launcher's exit code to a file on the shared
dir, which the login node reads when the job ends (slurm_follow.py).

Kept apart from slurm_login.py and free of plan.py so that `trainer plan --slurm` (plan.py) shows the
same script and sbatch line the launch submits.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from trainer.controller.inventory import Cluster
from trainer.controller.launcher.slurm_allocation import SlurmNode, guest_cluster

#: Slurm's own limit on --signal's time.
MAX_WARNING_S = 65535
#: The launch dir's files of a job submitted from a login node.
BATCH_SCRIPT = "slurm-batch.sh"
#: The job's output (the guest launcher's), one file per job id; a requeued job appends to it.
BATCH_OUTPUT = "slurm-batch-{job}.out"
#: {"job", "restart", "code"}: the guest launcher's exit code, written by the script as it ends.
BATCH_EXIT = "slurm-batch-exit.json"
#: The secret `--env NAME` variables, `export NAME=VALUE` lines, mode 0600, sourced by the script.
SECRET_ENV = "slurm-secret-env"
#: The trainer config file given on the login node, copied (mode 0600) where the job reads it.
CONFIG_COPY = "slurm-config.yaml"
#: Placeholder names of the job's nodes in the login node's plan: Slurm picks them when the job starts.
PLACEHOLDER = "slurm-node-{rank}"
PLACEHOLDER_ADDRESS = "<assigned by Slurm>"


@dataclass(frozen=True)
class BatchOptions:
    """Scheduler settings that are not part of the job itself (empty = the site's default)."""

    time_limit: str = ""
    """--time: the job's time limit, e.g. 24:00:00."""
    partition: str = ""
    """--partition: the Slurm partition (a PBS queue)."""
    cpus_per_task: int = 0
    """--cpus-per-task: CPUs for each node's task (data loaders)."""
    warning_s: int = 120
    """Slurm sends SIGUSR2 this many seconds before the job's end (the bundled trainer saves and stops);
    0: no signal. 120 by default: a save of a large model on a slow share takes a minute."""


def add_batch_options(group: argparse._ArgumentGroup) -> None:
    """--time, --partition, --cpus-per-task and --warning-seconds: `trainer sbatch`'s and those of
    `trainer launch/plan --slurm`."""
    group.add_argument("--time", default="", help="time limit, e.g. 24:00:00 (default: the site's)")
    group.add_argument("--partition", default="", help="partition (Slurm) or queue (PBS)")
    group.add_argument("--cpus-per-task", type=int, default=0, help="CPUs per node's task (dataloaders)")
    group.add_argument(
        "--warning-seconds",
        type=int,
        default=BatchOptions.warning_s,
        metavar="S",
        help="Slurm sends SIGUSR2 S seconds before the time limit: the bundled trainer saves the step it is "
        f"in and stops, to resume from there (0: no signal; at most {MAX_WARNING_S}; default: %(default)s)",
    )


def batch_options(args: argparse.Namespace) -> BatchOptions:
    """The command line's BatchOptions; ValueError naming a bad --warning-seconds."""
    if not 0 <= args.warning_seconds <= MAX_WARNING_S:
        raise ValueError(f"--warning-seconds must be 0 to {MAX_WARNING_S}, not {args.warning_seconds}")
    return BatchOptions(
        time_limit=args.time,
        partition=args.partition,
        cpus_per_task=args.cpus_per_task,
        warning_s=args.warning_seconds,
    )


def add_slurm_arguments(parser: argparse.ArgumentParser) -> None:
    """--slurm and the job's size and limits, for `trainer launch` and `trainer plan`."""
    group = parser.add_argument_group(
        "Slurm, from a login node",
        "with --slurm: submit one batch job whose script runs this same `trainer launch` inside the "
        "allocation (its nodes as Slurm steps), and follow it from here",
    )
    group.add_argument(
        "--slurm",
        action="store_true",
        help="on a Slurm cluster's login node (outside an allocation): submit the run as a batch job and "
        "follow it to its end; Ctrl-C and `trainer stop` cancel the job (scancel)",
    )
    group.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="with --slurm: nodes to ask for (default: the inventory's number of hosts; Slurm picks them)",
    )
    add_batch_options(group)


def slurm_defaults() -> dict[str, object]:
    """--slurm and the job's options at their defaults (off): for a command that runs `trainer launch`
    without taking them (`trainer up`, which provisions over SSH)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_slurm_arguments(parser)
    return vars(parser.parse_args([]))


def slurm_option_problem(args: argparse.Namespace, inside_allocation: str | None) -> str | None:
    """What is wrong with the command line's Slurm options, or None."""
    given = [
        option
        for option, value, default in (
            ("--nodes", args.nodes, None),
            ("--time", args.time, ""),
            ("--partition", args.partition, ""),
            ("--cpus-per-task", args.cpus_per_task, 0),
            ("--warning-seconds", args.warning_seconds, BatchOptions.warning_s),
        )
        if value != default
    ]
    if not args.slurm:
        return f"{', '.join(given)}: only with --slurm (a batch job from a login node)" if given else None
    if inside_allocation is not None:
        return (
            f"--slurm submits a job from a login node, but this runs inside Slurm job {inside_allocation}: "
            "leave --slurm out (trainer launch runs its steps in this allocation)"
        )
    if getattr(args, "over_ssh", False):
        return "--slurm and --over-ssh: give one (a Slurm batch job, or a launch over SSH)"
    if args.nodes is not None and args.nodes < 1:
        return f"--nodes must be 1 or more, not {args.nodes}"
    if args.cpus_per_task < 0:
        return f"--cpus-per-task must be 0 or more, not {args.cpus_per_task}"
    if not 0 <= args.warning_seconds <= MAX_WARNING_S:
        return f"--warning-seconds must be 0 to {MAX_WARNING_S}, not {args.warning_seconds}"
    return None


def login_cluster(cluster: Cluster, nodes: int | None) -> Cluster:
    """The job as the login node plans it: the inventory's settings on `nodes` nodes (default: as many
    as it has hosts) that Slurm names when the job starts (placeholders here)."""
    count = nodes or len(cluster.hosts)
    placeholders = [SlurmNode(PLACEHOLDER.format(rank=r), PLACEHOLDER_ADDRESS) for r in range(count)]
    # No SLURM_GPUS_ON_NODE on a login node: the GPUs per node are the inventory's.
    return guest_cluster(cluster, placeholders, env={})


def guest_argv(args: argparse.Namespace, python: str, config: str | None) -> list[str]:
    """The `trainer launch` the batch script runs in the allocation: the login node's options, without
    the Slurm ones; `config`: where the job reads the config file (CONFIG_COPY), if one was given.
    `--env NAME` stays a bare name: its value comes from the job's environment or SECRET_ENV."""
    argv = [python, "-m", "trainer", "launch", "-i", str(Path(args.inventory).resolve())]
    argv += ["--run-name", args.run_name]
    if config:
        argv += ["--config", config]
    for item in args.overrides:
        argv += ["--set", item]
    if args.engine:
        argv += ["--engine", args.engine]
    for item in args.env:
        argv += ["--env", item]
    for path in args.vault_password_files:
        argv += ["--vault-password-file", str(Path(path).resolve())]
    # `trainer plan --slurm` has none of these: the script it shows runs the plain launch.
    if getattr(args, "max_restarts", 0):
        argv += ["--max-restarts", str(args.max_restarts)]
    for flag in ("exclude_failed", "allow_batch_change", "no_rejoin", "force"):
        if getattr(args, flag, False):
            argv.append("--" + flag.replace("_", "-"))
    for option in ("poll_interval", "unreachable_grace", "stall_timeout", "stop_grace", "world_timeout"):
        value = getattr(args, option, None)
        if value is not None:
            argv += ["--" + option.replace("_", "-"), f"{value:g}"]
    command = list(getattr(args, "command", None) or ())
    return [*argv, "--", *command] if command else argv


@dataclass(frozen=True)
class BatchJob:
    """What the login node submits: the job's shape, where its files go, what its script runs."""

    run_name: str
    """The run (--run-name): the job is named clustertrain-<run name>."""
    launch_dir: str
    """The run's launch dir on the shared dir (the script, its output, its exit code)."""
    workdir: str
    """Where the script runs `trainer launch` (the login node's current directory)."""
    nodes: int
    """Nodes asked for (--nodes), one task each."""
    gpus_per_node: int
    """GPUs each node asks for (0 on CPU nodes)."""
    bundled: bool
    """The bundled trainer (it saves on Slurm's warning signal) or your command."""
    guest_argv: tuple[str, ...]
    """The `trainer launch` the script runs in the allocation (slurm_batch.guest_argv)."""
    secrets: bool
    """Whether the script sources SECRET_ENV."""
    options: BatchOptions
    """--time, --partition, --cpus-per-task, --warning-seconds."""
    keep_allocation: bool = False
    """--no-kill: a lost node ends its part of the job, not the job (the launch's --exclude-failed: the
    launcher in the job leaves the node out and goes on). Slurm's default ends the whole job."""
    exclude: tuple[str, ...] = ()
    """--exclude: nodes the job must not run on (a job resubmitted without the batch node it lost)."""

    def path(self, name: str) -> str:
        return str(PurePosixPath(self.launch_dir) / name)

    def script(self) -> str:
        """slurm-batch.sh: the directives, then `trainer launch` in the allocation, then its exit code
        written where the login node reads it."""
        exit_file = shlex.quote(self.path(BATCH_EXIT))
        lines = [
            "#!/bin/bash",
            f"# Run {self.run_name}: `trainer launch` inside this job's allocation, its nodes as Slurm",
            "# steps (guest mode). Submitted and followed by `trainer launch --slurm` on a login node.",
            f"#SBATCH --job-name={shlex.quote('clustertrain-' + self.run_name)}",
            f"#SBATCH --nodes={self.nodes}",
            "#SBATCH --ntasks-per-node=1",
            *self._size_lines(),
            # A requeued job appends to its output: the login node keeps reading the same file.
            "#SBATCH --open-mode=append",
        ]
        if self.keep_allocation:
            lines += [
                "# A lost node ends its part, not the job: trainer launch leaves it out.",
                "#SBATCH --no-kill",
            ]
        if self.bundled and self.options.warning_s:
            lines += [
                "# Before the time limit (or `scancel --signal=USR2 JOB` before a preemption) the trainer",
                "# saves the step it is in and stops; trainer launch then requeues this job, which resumes.",
                f"#SBATCH --signal=USR2@{int(self.options.warning_s)}",
                "#SBATCH --requeue",
            ]
        lines += [
            # A scancel's TERM reaches trainer launch too, which stops the step and names it; the shell
            # waits for it (a trap runs after the command it interrupts) to write its exit code.
            "trap 'echo \"[clustertrain] the batch shell got SIGTERM: waiting for trainer launch\" >&2' TERM",
            f"cd {shlex.quote(self.workdir)} || exit 2",
            "export PYTHONUNBUFFERED=1  # the login node follows this job's output as it is written",
        ]
        if self.secrets:
            secret = shlex.quote(self.path(SECRET_ENV))
            lines.append(f". {secret} || exit 2  # the secret variables, mode 0600, never in this script")
        lines += [
            shlex.join(self.guest_argv),
            "code=$?",
            f'printf \'{{"job": "%s", "restart": %s, "code": %s}}\\n\' "$SLURM_JOB_ID" '
            f'"${{SLURM_RESTART_COUNT:-0}}" "$code" > {exit_file}.tmp && mv -f {exit_file}.tmp {exit_file}',
            'exit "$code"',
        ]
        return "\n".join(lines) + "\n"

    def _size_lines(self) -> list[str]:
        """The directives of what is asked beyond the nodes: GPUs, CPUs, time, partition."""
        options = self.options
        asked = [
            ("gpus-per-node", str(self.gpus_per_node) if self.gpus_per_node else ""),
            ("cpus-per-task", str(options.cpus_per_task) if options.cpus_per_task else ""),
            ("time", options.time_limit),
            ("partition", options.partition),
            ("exclude", ",".join(self.exclude)),
        ]
        return [f"#SBATCH --{name}={shlex.quote(value)}" for name, value in asked if value]

    def sbatch_argv(self) -> list[str]:
        """The submission: the output on the shared dir (an argument, not a directive: any path)."""
        output = self.path(BATCH_OUTPUT.format(job="%j"))
        return ["sbatch", "--parsable", f"--output={output}", self.path(BATCH_SCRIPT)]


def secret_lines(secrets: dict[str, str]) -> str:
    """SECRET_ENV's text: one `export NAME=VALUE` a variable, quoted."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in sorted(secrets.items()))
