"""Every rule a cluster inventory must follow, in one place: `cluster_problems`.

Two callers apply these rules, so they cannot drift: site.yml's validate play (the validate role's
filter plugin imports this module and runs it on the controller before any host is contacted) and
`trainer plan/launch/preflight` (trainer.controller.inventory.load_cluster runs it before anything
is written or any host is contacted). Standard library only: the filter plugin imports it from the
checkout, without the rest of the project's dependencies. Its imports: training_env, which holds the
rules this module shares with the command line (`--env`, the path rule used for training_workdir),
and trainer.engine_names, the engines `training_engine` may name.

Each message names the host(s), the variable, what is wrong and the fix; all problems are reported
at once, so one edit-and-rerun cycle fixes them all. A value that reaches a shell line, a template
or a config file (exports, fstab, chrony.conf, run.sh, the DeepSpeed hostfile, authorized_keys)
must fit a strict pattern here: no whitespace, quotes, parentheses, `*` or newlines where a path,
a name or an address is expected. Every variable that holds an address or a host name goes through
one validator, `address_problem` (no IPv6 scope id: Python accepts any text after the `%`).

Two purposes: PROVISION (site.yml) applies every rule; LAUNCH (plan/launch/preflight/status/sbatch)
applies every rule on the values that are set, the group layout, and one cluster address per host
(`cluster_ip`, set and unique across hosts: the master address and NCCL's interface come from it),
but not what only provisioning needs (the other variables the roles require, one ansible_host per
host, equal GPU counts, the new account's name and ids): a launch inventory may be a minimal one, or
put several loopback "nodes" on one machine (127.0.0.1, 127.0.0.2, ...: Linux routes all of
127.0.0.0/8 to lo).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from trainer.controller.training_env import (
    EnvError,
    ib_disable_problem,
    parse_training_env,
    path_problem,
    workdir_problem,
)
from trainer.engine_names import ENGINES

PROVISION, LAUNCH = "provision", "launch"
HEAD, WORKERS, CLUSTER = "head", "workers", "cluster"
#: The DeepSpeed ZeRO stages the trainer accepts (trainer.node.engines: 1, 2 or 3; stage 0 is plain
#: data parallelism, which is the ddp engine). A test checks the trainer agrees.
ZERO_STAGES = (1, 2, 3)
#: The trainer's shortest distributed.timeout_s (cluster_nccl_timeout_s becomes it); a test checks.
MIN_TIMEOUT_S = 10
NFS_BACKENDS = ("kernel", "ganesha")
#: sec= flavours for the share (nfs_server and nfs_client roles); '' or unset = sys.
NFS_SEC = ("sys", "krb5", "krb5i", "krb5p")
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
WORLD = ("0.0.0.0/0", "::/0", "*", "0.0.0.0", "::", "any")
MIN_ID, MAX_ID = 1000, 2**31 - 2
NOBODY_ID = 65534

#: An account or group the users role creates (Debian's useradd default rule).
NEW_ACCOUNT = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
#: Any existing account name (the one-host cluster trains as whoever runs it): POSIX portable.
ACCOUNT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,31}\$?")
#: An inventory host name: it is written into run.sh, known_hosts and ssh_config lines.
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
#: A DNS name (RFC 1123 labels).
DNS_NAME = re.compile(
    r"(?=.{1,253}\.?$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
#: cluster_name: markers, the cluster key's comment, run metadata.
CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: NCCL_SOCKET_IFNAME: optional = (exact) or ^ (exclude), then interface names or prefixes, comma-separated.
IFNAME = re.compile(r"[=^]?[A-Za-z0-9_.:@-]{1,15}(?:,[A-Za-z0-9_.:@-]{1,15})*")
#: One entry of ssh_trust_key_from (authorized_keys from=): an address, a CIDR or an ssh host pattern.
KEY_FROM = re.compile(r"!?[A-Za-z0-9.:/*?_-]+")

# Variables every host must have (host_vars or group_vars) to be provisioned, with the fix.
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
#: What a launch across hosts needs from REQUIRED. Without cluster_ip the launcher would fall back to
#: ansible_host or the inventory name, a management address that may sit on another network than the
#: one NCCL should use (and site.yml refuses such an inventory, so a launch must too).
LAUNCH_REQUIRED_MULTI_HOST = ("cluster_ip",)
# Variables that must have one value on every host.
SAME_EVERYWHERE = (
    "cluster_name",
    "cluster_subnet",
    "cluster_training_user",
    "cluster_training_group",
    "cluster_training_uid",
    "cluster_training_gid",
    "training_user_home",
    "cluster_shared_dir",
    "nfs_server_backend",
    "cluster_nfs_sec",
    "cluster_master_port",
    "cluster_comm_port_range",
    "training_venv",
    "training_procs_per_node",
    "training_engine",
    "training_zero_stage",
)

Check = Callable[[Any], "str | None"]


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


def as_int(value: Any) -> int | None:
    """An int from an int or a string of digits (INI inventories and Jinja give strings); else None.
    The launcher's topology reads the inventory's numbers with it too."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,18}\s*", value):
        return int(value)
    return None


