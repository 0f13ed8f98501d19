"""The ports each role opens are the firewall role's defaults, so an inventory's group_vars replace them.

site.yml used to load these lists with `vars_files`, which outranks group_vars: a user's list was
silently ignored. Here the real site.yml runs (`--tags firewall --check --diff`, nothing changes)
on a two-node inventory of this machine (connection local, 127.0.0.1-2) whose group_vars replace
two lists, and the rules the firewall role works with are read from its output: the ufw tasks' item
labels where ufw is installed, the list it prints in check mode where it is not yet. The same on the
provisioned test bed: tests/testbed/test_firewall_rules_override_testbed.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.loopback import two_node_inventory

REPO = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")


def ufw_state() -> dict[str, str]:
    """Digests of ufw's configuration (missing files included): check mode must not change them."""
    state = {}
    for top in (Path("/etc/ufw"), Path("/etc/default/ufw")):
        paths = sorted(top.rglob("*")) if top.is_dir() else [top]
        for path in paths:
            if path.is_file():
                state[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif not path.exists():
                state[str(path)] = "missing"
    return state


def check_firewall(inventory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "site.yml", "-i", str(inventory), "--tags", "firewall", "--check", "--diff"],
        cwd=REPO,
        env=dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FACT_CACHING="memory"),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_a_group_vars_rule_list_replaces_the_roles_default(tmp_path):
    inventory = two_node_inventory(
        tmp_path,
        {
            # No NTP port; the training ports replaced by one of the user's own.
            "firewall_timesync_rules": [],
            "firewall_trainer_env_rules": [{"port": "4242", "proto": "tcp", "comment": "my rendezvous"}],
        },
    )
    before = ufw_state()
    result = check_firewall(inventory)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert ufw_state() == before, "check mode changed ufw's configuration"
    # The user's rule, on both nodes (no group), from both cluster addresses.
    for source in ("127.0.0.1", "127.0.0.2"):
        assert f"4242/tcp from {source}" in output, output
    # The replaced defaults are gone: NTP (123/udp), MASTER_PORT and the NCCL/gloo range.
    for gone in ("123/udp from", "29777/tcp from", "40000:40020/tcp from"):
        assert gone not in output, f"{gone!r} still applied:\n{output}"
    # The list not overridden keeps its default: NFS on the head.
    assert "2049/tcp from 127.0.0.2" in output, output


def test_the_old_rule_list_names_are_refused_with_the_new_ones(tmp_path):
    inventory = two_node_inventory(tmp_path, {"trainer_env_firewall_rules": []})
    result = check_firewall(inventory)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "trainer_env_firewall_rules: old name" in output, output
    assert "rename to firewall_trainer_env_rules" in output, output
    # Refused in the validate plays, before any role ran.
    assert "TASK [firewall" not in output, output


def test_each_role_declares_its_own_ports_and_the_firewall_role_holds_none():
    """DebOps' dependent variables: the ports a role needs sit in that role's defaults, next to the
    settings they follow (nfs_server's mountd port, trainer_env's MASTER_PORT); the firewall role only
    names the roles whose lists it loads, so a port is never written (or defaulted) twice."""
    roles = REPO / "roles"
    firewall_defaults = yaml.safe_load((roles / "firewall" / "defaults" / "main.yml").read_text())
    port_roles = yaml.safe_load((roles / "firewall" / "vars" / "main.yml").read_text())["firewall_port_roles"]
    assert set(port_roles) == {"timesync", "nfs_server", "trainer_env"}
    for role in port_roles:
        declared = yaml.safe_load((roles / role / "defaults" / "main.yml").read_text())
        assert f"{role}_firewall_ports" in declared, f"{role} declares the ports it needs"
        assert (roles / role / "tasks" / "firewall_ports.yml").is_file(), f"the way into {role}"
        rule_list = firewall_defaults[f"firewall_{role}_rules"]
        assert rule_list == f"{{{{ {role}_firewall_ports | default([]) }}}}", rule_list
    text = (roles / "firewall" / "defaults" / "main.yml").read_text()
    for port_setting in ("- port:", "nfs_server_mountd_port", "cluster_master_port", "'2049'", '"123"'):
        assert port_setting not in text, f"firewall/defaults still holds another role's rule: {port_setting}"
