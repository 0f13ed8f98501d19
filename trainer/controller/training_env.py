"""The rules for what a launch adds to every node's environment and where its command runs.

`training_env` (inventory, a mapping per host) and `--env NAME=VALUE` / `--env NAME` (command line)
add variables to the environment of the command every node runs; `training_workdir` is the
directory it runs in. These rules live here once: trainer.controller.inventory_rules (the rules
site.yml's validate play and `trainer plan/launch/preflight` apply to the inventory) imports them,
and `trainer plan/launch/sbatch` apply them to `--env` (refused before anything starts). The path
rule (`path_problem`: absolute, a strict character set, no `..`, not `/`) is here too, for
training_workdir and every other path in the inventory. Standard library only.

A value reaches a shell line (the node's run.sh, a Slurm script), so names must be shell
identifiers and values are always quoted where they are written. Secret values (a name such as
WANDB_API_KEY or HF_TOKEN, a value holding a credential inside a URL such as
HTTPS_PROXY=http://user:pass@proxy:3128, or `{value: ..., secret: true}` in the inventory; the rule
is trainer.redaction's) never appear in run.sh, plan output or Ansible's log: they go to a file only
the training user can read. A secret is never given as a value on the command line (`ps` shows it
to every account on the controller while the launcher runs): `--env NAME` takes it from the shell.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.redaction import secret_env

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: Variables the launcher sets on every node, and where each comes from (the fix to name when a
#: user tries to set one through training_env or --env: two sources for one value would drift).
LAUNCHER_SETS = {
    "NNODES": "the number of hosts in the inventory",
    "NODE_RANK": "the inventory order or cluster_node_rank",
    "MASTER_ADDR": "the head's cluster_ip",
    "MASTER_PORT": "cluster_master_port",
    "GPUS_PER_NODE": "training_procs_per_node",
    "WORLD_SIZE": "the node count times training_procs_per_node",
    "CLUSTER_NODE_GPUS": "cluster_accelerators",
    "NCCL_SOCKET_IFNAME": "cluster_nccl_socket_ifname",
    "GLOO_SOCKET_IFNAME": "cluster_nccl_socket_ifname",
    "NCCL_IB_DISABLE": "cluster_nccl_ib_disable",
    "NCCL_DEBUG": "cluster_nccl_debug",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "the launcher (always 1: a timed-out collective ends the job)",
    "ACCELERATE_CONFIG_FILE": "the launcher (each node's generated accelerate config)",
    "DEEPSPEED_CONFIG": "the launcher (the run's generated DeepSpeed JSON)",
    "CLUSTER_OUTPUT_DIR": "cluster_shared_dir and --run-name",
}
#: Names the launcher uses to find and stop its own processes.
RESERVED_PREFIX = "CLUSTERTRAIN_"

#: `cluster_nccl_ib_disable`: auto = 0 on nodes with InfiniBand/RoCE devices, 1 elsewhere.
IB_AUTO = "auto"
IB_DEVICES_DIR = "/sys/class/infiniband"


class EnvError(ValueError):
    """Bad training_env / --env / training_workdir; `problems` lists each with its fix."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class ExtraEnv:
    """Variables added to a node's environment: values as strings, and which of them are secret."""

    values: dict[str, str] = field(default_factory=dict)
    secret: frozenset[str] = frozenset()

    def merged(self, later: ExtraEnv) -> ExtraEnv:
        """`later` wins for names both set (the command line over the inventory)."""
        values = {**self.values, **later.values}
        secret = (self.secret - later.values.keys()) | later.secret
        return ExtraEnv(values, frozenset(secret))

    @property
    def public(self) -> dict[str, str]:
        return {k: v for k, v in self.values.items() if k not in self.secret}

    @property
    def secrets(self) -> dict[str, str]:
        return {k: v for k, v in self.values.items() if k in self.secret}


def name_problem(name: Any, source: str) -> str | None:
    """Why `name` cannot be set through `source` (None if it can)."""
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        return (
            f"{source}: {name!r} is not a valid environment variable name; fix: use letters, digits "
            "and '_', not starting with a digit (e.g. NCCL_IB_HCA)"
        )
    if name in LAUNCHER_SETS:
        origin = LAUNCHER_SETS[name]
        instead = f"; set {origin} instead" if origin.startswith(("cluster_", "training_")) else ""
        return f"{source}: {name} is set by the launcher from {origin}; fix: remove it from {source}{instead}"
    if name.startswith(RESERVED_PREFIX):
        return (
            f"{source}: {name}: names starting with {RESERVED_PREFIX} are the launcher's own; fix: rename it"
        )
    return None


