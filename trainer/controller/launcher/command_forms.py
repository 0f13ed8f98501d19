"""The launchers users start their own command with, and how each is made to form one job.

`trainer launch -- COMMAND` runs COMMAND on every node. Users bring it in the forms the seed guides
and the tools' READMEs show; each reads the job's shape from a different place, and the forms
that read nothing silently start one separate job per node. What is recognised (the command's first
word, or `python -m`):

- `torchrun ...` and `python -m torch.distributed.run ...`: torchrun reads every option it is not
  given from `PET_<OPTION>` (torch.distributed.argparse_util.env), so the launcher exports
  PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR, PET_MASTER_PORT and
  PET_RDZV_BACKEND=static on every node (plan.JobPlan.node_env): plain `torchrun train.py` and the
  explicit `--nnodes $NNODES ...` form both form one job. `--standalone`, or a literal `--nnodes`,
  `--node-rank` (the same on every node) or an `--nnodes` other than the inventory's cannot: refused
  before the start.
- `accelerate launch ...`: reads its config file, which does not say which node it runs on unless
  it is this node's generated `accelerate-nodeN.yaml`. Without `--config_file` accelerate would read
  the training user's own default file (under $HF_HOME, shared by every run): the launcher adds
  `--config_file <this node's file>`. A literal `--num_machines 1` or `--machine_rank` is refused.
- `deepspeed ...`: its launcher starts every node itself, over pdsh, from the node it runs on; run
  on every node that is N launches of the whole job. The form that starts one node's share per node
  is `--no_ssh --node_rank N` with a hostfile; the launcher adds it (with the run's hostfile and the
  master address and port) unless the command says `--no_ssh` itself. `--hostfile` of the user's
  own (pdsh from every node) is refused.

Anything else (`bash train.sh`, a script that calls a launcher itself) runs as given; the
environment above is there for it too, and the world check (world.py) says when its nodes did not
join one job. Controller side only: pure functions of the command and the node's values.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

TORCHRUN = "torchrun"
ACCELERATE = "accelerate"
DEEPSPEED = "deepspeed"
#: `python -m MODULE` forms of the launchers.
_MODULES = {"torch.distributed.run": TORCHRUN, "torch.distributed.launch": TORCHRUN}
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


@dataclass(frozen=True)
class NodeValues:
    """What a node's share of the job is: the values a rewritten command carries."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    accelerate_config: str
    hostfile: str


@dataclass(frozen=True)
class Form:
    launcher: str | None
    """torchrun | accelerate | deepspeed, or None: a command the launcher does not recognise."""
    command: tuple[str, ...]
    """The command as the node runs it."""
    added: tuple[str, ...] = field(default=())
    """The arguments the launcher added to the user's command (the plan shows them)."""


@dataclass(frozen=True)
class LauncherForm:
    """One launcher the launcher recognises, and how its command is made to form one job (FORMS)."""

    name: str
    """torchrun | accelerate | deepspeed: what the plan and the start say the command runs."""
    program: str
    """The command's first word (its base name) that starts it."""
    reads: tuple[str, ...]
    """What it reads from what the launcher gives every node (the plan shows it)."""
    problem: Callable[[dict[str, str | None], str, int], str | None]
    """(its own options, the command as shown, nnodes) -> why it cannot form one job, with the fix."""
    added: Callable[[dict[str, str | None], NodeValues], tuple[str, ...]] = lambda options, node: ()
    """(its own options, this node's values) -> the arguments added before them on this node."""
    subcommand: tuple[str, ...] = ()
    """The words after the program that make it this launcher (`accelerate launch`)."""
    adapts_one_node: bool = False
    """Its command is rewritten on a one-node job too (accelerate's default config file is the user's)."""


def launcher_of(command: Sequence[str]) -> tuple[str | None, int]:
    """(the launcher the command starts, the index of its first own argument), or (None, 0)."""
    if not command:
        return None, 0
    program = PurePosixPath(command[0]).name
    for form in FORMS.values():
        if program == form.program and tuple(command[1 : 1 + len(form.subcommand)]) == form.subcommand:
            return form.name, 1 + len(form.subcommand)
    if _PYTHON.fullmatch(program):
        # python's own flags (-u, -X dev, ...) may come before -m
        for index, arg in enumerate(command[1:-1], start=1):
            if arg == "-m":
                module = command[index + 1]
                return (_MODULES[module], index + 2) if module in _MODULES else (None, 0)
            if not arg.startswith("-"):
                break
    return None, 0


