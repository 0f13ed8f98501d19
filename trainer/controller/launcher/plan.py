"""`trainer plan -i INVENTORY [-- COMMAND]`: the job a launch would start, printed; nothing is touched.

A JobPlan joins the topology (ranks, master, NCCL settings, from the inventory) with the trainer's
configuration (batch sizes, engine, precision), validated on the controller without torch, and what
each node runs: the bundled trainer under torchrun, or the user's own COMMAND (a script that reads
NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT and starts torchrun or `accelerate launch` itself), in
its working directory and with its environment. `trainer launch` starts exactly what `trainer plan`
shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from trainer import exitcodes
from trainer.controller.access import add_access_arguments, configure_access
from trainer.controller.inventory import Cluster, PlanningError, load_cluster
from trainer.controller.launcher import command_forms, config_sources, slurm_allocation, slurm_batch
from trainer.controller.launcher.topology import AUTO_IFNAME, Node, Topology, build_topology
from trainer.controller.training_env import (
    IB_AUTO,
    IB_DEVICES_DIR,
    EnvError,
    ExtraEnv,
    parse_env_options,
    parse_training_env,
    workdir_problem,
)
from trainer.engine_names import ENGINES
from trainer.redaction import REDACTED, redact_env, redact_override, secret_set_problem
from trainer.run_paths import RunPaths

DEFAULT_RUN_NAME = "default"
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class PlanError(PlanningError):
    """The job cannot be planned; the message names the problem and the fix."""


@dataclass(frozen=True)
class JobPlan:
    topology: Topology
    run_name: str
    engine: str
    shared_dir: str
    training_venv: str
    training_user: str
    config_source: str
    """Where the trainer config came from: a controller path, or "embedded default"."""
    overrides: tuple[str, ...]
    """The `--set` list applied to the config, launcher-derived ones first, the user's last."""
    config: dict[str, Any] = field(repr=False)
    """The resolved trainer config, secrets redacted (for showing)."""
    node_config: dict[str, Any] = field(repr=False)
    """The same with its secrets (the webhook URL): what every node trains with. Never printed."""
    user_command: tuple[str, ...] = ()
    """The user's own command for every node; empty = the bundled trainer under torchrun."""
    workdirs: Mapping[str, str] = field(default_factory=dict)
    """Host -> the directory the command runs in (training_workdir, default the shared dir)."""
    extra_env: Mapping[str, ExtraEnv] = field(default_factory=dict, repr=False)
    """Host -> training_env with --env on top: the variables added to that node's environment."""
    sources: Mapping[str, config_sources.Sourced] = field(default_factory=dict, repr=False)
    """Dotted config key -> its value (redacted) and where it came from (config_sources): what
    will train, and every value a layer set."""

    @property
    def runs_bundled_trainer(self) -> bool:
        return not self.user_command

    @property
    def world_checked(self) -> bool:
        """Whether the launcher checks that the workers join the head's job (world.py): the bundled
        trainer knows its world; a user's command on one node has nothing to join."""
        return not self.runs_bundled_trainer and self.topology.nnodes > 1

    @property
    def overruled(self) -> list[str]:
        """One line per config value that overrules what a lower layer set (config_sources.notes);
        the bundled trainer's only: a user's own command does not read the trainer config."""
        return config_sources.notes(self.sources) if self.runs_bundled_trainer else []

    @property
    def config_has_secrets(self) -> bool:
        return self.node_config != self.config

    @property
    def has_secrets(self) -> bool:
        """Whether anything sent to the nodes is secret (their Ansible tasks then run no_log)."""
        return self.config_has_secrets or any(e.secret for e in self.extra_env.values())

    @property
    def paths(self) -> RunPaths:
        """Every path of the run on the nodes (trainer.run_paths)."""
        return RunPaths.of(self.shared_dir, self.run_name)

    @property
    def output_dir(self) -> str:
        return str(self.paths.run_dir)

    @property
    def launch_dir(self) -> str:
        """Files the launcher writes for the run: config, DeepSpeed JSON, hostfile, node logs."""
        return str(self.paths.launch_dir)

    @property
    def deepspeed_config_path(self) -> str:
        return str(PurePosixPath(self.launch_dir) / "deepspeed.json")

    def accelerate_config_path(self, node: Node) -> str:
        return str(PurePosixPath(self.launch_dir) / f"accelerate-node{node.node_rank}.yaml")

    def command_form(self, node: Node) -> command_forms.Form:
        """The user's command as `node` runs it, and the launcher it starts (command_forms)."""
        topo = self.topology
        return command_forms.adapt(
            self.user_command,
            command_forms.NodeValues(
                nnodes=topo.nnodes,
                node_rank=node.node_rank,
                master_addr=topo.master_addr,
                master_port=topo.master_port,
                accelerate_config=self.accelerate_config_path(node),
                hostfile=str(PurePosixPath(self.launch_dir) / "hostfile"),
            ),
        )

    @property
    def user_launcher(self) -> str | None:
        """The launcher the user's command starts (torchrun, accelerate, deepspeed) or None."""
        return command_forms.launcher_of(self.user_command)[0]

    def workdir(self, node: Node) -> str:
        return self.workdirs.get(node.host) or self.shared_dir

    def node_env(
        self, node: Node, resolved_ifname: str | None = None, resolved_ib_disable: int | None = None
    ) -> dict[str, str]:
        """What `node`'s command gets besides the secrets: the topology, the NCCL settings, the
        generated files and the public part of training_env/--env (written into run.sh as is)."""
        env = self.topology.node_env(node, resolved_ifname, resolved_ib_disable)
        topo = self.topology
        # torchrun reads each option it is not given from PET_<OPTION>: a plain `torchrun train.py`
        # (many READMEs' form) then joins this job instead of starting one of its own per node.
        env |= {
            "PET_NNODES": str(topo.nnodes),
            "PET_NODE_RANK": str(node.node_rank),
            "PET_NPROC_PER_NODE": str(topo.gpus_per_node),
            "PET_MASTER_ADDR": topo.master_addr,
            "PET_MASTER_PORT": str(topo.master_port),
            "PET_RDZV_BACKEND": "static",
        }
        if not int(node.vars.get("cluster_accelerators") or 0):
            # The generated accelerate file says MULTI_GPU so that `accelerate launch` starts
            # GPUS_PER_NODE processes; on a CPU node this makes Accelerator() pick gloo (MULTI_CPU)
            # even in a script that does not pass cpu=True, instead of one single-process job each.
            env["ACCELERATE_USE_CPU"] = "true"
        env["CLUSTER_OUTPUT_DIR"] = self.output_dir
        env["DEEPSPEED_CONFIG"] = self.deepspeed_config_path
        env["ACCELERATE_CONFIG_FILE"] = self.accelerate_config_path(node)
        env.update(self.extra_env.get(node.host, ExtraEnv()).public)
        return env

    def node_secret_env(self, node: Node) -> dict[str, str]:
        """The secret variables for `node` (never in run.sh, never printed)."""
        return self.extra_env.get(node.host, ExtraEnv()).secrets

    def shown_env(self, node: Node) -> dict[str, str]:
        """`node`'s whole environment as `trainer plan` shows it: secrets redacted, `auto` settings
        described as they will be resolved at launch."""
        env = self.node_env(node)
        if node.nccl_socket_ifname == AUTO_IFNAME:
            env["NCCL_SOCKET_IFNAME"] = f"auto: =<the interface holding {node.address}> at launch"
        if self.topology.nccl_ib_disable == IB_AUTO:
            env["NCCL_IB_DISABLE"] = f"auto: 0 if every node lists devices in {IB_DEVICES_DIR}, else 1"
        extra = self.extra_env.get(node.host, ExtraEnv())
        env.update(redact_env(extra.secrets, extra.secret))
        return env

    @property
    def collective_timeout_s(self) -> int:
        """The bundled trainer's distributed.timeout_s (its config file may set it over
        cluster_nccl_timeout_s); the inventory's for a user's own command."""
        if self.runs_bundled_trainer:
            return int(self.config["distributed"]["timeout_s"])
        return self.topology.nccl_timeout_s

    @property
    def micro_batch_size(self) -> int:
        return int(self.config["train"]["micro_batch_size"])

    @property
    def gradient_accumulation_steps(self) -> int:
        return int(self.config["train"]["gradient_accumulation_steps"])

    @property
    def effective_batch_size(self) -> int:
        return self.micro_batch_size * self.topology.world_size * self.gradient_accumulation_steps

    def node_command(self, node: Node) -> list[str]:
        """What runs on `node`: the user's command as given, or the bundled trainer under torchrun
        with a static rendezvous on the head's master port.

        Static (not c10d) because it gives every node the rank the plan shows (c10d orders nodes
        by address) and keeps all rendezvous traffic on MASTER_PORT, the port the firewall opens.
        All three engines start this way; the trainer picks DDP, DeepSpeed or accelerate from
        `distributed.engine` (both read the torchrun environment). torchrun's --log-dir is the node
        dir's `torchrun/`: each launch gets a subdir named after its launch id (run.sh sets the
        rendezvous id to it), holding each rank's `error.json` (the rank's exception, written by the
        trainer's `@record`), which `trainer launch` reads to name the root cause.
        """
        if self.user_command:
            return list(self.command_form(node).command)
        topo = self.topology
        venv = PurePosixPath(self.training_venv)
        return [
            str(venv / "bin" / "torchrun"),
            f"--nnodes={topo.nnodes}",
            f"--nproc-per-node={topo.gpus_per_node}",
            f"--node-rank={node.node_rank}",
            f"--master-addr={topo.master_addr}",
            f"--master-port={topo.master_port}",
            "--max-restarts=0",
            f"--log-dir={self.paths.torchrun_log_dir(node.node_rank)}",
            "--no-python",
            str(venv / "bin" / "trainer"),
            "train",
            "--config",
            str(PurePosixPath(self.launch_dir) / "config.yaml"),
        ]

    def as_dict(self) -> dict[str, Any]:
        bundled = self.runs_bundled_trainer
        return {
            **self.topology.as_dict(),
            "run_name": self.run_name,
            "engine": self.engine if bundled else None,
            "user_command": list(self.user_command) or None,
            "user_launcher": self.user_launcher,
            "output_dir": self.output_dir,
            "training_venv": self.training_venv,
            "training_user": self.training_user,
            "config_source": self.config_source,
            "overrides": [redact_override(o) for o in self.overrides],
            "sources": {k: v.as_dict() for k, v in self.sources.items()} if bundled else None,
            "overruled": self.overruled,
            "micro_batch_size": self.micro_batch_size if bundled else None,
            "gradient_accumulation_steps": self.gradient_accumulation_steps if bundled else None,
            "effective_batch_size": self.effective_batch_size if bundled else None,
            "workdirs": {n.host: self.workdir(n) for n in self.topology.nodes},
            "env": {n.host: self.shown_env(n) for n in self.topology.nodes},
            "commands": {n.host: self.node_command(n) for n in self.topology.nodes},
        }


