"""site.yml skips the roles on a converged cluster, and runs them again after a change, on the bed.

The bed's inventory makes every run a full one (molecule/default/inventory/group_vars/cluster/
provisioning.yml); these runs turn the converged check on with -e converged_full_run=false, as a
user's inventory has it. What a user notices: a re-run of an untouched cluster says the roles are
skipped and runs none of them; a file a role manages, edited by hand on one worker, makes the next
run a full one that names the host and the file and puts the file back; the run after that is
skipped again. The same full run meets a rule inserted ahead of ufw's chains on another worker
(`iptables -I INPUT 1 -j ACCEPT`): it is deleted, and the record that run writes is of the repaired
firewall, so the rule is not taken as the new baseline. And a home that hangs (a FUSE mount whose
server never answers, as an NFS server that stopped) stops the run within the probe's timeout, naming
the node and the path, instead of hanging site.yml.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from helpers.bed_launch import BED_UP, ENV
from helpers.hung_mount import hung_mount_in
from helpers.testbed_nodes import INVENTORY, PLAYBOOK, site

REPO = Path(__file__).resolve().parents[2]
HOST = "ct-worker2"
#: The worker whose firewall gets a rule behind ufw's back.
FIREWALL_HOST = "ct-worker1"
BYPASS = "-A INPUT -j ACCEPT"
CHRONY_CONF = "/etc/chrony/chrony.conf"
SKIPPED = "and this run is made from the same inputs: the roles are skipped"

pytestmark = [pytest.mark.slow, BED_UP]


def on_host(script: str, host: str = HOST) -> str:
    return subprocess.run(
        ["podman", "exec", host, "sh", "-euc", script],
        capture_output=True, text=True, env=ENV, check=True, timeout=120,
    ).stdout  # fmt: skip


def test_a_converged_cluster_is_skipped_and_a_hand_edit_brings_the_roles_back():
    # A fresh record first, whatever the tests before this one left: a run with the check on is a
    # full run that writes every node's record where a node differs from it, and a skip of seconds
    # where the test before left it fresh (test_converged_limits_testbed's last run before this one
    # writes it). Where it was a skip, it is the skip this test checks; else the next run must be.
    out, recap = site("-e", "converged_full_run=false")
    if SKIPPED not in out:
        assert "TASK [converged : Record it, with the cluster digest, root-only on each node]" in out
        out, recap = site("-e", "converged_full_run=false")
    assert SKIPPED in out, out[-4000:]
    assert "TASK [users" not in out and "TASK [trainer_env" not in out, "no role runs"
    assert {host for host, (_, changed) in recap.items() if changed} == set(), recap
    on_node = on_host("stat -c '%a %u' /var/lib/clustertrain /var/lib/clustertrain/converged.json")
    assert on_node.split() == ["700", "0", "600", "0"], "the record is root's only"

    before = on_host(f"cat {CHRONY_CONF}")
    on_host(f"echo 'server 192.0.2.1 iburst  # edited by hand' >> {CHRONY_CONF}")
    # An ACCEPT ahead of ufw's chains: every port open, while ufw's status (its files) shows no change.
    on_host("iptables -I INPUT 1 -j ACCEPT", FIREWALL_HOST)
    try:
        out, recap = site("-e", "converged_full_run=false")
    finally:
        input_rules = on_host("iptables -S INPUT", FIREWALL_HOST)
        on_host("while iptables -D INPUT -j ACCEPT 2>/dev/null; do :; done", FIREWALL_HOST)
    assert SKIPPED not in out
    edited = rf"{HOST}: path {CHRONY_CONF}: file 0644 0:0 sha256:\S+ -> file 0644 0:0 sha256:"
    assert re.search(edited, out), out[-4000:]
    assert "TASK [timesync : Write chrony's configuration" in out
    assert recap[HOST][1] > 0, "the edit was put right"
    assert on_host(f"cat {CHRONY_CONF}") == before
    assert re.search(rf"{FIREWALL_HOST}: [^.]*kernel firewall: iptables-save exit 0", out), "the probe saw it"
    assert f"(item={BYPASS} (iptables))" in out, "the full run names the rule it deletes"
    assert BYPASS not in input_rules.splitlines(), f"the full run left the bypass in place:\n{input_rules}"
    assert "-A INPUT -j ufw-before-logging-input" in input_rules.splitlines()[1], input_rules

    out, recap = site("-e", "converged_full_run=false")
    assert SKIPPED in out, "the full run wrote a new record: the next run is skipped again"
    # That record is of the repaired firewall: had it been written with the bypass in place (as before
    # this was fixed), the run above, made after the bypass was deleted, could not have been skipped.


def test_a_home_that_hangs_stops_the_run_naming_the_node_and_the_path():
    """The training account's home on a server that stopped answering: root's stat of
    ~/.ssh/authorized_keys blocks in the kernel. Before the probe had a timeout, site.yml hung there."""
    out, _ = site("-e", "converged_full_run=false")  # every node holds a record (seconds when fresh)
    inspect = ["podman", "inspect", "--format", "{{.State.Pid}}", HOST]
    pid = int(subprocess.run(inspect, capture_output=True, text=True, env=ENV, check=True, timeout=60).stdout)
    timeout_s = 10
    with hung_mount_in(pid, "/home/trainer", env=ENV):
        started = time.monotonic()
        try:
            run = subprocess.run(
                [PLAYBOOK, "-i", str(INVENTORY), str(REPO / "site.yml"), "-e", "converged_full_run=false",
                 "-e", f"converged_probe_timeout_s={timeout_s}"],
                capture_output=True, text=True, cwd=REPO, timeout=300,
                env={**ENV, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_NOCOLOR": "1"},
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail("site.yml hung on the home for 300 s")
        took = time.monotonic() - started
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    said = rf"{HOST}: the converged probe waited {timeout_s} s on path /home/trainer\S* and it did not answer"
    assert re.search(said, out), out[-4000:]
    assert "TASK [users" not in out, "no role ran"
    assert took < 120, f"site.yml took {took:.0f} s to stop"
