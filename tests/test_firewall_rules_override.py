"""The ports each role opens are the firewall role's defaults, so an inventory's group_vars replace them.

site.yml used to load these lists with `vars_files`, which outranks group_vars: a user's list was
silently ignored. Here the real site.yml runs (`--tags firewall --check --diff`, nothing changes)
on a two-node inventory of this machine (connection local, 127.0.0.1-2) whose group_vars replace
two lists, and the rules the firewall role works with are read from its output: the ufw tasks' item
labels where ufw is installed, the list it prints in check mode where it is not yet. On the
provisioned test bed, the whole `site.yml --check --diff` passes and shows the overriding list's
new rule as one ufw would add, on the head only, with every node's ufw rules left as they were.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_launch_testbed import BED_UP, ENV, HOSTS, INVENTORY, group_vars

REPO = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")


def two_node_inventory(tmp_path: Path, group_vars: dict) -> Path:
    """A head and a worker on this machine, and `group_vars` in the inventory's group_vars/cluster.yml."""
    inventory = tmp_path / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    shared = tmp_path / "shared"
    shared.mkdir()
    hosts = {
        "cluster": {
            "children": {
                "head": {"hosts": {"node-a": {"cluster_ip": "127.0.0.1"}}},
                "workers": {"hosts": {"node-b": {"cluster_ip": "127.0.0.2"}}},
            },
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "cluster_name": "override",
                "cluster_accelerators": 0,
                "cluster_accelerator_model": "cpu",
                "cluster_subnet": "127.0.0.0/8",
                "cluster_training_user": "trainer",
                "cluster_training_group": "trainer",
                "cluster_training_uid": 2000,
                "cluster_training_gid": 2000,
                "cluster_shared_dir": str(shared),
                "cluster_master_port": 29777,
                "cluster_comm_port_range": "40000:40020",
                "cluster_ntp_servers": [],
                "cluster_nccl_socket_ifname": "lo",
                "nfs_server_backend": "kernel",
                "training_engine": "ddp",
                "training_procs_per_node": 1,
                "training_venv": str(Path(sys.executable).parents[1]),
                "training_wheelhouse": "",
            },
        }
    }
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    (inventory / "group_vars" / "cluster.yml").write_text(yaml.safe_dump(group_vars))
    return inventory


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


def ufw_rules(host: str) -> str:
    return subprocess.run(
        ["podman", "exec", host, "ufw", "show", "added"], capture_output=True, text=True, env=ENV, check=True
    ).stdout


#: Every node's cluster address on the bed (the firewall's cluster sources).
BED_ADDRESSES = ("10.89.42.10", "10.89.42.11", "10.89.42.12")


@pytest.mark.testbed
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
        # The firewall's play only (the validate play always runs first): Molecule's `check` step
        # already runs the whole site.yml in check mode on this bed.
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
