"""The master port reachable from every worker, and ufw's rules as the cluster needs them."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from trainer.controller.inventory import Cluster
from trainer.controller.preflight.host_facts import each_host_answer
from trainer.controller.preflight.report import FAIL, PASS, SKIP, WARN, Result


def master_port(
    cluster: Cluster, listener: dict[str, Any] | None, clients: dict[str, Any], why_missing
) -> list[Result]:
    check = "master_port"
    head = cluster.head
    port = int(head.get("cluster_master_port", 29500))
    if cluster.is_single_host:
        return [Result(check, head.name, SKIP, "skipped: one node")]
    if listener is None:
        return [
            Result(
                check,
                head.name,
                FAIL,
                f"could not open a test listener: {why_missing(head.name)}",
                fix=f"check that python3 runs on {head.name} (python3 --version there)",
            )
        ]
    state = listener.get("master_port", {})
    if not state.get("listening"):
        in_use = state.get("error") == "in use"
        return [
            Result(
                check,
                head.name,
                FAIL,
                f"port {port} on {head.name} is already in use"
                if in_use
                else f"cannot listen on {port}: {state.get('error')}",
                fix=f"on {head.name}: stop what holds {head.address}:{port} (a leftover trainer? "
                f"ss -ltnp 'sport = :{port}') or choose another cluster_master_port",
            )
        ]
    results = []
    for worker, answer in each_host_answer(
        cluster.workers,
        clients,
        why_missing,
        results,
        check=check,
        unreadable=lambda worker, why: f"could not test: {why}",
        fix=lambda worker: f"check that Ansible reaches {worker.name} (ansible {worker.name} -m ping)",
    ):
        reached = answer.get("master_port", {})
        if reached.get("connected"):
            results.append(Result(check, worker.name, PASS, f"reached {head.name} {head.address}:{port}"))
        else:
            results.append(
                Result(
                    check,
                    worker.name,
                    FAIL,
                    f"cannot connect to {head.name} {head.address}:{port}: {reached.get('error')}",
                    fix=f"allow the master port on {head.name} for the cluster: ufw allow from "
                    f"{head.get('cluster_subnet', '<cluster subnet>')} to any port {port} proto tcp "
                    "(the firewall role does; check `ufw status numbered` for a deny above it)",
                )
            )
    return results


@dataclass(frozen=True)
class UfwRule:
    ports: tuple[tuple[int, int], ...] | None  # None: any port
    proto: str | None  # "tcp", "udp" or None for both
    action: str  # ALLOW, DENY, REJECT, LIMIT
    source: str  # "Anywhere" or an address/CIDR
    text: str


_RULE = re.compile(
    r"^(?P<to>.+?)\s{2,}(?P<action>ALLOW|DENY|REJECT|LIMIT)(?: (?P<direction>IN|OUT|FWD))?\s+(?P<src>.+?)\s*$"
)
_PORT_SPEC = re.compile(r"^(?P<ports>[\d:,]+)(?:/(?P<proto>tcp|udp))?$")


def parse_ufw_status(text: str) -> tuple[bool, str, list[UfwRule]]:
    """(active, default incoming policy, IPv4 rules in order) from `ufw status verbose`."""
    active = bool(re.search(r"^Status:\s*active", text, re.M))
    default = re.search(r"^Default:\s*(\w+)\s*\(incoming\)", text, re.M)
    rules: list[UfwRule] = []
    in_table = False
    for line in text.splitlines():
        if line.startswith("--"):
            in_table = True
            continue
        if not in_table or not line.strip() or "(v6)" in line:
            continue
        match = _RULE.match(line)
        if not match or match["direction"] in ("OUT", "FWD"):
            continue
        target = match["to"].split()[-1]
        spec = _PORT_SPEC.match(target)
        if spec:
            ranges = []
            for part in spec["ports"].split(","):
                low, _, high = part.partition(":")
                ranges.append((int(low), int(high or low)))
            ports, proto = tuple(ranges), spec["proto"]
        elif target == "Anywhere" or re.match(r"^[\d./]+$", target):
            ports, proto = None, None
        else:
            continue  # application profiles (OpenSSH) and the like: not about our ports
        rules.append(UfwRule(ports, proto, match["action"], match["src"].split()[0], " ".join(line.split())))
    return active, (default[1] if default else "deny"), rules


def _matches(rule: UfwRule, port: int, source: str) -> bool:
    if rule.proto not in (None, "tcp"):
        return False
    if rule.ports is not None and not any(low <= port <= high for low, high in rule.ports):
        return False
    if rule.source == "Anywhere":
        return True
    try:
        return ipaddress.ip_address(source) in ipaddress.ip_network(rule.source, strict=False)
    except ValueError:
        return False


def ufw_verdict(rules: list[UfwRule], default: str, port: int, source: str) -> tuple[bool, str]:
    """(allowed, the deciding rule) for a TCP connection to `port` from `source`: first match wins."""
    for rule in rules:
        if _matches(rule, port, source):
            return rule.action in ("ALLOW", "LIMIT"), rule.text
    return default == "allow", f"default {default} (incoming)"


def ufw(cluster: Cluster, outputs: dict[str, Any], why_missing) -> list[Result]:
    check = "ufw"
    if cluster.is_single_host:
        return [
            Result(
                check,
                cluster.head.name,
                SKIP,
                "skipped: one node (cluster traffic stays on this machine; the firewall role skips it)",
            )
        ]
    head = cluster.head
    master = int(head.get("cluster_master_port", 29500))
    low, high = (int(p) for p in str(head.get("cluster_comm_port_range", "29400:29999")).split(":"))
    results = []
    for host, output in each_host_answer(
        cluster.hosts,
        outputs,
        why_missing,
        results,
        check=check,
        unreadable=lambda host, why: f"could not read ufw: {why}",
        fix=lambda host: (
            f"check that Ansible can become root on {host.name} (ansible {host.name} -b -m ping)"
        ),
    ):
        if output.get("rc") != 0:
            message = " ".join(str(output.get(k) or "") for k in ("msg", "stderr", "stdout")).strip()
            if "No such file" in message or output.get("rc") == 127:
                message = "ufw is not installed"
            elif "Permission denied" in message:
                message = "ufw cannot read the firewall rules (it needs root and CAP_NET_ADMIN)"
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"ufw status failed: {message[-200:]}",
                    fix=f"install and enable ufw with the cluster rules on {host.name}: "
                    "ansible-playbook site.yml --tags firewall",
                )
            )
            continue
        active, default, rules = parse_ufw_status(output.get("stdout", ""))
        if not active:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    "ufw is inactive: every port is open to every network",
                    fix=f"enable the firewall with the cluster rules on {host.name}: "
                    "ansible-playbook site.yml --tags firewall",
                )
            )
            continue
        problems = []
        peers = [p for p in cluster.hosts if p.name != host.name]
        wanted = [(master, "master port")] if host.name == head.name else []
        wanted += [(low, "comm range start"), (high, "comm range end")]
        for port, label in wanted:
            for peer in peers:
                allowed, rule = ufw_verdict(rules, default, port, peer.address)
                if not allowed:
                    problems.append(
                        f"{label} {port}/tcp from {peer.name} ({peer.address}) blocked by: {rule}"
                    )
        if problems:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    "; ".join(problems),
                    fix=f"on {host.name}: remove the blocking rule (ufw status numbered; ufw delete N) and "
                    f"allow {low}:{high}/tcp and the master port from "
                    f"{head.get('cluster_subnet', 'the cluster subnet')}",
                    data={"rules": [r.text for r in rules]},
                )
            )
        else:
            results.append(
                Result(
                    check,
                    host.name,
                    PASS,
                    f"active; {'master port and ' if host.name == head.name else ''}"
                    f"{low}:{high}/tcp open to the other nodes",
                )
            )
    return results


def clock_results(
    cluster: Cluster,
    clients: dict[str, Any],
    facts: dict[str, Any],
    bound_s: float,
    why_missing_client,
    why_missing_facts,
) -> list[Result]:
    """One verdict per node: chronyd running and synchronised (the head's source, the workers'
    the head), and each worker's offset against the head as measured."""
    from trainer.controller.preflight import clock

    if cluster.is_single_host:
        return [Result(clock.CHECK, cluster.head.name, SKIP, "skipped: one node")]
    head = cluster.head
    results = []
    for host in cluster.hosts:
        is_head = host.name == head.name
        chrony = (facts.get(host.name) or {}).get("chrony")
        if chrony is None:
            chrony = {"running": False, "error": why_missing_facts(host.name)}
        status, detail, fix = clock.chrony_verdict(host.name, chrony, head.name, head.address, is_head)
        verdicts = [(status, detail, fix)]
        data: dict[str, Any] = {"chrony": chrony.get("tracking")}
        if is_head:
            verdicts.append((PASS, "reference clock (offsets are against the head)", ""))
        else:
            answer = (clients.get(host.name) or {}).get("clock")
            if not answer or not answer.get("samples"):
                reason = (answer or {}).get("error") or why_missing_client(host.name)
                verdicts.append(
                    (
                        FAIL,
                        f"cannot measure the clock of {host.name} against {head.name}: {reason}",
                        f"open the cluster comm port range on {head.name} for {host.name} "
                        f"(ufw allow from {host.address} to any port "
                        f"{head.get('cluster_comm_port_range', '29400:29999')!s}/tcp)",
                    )
                )
            else:
                offset, rtt = clock.best_offset([tuple(s) for s in answer["samples"]])
                measured = clock.evaluate(host.name, head.name, offset, rtt, bound_s)
                verdicts.append((measured.status, measured.detail, measured.fix))
                data.update(measured.data)
        worst = (
            FAIL
            if any(v[0] == FAIL for v in verdicts)
            else (WARN if any(v[0] == WARN for v in verdicts) else PASS)
        )
        shown = [v for v in verdicts if v[0] == worst] if worst != PASS else verdicts
        results.append(
            Result(
                clock.CHECK,
                host.name,
                worst,
                "; ".join(v[1] for v in (verdicts if worst == PASS else shown)),
                fix="; ".join(v[2] for v in shown if v[2]),
                data=data,
            )
        )
    return results
