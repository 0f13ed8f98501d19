"""Run the preflight playbook through the project's ansible-runner wrapper and collect what each
node's probes printed (JSON on stdout), keyed by probe and host."""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.controller.inventory import Cluster
from trainer.controller.preflight import nfs, schedule
from trainer.controller.preflight.bandwidth import bandwidth_ports, parse_port_range

PLAYBOOK = Path(__file__).parent / "playbooks" / "preflight.yml"
CLEANUP_PLAYBOOK = Path(__file__).parent / "playbooks" / "cleanup.yml"
#: Every process a probe starts on a node carries this variable (=the run's token), so a stopped
#: preflight finds and ends what it left (cleanup.yml).
MARKER = "CLUSTERTRAIN_PREFLIGHT"
#: As the launcher runs Ansible: pipelining, fewer round trips per task; forks per run (forks()).
ANSIBLE_ENV = {"ANSIBLE_PIPELINING": "True", "ANSIBLE_NOCOLOR": "True"}
#: Task names in preflight.yml whose stdout is JSON.
NODE_FACTS = "Preflight | node facts"
UFW = "Preflight | ufw status"
#: Its first line of stdout is the user Ansible runs as; where that is root, ufw's status follows
#: (preflight.yml): the UFW probe's output is taken from there.
WHOAMI = "Who Ansible runs as"
SSH = "Preflight | ssh to peers"
LISTENER = "Preflight | head listener"
CLIENT = "Preflight | head client"
SHARED_VERIFY = "Preflight | shared dir verify"
#: One task per node for every round (iperf_pair.py rounds); what it printed is kept by role, the
#: servers' as IPERF_SERVER (host#round), the clients' in Probes.iperf.
IPERF_TEST = "Preflight | iperf3 test"
IPERF_SERVER = "iperf3 server"


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
    #: ansible-runner's status: "successful", "failed", "timeout" (the backstop) or "canceled".
    status: str = ""

    def get(self, probe: str, host: str) -> Any:
        return self.outputs.get(probe, {}).get(host)

    def why_missing(self, probe: str, host: str) -> str:
        if host in self.unreachable:
            return f"Ansible cannot reach {host}: {self.unreachable[host]}"
        return self.errors.get(probe, {}).get(host) or f"the probe did not run on {host}"


def forks(cluster: Cluster) -> int:
    """Ansible forks for a probe run: one per host, within what this machine holds (forks.py, the
    one place the limits are derived). Past the limit Ansible takes the nodes in batches, task by
    task, which the probes allow: no task waits on another host of the same task (an iperf3 client
    waits on a server started by the task before)."""
    from trainer.controller.forks import forks_for

    return forks_for(len(cluster.hosts))


def iperf_rounds(cluster: Cluster, full: bool = False) -> list[dict[str, Any]]:
    """The bandwidth rounds as the playbook takes them (schedule.bandwidth_rounds: O(log N) rounds,
    every pair with `full`); each round's server port its own from the top of the comm range (taken
    in turn when the range holds fewer), as the nodes go through the rounds without a clock."""
    rounds = schedule.bandwidth_rounds([h.name for h in cluster.hosts], full)
    return with_ports(cluster, [{"index": i, "pairs": pairs} for i, pairs in enumerate(rounds, start=1)])


def _test_ports(cluster: Cluster) -> tuple[str, int, int]:
    """(the comm port range, the master port, how many of the range's ports a test may take)."""
    head = cluster.head
    comm_range = str(head.get("cluster_comm_port_range", "29400:29999"))
    master = int(head.get("cluster_master_port", 29500))
    low, high = parse_port_range(comm_range)
    return comm_range, master, high - low + 1 - (low <= master <= high)


