"""The interface NCCL and gloo will use on each node, resolved as `trainer launch` resolves it.

`cluster_nccl_socket_ifname: auto` is the interface holding the node's cluster_ip (what launch's
node probe picks); any other value is NCCL_SOCKET_IFNAME as written (`eth` a prefix, `=eth0` exact,
`^docker,lo` an exclusion). The environment a node gets comes from the launcher's own
`Topology.node_env`, so GLOO_SOCKET_IFNAME (gloo takes one exact name) is the one launch exports.
Each node must have that interface, up, holding its cluster address, with the same MTU as the other
nodes (a jumbo-frame node among 1500-byte ones drops NCCL's large packets: a hang, not an error).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

from trainer.controller.inventory import Cluster, Host
from trainer.controller.launcher.topology import AUTO_IFNAME, Node, Topology
from trainer.controller.preflight.compare import odd_ones
from trainer.controller.preflight.host_facts import each_host_fact
from trainer.controller.preflight.report import FAIL, PASS, WARN, Result

CHECK = "interface"


def holding(interfaces: list[dict[str, Any]], address: str) -> str:
    """The interface with `address` assigned, else the loopback one whose prefix holds it ('' if
    none): launch's rule for `auto` (node_ctl.interface_of)."""
    for iface in interfaces:
        if any(a.split("/")[0] == address for a in iface.get("addresses", [])):
            return iface["name"].split("@")[0]
    for iface in interfaces:
        if "LOOPBACK" in iface.get("flags", []) and holds(iface, address):
            return iface["name"].split("@")[0]
    return ""


def holds(iface: dict[str, Any], address: str) -> bool:
    """The interface has `address`; a loopback interface holds its whole prefix (127.0.0.0/8)."""
    for item in iface.get("addresses", []):
        if item.split("/")[0] == address:
            return True
        if "LOOPBACK" in iface.get("flags", []):
            try:
                if ipaddress.ip_address(address) in ipaddress.ip_network(item, strict=False):
                    return True
            except ValueError:
                continue
    return False


