"""The ports each role opens are the firewall role's defaults, so an inventory's group_vars replace them,
on the provisioned test bed: the whole `site.yml --check --diff` passes and shows the overriding list's
new rule as one ufw would add, on the head only, with every node's ufw rules left as they were.
The same on this machine, with a two-node inventory of loopback addresses:
tests/unit/roles/test_firewall_rules_override.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.bed_launch import BED_UP, ENV, HOSTS, INVENTORY, group_vars

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")


def ufw_rules(host: str) -> str:
    return subprocess.run(
        ["podman", "exec", host, "ufw", "show", "added"], capture_output=True, text=True, env=ENV, check=True
    ).stdout


#: Every node's cluster address on the bed (the firewall's cluster sources).
BED_ADDRESSES = ("10.89.42.10", "10.89.42.11", "10.89.42.12")


@pytest.mark.slow
@BED_UP
def test_check_diff_on_the_provisioned_bed_shows_the_group_vars_rule_and_changes_nothing(tmp_path):
    inventory = tmp_path / "inventory"
    shutil.copytree(INVENTORY, inventory)
    bed = group_vars()
    # The role's two training rules as they are, plus a port of the user's own on the head.
    rules = [
        {"port": str(bed["cluster_master_port"]), "proto": "tcp", "group": "head",
         "comment": "trainer_env: rendezvous (MASTER_PORT)"},
        {"port": bed["cluster_comm_port_range"], "proto": "tcp",
         "comment": "trainer_env: NCCL/gloo between nodes"},
        {"port": "4242", "proto": "tcp", "group": "head", "comment": "my exporter"},
    ]  # fmt: skip
    (inventory / "group_vars" / "cluster" / "zz_firewall_override.yml").write_text(
        yaml.safe_dump({"firewall_trainer_env_rules": rules})
    )
    # The copied inventory cannot find the repo's wheelhouse from its own path.
    wheelhouse = ENV.get("CLUSTERTRAIN_WHEELHOUSE", str(REPO / ".cache" / "wheelhouse"))
    before = {host: ufw_rules(host) for host in HOSTS}
    result = subprocess.run(
        # The firewall's play only (the validate play always runs first): the whole site.yml in check
        # mode on the provisioned bed is test_converged_limits_testbed's targeted-runs test.
        [str(ANSIBLE_PLAYBOOK), "site.yml", "-i", str(inventory), "--tags", "firewall", "--check", "--diff"],
        cwd=REPO,
        env={**ENV, "ANSIBLE_NOCOLOR": "1", "CLUSTERTRAIN_WHEELHOUSE": wheelhouse},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    for source in BED_ADDRESSES:
        assert f"changed: [ct-head] => (item=4242/tcp from {source})" in output, output[-6000:]
    for worker in ("ct-worker1", "ct-worker2"):
        assert f"[{worker}] => (item=4242/tcp" not in output, f"the head's rule on {worker}"
    assert {host: ufw_rules(host) for host in HOSTS} == before, "check mode changed ufw's rules"
