"""The inventory of a `trainer launch` inside a Slurm allocation, for the tests on the real Slurm of
slurm_cluster.py: its hosts are placeholders that the allocation's nodes replace (guest mode takes the
topology from Slurm); its shared dir, venv, processes per node and training_env are the job's.

Imported by tests (`from helpers.slurm_site import ...`); it imports no test module.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from helpers.loopback import VENV


def guest_inventory(root: Path, *, procs_per_node: int, master_port: int) -> tuple[Path, Path]:
    """(inventory, shared dir) under `root`, for a guest launch of `procs_per_node` processes a node."""
    shared = root / "shared"
    shared.mkdir()
    inventory = root / "inventory"
    (inventory / "group_vars" / "cluster").mkdir(parents=True)
    hosts = {
        "cluster": {
            "children": {
                "head": {"hosts": {"login-a": {"cluster_ip": "192.0.2.10", "cluster_accelerators": 0}}},
                "workers": {"hosts": {"login-b": {"cluster_ip": "192.0.2.11", "cluster_accelerators": 0}}},
            }
        }
    }
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    settings = {
        "cluster_master_port": master_port,
        "cluster_shared_dir": str(shared),
        "training_venv": str(VENV),
        "training_procs_per_node": procs_per_node,
        "cluster_nccl_timeout_s": 120,
        "training_env": {"HF_HOME": str(root / "hf")},
    }
    (inventory / "group_vars" / "cluster" / "all.yml").write_text(yaml.safe_dump(settings))
    return inventory, shared