def nccl_selects(spec: str, names: list[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME=`spec` lets NCCL use: prefixes by default, `=` exact
    names, a leading `^` excludes the listed ones instead."""
    exclude = spec.startswith("^")
    text = spec[1:] if exclude else spec
    exact = text.startswith("=")
    patterns = [p for p in (text[1:] if exact else text).split(",") if p]

    def listed(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    return [name for name in names if listed(name) != exclude]


def is_up(iface: dict[str, Any]) -> bool:
    flags = iface.get("flags", [])
    return "UP" in flags and ("LOWER_UP" in flags or "LOOPBACK" in flags) and iface.get("operstate") != "DOWN"


def launch_env(host: Host, spec: str, resolved: str | None, inventory: Path) -> dict[str, str]:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME as launch exports them, from the launcher's own
    Topology.node_env (a one-node topology: only the interface settings are read here)."""
    node = Node(host=host.name, node_rank=0, address=host.address, nccl_socket_ifname=spec, vars=host.vars)
    topology = Topology(
        inventory=inventory,
        nodes=(node,),
        master_port=0,
        gpus_per_node=1,
        nccl_ib_disable=1,
        nccl_debug="WARN",
        nccl_timeout_s=0,
    )
    env = topology.node_env(node, resolved_ifname=resolved)
    return {k: env[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if k in env}


def evaluate(cluster: Cluster, facts: dict[str, Any], why_missing) -> list[Result]:
    results: list[Result] = []
    mtus: dict[str, int] = {}
    chosen_names: dict[str, str] = {}
    cpu_nodes = any(int(h.get("cluster_accelerators", 0) or 0) == 0 for h in cluster.hosts)
    for host, found in each_host_fact(
        cluster,
        facts,
        "interfaces",
        why_missing,
        results,
        check=CHECK,
        unreadable=lambda host, reason: f"cannot list the interfaces of {host.name}: {reason}",
        fix=lambda host: (
            f"install iproute2 on {host.name} (apt-get install iproute2): `ip -j addr` must work"
        ),
    ):
        interfaces = found["interfaces"]
        by_name = {i["name"].split("@")[0]: i for i in interfaces}
        names = list(by_name)
        spec = str(host.get("cluster_nccl_socket_ifname") or AUTO_IFNAME)
        owner = holding(interfaces, host.address)
        listing = ", ".join(f"{n} ({', '.join(i['addresses']) or 'no IPv4'})" for n, i in by_name.items())
        if spec == AUTO_IFNAME:
            if not owner:
                results.append(
                    Result(
                        CHECK,
                        host.name,
                        FAIL,
                        f"cluster_nccl_socket_ifname is auto but no interface of {host.name} holds its "
                        f"cluster_ip {host.address} (it has: {listing}); trainer launch would refuse it",
                        fix=f"set cluster_ip of {host.name} to one of its addresses, or set "
                        f"cluster_nccl_socket_ifname: =<interface> for {host.name} in the inventory",
                    )
                )
                continue
            selected = [owner]
        else:
            selected = nccl_selects(spec, names)
            if not selected:
                results.append(
                    Result(
                        CHECK,
                        host.name,
                        FAIL,
                        f"NCCL_SOCKET_IFNAME={spec} (cluster_nccl_socket_ifname) matches no interface of "
                        f"{host.name} (it has: {listing}): NCCL cannot start there",
                        fix=f"set cluster_nccl_socket_ifname: {('=' + owner) if owner else 'auto'} for "
                        f"{host.name} in the inventory (or auto: the interface holding {host.address})",
                    )
                )
                continue
            holders = [n for n in selected if holds(by_name[n], host.address)]
            if not holders:
                results.append(
                    Result(
                        CHECK,
                        host.name,
                        FAIL,
                        f"NCCL_SOCKET_IFNAME={spec} selects {', '.join(selected)} on {host.name}, none of "
                        f"which holds its cluster_ip {host.address}" + (f" ({owner} does)" if owner else ""),
                        fix=f"set cluster_nccl_socket_ifname: {('=' + owner) if owner else 'auto'} for "
                        f"{host.name} in the inventory, so training traffic goes where preflight tested it",
                    )
                )
                continue
            selected = holders
        iface = by_name[selected[0]]
        # `auto` is exported as an exact name (=eth0), as launch's run.sh does.
        env = launch_env(host, spec, f"={owner}" if spec == AUTO_IFNAME else None, cluster.inventory)
        gloo = env.get("GLOO_SOCKET_IFNAME")
        problems: list[tuple[str, str]] = []
        if gloo and gloo not in by_name:
            problems.append(
                (
                    f"GLOO_SOCKET_IFNAME={gloo} (launch derives it from cluster_nccl_socket_ifname {spec!r}) "
                    f"is no interface of {host.name}: gloo takes one exact name",
                    f"set cluster_nccl_socket_ifname: ={iface['name']} for {host.name} in the inventory",
                )
            )
        if not is_up(iface):
            problems.append(
                (
                    f"{iface['name']} on {host.name} is down (state {iface.get('operstate')}, "
                    f"flags {','.join(iface.get('flags', []))})",
                    f"on {host.name}: ip link set {iface['name']} up, and check its link "
                    f"(ethtool {iface['name']}: cable, switch port)",
                )
            )
        if problems:
            results.append(
                Result(
                    CHECK,
                    host.name,
                    FAIL,
                    "; ".join(p for p, _ in problems),
                    fix="; ".join(f for _, f in problems),
                )
            )
            continue
        mtus[host.name] = int(iface.get("mtu") or 0)
        chosen_names[host.name] = iface["name"]
        shown_env = ", ".join(f"{k}={v}" for k, v in env.items()) or "NCCL picks its interface itself"
        status, fix = PASS, ""
        if not gloo and cpu_nodes:
            status = WARN
            fix = (
                f"give one exact interface (cluster_nccl_socket_ifname: ={iface['name']}) or auto for "
                f"{host.name}: with a list or an exclusion launch sets no GLOO_SOCKET_IFNAME and gloo "
                "binds to whatever the hostname resolves to"
            )
        results.append(
            Result(
                CHECK,
                host.name,
                status,
                f"{shown_env}: {iface['name']} up, holds {host.address}, MTU {mtus[host.name]}",
                fix=fix,
                data={"interface": iface["name"], "mtu": mtus[host.name], "env": env},
            )
        )
    reference, odd = odd_ones(mtus, cluster.head.name)
    for name in odd:
        results.append(
            Result(
                CHECK,
                name,
                FAIL,
                f"MTU {mtus[name]} on {name}'s {chosen_names[name]}, the other nodes use {reference}: "
                "large NCCL/gloo packets are dropped between them (a hang, not an error)",
                fix=f"on {name}: ip link set dev {chosen_names[name]} mtu {reference} (and in its network "
                f"configuration), or give every node and switch port MTU {mtus[name]}",
                data={"mtu": mtus[name], "others": reference},
            )
        )
    return results
