"""Run the preflight playbook through the project's ansible-runner wrapper and collect what each
node's probes printed (JSON on stdout), keyed by probe and host."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.controller.inventory import Cluster
from trainer.controller.preflight.bandwidth import bandwidth_ports, parse_port_range, round_robin

PLAYBOOK = Path(__file__).parent / "playbooks" / "preflight.yml"

#: Task names in preflight.yml whose stdout is JSON.
NODE_FACTS = "Preflight | node facts"
UFW = "Preflight | ufw status"
SSH = "Preflight | ssh to peers"
LISTENER = "Preflight | head listener"
CLIENT = "Preflight | head client"
SHARED_WRITE = "Preflight | shared dir write"
SHARED_VERIFY = "Preflight | shared dir verify"
IPERF_SERVER = "Preflight | iperf3 server"
IPERF_CLIENT = "Preflight | iperf3 client"


@dataclass
class Probes:
    """Per probe, per host: parsed JSON (or the raw module result for non-JSON tasks)."""

    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Per probe, per host: why there is no output (unreachable, task failed, bad JSON).
    errors: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Hosts Ansible could not reach at all, with the message.
    unreachable: dict[str, str] = field(default_factory=dict)
    #: Every iperf3 client result, in run order (one per pair).
    iperf: list[dict[str, Any]] = field(default_factory=list)
    playbook_output: str = ""

    def get(self, probe: str, host: str) -> Any:
        return self.outputs.get(probe, {}).get(host)

    def why_missing(self, probe: str, host: str) -> str:
        if host in self.unreachable:
            return f"Ansible cannot reach {host}: {self.unreachable[host]}"
        return self.errors.get(probe, {}).get(host) or f"the probe did not run on {host}"


def iperf_rounds(cluster: Cluster) -> list[dict[str, Any]]:
    """The round-robin schedule as the playbook takes it; the server port is from the comm range."""
    head = cluster.head
    port = bandwidth_ports(
        str(head.get("cluster_comm_port_range", "29400:29999")), int(head.get("cluster_master_port", 29500))
    )[0]
    rounds = round_robin([h.name for h in cluster.hosts])
    return [
        {"index": i, "pairs": [{"client": a, "server": b, "port": port} for a, b in pairs]}
        for i, pairs in enumerate(rounds, start=1)
    ]


def extravars(cluster: Cluster, checks: list[str], iperf_seconds: int) -> dict[str, Any]:
    head = cluster.head
    comm_range = str(head.get("cluster_comm_port_range", "29400:29999"))
    parse_port_range(comm_range)  # a clear error before anything runs
    return {
        "preflight_checks": checks,
        "preflight_nodes": [{"name": h.name, "address": h.address} for h in cluster.hosts],
        "preflight_addresses": {h.name: h.address for h in cluster.hosts},
        "preflight_head": head.name,
        "preflight_master_port": int(head.get("cluster_master_port", 29500)),
        "preflight_comm_port_range": comm_range,
        "preflight_token": secrets.token_hex(8),
        "preflight_iperf_rounds": iperf_rounds(cluster) if "bandwidth" in checks else [],
        "preflight_iperf_seconds": iperf_seconds,
    }


def run_probes(cluster: Cluster, checks: list[str], iperf_seconds: int = 3, on_event=None) -> Probes:
    from trainer.controller.runner import run_playbook  # imported here: ansible-runner is heavy

    result = run_playbook(
        PLAYBOOK, cluster.inventory, extravars=extravars(cluster, checks, iperf_seconds), on_event=on_event
    )
    probes = Probes(playbook_output=result.output)
    for host, items in result.unreachable.items():
        probes.unreachable[host] = items[0].message
    for item in result.results:
        if item.status == "skipped":
            continue
        if item.status != "ok":
            probes.errors.setdefault(item.task, {})[item.host] = item.message or item.status
            continue
        if item.task == UFW:
            probes.outputs.setdefault(UFW, {})[item.host] = item.result
            continue
        stdout = str(item.result.get("stdout") or "").strip()
        if item.result.get("rc") not in (0, None) or not stdout:
            # The probe could not run at all (no python3, become refused): its own words say why.
            probes.errors.setdefault(item.task, {})[item.host] = item.message or "the probe printed nothing"
            continue
        try:
            parsed = json.loads(stdout.splitlines()[-1])
        except ValueError:
            probes.errors.setdefault(item.task, {})[item.host] = f"unreadable probe output: {stdout[-300:]}"
            continue
        if item.task == IPERF_CLIENT:
            probes.iperf.append({"client": item.host, **parsed})
        elif item.task == IPERF_SERVER:
            probes.outputs.setdefault(IPERF_SERVER, {})[f"{item.host}#{parsed.get('round')}"] = parsed
        else:
            probes.outputs.setdefault(item.task, {})[item.host] = parsed
    return probes
