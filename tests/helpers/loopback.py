"""A cluster of "hosts" that are all this machine, for the local multi-process tests: node0 (the
head, 127.0.0.1), node1 (127.0.0.2), ... with ansible_connection local; one address per host, as the
inventory rules require (all of 127/8 is on lo). A helper module, not a test module: the tests
import it instead of each other."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_inventory(root: Path, nodes: int = 2, **settings: Any) -> tuple[Path, Path]:
    """(inventory, shared dir) under `root`: `nodes` loopback hosts, CPU only, one process each,
    the shared dir `root/shared`; `settings` go over the defaults in group_vars/cluster/all.yml."""
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "cluster_accelerators": 0,
        "cluster_accelerator_model": "cpu",
    }
    hosts = {f"node{i}": dict(local, cluster_ip=f"127.0.0.{i + 1}") for i in range(nodes)}
    inventory = root / "inventory"
    (inventory / "group_vars" / "cluster").mkdir(parents=True)
    children = {
        "head": {"hosts": {"node0": hosts.pop("node0")}},
        "workers": {"hosts": hosts},
    }
    (inventory / "hosts.yml").write_text(yaml.safe_dump({"cluster": {"children": children}}, sort_keys=False))
    shared = root / "shared"
    defaults = {
        "cluster_training_user": subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip(),
        "cluster_master_port": free_port(),
        "cluster_nccl_socket_ifname": "auto",
        "cluster_nccl_ib_disable": 1,
        "cluster_nccl_debug": "WARN",
        "cluster_nccl_timeout_s": 120,
        "cluster_shared_dir": str(shared),
        "cluster_data_path": "",
        "training_venv": str(VENV),
        "training_procs_per_node": 1,
        "training_engine": "ddp",
        "training_config": "",
    }
    (inventory / "group_vars" / "cluster" / "all.yml").write_text(yaml.safe_dump(defaults | settings))
    return inventory, shared


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
