"""The cluster's training topology, derived from the inventory alone (no host is contacted).

The head is node rank 0, the workers follow in inventory order; an integer `cluster_node_rank` host
variable pins a host to a rank. Every node runs the same number of processes (torchrun takes one
`--nproc-per-node`), so the global ranks of node N are N*GPUS_PER_NODE ... N*GPUS_PER_NODE+G-1.
Everything a node needs to join the job is in `Topology.node_env(node)`: the variables the seed
guides tell users to export by hand on every machine (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
GPUS_PER_NODE) plus the NCCL settings from group_vars. Two settings can say `auto` and are then
resolved on each node at launch: the NCCL interface and NCCL_IB_DISABLE.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.controller.inventory import Cluster, Host, PlanningError
from trainer.controller.inventory_rules import as_int
from trainer.controller.training_env import IB_AUTO, ib_disable_problem, ib_disable_value

#: cluster_nccl_socket_ifname value that means "the interface holding the host's cluster_ip".
AUTO_IFNAME = "auto"
DEFAULT_MASTER_PORT = 29500


class TopologyError(PlanningError):
    """The inventory cannot be turned into a training job; the message names the problem and the fix."""


@dataclass(frozen=True)
class Node:
    """One machine of the job."""

    host: str
    node_rank: int
    address: str
    nccl_socket_ifname: str
    """`auto` (resolved on the host at launch into `=iface`) or the inventory's value as written."""
    vars: Mapping[str, Any] = field(repr=False, compare=False)

    def global_ranks(self, gpus_per_node: int) -> range:
        return range(self.node_rank * gpus_per_node, (self.node_rank + 1) * gpus_per_node)