#: Shells whose first argument is a script file (`bash finetune/finetune_lora_ds.sh`).
_SHELLS = {"bash", "sh", "dash", "zsh"}
#: python's own options that take a value (so the word after them is not the script).
_PYTHON_VALUED = {"-X", "-W", "-Q"}


def script_of(command: Sequence[str]) -> str | None:
    """The script file `command` runs (`train.py` of `torchrun train.py`, `python -u train.py`, `accelerate
    launch train.py`, `bash run.sh`), as written: relative paths are the working directory's. None for a
    module (`-m pkg`), inline code (`-c`) or a program that is itself the script (checked as the program)."""
    launcher, start = launcher_of(command)
    if launcher is not None:
        args = list(command[start:])
        index = _script_index(args)
        options = _options(args[:index])
        if index >= len(args) or {"module", "m", "no_python", "run_path"} & set(options):
            return None
        script = args[index]
        return None if script.startswith("-") else script
    if not command:
        return None
    program = PurePosixPath(command[0]).name
    if not (_PYTHON.fullmatch(program) or program in _SHELLS):
        return None
    args, python, index = list(command[1:]), bool(_PYTHON.fullmatch(program)), 0
    while index < len(args) and args[index].startswith("-"):
        flag = args[index]
        if flag in ("-m", "-c") or (python and flag.startswith(("-m", "-c"))):  # also -mpkg, -cCODE
            return None
        index += 2 if python and flag in _PYTHON_VALUED else 1
    return args[index] if index < len(args) else None


def _script_index(args: Sequence[str]) -> int:
    """Where a launcher's own options end (as `_options` reads them): the script's index."""
    index = 0
    while index < len(args):
        arg = args[index]
        if not arg.startswith("--"):
            return index
        name, has_value, _ = arg[2:].partition("=")
        name = name.replace("-", "_")
        takes_next = index + 1 < len(args) and not args[index + 1].startswith("-")
        if not has_value and takes_next and name not in _FLAGS:
            index += 1
        index += 1
    return index


def _options(args: Sequence[str]) -> dict[str, str | None]:
    """The launcher's own options (before the script): `--name value`, `--name=value` or a flag, with
    `-` and `_` in names treated alike, as torch's and accelerate's parsers do."""
    found: dict[str, str | None] = {}
    index = 0
    while index < len(args):
        arg = args[index]
        if not arg.startswith("--"):
            break  # the script: what follows is its own arguments
        name, has_value, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if has_value:
            found[name] = value
        elif index + 1 < len(args) and not args[index + 1].startswith("-") and name not in _FLAGS:
            found[name] = args[index + 1]
            index += 1
        else:
            found[name] = None
        index += 1
    return found


#: Options of the three launchers that take no value (so the next word is the script).
_FLAGS = {
    "standalone",
    "no_python",
    "module",
    "m",
    "run_path",
    "no_ssh",
    "no_ssh_check",
    "no_local_rank",
    "cpu",
    "multi_gpu",
    "use_deepspeed",
    "use_fsdp",
    "quiet",
    "q",
    "debug",
    "force_multi",
    "save_pid",
    "bind_cores_to_rank",
    "same_network",
    "tpu",
    "use_megatron_lm",
    "downcast_bf16",
    "enable_cpu_affinity",
    "elastic_training",
    "use_env",
}


def problem(command: Sequence[str], nnodes: int) -> str | None:
    """Why `command` cannot form one job on `nnodes` nodes (the fix included), or None."""
    launcher, start = launcher_of(command)
    if launcher is None or nnodes < 2:
        return None
    shown = " ".join(command[: start + 1]) + " ..."
    return FORMS[launcher].problem(_options(command[start:]), shown, nnodes)


def adapt(command: Sequence[str], node: NodeValues) -> Form:
    """The command as `node` runs it: accelerate gets this node's config file, deepspeed the
    one-node-per-node form; torchrun reads the PET_* environment and is run as given."""
    launcher, start = launcher_of(command)
    command = tuple(command)
    if launcher is None:
        return Form(launcher, command)
    form = FORMS[launcher]
    if node.nnodes < 2 and not form.adapts_one_node:
        return Form(launcher, command)
    added = form.added(_options(command[start:]), node)
    return Form(launcher, command[:start] + added + command[start:], added)


