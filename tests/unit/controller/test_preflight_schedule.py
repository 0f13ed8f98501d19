"""Preflight at scale (issue 27): the login and iperf3 rounds, and SSH trust judged by content."""

from __future__ import annotations

import itertools
import math

import pytest

from trainer.controller.preflight import schedule, ssh, ssh_keys
from trainer.controller.preflight.report import FAIL, PASS, WARN


def _names(count: int) -> list[str]:
    return [f"n{i:02d}" for i in range(count)]


def _connected(nodes: list[str], pairs: list[tuple[str, str]]) -> bool:
    links: dict[str, set[str]] = {n: set() for n in nodes}
    for a, b in pairs:
        links[a].add(b)
        links[b].add(a)
    seen, todo = {nodes[0]}, [nodes[0]]
    while todo:
        for peer in links[todo.pop()] - seen:
            seen.add(peer)
            todo.append(peer)
    return seen == set(nodes)


@pytest.mark.parametrize("count", [2, 3, 5, 8, 13, 32, 64, 100])
def test_each_login_round_is_a_permutation_and_there_are_log2_n_of_them(count):
    nodes = _names(count)
    rounds = schedule.login_rounds(nodes)
    assert len(rounds) == math.ceil(math.log2(count))
    for pairs in rounds:
        # Every node logs in once and is logged in to once: one new connection per sshd per round.
        assert sorted(s for s, _ in pairs) == nodes and sorted(t for _, t in pairs) == nodes
        assert all(s != t for s, t in pairs)
    every = [p for r in rounds for p in r]
    assert len(every) == len(set(every)), "a pair logged in to twice"
    assert _connected(nodes, every)
    assert schedule.login_rounds(nodes) == rounds  # deterministic


def test_logins_grow_as_n_log_n_and_full_matrix_is_every_pair_still_one_per_sshd_per_round():
    logins = {n: sum(len(r) for r in schedule.login_rounds(_names(n))) for n in (8, 32, 64)}
    assert logins == {8: 24, 32: 160, 64: 384}  # N(N-1) would be 56, 992, 4032
    full = schedule.login_rounds(_names(8), full=True)
    assert {p for r in full for p in r} == {(a, b) for a in _names(8) for b in _names(8) if a != b}
    assert all(sorted(t for _, t in r) == _names(8) for r in full)
    # Three nodes: the sample is every pair already.
    assert len({p for r in schedule.login_rounds(_names(3)) for p in r}) == 6


@pytest.mark.parametrize("count", [2, 3, 4, 5, 8, 9, 17, 32, 33, 64])
def test_bandwidth_rounds_are_matchings_covering_every_node_in_log_rounds(count):
    nodes = _names(count)
    rounds = schedule.bandwidth_rounds(nodes)
    full = schedule.bandwidth_rounds(nodes, full=True)
    assert len(full) == (count - 1 if count % 2 == 0 else count)
    assert len(rounds) == min(len(full), math.ceil(math.log2(count)) + 1)
    for pairs in rounds:
        ends = [n for pair in pairs for n in pair]
        assert len(ends) == len(set(ends)), f"a node twice in one round: {pairs}"
    pairs = [p for r in rounds for p in r]
    assert len({frozenset(p) for p in pairs}) == len(pairs)  # no pair measured twice
    assert _connected(nodes, pairs)  # every node measured, and against more than its own corner
    peers = {n: sum(n in p for p in pairs) for n in nodes}
    assert min(peers.values()) >= min(count - 1, len(rounds) - 1)  # odd N: at most one bye each
    assert schedule.bandwidth_rounds(nodes) == rounds


def test_small_clusters_keep_every_pair():
    for count in (2, 3, 4):
        assert schedule.bandwidth_rounds(_names(count)) == schedule.bandwidth_rounds(_names(count), full=True)


KEY = "ssh-ed25519 AAAAkey"
OTHER = "ssh-ed25519 AAAAother"
HOST = "ssh-ed25519 AAAAhost"


def _keys(nodes, addresses, authorized=None, host=None):
    return {
        n: {
            "identities": [KEY],
            "authorized": (authorized or {}).get(n, [{"key": KEY, "from": ",".join(addresses.values())}]),
            "host_keys": [(host or {}).get(n, HOST)],
            "known": {
                p: {"host": addresses[p], "keys": [HOST], "ca": False, "revoked": False} for p in nodes
            },
        }
        for n in nodes
    }


def _outputs(nodes, addresses, keys, refused=()):
    order = schedule.login_order(nodes)
    return {
        n: {
            "keys": keys[n],
            "results": [
                {
                    "peer": p,
                    "address": addresses[p],
                    "rc": 255 if p in refused else 0,
                    "stderr": f"ssh: connect to host {addresses[p]} port 22: Connection refused"
                    if p in refused
                    else "",
                    "tries": 1,
                    "start": 1.0,
                    "end": 2.0,
                }
                for p in order[n]
            ],
        }
        for n in nodes
    }


def _missing(host):
    return f"no answer from {host}"


def test_a_healthy_cluster_passes_with_every_pair_proven_and_no_pass_line_per_pair():
    nodes = _names(8)
    addresses = {n: f"10.0.0.{i + 1}" for i, n in enumerate(nodes)}
    results, summary = ssh.evaluate(
        nodes, addresses, "train", _outputs(nodes, addresses, _keys(nodes, addresses)), _missing
    )
    assert {r.status for r in results} == {PASS}
    proven = {
        (r.subject.split(" -> ")[0], p) for r in results if r.subject.endswith("*") for p in r.data["peers"]
    }
    logged = {tuple(r.subject.split(" -> ")) for r in results if not r.subject.endswith("*")}
    assert proven | logged == {(a, b) for a in nodes for b in nodes if a != b}
    assert summary["logins"] == 24 and summary["logins_per_sshd"] == 3


