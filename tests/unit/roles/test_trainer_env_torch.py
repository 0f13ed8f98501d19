"""trainer_env picks the torch build per node from the inventory: CUDA where the node has GPUs, CPU
elsewhere, the wheelhouse over any index, always pinned. The role's own defaults are evaluated by
Ansible for two inventory hosts (nothing is installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
DEFAULTS = REPO / "roles" / "trainer_env" / "defaults" / "main.yml"
PLAYBOOK = f"""
- hosts: cluster
  connection: local
  gather_facts: false
  tasks:
    - ansible.builtin.include_vars: {DEFAULTS}
    - ansible.builtin.debug:
        msg: "TORCH {{{{ {{'host': inventory_hostname, 'args': trainer_env_torch_pip_args}} | to_json }}}}"
"""


def torch_args(tmp_path: Path, group_vars: dict) -> dict[str, list[str]]:
    inventory = {
        "cluster": {
            "hosts": {"gpu-node": {"cluster_accelerators": 8}, "cpu-node": {"cluster_accelerators": 0}},
            "vars": {"training_venv": "/opt/venv", **group_vars},
        }
    }
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    run = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"),
         str(tmp_path / "play.yml")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    found = {}
    for line in run.stdout.splitlines():
        if '"msg": "TORCH ' in line:
            data = json.loads(json.loads("{" + line.strip().rstrip(",") + "}")["msg"].removeprefix("TORCH "))
            found[data["host"]] = data["args"]
    return found


def test_gpu_nodes_get_the_cuda_index_and_cpu_nodes_the_cpu_index(tmp_path) -> None:
    args = torch_args(
        tmp_path,
        {
            "training_wheelhouse": "",
            "training_torch_version": "2.9.1",
            "training_torch_index_url_cuda": "https://mirror.invalid/torch/cu126",
            "training_torch_index_url_cpu": "https://mirror.invalid/torch/cpu",
        },
    )
    assert args["gpu-node"] == ["--index-url", "https://mirror.invalid/torch/cu126", "torch==2.9.1"]
    assert args["cpu-node"] == ["--index-url", "https://mirror.invalid/torch/cpu", "torch==2.9.1"]


def test_a_wheelhouse_wins_over_every_index_and_the_default_is_pinned(tmp_path) -> None:
    args = torch_args(
        tmp_path,
        {"training_wheelhouse": "/srv/wheels", "training_torch_index_url_cuda": "https://m.invalid/cu"},
    )
    expected = ["--no-index", "--find-links", "/var/cache/clustertrain/wheelhouse", "torch==2.13.0"]
    assert args == {"gpu-node": expected, "cpu-node": expected}