def _value_text(value: Any) -> str | None:
    """The environment string for a YAML scalar (None if it is not one)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    return None


def parse_training_env(value: Any, source: str = "training_env") -> ExtraEnv:
    """Check the inventory's `training_env` and return it; raises EnvError naming every problem.

    Each entry is NAME: VALUE (a string or number), or NAME: {value: VALUE, secret: true|false}.
    """
    if value in (None, ""):
        return ExtraEnv()
    if not isinstance(value, Mapping):
        raise EnvError(
            [
                f"{source} is {value!r}, not a mapping; fix: write NAME: value lines under it, e.g. "
                "training_env: {NCCL_IB_HCA: mlx5_0}"
            ]
        )
    problems: list[str] = []
    values: dict[str, str] = {}
    secret: set[str] = set()
    for name, raw in value.items():
        if problem := name_problem(name, source):
            problems.append(problem)
            continue
        marked: Any = None
        if isinstance(raw, Mapping):
            unknown = set(raw) - {"value", "secret"}
            if "value" not in raw or unknown:
                problems.append(
                    f"{source}.{name} is {dict(raw)!r}; fix: write {{value: ..., secret: true}} "
                    "(only the keys value and secret)"
                )
                continue
            marked = raw.get("secret")
            if not isinstance(marked, bool) and marked is not None:
                problems.append(f"{source}.{name}.secret is {marked!r}; fix: use true or false")
                continue
            raw = raw["value"]
        text = _value_text(raw)
        if text is None:
            problems.append(
                f"{source}.{name} is {raw!r}; fix: give a string or a number "
                "(remove the entry to leave the variable unset)"
            )
            continue
        if "\0" in text:
            problems.append(f"{source}.{name} contains a NUL character; fix: remove it")
            continue
        values[name] = text
        if marked is True or (marked is None and secret_env(name, text)):
            secret.add(name)
    if problems:
        raise EnvError(problems)
    return ExtraEnv(values, frozenset(secret))


def parse_env_options(items: Sequence[str], environ: Mapping[str, str] | None = None) -> ExtraEnv:
    """`--env NAME=VALUE` (as given) or `--env NAME` (this shell's value, so a key stays off the
    command line). A secret (by its name or a credential in a URL) given as NAME=VALUE is refused:
    for the whole launch `ps` would show it to every account on the controller."""
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    values: dict[str, str] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if problem := name_problem(name, "--env"):
            problems.append(problem)
            continue
        if not sep:
            if name not in environ:
                problems.append(
                    f"--env {name}: {name} is not set in this shell; fix: export it first or write "
                    f"--env {name}=VALUE"
                )
                continue
            text = environ[name]
        elif secret_env(name, text):
            # The value itself is never repeated: it is the secret.
            problems.append(
                f"--env {name}=...: a secret on the command line shows in `ps` and your shell history; "
                f"fix: export {name} in this shell and give --env {name} (the value is taken from the "
                "environment), or set it in the inventory's training_env (vaulted)"
            )
            continue
        if "\0" in text:
            problems.append(f"--env {name}: the value contains a NUL character")
            continue
        values[name] = text
    if problems:
        raise EnvError(problems)
    return ExtraEnv(values, frozenset(n for n, text in values.items() if secret_env(n, text)))


#: A path on the nodes or the controller: absolute, and only these characters (no whitespace, quotes,
#: parentheses, `*`, `,` or control characters), so it can be written into exports, fstab and shell
#: lines unchanged. trainer.controller.inventory_rules applies it to every path in the inventory.
PATH = re.compile(r"/[A-Za-z0-9._+@=~/-]*")
PATH_FIX = "use an absolute path of letters, digits and . _ - + @ = ~ / only"


def path_problem(value: Any, example: str) -> str | None:
    """Why `value` is not a usable absolute path, starting with "is" (the caller names the variable)."""
    if not isinstance(value, str) or not value.startswith("/"):
        return f"is {value!r}, not an absolute path; fix: give the full path starting with /, e.g. {example}"
    if not PATH.fullmatch(value):
        return (
            f"is {value!r}: whitespace, quotes, parentheses, '*', ',' or control characters could end "
            f"up in the config files and shell lines it is written to; fix: {PATH_FIX}"
        )
    if ".." in value.split("/"):
        return f"is {value!r}, which climbs with '..'; fix: write the path without '..', e.g. {example}"
    if os.path.normpath(value) == "/":
        return f"is /, the whole file system; fix: use a dedicated directory such as {example}"
    return None


def workdir_problem(value: Any, source: str = "training_workdir") -> str | None:
    """Why `value` cannot be the directory the command runs in ('' or unset = the shared dir)."""
    if value in (None, ""):
        return None
    problem = path_problem(value, "/srv/clustertrain/shared/code")
    if problem and not (isinstance(value, str) and value.startswith("/")):
        problem += " (or '' for the shared dir)"
    return f"{source} {problem}" if problem else None


def ib_disable_problem(value: Any) -> str | None:
    """Why `value` is not a cluster_nccl_ib_disable setting (None if it is one)."""
    if ib_disable_value(value) is None:
        return (
            f"cluster_nccl_ib_disable is {value!r}; fix: use auto (0 where {IB_DEVICES_DIR} lists "
            "devices, 1 elsewhere), 0 (InfiniBand/RoCE) or 1 (plain Ethernet)"
        )
    return None


def ib_disable_value(value: Any) -> str | int | None:
    """'auto', 0 or 1 from the inventory's value (unset = auto); None if it is none of those."""
    if value in (None, "", IB_AUTO):
        return IB_AUTO
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value in (0, 1):
        return value
    if isinstance(value, str) and value.strip() in ("0", "1"):
        return int(value.strip())
    return None