def with_ports(cluster: Cluster, rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """rounds ({index, pairs: [(client, server)] or [{client, server}]}) with each pair's port."""
    comm_range, master, room = _test_ports(cluster)
    ports = bandwidth_ports(comm_range, master, max(1, min(len(rounds), room)))
    placed = []
    for scheduled in rounds:
        port = ports[(scheduled["index"] - 1) % len(ports)]
        pairs = [p if isinstance(p, dict) else {"client": p[0], "server": p[1]} for p in scheduled["pairs"]]
        placed.append({"index": scheduled["index"], "pairs": [{**p, "port": port} for p in pairs]})
    return placed


def iperf_reach(cluster: Cluster, rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> its reach pass (iperf_pair.py --reach): the port it listens on and connects to, one of
    the comm range's that no round's server takes, and the peers it has a test with. {} when the
    range has no port to spare (the rounds are tested without it, as before it)."""
    comm_range, master, room = _test_ports(cluster)
    taken = {pair["port"] for r in rounds for pair in r["pairs"]}
    if room <= len(taken):
        return {}
    port = bandwidth_ports(comm_range, master, len(taken) + 1)[-1]
    addresses = {h.name: h.address for h in cluster.hosts}
    peers: dict[str, list[str]] = {h.name: [] for h in cluster.hosts}
    for pair in (p for r in rounds for p in r["pairs"]):
        peers[pair["client"]].append(pair["server"])
        peers[pair["server"]].append(pair["client"])
    reach = {}
    for name, theirs in peers.items():
        if theirs:
            listed = [[peer, addresses[peer]] for peer in dict.fromkeys(theirs)]
            reach[name] = {"name": name, "port": port, "bind": addresses[name], "peers": listed}
    return reach


def iperf_plan(cluster: Cluster, rounds: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """name -> its iperf3 steps in round order, as iperf_pair.py rounds takes them: serve (bind to
    its own address) or measure (its server's address); a node with no test in a round has no step."""
    addresses = {h.name: h.address for h in cluster.hosts}
    plan: dict[str, list[dict[str, Any]]] = {h.name: [] for h in cluster.hosts}
    for scheduled in rounds:
        for pair in scheduled["pairs"]:
            client, server, port = pair["client"], pair["server"], pair["port"]
            plan[server].append({"round": scheduled["index"], "role": "server", "port": port,
                                 "bind": addresses[server], "peer_name": client})  # fmt: skip
            plan[client].append({"round": scheduled["index"], "role": "client", "port": port,
                                 "peer": addresses[server], "peer_name": server})  # fmt: skip
    return plan


def _training_env(host) -> dict[str, str]:
    """The host's training_env as launch would add it (problems are the topology check's to name)."""
    from trainer.controller.training_env import EnvError, parse_training_env

    try:
        return parse_training_env(host.get("training_env")).values
    except EnvError:
        return {}


def marker_name(host: str, token: str) -> str:
    """The file each node writes into the shared dir for the head to find."""
    return f".preflight-{host}-{token}"


def node_requests(
    cluster: Cluster, checks: list[str], token: str, model_dir: str = "", io_timeout_s: float = 10.0
) -> dict[str, dict[str, Any]]:
    """Per host: what node_facts.py looks at there (see its docstring)."""
    wanted = set(checks)
    requests = {}
    for host in cluster.hosts:
        request: dict[str, Any] = {
            "venv": str(host.get("training_venv") or ""),
            "data_path": str(host.get("cluster_data_path") or ""),
            "address": host.address,
            "gpus": int(host.get("cluster_accelerators", 0) or 0),
            "io_timeout_s": io_timeout_s,
            "chrony": "clock" in wanted and not cluster.is_single_host,
        }
        if wanted & {"shared_dir", "space", "nfs"}:
            request["shared_dir"] = str(host.get("cluster_shared_dir") or "")
        if "shared_dir" in wanted:
            request["marker"] = {"name": marker_name(host.name, token), "token": token}
        if "nfs" in wanted:
            request["nfs"] = nfs.node_request(cluster, host)
        if "space" in wanted and host.name == cluster.head.name and model_dir.startswith("/"):
            request["model_dir"] = model_dir
        if extensions_dir := _training_env(host).get("TORCH_EXTENSIONS_DIR"):
            request["extensions_dir"] = extensions_dir  # the job's own setting wins over the venv's
        requests[host.name] = request
    return requests


def extravars(
    cluster: Cluster,
    checks: list[str],
    iperf_seconds: int,
    token: str | None = None,
    model_dir: str = "",
    io_timeout_s: float = 10.0,
    rounds: list[dict[str, Any]] | None = None,
    probes: Collection[str] = (),
    full: bool = False,
) -> dict[str, Any]:
    """The probe playbook's variables; `rounds` replaces the bandwidth check's schedule (a
    re-measure of some pairs); `probes`: the playbook's tasks to run, those the checks read
    (checks.probes_for); `full`: every pair logs in and is measured (--full-matrix)."""
    head = cluster.head
    comm_range = str(head.get("cluster_comm_port_range", "29400:29999"))
    parse_port_range(comm_range)  # a clear error before anything runs
    token = token or secrets.token_hex(8)
    scheduled = []
    if IPERF_TEST in probes:
        scheduled = with_ports(cluster, rounds) if rounds else iperf_rounds(cluster, full)
    return {
        "preflight_nodes": [{"name": h.name, "address": h.address} for h in cluster.hosts],
        "preflight_addresses": {h.name: h.address for h in cluster.hosts},
        "preflight_head": head.name,
        "preflight_master_port": int(head.get("cluster_master_port", 29500)),
        "preflight_comm_port_range": comm_range,
        "preflight_token": token,
        "preflight_marker": MARKER,
        "preflight_probes": sorted(probes),
        "preflight_requests": node_requests(cluster, checks, token, model_dir, io_timeout_s),
        "preflight_io_timeout_s": io_timeout_s,
        "preflight_iperf_plan": iperf_plan(cluster, scheduled) if IPERF_TEST in probes else {},
        # A first measurement tries each pair's connections both ways before any test; a second one
        # measures again pairs that were tested.
        "preflight_iperf_reach": iperf_reach(cluster, scheduled) if scheduled and rounds is None else {},
        "preflight_iperf_seconds": iperf_seconds,
        "preflight_ssh_logins": ssh_logins(cluster, full) if SSH in probes and rounds is None else {},
    }


def ssh_logins(cluster: Cluster, full: bool = False) -> dict[str, list[list[str]]]:
    """name -> [[peer, address], ...] it logs in to, in round order (schedule.login_order)."""
    addresses = {h.name: h.address for h in cluster.hosts}
    order = schedule.login_order([h.name for h in cluster.hosts], full)
    return {name: [[peer, addresses[peer]] for peer in peers] for name, peers in order.items()}


def time_limit_s(
    cluster: Cluster, probes: Collection[str], iperf_seconds: int, io_timeout_s: float, full: bool = False
) -> float:
    """The whole probe playbook's bound: every task has its own timeout, this is the backstop."""
    names = [h.name for h in cluster.hosts]
    rounds = len(schedule.bandwidth_rounds(names, full)) if IPERF_TEST in probes else 0
    logins = len(schedule.login_offsets(len(names), full)) if SSH in probes else 0
    return 300 + 4 * io_timeout_s + rounds * (iperf_seconds + 120) + 20 * logins


def run_probes(
    cluster: Cluster,
    checks: list[str],
    iperf_seconds: int = 3,
    on_event=None,
    token: str | None = None,
    model_dir: str = "",
    io_timeout_s: float = 10.0,
    rounds: list[dict[str, Any]] | None = None,
    probes: Collection[str] = (),
    full: bool = False,
    limit: list[str] | None = None,
) -> Probes:
    """`probes`: the playbook's tasks to run (checks.probes_for(checks)); `limit`: only these hosts (a
    re-measure of some pairs: the others have nothing to run)."""
    from trainer.controller.runner import run_playbook  # imported here: ansible-runner is heavy

    variables = extravars(
        cluster, checks, iperf_seconds, token, model_dir, io_timeout_s, rounds, probes=probes, full=full
    )
    result = run_playbook(
        PLAYBOOK,
        cluster.inventory,
        extravars=variables,
        on_event=on_event,
        limit=",".join(limit) if limit else None,
        timeout_s=time_limit_s(cluster, probes, iperf_seconds, io_timeout_s, full),
        env=ANSIBLE_ENV | {"ANSIBLE_FORKS": str(forks(cluster))},
    )
    probes = Probes(playbook_output=result.output, status=result.status)
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
        if item.task == WHOAMI:
            if "ufw" in checks and (ufw := ufw_after_whoami(item.result)) is not None:
                probes.outputs.setdefault(UFW, {})[item.host] = ufw
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
        if item.task == IPERF_TEST:
            for measured in parsed.get("clients", []):
                probes.iperf.append({"client": item.host, **measured})
            for served in parsed.get("servers", []):
                probes.outputs.setdefault(IPERF_SERVER, {})[f"{item.host}#{served.get('round')}"] = served
        else:
            probes.outputs.setdefault(item.task, {})[item.host] = parsed
    return probes


def ufw_after_whoami(result: dict[str, Any]) -> dict[str, Any] | None:
    """The ufw status the whoami task read where Ansible is root (as the ufw task's own result:
    rc, stdout, stderr), or None where it is not (the ufw task ran there)."""
    user, _, rest = str(result.get("stdout") or "").partition("\n")
    if user.strip() != "root":
        return None
    return {"rc": result.get("rc"), "stdout": rest, "stderr": str(result.get("stderr") or ""), "msg": ""}


def cleanup(cluster: Cluster, token: str, locks_newer_than: float | None = None) -> str:
    """End what a stopped preflight left on the nodes: its processes (listener, iperf3 servers),
    its marker files in the shared dir, and build locks a stopped DeepSpeed job left. Returns a
    one-line summary."""
    from trainer.controller.runner import run_playbook

    result = run_playbook(
        CLEANUP_PLAYBOOK,
        cluster.inventory,
        extravars={
            "preflight_token": token,
            "preflight_marker": MARKER,
            "preflight_locks_newer_than": locks_newer_than if locks_newer_than is not None else "",
        },
        timeout_s=180,
        env=ANSIBLE_ENV | {"ANSIBLE_FORKS": str(forks(cluster))},
    )
    done = []
    for item in result.results:
        if item.status != "ok" or not str(item.result.get("stdout") or "").strip():
            continue
        try:
            found = json.loads(str(item.result["stdout"]).strip().splitlines()[-1])
        except ValueError:
            continue
        for key in ("killed", "removed_files", "removed_locks"):
            if found.get(key):
                done.append(f"{item.host}: {key.replace('_', ' ')} {', '.join(map(str, found[key]))}")
    failed = sorted(set(result.failed) | set(result.unreachable))
    summary = "; ".join(done) or "nothing was left"
    if failed:
        summary += f" (could not clean up on {', '.join(failed)})"
    return summary
