"""Read an Ansible inventory the way ansible-playbook would, without touching any host.

The launcher, `trainer plan` and preflight all start from the same picture of the cluster: the
head (rank 0), the workers in a stable order, and each host's variables with Jinja templates
rendered (the local inventory derives paths from `inventory_dir`). Ansible's own inventory and
variable managers do the loading, so group_vars/host_vars precedence is exactly Ansible's.
Vaulted variables are decrypted with the command's vault password files (trainer.controller.access);
connection secrets (ansible_become_password and the like) are never rendered: nothing here needs them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.controller import access, inventory_rules

HEAD_GROUP = "head"
WORKERS_GROUP = "workers"
CLUSTER_GROUP = "cluster"


class PlanningError(ValueError):
    """The job cannot be planned from what it was given: the inventory (InventoryError), the topology
    it describes (topology.TopologyError), the trainer config or the command line (plan.PlanError).
    Every command that plans catches this one class; the message names the problem and the fix."""


class InventoryError(PlanningError):
    """The inventory cannot describe a cluster; the message names the problem and the fix."""


@dataclass(frozen=True)
class Host:
    """One node of the cluster as the inventory describes it."""

    name: str
    vars: dict[str, Any] = field(repr=False)

    @property
    def address(self) -> str:
        """The cluster address: `cluster_ip`, else `ansible_host`, else the inventory name (the
        fallbacks serve a one-host cluster only: the rules require cluster_ip across hosts)."""
        return str(self.vars.get("cluster_ip") or self.vars.get("ansible_host") or self.name)

    def get(self, key: str, default: Any = None) -> Any:
        return self.vars.get(key, default)


@dataclass(frozen=True)
class Cluster:
    """The head and the workers, in inventory order (the order ranks are given in)."""

    inventory: Path
    head: Host
    workers: tuple[Host, ...]

    @property
    def hosts(self) -> tuple[Host, ...]:
        return (self.head, *self.workers)

    @property
    def is_single_host(self) -> bool:
        return not self.workers


def _to_plain(value: Any) -> Any:
    """Strip Ansible's tagged/lazy containers down to plain Python values."""
    if isinstance(value, dict):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    return value


def load_host_vars(inventory: str | os.PathLike[str]) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """Return (groups -> host names, host name -> rendered variables) for an inventory path."""
    inventory = Path(inventory)
    if not inventory.exists():
        raise InventoryError(
            f"inventory {inventory} does not exist; pass -i with a directory or file such as "
            "inventory/local or inventory/example"
        )
    # Imported here: ansible is slow to import and only needed when an inventory is read.
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.plugins.loader import init_plugin_loader
    from ansible.template import Templar
    from ansible.utils.collection_loader import AnsibleCollectionConfig
    from ansible.vars.manager import VariableManager

    # Lookups and filters in inventory variables (env, dirname) need the plugin loader; once per
    # process (`trainer up` reads the inventory in each phase): a second call only warns.
    if AnsibleCollectionConfig.collection_finder is None:
        init_plugin_loader()
    loader = DataLoader()
    try:
        access.vault_secrets(loader)
    except access.AccessError as err:
        raise InventoryError(str(err)) from None
    _check_yaml_syntax(loader, inventory)
    manager = InventoryManager(loader=loader, sources=[str(inventory)])
    if not getattr(getattr(manager, "_inventory", None), "processed_sources", [inventory]):
        # Ansible only warns (its reason is printed above) and goes on with an empty or half-built
        # inventory: a host name it refuses, such as one ending in ':' or an unclosed '['.
        raise InventoryError(
            f"inventory {inventory}: Ansible could not read it as an inventory (its reason is printed "
            "above); fix: correct the file it names (host names: letters, digits, '.', '_' or '-')"
        )
    variables = VariableManager(loader=loader, inventory=manager)
    known = {host.name for host in manager.get_hosts()}
    groups = {
        name: [h.name for h in group.get_hosts() if h.name in known] for name, group in manager.groups.items()
    }
    rendered: dict[str, dict] = {}
    problems: dict[str, list[str]] = {}  # the same problem on several hosts is one message
    for host in manager.get_hosts():
        try:
            host_vars = variables.get_vars(host=host, include_hostvars=False)
        except Exception as err:  # e.g. its fact cache file cannot be opened: a name too long
            reason = (str(err).splitlines() or [type(err).__name__])[0]
            problem = (
                f"Ansible cannot read its variables ({reason}); fix: give the host a shorter name of "
                "letters, digits, '.', '_' or '-' (its address goes in ansible_host)"
            )
            problems.setdefault(problem, []).append(host.name)
            continue
        templar = Templar(loader=loader, variables=host_vars)
        rendered[host.name] = {}
        for key, value in host_vars.items():
            if key.startswith("ansible_facts") or key in access.CONNECTION_SECRETS:
                continue
            try:  # one variable at a time, so an error names the variable
                rendered[host.name][key] = _to_plain(templar.template(value))
            except Exception as err:  # AnsibleError, vault errors: named, not a traceback
                problem = access.describe_unrenderable(key, err)
                if "fix:" not in problem:
                    problem += "; fix: correct the template in its value, or define the variables it uses"
                problems.setdefault(problem, []).append(host.name)
    if problems:
        raise InventoryError(
            f"inventory {inventory}: "
            + "; ".join(
                f"{'host' if len(hosts) == 1 else 'hosts'} {', '.join(hosts)}: {problem}"
                for problem, hosts in problems.items()
            )
        )
    return groups, rendered


