"""iperf3 between every pair of nodes, in parallel rounds, and what the numbers mean for ZeRO.

N(N-1)/2 sequential tests take too long on a big cluster, and tests run at the same time on the
same node would share its NIC and under-report. The circle method gives N-1 rounds (N odd: one node
sits out each round) in which every node is in at most one test, and every pair meets exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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


#: A direction slower than this fraction of the median of every other measured direction is an
#: outlier: one bad link (a cable, a shaper, a duplex mismatch), not a slow network.
OUTLIER_FRACTION = 0.25
#: The length of each test of the rounds (seconds, --iperf-seconds): short, since a link is sampled
#: in every round and a pair that looks bad is measured again, longer (retest_seconds).
DEFAULT_SECONDS = 1


def retest_seconds(seconds: int) -> int:
    """The length of a second measurement of a pair that looked bad: three times the first, at least
    3 s, so a slow start or a burst of other traffic on a busy host weighs less than in the first."""
    return max(3, 3 * seconds)


def outlier_medians(measured: dict[tuple[str, str], float | None]) -> dict[tuple[str, str], float]:
    """(sender, receiver) -> median of all other directions, for the directions that are outliers.

    Needs at least two other measurements (three directions: 2 nodes have only one pair)."""
    values = {key: v for key, v in measured.items() if v is not None}
    found = {}
    for key, value in values.items():
        others = sorted(v for other, v in values.items() if other != key)
        if len(others) < 2:
            continue
        middle = len(others) // 2
        median = others[middle] if len(others) % 2 else (others[middle - 1] + others[middle]) / 2
        if value < OUTLIER_FRACTION * median:
            found[key] = median
    return found


def evaluate_pair(
    client: str,
    server: str,
    forward: float | None,
    reverse: float | None,
    error: str,
    threshold_gbit: float,
    outliers: dict[tuple[str, str], float] | None = None,
) -> Result:
    """A failed test is a failure; an outlier direction or a pair below the threshold a warning
    naming both hosts (the ZeRO advice comes once, after the matrix)."""
    subject = f"{client} <-> {server}"
    if "open a connection to" in error:  # the reach pass (iperf_pair.py): the pair was not tested
        return Result(
            CHECK,
            subject,
            FAIL,
            f"blocked between {client} and {server}: {error}",
            fix=f"a firewall drops or refuses new connections between {client} and {server} on the "
            "cluster comm port range while other pairs connect (a job would hang in its first "
            f"collective): look for the rule with `iptables -S INPUT` and `ufw status numbered` on both; "
            "ansible-playbook site.yml --tags firewall puts the cluster's rules back",
        )
    if "Ansible cannot reach" in error:
        return Result(
            CHECK,
            subject,
            FAIL,
            f"not measured: {error.splitlines()[0]}",
            fix="the ssh check above names why Ansible cannot reach it; run preflight again once it does",
        )
    if error or forward is None:
        return Result(
            CHECK,
            subject,
            FAIL,
            f"iperf3 test failed: {error}",
            fix=f"check that iperf3 is installed on {client} and {server} (apt-get install iperf3) and that "
            f"ufw on {server} allows the cluster comm port range from {client} "
            "(ansible-playbook site.yml --tags firewall)",
        )
    slowest = min(v for v in (forward, reverse) if v is not None)
    shown = f"{forward:.2f} Gbit/s ->" + (f", {reverse:.2f} Gbit/s <-" if reverse is not None else "")
    data = {"client": client, "server": server, "forward_gbit": forward, "reverse_gbit": reverse}
    slow_directions = [
        (sender, receiver, value, (outliers or {})[(sender, receiver)])
        for sender, receiver, value in ((client, server, forward), (server, client, reverse))
        if value is not None and (sender, receiver) in (outliers or {})
    ]
    if slow_directions:
        detail = "; ".join(
            f"{sender} -> {receiver} {value:.3f} Gbit/s is {median / max(value, 1e-9):.0f}x below the median "
            f"of the other links ({median:.2f} Gbit/s)"
            for sender, receiver, value, median in slow_directions
        )
        sender, receiver = slow_directions[0][:2]
        return Result(
            CHECK,
            subject,
            WARN,
            detail,
            fix=f"one slow link, from {sender} to {receiver}: on {sender} and {receiver} look for errors "
            "and drops (ip -s link), the negotiated speed and duplex (ethtool <interface>) and a traffic "
            f"shaper (tc qdisc show); reproduce with iperf3 -c <{receiver}'s cluster_ip> run on {sender}",
            data={**data, "outlier": [list(d[:2]) for d in slow_directions]},
        )
    if slowest < threshold_gbit:
        return Result(
            CHECK,
            subject,
            WARN,
            f"{shown}: below {threshold_gbit:g} Gbit/s",
            fix=f"check the NICs and the route between {client} and {server} (ip -s link and ethtool "
            "<interface> on both), or lower the bar for this network (--bandwidth-threshold-gbit, "
            "preflight_bandwidth_threshold_gbit); see the ZeRO advice below the matrix",
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


@dataclass
class Measured:
    """Per scheduled pair (client, server): (client->server, server->client) Gbit/s and an error."""

    pairs: dict[tuple[str, str], tuple[float | None, float | None, str]] = field(default_factory=dict)

    def directions(self) -> dict[tuple[str, str], float | None]:
        """(sender, receiver) -> Gbit/s, both directions of every pair iperf3 answered for."""
        found: dict[tuple[str, str], float | None] = {}
        for (client, server), (forward, reverse, error) in self.pairs.items():
            if not error:  # an error comes without numbers (parse_iperf_json, measure)
                found[(client, server)], found[(server, client)] = forward, reverse
        return found

    def better_of(self, again: Measured) -> Measured:
        """Each direction's faster measurement: a link carries at least what it once carried, while a
        test can only come out slow by chance (a busy host, a burst of other traffic), not fast."""
        pairs = dict(self.pairs)
        for pair, (forward, reverse, error) in again.pairs.items():
            first_forward, first_reverse, first_error = pairs.get(pair, (None, None, error))
            forward, reverse = _faster(first_forward, forward), _faster(first_reverse, reverse)
            pairs[pair] = (forward, reverse, "" if forward is not None else first_error)
        return Measured(pairs)


def _faster(first: float | None, second: float | None) -> float | None:
    return max((v for v in (first, second) if v is not None), default=None)


def measure(
    rounds: list[dict[str, Any]], clients: list[dict[str, Any]], servers: dict[str, Any], why_missing
) -> Measured:
    """What the iperf3 probes of every round measured, per scheduled pair."""
    by_pair = {(c["client"], c.get("peer_name")): c for c in clients}
    # The nodes whose task ran: a pair with a node that did not run it (Ansible cannot reach it) is
    # named for that node's cause, not for the connections its peer could not make to it.
    ran = {c["client"] for c in clients} | {key.split("#")[0] for key in servers}
    found = Measured()
    for scheduled in rounds:
        for pair in scheduled["pairs"]:
            client, server = pair["client"], pair["server"]
            answer = by_pair.get((client, server))
            started = servers.get(f"{server}#{scheduled['index']}") or {}
            absent = next((end for end in (client, server) if end not in ran), None)
            if absent is not None and (answer is None or answer.get("error")):
                found.pairs[(client, server)] = (None, None, why_missing(absent))
            elif started.get("started") is False and started.get("error") and not started.get("skipped"):
                # The client's "unable to connect" would hide why; the server step names the cause.
                found.pairs[(client, server)] = (None, None, f"{server}: {started['error']}")
            elif answer is None:
                found.pairs[(client, server)] = (None, None, started.get("error") or why_missing(client))
            else:
                found.pairs[(client, server)] = parse_iperf_json(answer)
    return found


def retest_rounds(
    found: Measured, rounds: list[dict[str, Any]], threshold_gbit: float | None = None
) -> list[dict[str, Any]]:
    """The pairs with an outlier direction, and those below `threshold_gbit` while most measured pairs
    are above it (one slow test on a busy host; when most are below, the network is slow and a second
    test would say so again), scheduled again in rounds of disjoint pairs (as few as fit), for one more
    measurement before they are called slow; [] when there is none."""
    directions = found.directions()
    bad = set(outlier_medians(directions))
    if threshold_gbit is not None:
        slowest = {pair: min((v for v in values[:2] if v is not None), default=None)
                   for pair, values in found.pairs.items() if not values[2]}  # fmt: skip
        slow = {pair for pair, value in slowest.items() if value is not None and value < threshold_gbit}
        answered = len(slowest)
        if len(slow) * 2 < answered:
            bad |= slow
    again: list[tuple[set[str], list[dict[str, Any]]]] = []  # (nodes busy in the round, its pairs)
    for pair in (p for r in rounds for p in r["pairs"]):
        ends = {pair["client"], pair["server"]}
        if not {(pair["client"], pair["server"]), (pair["server"], pair["client"])} & bad:
            continue
        busy, pairs = next(((b, p) for b, p in again if not b & ends), (set(), []))
        if not pairs:
            again.append((busy, pairs))
        busy |= ends
        pairs.append(pair)
    return [{"index": i, "pairs": pairs} for i, (_, pairs) in enumerate(again, start=1)]


def evaluate(
    nodes: list[str],
    rounds: list[dict[str, Any]],
    found: Measured,
    threshold_gbit: float,
    retested: list[dict[str, Any]] | None = None,
    first: Measured | None = None,
) -> tuple[list[Result], dict[str, Any]]:
    """Verdicts per pair and the matrix (for the report); `retested` are the rounds measured a
    second time (retest_rounds), whose pairs' verdicts rest on the faster of the two measurements,
    and `first` what the first rounds measured (all pairs once)."""
    measured = found.directions()
    outliers = outlier_medians(measured)
    twice = {(p["client"], p["server"]) for r in retested or [] for p in r["pairs"]}
    if first is not None and twice:
        # A direction measured once is judged beside the tests of its own rounds: beside the faster
        # second measurements of the retested pairs, a short first test on a busy host looks slow
        # that did not among its own (a false warning on the bed, under load). One slow among its
        # own rounds was retested, and is judged on its faster measurement.
        among_first = outlier_medians(first.directions())
        outliers = {
            direction: median
            for direction, median in outliers.items()
            if direction in among_first or {direction, direction[::-1]} & twice
        }
    results = []
    for (client, server), values in found.pairs.items():
        result = evaluate_pair(client, server, *values, threshold_gbit, outliers)
        if (client, server) in twice:
            result = replace(result, detail=f"{result.detail} (measured twice: the faster of the two)")
        results.append(result)
    cells = matrix(nodes, measured)
    report = {
        "unit": "Gbit/s",
        "nodes": nodes,
        "matrix": cells,
        "threshold_gbit": threshold_gbit,
        "outlier_fraction": OUTLIER_FRACTION,
        "rounds": [[[p["client"], p["server"]] for p in r["pairs"]] for r in rounds],
        "retested": sorted([client, server] for client, server in twice),
    }
    return results, report
