"""site.yml refuses to log in as the training account and become root from it.

Ansible copies what it runs as root into the login's `~/.ansible/tmp` first; when the login is the
training account, any job of that account can replace those scripts before root runs them, so every
job would be root on every node. The validate play (the rule book, trainer/controller/inventory_rules.py)
refuses the combination before any host is contacted: here it runs for real with ansible-playbook on
an inventory whose hosts have a connection plugin that does not exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from trainer.controller.inventory_rules import PROVISION, cluster_problems

REPO = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
NO_CONNECTION = "clustertrain_must_not_connect"
PLAY = """---
- name: Validate the inventory on the controller, as site.yml does
  hosts: localhost
  connection: local
  gather_facts: false
  any_errors_fatal: true
  roles:
    - role: validate
"""
CLUSTER_VARS = {
    "ansible_connection": NO_CONNECTION,
    "ansible_user": "trainer",
    "ansible_become": True,
    "cluster_name": "c",
    "cluster_subnet": "10.20.0.0/24",
    "cluster_training_user": "trainer",
    "cluster_training_group": "trainer",
    "cluster_training_uid": 2000,
    "cluster_training_gid": 2000,
    "cluster_shared_dir": "/srv/clustertrain/output",
    "nfs_server_backend": "kernel",
    "cluster_master_port": 29500,
    "cluster_comm_port_range": "29400:29999",
    "cluster_ntp_servers": ["ntp1.example.internal"],
    "training_venv": "/opt/clustertrain/venv",
    "training_procs_per_node": 1,
    "training_engine": "ddp",
}
HOSTS = {
    "node-a": {"cluster_ip": "10.20.0.10", "cluster_accelerators": 0, "ansible_host": "10.20.0.10"},
    "node-b": {"cluster_ip": "10.20.0.11", "cluster_accelerators": 0, "ansible_host": "10.20.0.11"},
}
REFUSAL = "ansible_user trainer is cluster_training_user and becomes root (ansible_become)"


def test_site_yml_validate_refuses_the_training_account_as_a_login_that_becomes_root(tmp_path):
    inventory = tmp_path / "inventory"
    (inventory / "group_vars" / "cluster").mkdir(parents=True)
    tree = {
        "cluster": {
            "children": {
                "head": {"hosts": {"node-a": HOSTS["node-a"]}},
                "workers": {"hosts": {"node-b": HOSTS["node-b"]}},
            }
        }
    }
    (inventory / "hosts.yml").write_text(yaml.safe_dump(tree))
    (inventory / "group_vars" / "cluster" / "all.yml").write_text(yaml.safe_dump(CLUSTER_VARS))
    (tmp_path / "play.yml").write_text(PLAY)
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), str(tmp_path / "play.yml"), "-i", str(inventory)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode != 0, done.stdout
    assert f"hosts node-a, node-b: {REFUSAL}" in done.stdout, done.stdout
    assert NO_CONNECTION not in done.stdout + done.stderr, "a host was contacted"


def test_an_admin_login_or_no_become_passes():
    hostvars = {name: {**CLUSTER_VARS, **hv} for name, hv in HOSTS.items()}
    groups = {"cluster": list(HOSTS), "head": ["node-a"], "workers": ["node-b"]}
    assert any(REFUSAL in p for p in cluster_problems(hostvars, groups, PROVISION))
    for change in ({"ansible_user": "admin"}, {"ansible_become": False}, {"ansible_become_user": "trainer"}):
        varied = {name: {**hv, **change} for name, hv in hostvars.items()}
        assert not any(REFUSAL in p for p in cluster_problems(varied, groups, PROVISION)), change