def _unset(value: Any) -> bool:
    return value is None or value == ""


def _check_each(hosts: Mapping[str, Mapping], var: str, check: Check, out: Problems) -> None:
    """Run `check(value)` for each host that has `var`; a returned string is the problem text."""
    for name, hv in hosts.items():
        if var in hv:
            text = check(hv[var])
            if text:
                out.add(name, f"{var} {text}")


def _port(low: int) -> Check:
    def check(value: Any) -> str | None:
        port = as_int(value)
        if port is None or not low <= port <= 65535:
            return f"is {value!r}; fix: use a port number from {low} to 65535"
        return None

    return check


def _port_or_auto(value: Any) -> str | None:
    return None if value == "auto" else _port(1)(value)


def _port_range(value: Any) -> str | None:
    match = re.fullmatch(r"(\d{1,5}):(\d{1,5})", str(value).strip())
    if not match:
        return f'is {value!r}; fix: write it as "LOW:HIGH", e.g. "29400:29999"'
    low, high = int(match[1]), int(match[2])
    if not (1024 <= low <= high <= 65535):
        return f"is {value!r}; fix: use 1024 <= LOW <= HIGH <= 65535"
    return None


def _path(example: str, allow_empty: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if allow_empty and _unset(value):
            return None
        return path_problem(value, example)

    return check


def _home(value: Any) -> str | None:
    if _unset(value):
        return None  # the roles' default: /home/<cluster_training_user>
    if problem := path_problem(value, "/home/trainer"):
        return problem
    if value.endswith("/"):
        return f"is {value!r}; fix: write it without the trailing /, e.g. /home/trainer"
    return None


def _controller_path_form(value: Any) -> str | None:
    if _unset(value):
        return None
    if problem := path_problem(value, "/srv/clustertrain/wheels"):
        return problem.replace("not an absolute path", "not an absolute path on the controller")
    return None


def _controller_path(value: Any) -> str | None:
    if problem := _controller_path_form(value):
        return problem
    if not _unset(value) and not os.path.exists(value):
        return f"is {value} but that does not exist on the controller; fix: create it or set ''"
    return None


def _one_of(choices: tuple, allow_empty: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if allow_empty and _unset(value):
            return None
        if isinstance(value, bool) or (value not in choices and as_int(value) not in choices):
            return f"is {value!r}; fix: use one of {', '.join(str(c) for c in choices)}"
        return None

    return check


def _zero_stage(value: Any) -> str | None:
    if _one_of(ZERO_STAGES, allow_empty=True)(value) is None:
        return None
    return (
        f"is {value!r}; fix: use one of {', '.join(map(str, ZERO_STAGES))} (DeepSpeed's ZeRO stages the "
        "trainer runs; for data parallelism without ZeRO set training_engine: ddp)"
    )


def _subnet(value: Any) -> str | None:
    text = str(value).strip()
    if text in WORLD:
        return (
            f"is {text}, which would open NFS, NTP and the training ports to the whole world; "
            "fix: set the cluster network's own CIDR, e.g. 10.20.0.0/24"
        )
    if _has_scope_id(text):
        return _scope_id_problem(value, "10.20.0.0/24 or fd00:20::/64")
    net = plain_network(text)
    if net is None:
        return f"is {value!r}, not a CIDR; fix: write it like 10.20.0.0/24"
    if net.prefixlen == 0:
        return f"is {text}, the whole address space; fix: set the cluster network's own CIDR"
    return None


# --- Addresses: one validator for every inventory variable that holds an address or a host name ---
# Python's ipaddress accepts an IPv6 scope id (`fe80::1%eth0`) holding any text, newlines included,
# and ignores it when it compares or tests membership: such a cluster_ip passed the subnet check and
# wrote its own lines (`allow all`, `Match exec ...`) into chrony.conf and the ssh client config,
# which root reads. The roles write addresses into config lines that have no use for a zone, so an
# address here is only what an address is made of: hex digits, '.' and ':' (and a /prefix for a
# network). Everything else must be a host name of RFC 1123 labels (DNS_NAME).

#: The characters of an IPv4 or IPv6 address as the roles write it; a /prefix for a network.
ADDRESS_TEXT = re.compile(r"[0-9A-Fa-f.:]{2,45}")
NETWORK_TEXT = re.compile(r"[0-9A-Fa-f.:]{2,45}(?:/[0-9]{1,3})?")


def plain_address(value: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`value` as an IP address, or None: not a string, not an address, or one with a scope id."""
    if not isinstance(value, str) or not ADDRESS_TEXT.fullmatch(value):
        return None
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        return None


def plain_network(value: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """`value` as a network (host bits allowed: 10.20.0.1/24), or None, as plain_address."""
    if not isinstance(value, str) or not NETWORK_TEXT.fullmatch(value):
        return None
    try:
        return ipaddress.ip_network(value, strict=False)
    except ValueError:
        return None


def _has_scope_id(value: Any) -> bool:
    return isinstance(value, str) and "%" in value


#: Why a scope id is refused, said the same way for every variable.
SCOPE_ID_REASON = (
    "an address with a scope id (%...), which the config files it is written to (chrony.conf, "
    "ssh_config, exports) cannot hold"
)


def _scope_id_problem(value: Any, example: str) -> str:
    return f"is {value!r}, {SCOPE_ID_REASON}; fix: write the address without the %zone, e.g. {example}"


def address_problem(value: Any, example: str, host_names: bool = True) -> str | None:
    """The one address rule: why `value` is not an IP address (without a scope id) or, where
    `host_names`, a host name of RFC 1123 labels; None when it is one. The text starts with "is"
    (the caller names the variable) and ends with the fix, written like `example`."""
    if plain_address(value) is not None:
        return None
    if host_names and isinstance(value, str) and DNS_NAME.fullmatch(value):
        return None
    if _has_scope_id(value):
        return _scope_id_problem(value, example)
    what = "a host name or IP address" if host_names else "an IP address"
    return f"is {value!r}, not {what}; fix: write it like {example}"


def _ip(value: Any) -> str | None:
    return address_problem(value, "10.20.0.11 or fd00:20::11", host_names=False)


def host_or_ip(example: str) -> Check:
    """A check that a value is a DNS host name or an IP address (address_problem)."""

    def check(value: Any) -> str | None:
        return address_problem(value, example)

    return check


def _account_id(kind: str) -> Check:
    def check(value: Any) -> str | None:
        number = as_int(value)
        if number is None or number < MIN_ID:
            return (
                f"is {value!r}; fix: use a {kind} of {MIN_ID} or above (below {MIN_ID} are system "
                "accounts on Debian/Ubuntu)"
            )
        if number == NOBODY_ID or number > MAX_ID:
            return f"is {number}, reserved; fix: use another {kind} >= {MIN_ID}"
        return None

    return check


def _account_name(pattern: re.Pattern[str], fix: str) -> Check:
    def check(value: Any) -> str | None:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            return f"is {value!r}; fix: {fix}"
        return None

    return check


def _pattern(pattern: re.Pattern[str], fix: str, allow_empty: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if allow_empty and _unset(value):
            return None
        if not isinstance(value, str) or not pattern.fullmatch(value):
            return f"is {value!r}; fix: {fix}"
        return None

    return check


def _ntp_servers(value: Any) -> str | None:
    fix = "write a YAML list of host names or addresses, e.g. [ntp1.example.internal, 10.20.0.1]"
    if not isinstance(value, list):
        return f"is {value!r}, not a list; fix: {fix}"
    bad = [s for s in value if address_problem(s, "ntp1.example.internal")]
    if not bad:
        return None
    listed = ", ".join(repr(s) for s in bad)
    if any(_has_scope_id(s) for s in bad):
        return f"has {listed}, {SCOPE_ID_REASON}; fix: write each address without the %zone; {fix}"
    return f"has {listed}, not a host name or IP address; fix: {fix}"


def _key_from(value: Any) -> str | None:
    fix = (
        "write a YAML list of the addresses, CIDRs or ssh host patterns the cluster key may log in "
        "from, e.g. [10.20.0.0/24]; leave it unset for every node's cluster_ip"
    )
    if not isinstance(value, list) or not value:
        return f"is {value!r}, not a non-empty list; fix: {fix}"
    bad = [e for e in value if not isinstance(e, str) or not KEY_FROM.fullmatch(e)]
    if bad:
        return f"has {', '.join(repr(e) for e in bad)}; fix: {fix}"
    world = [e for e in value if e.lstrip("!") in WORLD or _is_world_network(e)]
    if world:
        return (
            f"has {', '.join(world)}, which lets a copy of the cluster key log in from anywhere; fix: {fix}"
        )
    return None


def _is_world_network(entry: str) -> bool:
    try:
        return "/" in entry and ipaddress.ip_network(entry, strict=False).prefixlen == 0
    except ValueError:
        return False


def _ssh_sources(value: Any) -> str | None:
    fix = "write a YAML list of addresses and CIDRs, e.g. [10.20.0.0/24, 192.0.2.7], or [any]"
    if not isinstance(value, list) or not value:
        return f"is {value!r}, not a non-empty list; fix: {fix}"
    bad = [e for e in value if e != "any" and _network_problem(e)]
    if bad:
        return f"has {', '.join(repr(e) for e in bad)}, not an address or CIDR; fix: {fix}"
    return None


def _network_problem(value: Any) -> bool:
    return plain_network(value) is None


def _timeout(value: Any) -> str | None:
    if (as_int(value) or 0) >= MIN_TIMEOUT_S:
        return None
    return f"is {value!r}; fix: use a whole number of seconds, {MIN_TIMEOUT_S} or more (e.g. 1800)"


def _accelerator_model(value: Any) -> str | None:
    if _unset(value):
        return None
    if not isinstance(value, str) or not value.isprintable() or len(value) > 128 or '"' in value:
        return f"is {value!r}; fix: use the GPU's name on one line, e.g. NVIDIA H100 80GB HBM3"
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


def _check_host_names(names: list[str], out: Problems) -> None:
    for name in names:
        if not isinstance(name, str) or not HOST_NAME.fullmatch(name):
            out.cluster(
                f"host name {name!r} cannot be written into run.sh, known_hosts or ssh_config; fix: name "
                "the host with letters, digits, '.', '_' or '-' (set its address in ansible_host)"
            )


def _check_required(hosts: Mapping[str, Mapping], required: Mapping[str, str], out: Problems) -> None:
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


def _check_in_subnet(hosts: Mapping[str, Mapping], out: Problems) -> None:
    for name, hv in hosts.items():
        if _unset(hv.get("cluster_ip")) or _ip(hv["cluster_ip"]):
            continue  # unset: required; not an address: reported by the value rule
        address = ipaddress.ip_address(str(hv["cluster_ip"]))
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


#: More processes per node than any machine has GPUs or cores for: a typo, refused before the plan
#: lists each rank.
MAX_PROCS_PER_NODE = 1024


def _check_accelerators(
    hosts: Mapping[str, Mapping], head: str | None, provision: bool, out: Problems
) -> None:
    counts = {}
    for name, hv in hosts.items():
        if "cluster_accelerators" not in hv:
            continue
        count = as_int(hv["cluster_accelerators"])
        if count is None or count < 0 or count > MAX_PROCS_PER_NODE:
            # Too many is refused too: without training_procs_per_node the launcher starts one process
            # per GPU, and the plan lists each rank.
            out.add(
                name,
                f"cluster_accelerators is {hv['cluster_accelerators']!r}; fix: use the GPU count, 0 to "
                f"{MAX_PROCS_PER_NODE}",
            )
            continue
        counts[name] = count
    reference = head if head in counts else next(iter(counts), None)
    if provision:
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
                    f"cluster_accelerator_model is {model!r} but {reference} has {ref_model!r}; fix: use "
                    "one GPU type per cluster (mixed types train at the pace of the slowest)",
                )
    for name, hv in hosts.items():
        if _unset(hv.get("training_procs_per_node")):
            continue  # required for provisioning; the launcher takes the GPU count
        procs = as_int(hv["training_procs_per_node"])
        if procs is None or procs < 1:
            out.add(name, f"training_procs_per_node is {hv['training_procs_per_node']!r}; fix: use 1 or more")
        elif procs > MAX_PROCS_PER_NODE:
            # The plan lists every rank: a typo of 2**31 made `trainer plan` take all the controller's
            # memory (24 GB) before any rule spoke (found by tests/unit/controller/test_inventory_fuzz.py).
            out.add(
                name,
                f"training_procs_per_node is {procs}; fix: use one process per GPU (or per CPU core on a "
                f"CPU-only host), at most {MAX_PROCS_PER_NODE}",
            )
        elif provision and counts.get(name) and procs > counts[name]:
            out.add(
                name,
                f"training_procs_per_node is {procs} but the host has {counts[name]} GPUs; fix: one process "
                "per GPU at most",
            )


def _check_node_ranks(hosts: Mapping[str, Mapping], head: str | None, out: Problems) -> None:
    ranks = {n: hv["cluster_node_rank"] for n, hv in hosts.items() if not _unset(hv.get("cluster_node_rank"))}
    seen: dict[int, str] = {}
    for name, value in ranks.items():
        rank = as_int(value)
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


#: The rules on single values: (variable, check). Applied for every purpose, to every host that
#: sets the variable.
VALUE_RULES: tuple[tuple[str, Check], ...] = (
    ("cluster_ip", _ip),
    ("ansible_host", host_or_ip("gpu-head.example.internal or 10.20.0.10")),
    ("ansible_port", lambda v: None if _unset(v) else _port(1)(v)),
    ("cluster_name", _pattern(CLUSTER_NAME, "use letters, digits, '.', '_' or '-' (at most 64), e.g. gpu-a")),
    ("cluster_accelerator_model", _accelerator_model),
    ("cluster_subnet", _subnet),
    ("cluster_master_port", _port(1024)),
    ("cluster_comm_port_range", _port_range),
    ("cluster_shared_dir", _path("/srv/clustertrain/output")),
    ("cluster_data_path", _path("/srv/clustertrain/output/data/train.txt", allow_empty=True)),
    ("cluster_nfs_sec", _one_of(NFS_SEC, allow_empty=True)),
    ("training_venv", _path("/opt/clustertrain/venv")),
    ("training_workdir", lambda v: _strip_name(workdir_problem(v))),
    ("training_user_home", _home),
    ("training_wheelhouse", _controller_path),
    ("training_config", _controller_path),
    ("training_engine", _one_of(ENGINES)),
    ("training_zero_stage", _zero_stage),
    ("nfs_server_backend", _one_of(NFS_BACKENDS)),
    ("cluster_ntp_servers", _ntp_servers),
    ("cluster_nccl_socket_ifname", _pattern(IFNAME, "use auto or an interface name such as eth1", True)),
    ("cluster_nccl_ib_disable", lambda v: _strip_name(ib_disable_problem(v))),
    ("cluster_nccl_debug", _one_of(NCCL_DEBUG_LEVELS)),
    ("cluster_nccl_timeout_s", _timeout),
    ("ssh_trust_key_from", _key_from),
    ("ssh_trust_port", _port_or_auto),
    ("firewall_ssh_port", _port(1)),
    ("firewall_ssh_sources", _ssh_sources),
)


#: Controller files only provisioning reads: a launch checks their form, not that they exist (a copy
#: of an inventory elsewhere, or another controller, may launch without the wheelhouse).
PROVISIONING_FILES = frozenset({"training_wheelhouse"})

#: Every variable these rules read (besides the group layout and host names).
VARIABLES: tuple[str, ...] = tuple(
    sorted(
        {var for var, _ in VALUE_RULES}
        | set(REQUIRED)
        | set(REQUIRED_MULTI_HOST)
        | set(SAME_EVERYWHERE)
        | {"cluster_node_rank", "training_procs_per_node", "cluster_accelerators", "training_env"}
    )
)


def _check_login_is_not_the_training_user(hosts: Mapping[str, Mapping], out: Problems) -> None:
    """Provisioning logs in as ansible_user and becomes root. Ansible first copies what root runs into
    the login's `~/.ansible/tmp`: when the login is the training account, any job of that account can
    replace those scripts before root runs them, so every job would be root on that host. (Training
    as root itself, on one host, gains nothing by it.)"""
    for name, hv in hosts.items():
        user = hv.get("ansible_user")
        if user == "root":
            continue
        become = str(hv.get("ansible_become", "")).strip().lower() in ("true", "yes", "on", "1")
        if (
            user
            and user == hv.get("cluster_training_user")
            and become
            and hv.get("ansible_become_user") in (None, "", "root")
        ):
            out.add(
                name,
                f"ansible_user {user} is cluster_training_user and becomes root (ansible_become): any job "
                f"of {user} could replace the scripts Ansible copies into its ~/.ansible/tmp for root to "
                f"run, and be root; fix: log in as an administration account with sudo (ansible_user: admin) "
                f"and keep {user} for training only",
            )


def cluster_problems(hostvars: Mapping, groups: Mapping, purpose: str = PROVISION) -> list[str]:
    """Return the inventory's problems (empty when it describes a usable cluster).

    `hostvars` maps each host name to its variables, `groups` each group to its host names.
    """
    if purpose not in (PROVISION, LAUNCH):
        raise ValueError(f"purpose must be {PROVISION!r} or {LAUNCH!r}, not {purpose!r}")
    provision = purpose == PROVISION
    out = Problems()
    head, names = _check_groups(groups, out)
    _check_host_names(names, out)
    hosts = {name: dict(hostvars[name]) for name in names if name in hostvars}
    multi_host = len(hosts) > 1
    if provision:
        _check_required(hosts, dict(REQUIRED, **(REQUIRED_MULTI_HOST if multi_host else {})), out)
        _check_same_everywhere(hosts, out)
    elif multi_host:
        _check_required(hosts, {var: REQUIRED[var] for var in LAUNCH_REQUIRED_MULTI_HOST}, out)
    # Two nodes on one address: the master address or NCCL's interface would be another node's.
    _check_unique(hosts, "cluster_ip", "cluster address", out)
    if provision:
        _check_unique(hosts, "ansible_host", "ansible_host:ansible_port", out)
        _check_in_subnet(hosts, out)
    for var, check in VALUE_RULES:
        if not provision and var in PROVISIONING_FILES:
            check = _controller_path_form  # a launch never reads it: its form only
        _check_each(hosts, var, check, out)
    _check_accelerators(hosts, head, provision, out)
    _check_node_ranks(hosts, head, out)
    _check_training_env(hosts, out)
    if provision:
        _check_login_is_not_the_training_user(hosts, out)
    if provision and multi_host:
        # Across hosts the users role creates the account (and trains as it over SSH): never root.
        new_account = "use a lowercase name such as trainer (letters, digits, '_' or '-', at most 32)"
        _check_each(hosts, "cluster_training_user", _account_name(NEW_ACCOUNT, new_account), out)
        _check_each(hosts, "cluster_training_group", _account_name(NEW_ACCOUNT, new_account), out)
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
    else:
        # One host (whoever runs it) or a launch: an existing account, any portable name.
        fix = "use an account name of letters, digits, '.', '_' or '-', such as trainer"
        _check_each(hosts, "cluster_training_user", _account_name(ACCOUNT, fix), out)
        _check_each(
            hosts, "cluster_training_group", _account_name(ACCOUNT, fix.replace("account", "group")), out
        )
    return out.messages()
