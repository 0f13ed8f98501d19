"""Who checks whom, in which round: the SSH logins and the iperf3 pairs, sampled to O(log N) rounds.

Every pair of N nodes is N(N-1) logins and N-1 iperf3 rounds: at 32 nodes minutes of work, and
every sshd receiving N-1 logins at once (sshd's MaxStartups drops unauthenticated connections past
10). The fast pass samples instead, in rounds that bound what each node receives:

- SSH logins: round j is the permutation i -> i + 2^j (mod N), j = 0, 1, 2, ... while 2^j < N. Each
  node logs in to ceil(log2 N) peers, near and far on the ring, and each sshd receives exactly one
  login per round, so ceil(log2 N) in all (6 at 64 nodes). Every pair's keys are proven by content
  on the controller (preflight.ssh_trust), so the logins only have to prove the mechanism: sshd up,
  reachable, reading the keys as the content says.
- iperf3: ceil(log2 N) + 1 rounds of the circle method's round robin (each a matching: every node
  in at most one test per round), spread over its N-1 rounds so each node meets near and far peers.
  A node with a bad NIC or cable is slow against every peer it meets; a slow pair is measured again.

`full=True` gives every pair: N-1 login rounds (still one login per sshd per round) and the whole
round robin. Small clusters get every pair anyway: when the sample would not be smaller.
"""

from __future__ import annotations

import math

from trainer.controller.preflight.bandwidth import round_robin


def login_offsets(count: int, full: bool = False) -> list[int]:
    """The ring distances of the login rounds: 1, 2, 4, ... below `count`, or 1..count-1 when full."""
    if full:
        return list(range(1, count))
    offsets, step = [], 1
    while step < count:
        offsets.append(step)
        step *= 2
    return offsets


def login_rounds(nodes: list[str], full: bool = False) -> list[list[tuple[str, str]]]:
    """Rounds of (source, target) logins; each round is a permutation (every node logs in once and
    is logged in to once), so no sshd gets more than one login of a round."""
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"duplicate node names in {nodes}")
    count = len(nodes)
    return [
        [(nodes[i], nodes[(i + offset) % count]) for i in range(count)]
        for offset in login_offsets(count, full)
    ]


def login_order(nodes: list[str], full: bool = False) -> dict[str, list[str]]:
    """node -> its login targets in round order (the node-side probe runs them one at a time)."""
    order: dict[str, list[str]] = {name: [] for name in nodes}
    for pairs in login_rounds(nodes, full):
        for source, target in pairs:
            order[source].append(target)
    return order


def sampled_round_count(count: int) -> int:
    """How many iperf3 rounds the fast pass measures: ceil(log2 N) + 1 (N=8: 4, 32: 6, 64: 7)."""
    return math.ceil(math.log2(count)) + 1 if count > 1 else 0


def bandwidth_rounds(nodes: list[str], full: bool = False) -> list[list[tuple[str, str]]]:
    """Rounds of disjoint (client, server) pairs: the whole round robin when full or small, else
    sampled_round_count of its rounds, evenly spread (round k pairs ring neighbours at distances
    that change with k, so the spread mixes near and far peers)."""
    every = round_robin(nodes)
    wanted = sampled_round_count(len(nodes))
    if full or wanted >= len(every):
        return every
    picked = sorted({round(k * (len(every) - 1) / (wanted - 1)) for k in range(wanted)})
    return [every[i] for i in picked]
