"""A cluster of "hosts" that are all this machine, for the local multi-process tests: node0 (the
head, 127.0.0.1), node1 (127.0.0.2), ... with ansible_connection local; one address per host, as the
inventory rules require (all of 127/8 is on lo). A helper module, not a test module: the tests
import it instead of each other."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
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
