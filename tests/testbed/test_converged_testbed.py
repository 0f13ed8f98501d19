"""site.yml skips the roles on a converged cluster, and runs them again after a change, on the bed.

The bed's inventory makes every run a full one (molecule/default/inventory/group_vars/cluster/
provisioning.yml); these runs turn the converged check on with -e converged_full_run=false, as a
user's inventory has it. What a user notices: a re-run of an untouched cluster says the roles are
skipped and runs none of them; a file a role manages, edited by hand on one worker, makes the next
run a full one that names the host and the file and puts the file back; the run after that is
skipped again.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers.bed_launch import BED_UP, ENV
from helpers.testbed_nodes import site

REPO = Path(__file__).resolve().parents[2]
HOST = "ct-worker2"
CHRONY_CONF = "/etc/chrony/chrony.conf"
SKIPPED = "and this run is made from the same inputs: the roles are skipped"

pytestmark = [pytest.mark.slow, BED_UP]


def on_host(script: str) -> str:
    return subprocess.run(
        ["podman", "exec", HOST, "sh", "-euc", script],
        capture_output=True, text=True, env=ENV, check=True, timeout=120,
    ).stdout  # fmt: skip


def test_a_converged_cluster_is_skipped_and_a_hand_edit_brings_the_roles_back():
    # A fresh record first, whatever the tests before this one left: a run with the check on is a
    # full run that writes every node's record where a node differs from it, and a skip of seconds
    # where the test before left it fresh (test_converged_limits_testbed's last run before this one
    # writes it).
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
    out, recap = site("-e", "converged_full_run=false")
    assert SKIPPED not in out
    edited = rf"{HOST}: path {CHRONY_CONF}: file 0644 0:0 sha256:\S+ -> file 0644 0:0 sha256:"
    assert re.search(edited, out), out[-4000:]
    assert "TASK [timesync : Write chrony's configuration" in out
    assert recap[HOST][1] > 0, "the edit was put right"
    assert on_host(f"cat {CHRONY_CONF}") == before

    out, recap = site("-e", "converged_full_run=false")
    assert SKIPPED in out, "the full run wrote a new record: the next run is skipped again"
