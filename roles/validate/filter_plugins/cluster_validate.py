"""`cluster_problems`: everything wrong with a cluster inventory, as messages a user can act on.

The validate play runs this on the controller before any host is contacted. Each message names
the host(s), the variable, what is wrong and the fix. All problems are reported at once, so one
edit-and-rerun cycle fixes them all.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# The rules for training_env, training_workdir and cluster_nccl_ib_disable live once, in the
# project's own (standard-library-only) module, which `trainer plan/launch` apply too. This
# checkout's copy comes first, so the playbook checks exactly what the launcher will.
_CHECKOUT = Path(__file__).resolve().parents[3]
if (_CHECKOUT / "trainer" / "controller" / "training_env.py").is_file():
    sys.path.insert(0, str(_CHECKOUT))
from trainer.controller.training_env import (  # noqa: E402
    EnvError,
    ib_disable_problem,
    parse_training_env,
    workdir_problem,
)

HEAD, WORKERS, CLUSTER = "head", "workers", "cluster"
ENGINES = ("ddp", "deepspeed", "accelerate")
NFS_BACKENDS = ("kernel", "ganesha")
ZERO_STAGES = (0, 1, 2, 3)
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
WORLD = ("0.0.0.0/0", "::/0", "*", "0.0.0.0", "::")
MIN_ID, MAX_ID = 1000, 2**31 - 2
NOBODY_ID = 65534
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")

# Variables every host must have (host_vars or group_vars), with the fix to print when one is missing.
REQUIRED = {
    "cluster_ip": "set the host's address on the cluster network in hosts.yml",
    "cluster_accelerators": "set the host's GPU count (0 on a CPU-only host) in hosts.yml",
    "cluster_name": "set it in group_vars/cluster/cluster.yml",
    "cluster_subnet": "set the cluster network's CIDR in group_vars/cluster/cluster.yml",
    "cluster_training_user": "set it in group_vars/cluster/cluster.yml",
    "cluster_training_group": "set it in group_vars/cluster/cluster.yml",
    "cluster_shared_dir": "set an absolute path in group_vars/cluster/storage.yml",
    "nfs_server_backend": "set kernel or ganesha in group_vars/cluster/storage.yml",
    "cluster_master_port": "set it (e.g. 29500) in group_vars/cluster/network.yml",
    "cluster_comm_port_range": 'set it (e.g. "1024:65535") in group_vars/cluster/network.yml',
    "cluster_ntp_servers": "set a list (may be empty) in group_vars/cluster/network.yml",
    "training_venv": "set an absolute path in group_vars/cluster/training.yml",
    "training_procs_per_node": "set it in group_vars/cluster/training.yml",
    "training_engine": "set ddp, deepspeed or accelerate in group_vars/cluster/training.yml",
}
# Needed only across hosts: the users role creates the account with these ids on every node.
REQUIRED_MULTI_HOST = {
    "cluster_training_uid": "set a UID >= 1000 in group_vars/cluster/cluster.yml",
    "cluster_training_gid": "set a GID >= 1000 in group_vars/cluster/cluster.yml",
}
# Variables that must have one value on every host.
SAME_EVERYWHERE = (
    "cluster_name",
    "cluster_subnet",
    "cluster_training_user",
    "cluster_training_group",
    "cluster_training_uid",
    "cluster_training_gid",
    "cluster_shared_dir",
    "nfs_server_backend",
    "cluster_master_port",
    "cluster_comm_port_range",
    "training_venv",
    "training_procs_per_node",
    "training_engine",
    "training_zero_stage",
)


class Problems:
    """Collects messages; the same problem on several hosts becomes one message naming them all."""

    def __init__(self) -> None:
        self._by_text: dict[str, list[str]] = defaultdict(list)

    def add(self, host: str, text: str) -> None:
        if host not in self._by_text[text]:
            self._by_text[text].append(host)

    def cluster(self, text: str) -> None:
        self._by_text[text].append("")

    def messages(self) -> list[str]:
        out = []
        for text, hosts in self._by_text.items():
            named = [h for h in hosts if h]
            if not named:
                out.append(f"inventory: {text}")
            else:
                label = "host" if len(named) == 1 else "hosts"
                out.append(f"{label} {', '.join(named)}: {text}")
        return out


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        return int(value)
    return None


def _check_each(hosts: Mapping[str, Mapping], var: str, check: Callable[[Any], str | None], out: Problems):
    """Run `check(value)` for each host that has `var`; a returned string is the problem text."""
    for name, hv in hosts.items():
        if var in hv:
            text = check(hv[var])
            if text:
                out.add(name, f"{var} {text}")


def _port(value: Any) -> str | None:
    port = _as_int(value)
    if port is None or not 1024 <= port <= 65535:
        return f"is {value!r}; fix: use a port number from 1024 to 65535"
    return None


def _port_range(value: Any) -> str | None:
    match = re.fullmatch(r"(\d+):(\d+)", str(value).strip())
    if not match:
        return f'is {value!r}; fix: write it as "LOW:HIGH", e.g. "29400:29999"'
    low, high = int(match[1]), int(match[2])
    if not (1024 <= low <= high <= 65535):
        return f"is {value!r}; fix: use 1024 <= LOW <= HIGH <= 65535"
    return None


def _absolute(allow_empty: bool) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if allow_empty and value in ("", None):
            return None
        if not isinstance(value, str) or not os.path.isabs(value):
            return f"is {value!r}, not an absolute path; fix: give the full path starting with /"
        if os.path.normpath(value) == "/":
            return "is /; fix: use a dedicated directory such as /srv/clustertrain/output"
        return None

    return check


def _controller_path(value: Any) -> str | None:
    if value in ("", None):
        return None
    if not isinstance(value, str) or not os.path.isabs(value):
        return f"is {value!r}, not an absolute path on the controller; fix: give the full path or ''"
    if not os.path.exists(value):
        return f"is {value} but that does not exist on the controller; fix: create it or set ''"
    return None


def _one_of(choices: tuple) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value not in choices and _as_int(value) not in choices:
            return f"is {value!r}; fix: use one of {', '.join(str(c) for c in choices)}"
        return None

    return check


def _subnet(value: Any) -> str | None:
    text = str(value).strip()
    if text in WORLD:
        return (
            f"is {text}, which would open NFS, NTP and the training ports to the whole world; "
            "fix: set the cluster network's own CIDR, e.g. 10.20.0.0/24"
        )
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        return f"is {value!r}, not a CIDR; fix: write it like 10.20.0.0/24"
    if net.prefixlen == 0:
        return f"is {text}, the whole address space; fix: set the cluster network's own CIDR"
    return None


def _account_id(kind: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        number = _as_int(value)
        if number is None or number < MIN_ID:
            return (
                f"is {value!r}; fix: use a {kind} of {MIN_ID} or above (below {MIN_ID} are system "
                "accounts on Debian/Ubuntu)"
            )
        if number == NOBODY_ID or number > MAX_ID:
            return f"is {number}, reserved; fix: use another {kind} >= {MIN_ID}"
        return None

    return check


def _user_name(value: Any) -> str | None:
    if not isinstance(value, str) or not USER_NAME.match(value):
        return f"is {value!r}; fix: use a lowercase account name such as trainer"
    return None


def _check_groups(groups: Mapping[str, list], out: Problems) -> tuple[str | None, list[str]]:
    heads = list(groups.get(HEAD, []))
    workers = list(groups.get(WORKERS, []))
    if len(heads) != 1:
        found = ", ".join(heads) if heads else "none"
        out.cluster(
            f"group '{HEAD}' must hold exactly one host (rank 0, NFS and time server), found "
            f"{len(heads)}: {found}; fix: put one host under '{HEAD}' and the others under '{WORKERS}'"
        )
    for name in heads:
        if name in workers:
            out.add(name, f"is in both '{HEAD}' and '{WORKERS}'; fix: a host is either the head or a worker")
    cluster = set(groups.get(CLUSTER, []))
    for name in heads + workers:
        if name not in cluster:
            out.add(name, f"is not in group '{CLUSTER}'; fix: make '{HEAD}' and '{WORKERS}' children of it")
    for name in sorted(cluster - set(heads) - set(workers)):
        out.add(name, f"is in '{CLUSTER}' but neither '{HEAD}' nor '{WORKERS}'; fix: put it in one of them")
    head = heads[0] if len(heads) == 1 else None
    return head, heads + [w for w in workers if w not in heads]


def _check_required(hosts: Mapping[str, Mapping], multi_host: bool, out: Problems) -> None:
    required = dict(REQUIRED, **(REQUIRED_MULTI_HOST if multi_host else {}))
    for name, hv in hosts.items():
        for var, fix in required.items():
            if hv.get(var) is None:
                out.add(name, f"{var} is not set; fix: {fix}")


def _check_same_everywhere(hosts: Mapping[str, Mapping], out: Problems) -> None:
    for var in SAME_EVERYWHERE:
        values = {name: hv[var] for name, hv in hosts.items() if var in hv}
        if len({repr(v) for v in values.values()}) > 1:
            listing = ", ".join(f"{n}={v!r}" for n, v in values.items())
            out.cluster(
                f"{var} differs between hosts ({listing}); fix: set it once in group_vars/cluster, "
                "not per host"
            )


def _check_unique(hosts: Mapping[str, Mapping], var: str, what: str, out: Problems) -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for name, hv in hosts.items():
        value = hv.get(var)
        if value not in (None, ""):
            key = str(value)
            if var == "ansible_host":
                key = f"{value}:{hv.get('ansible_port', 22)}"
            seen[key].append(name)
    for value, names in seen.items():
        if len(names) > 1:
            for name in names:
                others = ", ".join(n for n in names if n != name)
                out.add(name, f"{var} {value} is also the {what} of {others}; fix: give each host its own")


def _check_addresses(hosts: Mapping[str, Mapping], out: Problems) -> None:
    for name, hv in hosts.items():
        if hv.get("cluster_ip") is None:
            continue
        try:
            address = ipaddress.ip_address(str(hv["cluster_ip"]).strip())
        except ValueError:
            out.add(
                name, f"cluster_ip is {hv['cluster_ip']!r}, not an IP address; fix: write it like 10.20.0.11"
            )
            continue
        try:
            subnet = ipaddress.ip_network(str(hv.get("cluster_subnet", "")).strip(), strict=False)
        except ValueError:
            continue  # reported by the subnet check
        if address not in subnet:
            out.add(
                name,
                f"cluster_ip {address} is outside cluster_subnet {subnet}; fix: correct the address "
                "or widen cluster_subnet to the real cluster network",
            )


def _check_accelerators(hosts: Mapping[str, Mapping], head: str | None, out: Problems) -> None:
    counts = {}
    for name, hv in hosts.items():
        if "cluster_accelerators" not in hv:
            continue
        count = _as_int(hv["cluster_accelerators"])
        if count is None or count < 0:
            out.add(
                name,
                f"cluster_accelerators is {hv['cluster_accelerators']!r}; fix: use the GPU count, 0 or more",
            )
            continue
        counts[name] = count
    reference = head if head in counts else next(iter(counts), None)
    for name, count in counts.items():
        if count != counts[reference]:
            out.add(
                name,
                f"cluster_accelerators is {count} but {reference} has {counts[reference]}; fix: every "
                "node needs the same GPU count (set it right, or leave this host out)",
            )
    models = {
        n: hv.get("cluster_accelerator_model")
        for n, hv in hosts.items()
        if hv.get("cluster_accelerator_model")
    }
    ref_model = models.get(reference) if reference else None
    for name, model in models.items():
        if ref_model and model != ref_model:
            out.add(
                name,
                f"cluster_accelerator_model is {model!r} but {reference} has {ref_model!r}; fix: use one "
                "GPU type per cluster (mixed types train at the pace of the slowest)",
            )
    for name, hv in hosts.items():
        procs = _as_int(hv.get("training_procs_per_node"))
        if "training_procs_per_node" in hv and (procs is None or procs < 1):
            out.add(name, f"training_procs_per_node is {hv['training_procs_per_node']!r}; fix: use 1 or more")
        elif procs and counts.get(name) and procs > counts[name]:
            out.add(
                name,
                f"training_procs_per_node is {procs} but the host has {counts[name]} GPUs; fix: one process "
                "per GPU at most",
            )


def _check_node_ranks(hosts: Mapping[str, Mapping], head: str | None, out: Problems) -> None:
    ranks = {n: hv["cluster_node_rank"] for n, hv in hosts.items() if hv.get("cluster_node_rank") is not None}
    seen: dict[int, str] = {}
    for name, value in ranks.items():
        rank = _as_int(value)
        if rank is None or not 0 <= rank < len(hosts):
            out.add(name, f"cluster_node_rank is {value!r}; fix: use 0 to {len(hosts) - 1}, or remove it")
        elif name == head and rank != 0:
            out.add(name, f"cluster_node_rank is {rank} on the head; fix: the head is rank 0, remove it")
        elif name != head and rank == 0:
            out.add(name, "cluster_node_rank is 0 on a worker; fix: rank 0 is the head, use 1 or more")
        elif rank in seen:
            out.add(
                name, f"cluster_node_rank {rank} is also the rank of {seen[rank]}; fix: give each its own"
            )
        else:
            seen[rank] = name


def _strip_name(problem: str | None) -> str | None:
    """A shared rule's message without its leading variable name (_check_each adds it)."""
    return problem.split(" ", 1)[1] if problem else None


