"""Inventories of hosts that do not exist, for the tests that only plan (`trainer plan`, the launch
files, the inventory rules): nothing is contacted. A helper module, not a test module."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_inventory(root: Path, hosts: dict[str, dict], workers: dict[str, dict], **group_vars) -> Path:
    """A cluster inventory: `hosts` is the head group (normally one host), `workers` the others."""
    inventory = root / "inventory"
    (inventory / "group_vars" / "cluster").mkdir(parents=True)
    tree = {"cluster": {"children": {"head": {"hosts": hosts}, "workers": {"hosts": workers}}}}
    (inventory / "hosts.yml").write_text(yaml.safe_dump(tree, sort_keys=False))
    settings = {
        "cluster_master_port": 29500,
        "cluster_nccl_socket_ifname": "auto",
        "cluster_nccl_ib_disable": 1,
        "cluster_nccl_debug": "WARN",
        "cluster_nccl_timeout_s": 1800,
        "cluster_shared_dir": "/srv/shared",
        "training_venv": "/opt/venv",
        "training_procs_per_node": 2,
        "training_engine": "ddp",
        "training_config": "",
        "cluster_training_user": "trainer",
    }
    settings.update(group_vars)
    (inventory / "group_vars" / "cluster" / "all.yml").write_text(yaml.safe_dump(settings))
    return inventory


def three_nodes(tmp_path, head_vars=None, worker_vars=None, **group_vars) -> Path:
    worker_vars = worker_vars or {}
    return write_inventory(
        tmp_path,
        {"n-head": {"cluster_ip": "10.0.0.10", **(head_vars or {})}},
        {
            "n-b": {"cluster_ip": "10.0.0.12", **worker_vars.get("n-b", {})},
            "n-a": {"cluster_ip": "10.0.0.11", **worker_vars.get("n-a", {})},
        },
        **group_vars,
    )
