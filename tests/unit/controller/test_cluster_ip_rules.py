"""Every verb that reads a cluster inventory refuses a host without a cluster_ip, or two hosts on one,
as site.yml does: exit 2, the hosts and the fix named, before any host is contacted.

Without this, `trainer plan` took the management name (ansible_host, or the inventory name) as the
master address and NCCL's interface, and two nodes on one address: the launch then hangs at the
rendezvous or trains over the wrong network. The hosts' ansible_connection is a plugin that does not
exist, so any attempt to reach one would fail loudly with Ansible's own error instead of exit 2
(and no packet can leave this machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.plan_inventory import write_inventory

from trainer import exitcodes
from trainer.cli import main

#: A connection plugin Ansible does not have: reaching a host would fail naming it.
NO_CONNECTION = "clustertrain_must_not_connect"

MISSING = "host n-a: cluster_ip is not set; fix: set the host's address on the cluster network in hosts.yml"
DUPLICATE = (
    "host n-head: cluster_ip 127.0.0.1 is also the cluster address of n-a; fix: give each host its own",
    "host n-a: cluster_ip 127.0.0.1 is also the cluster address of n-head; fix: give each host its own",
)


def cluster(tmp_path: Path, n_a: dict) -> Path:
    """Three hosts; n-a's variables as given (no cluster_ip, or the head's)."""
    return write_inventory(
        tmp_path,
        {"n-head": {"cluster_ip": "127.0.0.1"}},
        {"n-a": n_a, "n-b": {"cluster_ip": "127.0.0.3"}},
        ansible_connection=NO_CONNECTION,
        cluster_shared_dir=str(tmp_path / "shared"),
    )


VERBS = {
    "plan": ["plan"],
    "launch": ["launch", "--run-name", "r1"],
    "preflight": ["preflight"],
    "status": ["status"],
    "sbatch": ["sbatch"],
}


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize(
    ("n_a", "expected"),
    [({}, (MISSING,)), ({"cluster_ip": "127.0.0.1"}, DUPLICATE)],
    ids=["missing", "duplicate"],
)
def test_every_verb_refuses_a_missing_or_shared_cluster_ip_before_contacting_a_host(
    tmp_path, capfd, monkeypatch, verb, n_a, expected
):
    monkeypatch.chdir(tmp_path)  # where sbatch would write its script and preflight its report
    inventory = cluster(tmp_path, n_a)
    code = main([*VERBS[verb], "-i", str(inventory)])
    out, err = capfd.readouterr()
    assert code == exitcodes.CONFIG_ERROR, out + err
    assert f"trainer {verb}: inventory {inventory}:" in err
    for line in expected:
        assert line in err, err
    assert NO_CONNECTION not in out + err, "a host was contacted"
    assert not (tmp_path / "shared").exists(), "nothing is written for the run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inventory"], "no script, report or file"


def test_one_host_needs_no_cluster_ip_and_distinct_loopback_addresses_pass(tmp_path, capfd):
    """The rule is across hosts: a one-host inventory keeps its fallback (the name), and several
    loopback "nodes" of one machine pass with their own addresses."""
    single = write_inventory(tmp_path / "one", {"solo": {}}, {}, ansible_connection=NO_CONNECTION)
    assert main(["plan", "-i", str(single), "--json"]) == exitcodes.OK
    assert '"master_addr": "solo"' in capfd.readouterr().out
    three = cluster(tmp_path / "three", {"cluster_ip": "127.0.0.2"})
    assert main(["plan", "-i", str(three), "--json"]) == exitcodes.OK
    assert '"address": "127.0.0.2"' in capfd.readouterr().out
    # The witness of the test above: a verb that does reach a host names the missing plugin.
    assert main(["status", "-i", str(three)]) != exitcodes.OK
    assert f"the connection plugin '{NO_CONNECTION}' was not found" in capfd.readouterr().err