def test_a_key_missing_on_one_node_fails_every_pair_into_it_with_the_fix():
    nodes = _names(8)
    addresses = {n: f"10.0.0.{i + 1}" for i, n in enumerate(nodes)}
    keys = _keys(nodes, addresses, authorized={"n05": []})
    outputs = _outputs(nodes, addresses, keys)
    for n in nodes:  # the logins into n05 are refused the key, as sshd would
        for attempt in outputs[n]["results"]:
            if attempt["peer"] == "n05":
                attempt.update(rc=255, stderr="ctsim@10.0.0.6: Permission denied (publickey).")
    results, _ = ssh.evaluate(nodes, addresses, "train", outputs, _missing)
    failed = {r.subject for r in results if r.status == FAIL}
    assert failed == {f"{n} -> n05" for n in nodes if n != "n05"}  # logged in to or not
    for result in (r for r in results if r.status == FAIL):
        assert "authorized_keys on n05" in result.fix and (
            "ssh_trust" in result.fix or "provision" in result.fix
        )


def test_a_stopped_sshd_is_named_with_its_fix_and_not_claimed_by_content():
    nodes = _names(8)
    addresses = {n: f"10.0.0.{i + 1}" for i, n in enumerate(nodes)}
    results, _ = ssh.evaluate(
        nodes,
        addresses,
        "train",
        _outputs(nodes, addresses, _keys(nodes, addresses), refused={"n03"}),
        _missing,
    )
    failed = [r for r in results if r.status == FAIL]
    assert failed and all(r.subject.endswith("-> n03") for r in failed)
    assert all("start sshd on n03" in r.fix for r in failed)
    assert not any("n03" in r.data.get("peers", []) for r in results if r.status == PASS)
    assert any(r.status == WARN and "n03" in r.detail for r in results)  # not proven, said so


def test_content_names_a_changed_host_key_and_a_from_pattern_that_leaves_a_node_out():
    problem = ssh_keys.host_key_problem("a", "b", "train", {"host": "10.0.0.2", "keys": [OTHER]}, [HOST])
    assert problem.kind == ssh_keys.HOST_KEY and "changed" in problem.detail
    assert "ssh-keygen -R 10.0.0.2" in problem.fix
    assert "not pinned" in ssh_keys.host_key_problem("a", "b", "t", {"host": "x", "keys": []}, [HOST]).detail
    assert ssh_keys.from_allows("10.0.0.0/24,!10.0.0.9", "10.0.0.3")
    assert not ssh_keys.from_allows("10.0.0.0/24,!10.0.0.9", "10.0.0.9")
    assert ssh_keys.from_allows("10.0.0.*", "10.0.0.9") and not ssh_keys.from_allows("10.0.1.*", "10.0.0.9")
    mine = {"identities": [KEY]}
    theirs = {"authorized": [{"key": KEY, "from": "10.0.0.1,10.0.0.2"}]}
    problem = ssh_keys.auth_problem("c", "10.0.0.3", "b", "train", mine, theirs)
    assert problem is not None and "only from 10.0.0.1,10.0.0.2" in problem.detail


def test_a_dropped_connection_is_named_as_such_not_as_a_firewall():
    detail, fix = ssh.diagnose("a", "b", "10.0.0.2", "t", "Connection closed by 10.0.0.2 port 22")
    assert "dropped" in detail and "MaxStartups" in fix and "ufw" not in fix


@pytest.mark.parametrize(
    ("count", "comm_range"), [(8, "29400:29999"), (9, "29400:29999"), (32, "29498:29501")]
)
def test_each_node_gets_its_rounds_in_order_one_step_per_round_each_round_its_own_port(count, comm_range):
    # The nodes go through the rounds without a clock (iperf_pair.py rounds): a node's steps must be in
    # round order, one per round, its partner's step the mirror of its own, and a round's port not the
    # one of the rounds next to it (a client running ahead would take another round's server).
    from pathlib import Path

    from trainer.controller.inventory import Cluster, Host
    from trainer.controller.preflight import probe

    names = _names(count)
    ports = {"cluster_comm_port_range": comm_range, "cluster_master_port": 29500}
    hosts = {name: {"cluster_ip": f"10.0.0.{i + 1}", **ports} for i, name in enumerate(names)}
    made = [Host(name, hosts[name]) for name in names]
    cluster = Cluster(Path("inv"), made[0], tuple(made[1:]))
    rounds = probe.iperf_rounds(cluster)
    plan = probe.iperf_plan(cluster, rounds)
    assert sum(len(steps) for steps in plan.values()) == 2 * sum(len(r["pairs"]) for r in rounds)
    for name, steps in plan.items():
        order = [s["round"] for s in steps]
        assert order == sorted(set(order)), f"{name}: {order}"
        for step in steps:
            (pair,) = [p for p in rounds[step["round"] - 1]["pairs"] if name in (p["client"], p["server"])]
            assert step["port"] == pair["port"] != 29500
            if step["role"] == "client":
                assert (step["peer_name"], step["peer"]) == (
                    pair["server"],
                    hosts[pair["server"]]["cluster_ip"],
                )
            else:
                assert step["bind"] == hosts[name]["cluster_ip"] == hosts[pair["server"]]["cluster_ip"]
    ports = [r["pairs"][0]["port"] for r in rounds]
    assert all(a != b for a, b in itertools.pairwise(ports))
    assert len(set(ports)) == min(len(rounds), 3 if comm_range == "29498:29501" else len(rounds))