@dataclass(frozen=True)
class Topology:
    inventory: Path
    nodes: tuple[Node, ...]
    """Sorted by node rank; nodes[0] is the head."""
    master_port: int
    gpus_per_node: int
    nccl_ib_disable: int | str
    """0, 1 or `auto` (resolved at launch: 0 when every node lists InfiniBand/RoCE devices)."""
    nccl_debug: str
    nccl_timeout_s: int

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def master_addr(self) -> str:
        return self.head.address

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    def node(self, host: str) -> Node:
        for node in self.nodes:
            if node.host == host:
                return node
        raise KeyError(host)

    def node_env(
        self, node: Node, resolved_ifname: str | None = None, resolved_ib_disable: int | None = None
    ) -> dict[str, str]:
        """The environment that makes `node` join the job (strings, ready for export).

        `resolved_ifname` is the interface found on the host when the inventory says `auto`; without
        it NCCL_SOCKET_IFNAME is left out (NCCL then picks an interface by itself). Likewise
        `resolved_ib_disable` for NCCL_IB_DISABLE `auto` (left out: NCCL probes by itself).
        """
        ib_disable = resolved_ib_disable if self.nccl_ib_disable == IB_AUTO else self.nccl_ib_disable
        env = {
            "NNODES": str(self.nnodes),
            "NODE_RANK": str(node.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "GPUS_PER_NODE": str(self.gpus_per_node),
            "WORLD_SIZE": str(self.world_size),
            # The node's GPU count per the inventory: the trainer refuses to start when torch sees
            # fewer (a CPU build, an old driver) instead of training on the CPU.
            "CLUSTER_NODE_GPUS": str(int(node.vars.get("cluster_accelerators", 0) or 0)),
            "NCCL_DEBUG": self.nccl_debug,
            # A collective that times out (cluster_nccl_timeout_s, the trainer's
            # distributed.timeout_s) aborts the process instead of hanging it.
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        }
        if ib_disable is not None:
            env["NCCL_IB_DISABLE"] = str(ib_disable)
        ifname = resolved_ifname if node.nccl_socket_ifname == AUTO_IFNAME else node.nccl_socket_ifname
        if ifname:
            env["NCCL_SOCKET_IFNAME"] = ifname
            # gloo (the CPU backend) takes a plain interface name: no `=` (exact) or `^` (exclude).
            if not ifname.startswith("^") and "," not in ifname:
                env["GLOO_SOCKET_IFNAME"] = ifname.lstrip("=")
        return env

    def as_dict(self) -> dict[str, Any]:
        return {
            "inventory": str(self.inventory),
            "nnodes": self.nnodes,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "gpus_per_node": self.gpus_per_node,
            "world_size": self.world_size,
            "nodes": [
                {
                    "host": n.host,
                    "node_rank": n.node_rank,
                    "address": n.address,
                    "global_ranks": list(n.global_ranks(self.gpus_per_node)),
                    "nccl_socket_ifname": n.nccl_socket_ifname,
                }
                for n in self.nodes
            ],
            "nccl": {
                "NCCL_IB_DISABLE": self.nccl_ib_disable,
                "NCCL_DEBUG": self.nccl_debug,
                "timeout_s": self.nccl_timeout_s,
            },
        }


def _node_ranks(cluster: Cluster) -> dict[str, int]:
    """Host -> node rank: pinned ranks from cluster_node_rank, the rest filled in inventory order."""
    hosts = cluster.hosts
    count = len(hosts)
    pinned: dict[str, int] = {}
    for host in hosts:
        raw = host.get("cluster_node_rank")
        if raw is None or raw == "":
            continue
        rank = as_int(raw)
        if rank is None:
            raise TopologyError(
                f"host {host.name}: cluster_node_rank must be an integer, got {raw!r}; "
                f"use a whole number from 0 to {count - 1} or remove the variable"
            )
        if not 0 <= rank < count:
            raise TopologyError(
                f"host {host.name}: cluster_node_rank {rank} is out of range for {count} nodes; "
                f"node ranks run from 0 to {count - 1}"
            )
        pinned[host.name] = rank
    head = cluster.head.name
    if pinned.get(head, 0) != 0:
        raise TopologyError(
            f"host {head} is the head (group 'head') but has cluster_node_rank {pinned[head]}; "
            "the head is always node rank 0 (it serves MASTER_ADDR): remove its cluster_node_rank "
            "or move another host into group 'head'"
        )
    pinned[head] = 0
    by_rank: dict[int, list[str]] = {}
    for name, rank in pinned.items():
        by_rank.setdefault(rank, []).append(name)
    duplicates = {rank: names for rank, names in by_rank.items() if len(names) > 1}
    if duplicates:
        rank, names = sorted(duplicates.items())[0]
        raise TopologyError(
            f"node rank {rank} is given to more than one host: {', '.join(sorted(names))}; "
            "every node needs its own rank: fix cluster_node_rank so each value appears once"
        )
    free = iter(r for r in range(count) if r not in by_rank)
    return {host.name: pinned[host.name] if host.name in pinned else next(free) for host in hosts}


def _procs_per_node(host: Host) -> int:
    raw = host.get("training_procs_per_node")
    if raw is None or raw == "":
        accelerators = as_int(host.get("cluster_accelerators", 0)) or 0
        if accelerators > 0:
            return accelerators
        raise TopologyError(
            f"host {host.name}: training_procs_per_node is not set and the host has no accelerators "
            "(cluster_accelerators is 0); set training_procs_per_node (processes per node) in "
            "group_vars/cluster/training.yml"
        )
    procs = as_int(raw)
    if procs is None or procs < 1:
        raise TopologyError(
            f"host {host.name}: training_procs_per_node must be a positive integer, got {raw!r}"
        )
    return procs


def _common_int(cluster: Cluster, var: str, default: int) -> int:
    values = {}
    for host in cluster.hosts:
        raw = host.get(var, default)
        value = as_int(raw)
        if value is None:
            raise TopologyError(f"host {host.name}: {var} must be an integer, got {raw!r}")
        values[host.name] = value
    return _one_setting(var, values, "it is one setting for the whole job: set it once in group_vars/cluster")


def _ib_disable(cluster: Cluster) -> int | str:
    values = {}
    for host in cluster.hosts:
        raw = host.get("cluster_nccl_ib_disable")
        if problem := ib_disable_problem(raw):
            raise TopologyError(f"host {host.name}: {problem}")
        values[host.name] = ib_disable_value(raw)
    return _one_setting(
        "cluster_nccl_ib_disable",
        values,
        "NCCL needs one transport for the whole job: set it once in group_vars/cluster (auto decides per "
        "cluster at launch)",
    )


def _one_setting(var: str, values: dict[str, Any], why: str) -> Any:
    """The value every host has of `var` (host -> its value); a TopologyError naming each host's where
    they differ, and `why` it must be one."""
    if len(set(values.values())) > 1:
        detail = ", ".join(f"{h}={v}" for h, v in values.items())
        raise TopologyError(f"{var} differs between hosts ({detail}); {why}")
    return next(iter(values.values()))


def build_topology(cluster: Cluster) -> Topology:
    """Check the inventory's training settings and derive the topology; raises TopologyError."""
    procs = {host.name: _procs_per_node(host) for host in cluster.hosts}
    if len(set(procs.values())) > 1:
        detail = ", ".join(f"{h}={p}" for h, p in procs.items())
        raise TopologyError(
            f"training_procs_per_node differs between hosts ({detail}); every node must run the same "
            "number of processes (GPUS_PER_NODE): use nodes with equal GPU counts or set "
            "training_procs_per_node to one value in group_vars/cluster/training.yml"
        )
    ranks = _node_ranks(cluster)
    master_port = _common_int(cluster, "cluster_master_port", DEFAULT_MASTER_PORT)
    if not 1024 <= master_port <= 65535:
        raise TopologyError(f"cluster_master_port {master_port} must be between 1024 and 65535")
    nodes = sorted(
        (
            Node(
                host=host.name,
                node_rank=ranks[host.name],
                address=host.address,
                nccl_socket_ifname=str(host.get("cluster_nccl_socket_ifname") or AUTO_IFNAME),
                vars=host.vars,
            )
            for host in cluster.hosts
        ),
        key=lambda n: n.node_rank,
    )
    head = cluster.head
    return Topology(
        inventory=cluster.inventory,
        nodes=tuple(nodes),
        master_port=master_port,
        gpus_per_node=next(iter(procs.values())),
        nccl_ib_disable=_ib_disable(cluster),
        nccl_debug=str(head.get("cluster_nccl_debug") or "WARN"),
        nccl_timeout_s=_common_int(cluster, "cluster_nccl_timeout_s", 1800),
    )