def _config_path(cluster: Cluster, cli_config: str | None) -> Path | None:
    raw = cli_config or str(cluster.head.get("training_config") or "")
    if not raw:
        return None
    path = Path(raw).expanduser()
    # training_config in the inventory may be relative to the inventory directory.
    candidates = [path] if path.is_absolute() or cli_config else [path, cluster.inventory / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    source = "--config" if cli_config else "training_config"
    raise PlanError(f"{source}: trainer config {raw} does not exist; give the path of a trainer YAML file")


def _absolute(cluster: Cluster, var: str) -> str:
    value = str(cluster.head.get(var) or "")
    if not value.startswith("/"):
        raise PlanError(
            f"{var} must be an absolute path on the nodes (got {value!r}); set it in group_vars/cluster"
        )
    return value.rstrip("/") or "/"


def make_plan(
    inventory: str | Path | Cluster,
    config: str | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    engine: str | None = None,
    run_name: str = DEFAULT_RUN_NAME,
    command: Sequence[str] = (),
    env_options: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> JobPlan:
    """Everything `trainer launch` needs, checked; raises a PlanningError (InventoryError, TopologyError
    or PlanError).

    `inventory` is a path, or a Cluster already built (`trainer sbatch --nodes N` has no inventory).
    `command` is the user's own command for every node (empty: the bundled trainer); `env_options`
    the `--env NAME[=VALUE]` list (a bare NAME takes its value from `environ`, default os.environ).
    """
    _check_job_arguments(run_name, overrides, engine, command)
    try:
        cli_env = parse_env_options(env_options, environ)
    except EnvError as err:
        raise PlanError("; ".join(err.problems)) from None
    cluster = inventory if isinstance(inventory, Cluster) else load_cluster(inventory)
    topology = build_topology(cluster)
    if command and (why := command_forms.problem(command, topology.nnodes)):
        raise PlanError(why)
    shared_dir = _absolute(cluster, "cluster_shared_dir")
    venv = _absolute(cluster, "training_venv")
    config_path = _config_path(cluster, config)
    workdirs, extra_env = _node_settings(cluster, shared_dir, cli_env)

    # One precedence rule (config_sources): trainer default < inventory group_vars < the config
    # file < --set < --engine; an inventory value goes in only where the file does not set the key.
    layers = config_sources.Layers(
        inventory=_inventory_settings(cluster),
        file_label="--config" if config else "training_config",
        file_values=config_sources.read_file_values(config_path),
        sets=tuple(overrides),
        engine=engine,
    )
    final = layers.overrides()
    final.append(f"output_dir={RunPaths.of(shared_dir, run_name).run_dir}")

    # The trainer's own loader: the same checks `trainer train` makes, before anything starts.
    from trainer.configerror import ConfigError
    from trainer.node.config import load_config

    try:
        loaded = load_config(config_path, final)
    except ConfigError as err:
        raise PlanError(f"trainer config: {err}") from None
    shown_config = loaded.to_dict()
    return JobPlan(
        topology=topology,
        run_name=run_name,
        engine=str(loaded.distributed.engine),
        shared_dir=shared_dir,
        training_venv=venv,
        training_user=str(cluster.head.get("cluster_training_user") or ""),
        config_source=str(config_path) if config_path else "embedded default",
        overrides=tuple(final),
        config=shown_config,
        node_config=loaded.to_dict(secrets=True),
        sources=layers.sources(shown_config),
        user_command=tuple(command),
        workdirs=workdirs,
        extra_env=extra_env,
    )


def _check_job_arguments(
    run_name: str, overrides: Sequence[str], engine: str | None, command: Sequence[str]
) -> None:
    """make_plan's arguments on their own, before the inventory is read; raises a PlanError."""
    if not _RUN_NAME.fullmatch(run_name):
        raise PlanError(
            f"--run-name {run_name!r} is not a valid run name; use letters, digits, '.', '_' or '-' "
            "(at most 64, starting with a letter or digit)"
        )
    for item in overrides:
        if "=" not in item:
            raise PlanError(f"--set {item!r}: expected section.key=value, e.g. train.max_steps=100")
        if problem := secret_set_problem(item):
            raise PlanError(problem)
        if item.split("=", 1)[0].strip() == "output_dir":
            raise PlanError(
                "--set output_dir is not allowed with trainer launch: the run goes to "
                "<cluster_shared_dir>/runs/<run name> so every node sees it; use --run-name instead"
            )
    if engine is not None and engine not in ENGINES:
        raise PlanError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if command and engine:
        raise PlanError(
            "--engine picks the bundled trainer's engine; your own command starts its own launcher "
            "(torchrun, deepspeed or accelerate launch): leave --engine out"
        )
    if command and not command[0]:
        raise PlanError("the command after -- is empty; give the program to run, e.g. -- bash train.sh")


def _inventory_settings(cluster: Cluster) -> dict[str, tuple[str, Any]]:
    """The trainer config values the inventory sets: dotted key -> (its variable, the value)."""
    settings: dict[str, tuple[str, Any]] = {}
    for key, var in (
        ("distributed.engine", "training_engine"),
        ("distributed.zero_stage", "training_zero_stage"),
        # The seed guides' "increase the NCCL timeout": the trainer's process-group timeout.
        ("distributed.timeout_s", "cluster_nccl_timeout_s"),
        ("data.path", "cluster_data_path"),
        # A secret, usually vaulted in the inventory; shown redacted like any health.webhook_url.
        ("health.webhook_url", "training_health_webhook_url"),
    ):
        value = cluster.head.get(var)
        if value not in (None, ""):
            settings[key] = (var, value)
    return settings


def _node_settings(
    cluster: Cluster, shared_dir: str, cli_env: ExtraEnv
) -> tuple[dict[str, str], dict[str, ExtraEnv]]:
    """Per host: the working directory and the added environment (training_env, then --env)."""
    # The same problem on several hosts (a group_vars value) is one message naming them all.
    problems: dict[str, list[str]] = {}
    workdirs: dict[str, str] = {}
    extra_env: dict[str, ExtraEnv] = {}
    for host in cluster.hosts:
        raw_workdir = host.get("training_workdir")
        if problem := workdir_problem(raw_workdir):
            problems.setdefault(problem, []).append(host.name)
        else:
            workdirs[host.name] = str(raw_workdir or shared_dir).rstrip("/") or "/"
        try:
            extra_env[host.name] = parse_training_env(host.get("training_env")).merged(cli_env)
        except EnvError as err:
            for problem in err.problems:
                problems.setdefault(problem, []).append(host.name)
    if problems:
        raise PlanError(
            "\n".join(
                f"{'host' if len(hosts) == 1 else 'hosts'} {', '.join(hosts)}: {problem}"
                for problem, hosts in problems.items()
            )
        )
    return workdirs, extra_env


# --- command line ---------------------------------------------------------------------------------


def add_job_arguments(parser: argparse.ArgumentParser, inventory_required: bool = True) -> None:
    """Options shared by `trainer plan`, `trainer launch` and `trainer sbatch`."""
    parser.add_argument("-i", "--inventory", required=inventory_required, help="inventory directory or file")
    parser.add_argument("--config", help="trainer YAML config on this machine (default: training_config)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one trainer config value, e.g. --set train.max_steps=100 (repeatable)",
    )
    parser.add_argument("--engine", choices=ENGINES, help="override distributed.engine (bundled trainer)")
    parser.add_argument(
        "--run-name",
        default=DEFAULT_RUN_NAME,
        help="output goes to <cluster_shared_dir>/runs/<run name>; a relaunch with the same name "
        "resumes from its latest checkpoint (default: %(default)s)",
    )
    add_env_argument(parser)
    add_access_arguments(parser)
    parser.epilog = COMMAND_EPILOG


def add_env_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--env",
        dest="env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="add a variable to every node's environment, over training_env (repeatable); NAME alone "
        "takes this shell's value, so a key stays off the command line; names such as *_KEY, "
        "*_TOKEN, *_SECRET and values with a credential in a URL (http://user:pass@...) are secret "
        "(redacted, never in run.sh) and must be given as NAME alone",
    )


#: How the user's own command is given (cli.py splits the arguments at the first `--`).
COMMAND_EPILOG = (
    "-- COMMAND [ARGS...]: run your own command on every node instead of the bundled trainer, in "
    "training_workdir (default: the shared dir), as the training user, with NNODES, NODE_RANK, "
    "MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE, WORLD_SIZE, the NCCL settings, DEEPSPEED_CONFIG, "
    "ACCELERATE_CONFIG_FILE and CLUSTER_OUTPUT_DIR set, e.g. -- bash finetune/finetune_lora_ds.sh"
)
#: cli.py gives these verbs what follows `--` as args.command.
TAKES_COMMAND = True
EXAMPLES = (
    "trainer plan -i inventory/mycluster  # ranks, master, NCCL settings, each node's environment",
    "trainer plan -i inventory/mycluster --engine deepspeed --set train.max_steps=1000 --json",
    "trainer plan -i inventory/mycluster -- bash finetune/finetune_lora_ds.sh  # your own command",
    "trainer plan --slurm -i inventory/mycluster --nodes 4 --time 24:00:00  # the batch job and its script",
)


def plan_from_args(
    args: argparse.Namespace,
    cluster: Cluster | None = None,
    excluded: Set[str] = frozenset(),
    extra: Sequence[str] = (),
) -> JobPlan:
    """The job a command line of add_job_arguments describes, from `cluster` (one already loaded, or
    made without an inventory: `trainer sbatch --nodes N`) or else args.inventory; without the
    `excluded` hosts and with `extra` --set after the user's (a restart that leaves nodes out)."""
    source: str | Cluster = args.inventory if cluster is None else cluster
    if excluded:
        assert isinstance(source, Cluster), "hosts are left out of a cluster already loaded"
        kept = tuple(h for h in source.workers if h.name not in excluded)
        source = dataclasses.replace(source, workers=kept)
    return make_plan(
        source,
        args.config,
        (*args.overrides, *extra),
        args.engine,
        args.run_name,
        command=tuple(getattr(args, "command", None) or ()),
        env_options=tuple(args.env),
    )


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    parser.add_argument(
        "config_file", nargs="?", metavar="CONFIG", help="trainer YAML config on this machine, as --config"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_over_ssh_argument(parser)
    slurm_batch.add_slurm_arguments(parser)


def add_over_ssh_argument(parser: argparse.ArgumentParser) -> None:
    """--over-ssh, for `trainer launch` and `trainer plan`."""
    parser.add_argument(
        "--over-ssh",
        action="store_true",
        help="inside a Slurm allocation (SLURM_JOB_ID set), launch over SSH with Ansible on the inventory's "
        "hosts as outside one, instead of as a step of the allocation on its nodes (srun)",
    )


def config_from_positional(args: argparse.Namespace) -> str | None:
    """`trainer VERB -i INV CONFIG`, as `trainer train CONFIG`: CONFIG is --config; a problem (two
    different files given) or None."""
    if getattr(args, "config_file", None):
        if args.config and args.config != args.config_file:
            return f"two config files given ({args.config_file} and --config {args.config}); give one"
        args.config = args.config_file
    return None


def print_plan(plan: JobPlan, console: Any = None) -> None:
    from rich.console import Console

    console = console or Console()
    _print_summary(plan, console)
    for line in plan.overruled:  # a value the user set that another one overrules: never silent
        console.print(f"overruled: {line}", soft_wrap=True, markup=False, highlight=False)
    _print_nodes(plan.topology, console)
    _print_environments(plan, console)


def _print_summary(plan: JobPlan, console: Any) -> None:
    from rich.table import Table

    topo = plan.topology
    summary = Table(title=f"Training job from {topo.inventory}", show_header=False, title_justify="left")
    summary.add_column("setting", style="bold")
    summary.add_column("value")
    ifnames = {n.nccl_socket_ifname for n in topo.nodes}
    ifname = (
        "auto (resolved at launch: =<interface holding cluster_ip>)"
        if ifnames == {AUTO_IFNAME}
        else ", ".join(sorted(ifnames))
    )
    ib_disable = (
        f"auto (resolved at launch: 0 if every node lists devices in {IB_DEVICES_DIR}, else 1)"
        if topo.nccl_ib_disable == IB_AUTO
        else topo.nccl_ib_disable
    )
    for key, value in (
        ("NNODES", topo.nnodes),
        ("MASTER_ADDR", topo.master_addr),
        ("MASTER_PORT", topo.master_port),
        ("GPUS_PER_NODE", topo.gpus_per_node),
        ("world size", topo.world_size),
        *_job_rows(plan),
        ("NCCL_SOCKET_IFNAME", ifname),
        ("NCCL_IB_DISABLE", ib_disable),
        ("NCCL_DEBUG", topo.nccl_debug),
        ("collective timeout", f"{plan.collective_timeout_s} s (distributed.timeout_s)"),
        ("trainer config", plan.config_source),
        ("output dir", plan.output_dir),
    ):
        summary.add_row(key, str(value))
    console.print(summary)


def _job_rows(plan: JobPlan) -> list[tuple[str, Any]]:
    """The summary's rows of what runs: the bundled trainer's config, or the user's command."""
    topo = plan.topology
    if plan.runs_bundled_trainer:
        return [
            *config_sources.rows(plan.sources),
            (
                "effective batch size",
                f"{plan.effective_batch_size} = micro batch {plan.micro_batch_size} × world "
                f"{topo.world_size} × accumulation {plan.gradient_accumulation_steps}",
            ),
        ]
    job: list[tuple[str, Any]] = [("command", f"your own: {shlex.join(plan.user_command)}")]
    if plan.user_launcher:
        added = plan.command_form(topo.head).added
        job.append(
            (
                "launcher",
                f"{plan.user_launcher}: reads "
                + ", ".join(command_forms.READS[plan.user_launcher])
                + (f"; added on each node: {' '.join(added)}" if added else ""),
            )
        )
    elif topo.nnodes > 1:
        job.append(
            (
                "launcher",
                "not one the launcher recognises (torchrun, python -m torch.distributed.run, "
                "accelerate launch, deepspeed): it runs as given; after the start the launcher "
                "warns when a node never connects to the head",
            )
        )
    return job


def _print_nodes(topo: Topology, console: Any) -> None:
    from rich.table import Table

    nodes = Table(title="Nodes", title_justify="left")
    for column in ("NODE_RANK", "host", "address", "global ranks"):
        nodes.add_column(column)
    for node in topo.nodes:
        ranks = node.global_ranks(topo.gpus_per_node)
        nodes.add_row(
            str(node.node_rank),
            node.host,
            node.address,
            f"{ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else str(ranks.start),
        )
    console.print(nodes)


def _print_environments(plan: JobPlan, console: Any) -> None:
    """Each node's environment: what every node shares once, then what is this node's own."""
    topo = plan.topology
    envs = {node.host: plan.shown_env(node) for node in topo.nodes}
    common = {k: v for k, v in envs[topo.head.host].items() if all(env.get(k) == v for env in envs.values())}
    console.print("[bold]Environment on every node[/bold]:")
    for key, value in common.items():
        console.print(f"  {key}={_shown_value(value)}", soft_wrap=True, markup=False)
    console.print(
        f"[bold]Per-node environment and command[/bold] (trainer launch writes them to "
        f"{plan.paths.node_dir('N')}/run.sh; secrets go to node-N/secret-env, readable by the training "
        "user only):"
    )
    for node in topo.nodes:
        console.print(f"  node {node.node_rank} ({node.host}):", markup=False)
        for key, value in envs[node.host].items():
            if key not in common:
                console.print(f"    {key}={_shown_value(value)}", soft_wrap=True, markup=False)
        console.print(
            f"    cd {shlex.quote(plan.workdir(node))} && {shlex.join(plan.node_command(node))}",
            soft_wrap=True,
            markup=False,
        )


def _shown_value(value: str) -> str:
    return value if value == REDACTED or value.startswith("auto: ") else shlex.quote(value)


def run(args: argparse.Namespace) -> int:
    if problem := config_from_positional(args):
        print(f"trainer plan: {problem}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    job = None if args.over_ssh else slurm_allocation.allocation_job()
    if problem := slurm_batch.slurm_option_problem(args, job):
        print(f"trainer plan: {problem}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if args.slurm:
        return _print_login_plan(args)
    try:
        configure_access(args)  # sudo/vault passwords (trainer.controller.access)
        cluster = None
        if job is not None:  # `trainer launch` here runs the job on the allocation's nodes
            cluster = slurm_allocation.allocation_cluster(args.inventory)
        plan = plan_from_args(args, cluster)
    except PlanningError as err:
        print(f"trainer plan: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    asked = _slurm_request(plan, job) if job is not None else None
    if args.json:
        print(json.dumps({**plan.as_dict(), **({"slurm": asked} if asked else {})}, indent=2))
        return exitcodes.OK
    print_plan(plan)
    if asked:
        print(
            f"Slurm: inside allocation {job}, `trainer launch` runs one step on its {len(asked['nodes'])} "
            f"node(s), one task each, no SSH: {asked['srun']}"
        )
        if asked.get("at_time_limit"):
            print(f"At the time limit: {asked['at_time_limit']}")
    return exitcodes.OK


def slurm_login_plan(args: argparse.Namespace) -> tuple[JobPlan, slurm_batch.BatchJob, dict[str, str]]:
    """`--slurm` on a login node: the plan on the nodes Slurm will name (placeholders here), the batch
    job that runs it (what `trainer launch --slurm` submits and `trainer plan --slurm` shows), and the
    secret --env variables, which go to slurm_batch.SECRET_ENV; a PlanningError names a problem."""
    configure_access(args)  # vault passwords (trainer.controller.access)
    plan = plan_from_args(args, slurm_batch.login_cluster(load_cluster(args.inventory), args.nodes))
    try:
        secrets = parse_env_options(tuple(args.env)).secrets
        options = slurm_batch.batch_options(args)
    except (EnvError, ValueError) as err:
        raise PlanError(str(err)) from None
    config = str(PurePosixPath(plan.launch_dir) / slurm_batch.CONFIG_COPY) if args.config else None
    on_gpus = int(plan.topology.head.vars.get("cluster_accelerators") or 0) > 0
    job = slurm_batch.BatchJob(
        run_name=plan.run_name,
        launch_dir=plan.launch_dir,
        workdir=str(Path.cwd()),
        nodes=plan.topology.nnodes,
        gpus_per_node=plan.topology.gpus_per_node if on_gpus else 0,
        bundled=plan.runs_bundled_trainer,
        guest_argv=tuple(
            slurm_batch.guest_argv(args, str(PurePosixPath(plan.training_venv) / "bin" / "python"), config)
        ),
        secrets=bool(secrets),
        options=options,
        # `trainer plan --slurm` has no --exclude-failed: the plan shows the job without it.
        keep_allocation=bool(getattr(args, "exclude_failed", False)),
    )
    return plan, job, secrets


def _print_login_plan(args: argparse.Namespace) -> int:
    """`trainer plan --slurm`: the job, and what Slurm is asked for (the sbatch line and the script)."""
    try:
        plan, job, _ = slurm_login_plan(args)
    except PlanningError as err:
        print(f"trainer plan: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    options = job.options
    asked = {
        "nodes": job.nodes,
        "tasks_per_node": 1,
        "processes_per_node": plan.topology.gpus_per_node,
        "gpus_per_node": job.gpus_per_node,
        "time": options.time_limit or None,
        "partition": options.partition or None,
        "sbatch": shlex.join(job.sbatch_argv()),
        "script": job.script(),
    }
    if args.json:
        print(json.dumps({**plan.as_dict(), "slurm": asked}, indent=2))
        return exitcodes.OK
    print_plan(plan)
    print(
        f"Slurm: `trainer launch --slurm` submits one batch job from here: {job.nodes} node(s), one task "
        f"per node, {plan.topology.gpus_per_node} process(es) per node"
        + (f", {job.gpus_per_node} GPU(s) per node" if job.gpus_per_node else "")
        + f", time {options.time_limit or 'the partition default'}, partition "
        f"{options.partition or 'the cluster default'}. Slurm names the nodes when the job starts ("
        f"{slurm_batch.PLACEHOLDER.format(rank='N')} above stand for them; the head is the first). In the "
        "job, `trainer launch` runs them as Slurm steps; this machine follows the job with one squeue a poll."
    )
    print(f"Submitted as: {asked['sbatch']}")
    print(f"Its script ({PurePosixPath(plan.launch_dir) / slurm_batch.BATCH_SCRIPT}):")
    print(job.script(), end="")
    return exitcodes.OK


def _slurm_request(plan: JobPlan, job: str) -> dict[str, Any]:
    """What a launch in allocation `job` asks Slurm for: the step's srun (its name carries the
    launch id, made at launch)."""
    hosts = [n.host for n in plan.topology.nodes]
    script = str(PurePosixPath(plan.launch_dir) / slurm_allocation.STEP_SCRIPT)
    argv = slurm_allocation.srun_argv(job, hosts, slurm_allocation.step_name("LAUNCH_ID"), script)
    asked = {"job": job, "nodes": hosts, "srun": shlex.join(argv)}
    if plan.runs_bundled_trainer:
        asked["at_time_limit"] = _at_time_limit(job)
    return asked


def _at_time_limit(job: str) -> str:
    """What happens at the allocation's end (slurm_requeue.py): one scontrol call."""
    warned = (
        "with `--signal=USR2@SECONDS` (trainer sbatch writes it) Slurm warns the trainer, which saves the "
        "step it is in and stops (exit 5)"
    )
    try:
        blocker = slurm_allocation.requeue_blocker(job)
    except slurm_allocation.SlurmError as err:
        blocker = f"scontrol could not say: {err}"
    if blocker is None:
        return f"{warned}; `trainer launch` requeues job {job}, which resumes from that checkpoint"
    return f"{warned}; job {job} is not requeued ({blocker}): run the same command again to resume"