#: Files Ansible reads as YAML in an inventory (the yaml plugin's extensions; group_vars, host_vars).
YAML_SUFFIXES = (".yml", ".yaml", ".json")


def _check_yaml_syntax(loader: Any, inventory: Path) -> None:
    """InventoryError at the first YAML file that does not parse, with its line and the parser's
    reason. Ansible only warns about such a file and goes on without it, which leaves a confusing
    error later ("found 0 heads") and the cause in a warning."""
    from ansible.errors import AnsibleError

    if inventory.is_dir():
        candidates = sorted(
            path
            for path in inventory.rglob("*")
            if path.suffix in YAML_SUFFIXES
            and path.is_file()
            and not any(part.startswith(".") for part in path.relative_to(inventory).parts)
        )
    else:
        candidates = [inventory] if inventory.suffix in YAML_SUFFIXES else []
    for path in candidates:
        try:
            loader.load_from_file(str(path), cache="none")  # the cache would keep this untrusted copy
        except AnsibleError as err:
            origin = getattr(err, "obj", None)
            where = str(path)
            if getattr(origin, "line_num", None):
                where += f", line {origin.line_num}, column {origin.col_num}"
            cause = err.__cause__
            reason = " ".join(
                str(text)
                for text in (getattr(cause, "problem", None), getattr(cause, "context", None))
                if text
            )
            raise InventoryError(
                f"inventory {where}: not valid YAML: {reason or err.message}; fix the file (Ansible would "
                "skip it with a warning)"
            ) from None


def refuse_problems(inventory: str | os.PathLike[str], problems: list[str], refuser: str = "") -> None:
    """Raise an InventoryError listing every one of the inventory rules' `problems`, if any; `refuser`
    names who refuses it where that is not the command itself (site.yml)."""
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise InventoryError(
            f"inventory {inventory}: {count}{f' {refuser} refuses' if refuser else ''}, nothing was started "
            "or changed:\n" + "\n".join(f"  {problem}" for problem in problems)
        )


def load_cluster(inventory: str | os.PathLike[str]) -> Cluster:
    """Load the inventory and check it with the rules site.yml's validate play applies
    (trainer.controller.inventory_rules, for a launch); raises InventoryError listing every problem
    before anything is written or any host is contacted."""
    groups, host_vars = load_host_vars(inventory)
    refuse_problems(inventory, inventory_rules.cluster_problems(host_vars, groups, inventory_rules.LAUNCH))
    heads = groups.get(HEAD_GROUP, [])
    if len(heads) != 1:
        found = ", ".join(heads) if heads else "none"
        raise InventoryError(
            f"inventory {inventory}: group '{HEAD_GROUP}' must hold exactly one host "
            f"(rank 0, NFS and time server); found {len(heads)}: {found}. "
            f"Put one host under '{HEAD_GROUP}' and the others under '{WORKERS_GROUP}'."
        )
    head_name = heads[0]
    workers = [name for name in groups.get(WORKERS_GROUP, []) if name != head_name]
    if head_name in groups.get(WORKERS_GROUP, []):
        raise InventoryError(
            f"inventory {inventory}: host {head_name} is in both '{HEAD_GROUP}' and "
            f"'{WORKERS_GROUP}'; a host is either the head or a worker."
        )
    return Cluster(
        inventory=Path(inventory),
        head=Host(head_name, host_vars[head_name]),
        workers=tuple(Host(name, host_vars[name]) for name in workers),
    )