SAME_EVERYWHERE = "is the same on every node"


def _torchrun_problem(options: dict[str, str | None], shown: str, nnodes: int) -> str | None:
    if "standalone" in options:
        return (
            f"`{shown}` with --standalone starts a separate single-node job on each of the "
            f"{nnodes} nodes; fix: drop --standalone (the launcher gives torchrun the job's "
            "nodes, rank, master and port in PET_* variables)"
        )
    nnodes_given = options.get("nnodes")
    if nnodes_given is not None and nnodes_given.split(":")[-1] != str(nnodes):
        return (
            f"`{shown}` says --nnodes {nnodes_given} but the inventory has {nnodes} nodes; fix: "
            "drop --nnodes (PET_NNODES carries it) or give it the inventory's node count"
        )
    if options.get("node_rank") is not None:
        return (
            f"`{shown}` gives --node-rank {options['node_rank']}, which {SAME_EVERYWHERE}; "
            "fix: drop it (PET_NODE_RANK carries each node's rank)"
        )
    return None


def _accelerate_problem(options: dict[str, str | None], shown: str, nnodes: int) -> str | None:
    machines = options.get("num_machines")
    if machines is not None and machines != str(nnodes):
        return (
            f"`{shown}` says --num_machines {machines} but the inventory has {nnodes} nodes; fix: "
            "drop it (each node's generated config file says it)"
        )
    if options.get("machine_rank") is not None:
        return (
            f"`{shown}` gives --machine_rank {options['machine_rank']}, which {SAME_EVERYWHERE}; "
            "fix: drop it (each node's generated config file carries its rank)"
        )
    return None


def _deepspeed_problem(options: dict[str, str | None], shown: str, nnodes: int) -> str | None:
    if "no_ssh" not in options and "hostfile" in options:
        return (
            f"`{shown}` with --hostfile starts the whole job over pdsh from every node it runs on "
            f"({nnodes} copies of the job); fix: drop --hostfile, and the launcher starts each node's "
            "share with deepspeed --no_ssh --node_rank N and the run's hostfile, or run "
            "`trainer launch` with the bundled trainer's deepspeed engine"
        )
    return None


def _accelerate_added(options: dict[str, str | None], node: NodeValues) -> tuple[str, ...]:
    return () if "config_file" in options else ("--config_file", node.accelerate_config)


def _deepspeed_added(options: dict[str, str | None], node: NodeValues) -> tuple[str, ...]:
    if "no_ssh" in options:
        return ()
    return (
        "--no_ssh",
        f"--node_rank={node.node_rank}",
        f"--hostfile={node.hostfile}",
        *(() if "master_addr" in options else (f"--master_addr={node.master_addr}",)),
        *(() if "master_port" in options else (f"--master_port={node.master_port}",)),
    )


#: Every launcher form the launcher recognises, in the order the module's docstring and docs/launch.md
#: describe them (the one list: tests/unit/controller/test_command_forms.py ties the docs to it).
FORMS: dict[str, LauncherForm] = {
    form.name: form
    for form in (
        LauncherForm(
            TORCHRUN,
            program="torchrun",
            reads=(
                "PET_NNODES",
                "PET_NODE_RANK",
                "PET_NPROC_PER_NODE",
                "PET_MASTER_ADDR",
                "PET_MASTER_PORT",
                "PET_RDZV_BACKEND",
            ),
            problem=_torchrun_problem,
        ),
        LauncherForm(
            ACCELERATE,
            program="accelerate",
            subcommand=("launch",),
            reads=("--config_file (this node's accelerate-nodeN.yaml)", "ACCELERATE_USE_CPU on CPU nodes"),
            problem=_accelerate_problem,
            added=_accelerate_added,
            adapts_one_node=True,
        ),
        LauncherForm(
            DEEPSPEED,
            program="deepspeed",
            reads=("--hostfile (the run's hostfile)", "--node_rank", "--master_addr", "--master_port"),
            problem=_deepspeed_problem,
            added=_deepspeed_added,
        ),
    )
}
#: What each launcher reads from the environment the launcher gives every node (shown by the plan).
READS = {name: form.reads for name, form in FORMS.items()}