def _check_training_env(hosts: Mapping[str, Mapping], out: Problems) -> None:
    for name, hv in hosts.items():
        try:
            parse_training_env(hv.get("training_env"))
        except EnvError as err:
            for problem in err.problems:
                out.add(name, problem)


def cluster_problems(hostvars: Mapping, groups: Mapping) -> list[str]:
    """Return the inventory's problems (empty when it describes a usable cluster)."""
    out = Problems()
    head, names = _check_groups(groups, out)
    hosts = {name: dict(hostvars[name]) for name in names if name in hostvars}
    multi_host = len(hosts) > 1
    _check_required(hosts, multi_host, out)
    _check_same_everywhere(hosts, out)
    _check_unique(hosts, "cluster_ip", "cluster address", out)
    _check_unique(hosts, "ansible_host", "ansible_host:ansible_port", out)
    _check_addresses(hosts, out)
    _check_accelerators(hosts, head, out)
    _check_node_ranks(hosts, head, out)
    _check_each(hosts, "cluster_subnet", _subnet, out)
    _check_each(hosts, "cluster_master_port", _port, out)
    _check_each(hosts, "cluster_comm_port_range", _port_range, out)
    _check_each(hosts, "cluster_shared_dir", _absolute(allow_empty=False), out)
    _check_each(hosts, "training_venv", _absolute(allow_empty=False), out)
    _check_each(hosts, "cluster_data_path", _absolute(allow_empty=True), out)
    _check_each(hosts, "training_wheelhouse", _controller_path, out)
    _check_each(hosts, "training_config", _controller_path, out)
    _check_each(hosts, "training_engine", _one_of(ENGINES), out)
    _check_each(hosts, "training_zero_stage", _one_of(ZERO_STAGES), out)
    _check_each(hosts, "nfs_server_backend", _one_of(NFS_BACKENDS), out)
    _check_each(hosts, "cluster_nccl_ib_disable", lambda v: _strip_name(ib_disable_problem(v)), out)
    _check_each(hosts, "training_workdir", lambda v: _strip_name(workdir_problem(v)), out)
    _check_training_env(hosts, out)
    _check_each(hosts, "cluster_nccl_debug", _one_of(NCCL_DEBUG_LEVELS), out)
    _check_each(
        hosts,
        "cluster_nccl_timeout_s",
        lambda v: None if (_as_int(v) or 0) > 0 else f"is {v!r}; fix: use a number of seconds above 0",
        out,
    )
    _check_each(
        hosts,
        "cluster_ntp_servers",
        lambda v: (
            None
            if isinstance(v, list) and all(isinstance(s, str) and s for s in v)
            else f"is {v!r}; fix: write a YAML list of host names, e.g. [ntp1.example.internal]"
        ),
        out,
    )
    if multi_host:
        _check_each(hosts, "cluster_training_user", _user_name, out)
        _check_each(hosts, "cluster_training_group", _user_name, out)
        _check_each(
            hosts,
            "cluster_training_user",
            lambda v: (
                "is root; fix: train as an unprivileged account such as trainer" if v == "root" else None
            ),
            out,
        )
        _check_each(hosts, "cluster_training_uid", _account_id("UID"), out)
        _check_each(hosts, "cluster_training_gid", _account_id("GID"), out)
    return out.messages()


class FilterModule:
    def filters(self) -> dict[str, Callable]:
        return {"cluster_problems": cluster_problems}
