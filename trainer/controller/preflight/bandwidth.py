"""iperf3 between every pair of nodes, in parallel rounds, and what the numbers mean for ZeRO.

N(N-1)/2 sequential tests take too long on a big cluster, and tests run at the same time on the
same node would share its NIC and under-report. The circle method gives N-1 rounds (N odd: one node
sits out each round) in which every node is in at most one test, and every pair meets exactly once.
"""

from __future__ import annotations

from typing import Any

from trainer.controller.preflight.report import FAIL, PASS, WARN, Result

CHECK = "bandwidth"

ZERO_ADVICE = (
    "use ZeRO-2 (distributed.zero_stage=2) for multi-node training on this network; ZeRO-3 shards the "
    "parameters too and needs a fast interconnect (InfiniBand/RoCE, 100+ Gbit/s). Keep training traffic "
    "on a dedicated network, raise gradient_accumulation_steps to talk less often, and check the NIC "
    "and cabling of the slow pairs"
)


def round_robin(nodes: list[str]) -> list[list[tuple[str, str]]]:
    """Rounds of disjoint pairs (circle method): every pair exactly once, no node twice in a round.

    Even N: N-1 rounds of N/2 pairs. Odd N: a placeholder makes N+1 and whoever meets it has a bye,
    so N rounds of (N-1)/2 pairs (each node still plays N-1 rounds; fewer rounds cannot hold all pairs).
    """
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"duplicate node names in {nodes}")
    ring: list[str | None] = list(nodes)
    if len(ring) % 2:
        ring.append(None)
    size = len(ring)
    rounds: list[list[tuple[str, str]]] = []
    for _ in range(size - 1):
        pairs = []
        for i in range(size // 2):
            first, second = ring[i], ring[size - 1 - i]
            if first is not None and second is not None:
                pairs.append((first, second))
        rounds.append(pairs)
        # Keep the first node fixed and rotate the rest one step clockwise.
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return [pairs for pairs in rounds if pairs]


def parse_iperf_json(result: dict[str, Any]) -> tuple[float | None, float | None, str]:
    """(client->server, server->client) Gbit/s from `iperf3 -J --bidir`, and an error if any."""
    if result.get("error"):
        return None, None, str(result["error"])
    end = result.get("end") or {}
    forward = (end.get("sum_received") or {}).get("bits_per_second")
    reverse = (end.get("sum_received_bidir_reverse") or {}).get("bits_per_second")
    if forward is None:
        return None, None, "iperf3 gave no summary (the test did not finish)"
    return forward / 1e9, (reverse / 1e9 if reverse is not None else None), ""


def matrix(nodes: list[str], measured: dict[tuple[str, str], float | None]) -> list[list[float | None]]:
    """Rows = sender, columns = receiver, Gbit/s; the diagonal and unmeasured cells are None."""
    return [[measured.get((sender, receiver)) for receiver in nodes] for sender in nodes]


def format_matrix(nodes: list[str], cells: list[list[float | None]]) -> str:
    width = max(12, *(len(n) + 5 for n in nodes))  # room for "-> " and a gap
    lines = ["Gbit/s".ljust(width) + "".join(("-> " + n).rjust(width) for n in nodes)]
    for sender, row in zip(nodes, cells, strict=True):
        text = "".join(("-" if v is None else f"{v:.2f}").rjust(width) for v in row)
        lines.append(sender.ljust(width) + text)
    return "\n".join(lines)


def evaluate_pair(
    client: str, server: str, forward: float | None, reverse: float | None, error: str, threshold_gbit: float
) -> Result:
    """A failed test is a failure; a slow pair is a warning with the ZeRO advice."""
    subject = f"{client} <-> {server}"
    if error or forward is None:
        return Result(
            CHECK,
            subject,
            FAIL,
            f"iperf3 test failed: {error}",
            fix=f"check that iperf3 is installed on both nodes and that the cluster comm port range is open "
            f"on {server} for {client} (ufw allow from the cluster subnet)",
        )
    slowest = min(v for v in (forward, reverse) if v is not None)
    shown = f"{forward:.2f} Gbit/s ->" + (f", {reverse:.2f} Gbit/s <-" if reverse is not None else "")
    data = {"client": client, "server": server, "forward_gbit": forward, "reverse_gbit": reverse}
    if slowest < threshold_gbit:
        # The ZeRO advice is printed once after the matrix; per pair it would repeat N(N-1)/2 times.
        return Result(
            CHECK,
            subject,
            WARN,
            f"{shown}: below {threshold_gbit:g} Gbit/s",
            fix="see the ZeRO advice below the matrix",
            data=data,
        )
    return Result(CHECK, subject, PASS, f"{shown} (threshold {threshold_gbit:g} Gbit/s)", data=data)


def bandwidth_ports(comm_range: str, master_port: int, count: int = 1) -> list[int]:
    """Ports for the iperf3 servers: the top of the cluster comm range, never the master port."""
    low, high = parse_port_range(comm_range)
    ports = [p for p in range(high, low - 1, -1) if p != master_port][:count]
    if len(ports) < count:
        raise ValueError(f"cluster_comm_port_range {comm_range} has no room for {count} test port(s)")
    return ports


def parse_port_range(comm_range: str) -> tuple[int, int]:
    """'29400:29999' -> (29400, 29999), with a message that names the variable when it is wrong."""
    try:
        low_text, high_text = str(comm_range).split(":")
        low, high = int(low_text), int(high_text)
    except ValueError:
        raise ValueError(
            f"cluster_comm_port_range must look like '29400:29999' (low:high), got {comm_range!r}"
        ) from None
    if not 0 < low <= high < 65536:
        raise ValueError(f"cluster_comm_port_range {comm_range!r} is not a valid low:high port range")
    return low, high


def evaluate(
    nodes: list[str],
    rounds: list[dict[str, Any]],
    clients: list[dict[str, Any]],
    servers: dict[str, Any],
    threshold_gbit: float,
    why_missing,
) -> tuple[list[Result], dict[str, Any]]:
    """Verdicts per pair and the matrix (for the report) from the iperf3 probes of every round."""
    by_pair = {(c["client"], c.get("peer_name")): c for c in clients}
    measured: dict[tuple[str, str], float | None] = {}
    results = []
    for scheduled in rounds:
        for pair in scheduled["pairs"]:
            client, server = pair["client"], pair["server"]
            answer = by_pair.get((client, server))
            if answer is None:
                started = servers.get(f"{server}#{scheduled['index']}") or {}
                reason = started.get("error") or why_missing(client)
                results.append(evaluate_pair(client, server, None, None, reason, threshold_gbit))
                continue
            forward, reverse, error = parse_iperf_json(answer)
            measured[(client, server)] = forward
            measured[(server, client)] = reverse
            results.append(evaluate_pair(client, server, forward, reverse, error, threshold_gbit))
    cells = matrix(nodes, measured)
    report = {
        "unit": "Gbit/s",
        "nodes": nodes,
        "matrix": cells,
        "threshold_gbit": threshold_gbit,
        "rounds": [[[p["client"], p["server"]] for p in r["pairs"]] for r in rounds],
    }
    return results, report
