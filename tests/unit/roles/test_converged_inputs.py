"""The converged check's controller side (roles/converged/filter_plugins/converged.py).

The inputs digest decides whether a node's record still describes this run: it must change with
anything that changes what a role writes (a role file, the trainer's sources, a wheel, an inventory
value) and must not change with what differs from run to run on its own (facts, Ansible's run
variables, the become password), or the check would never let a run be skipped.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[3] / "roles" / "converged" / "filter_plugins" / "converged.py"
spec = importlib.util.spec_from_file_location("converged_filters", PLUGIN)
converged = importlib.util.module_from_spec(spec)
spec.loader.exec_module(converged)


@pytest.fixture()
def checkout(tmp_path: Path, monkeypatch) -> Path:
    """A small checkout: a role, a playbook, the trainer's sources and a wheelhouse."""
    root = tmp_path / "checkout"
    (root / "roles" / "timesync" / "templates").mkdir(parents=True)
    (root / "roles" / "timesync" / "templates" / "chrony.conf.j2").write_text("server {{ head }}\n")
    (root / "playbooks").mkdir()
    (root / "playbooks" / "site.yml").write_text("---\n")
    (root / "trainer").mkdir()
    (root / "trainer" / "loop.py").write_text("STEPS = 1\n")
    (root / "trainer" / "__pycache__").mkdir()
    (root / "trainer" / "__pycache__" / "loop.cpython-311.pyc").write_bytes(b"\0")
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    (wheelhouse / "torch-2.13.0-cp311-none-linux_x86_64.whl").write_bytes(b"torch")
    monkeypatch.setattr(converged, "CHECKOUT", root)
    return root


def inventory(wheelhouse: Path, **changes) -> dict:
    head = {
        "cluster_training_uid": 2000,
        "training_wheelhouse": str(wheelhouse),
        "ansible_host": "10.0.0.10",
        "ansible_user": "admin",
        "ansible_become_password": "hunter2",
        "ansible_facts": {"uptime_seconds": 5, "packages": {"chrony": []}},
        "ansible_uptime_seconds": 5,
        "packages": {"chrony": []},
        "inventory_dir": "/home/me/checkout-a/inventory",
        "group_names": ["cluster", "head"],
        "webhook_token": "s3cret",
    }
    head.update(changes)
    return {"head-1": head, "worker-1": {"cluster_training_uid": 2000, "group_names": ["cluster", "workers"]}}


GROUPS = {"cluster": ["head-1", "worker-1"], "head": ["head-1"], "workers": ["worker-1"]}


def digest(hostvars: dict, groups: dict = GROUPS, version: str = "2.19.4") -> str:
    return converged.converged_inputs(hostvars, groups, version)


def test_what_changes_on_its_own_does_not_change_the_digest(checkout, tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    base = digest(inventory(wheelhouse))
    assert digest(inventory(wheelhouse)) == base
    facts_later = {"uptime_seconds": 9000, "packages": {"chrony": [], "vim": []}}
    same = [
        inventory(
            wheelhouse,
            ansible_facts=facts_later,
            ansible_uptime_seconds=9000,
            packages=facts_later["packages"],
        ),
        inventory(wheelhouse, ansible_become_password="another", webhook_token="other"),
        inventory(wheelhouse, inventory_dir="/srv/checkout-b/inventory", converged_full_run=True),
        # Run under Molecule: its variables join every host's (a new ephemeral dir each run).
        inventory(
            wheelhouse,
            molecule_ephemeral_directory="/root/.ansible/tmp/molecule.DW5A.default",
            molecule_yml={"driver": {"name": "podman"}},
        ),
    ]
    for hostvars in same:
        assert digest(hostvars) == base
    (checkout / "trainer" / "__pycache__" / "loop.cpython-311.pyc").write_bytes(b"\1")
    assert digest(inventory(wheelhouse)) == base


def test_what_a_role_writes_from_changes_the_digest(checkout, tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    seen = {digest(inventory(wheelhouse))}
    seen.add(digest(inventory(wheelhouse, cluster_training_uid=2001)))
    seen.add(digest(inventory(wheelhouse, ansible_host="10.0.0.99")))
    seen.add(digest(inventory(wheelhouse), groups={**GROUPS, "cluster": ["head-1"], "workers": []}))
    seen.add(digest(inventory(wheelhouse), version="2.20.0"))
    (checkout / "roles" / "timesync" / "templates" / "chrony.conf.j2").write_text(
        "server {{ head }} iburst\n"
    )
    seen.add(digest(inventory(wheelhouse)))
    (checkout / "trainer" / "loop.py").write_text("STEPS = 2\n")
    seen.add(digest(inventory(wheelhouse)))
    wheel = wheelhouse / "torch-2.13.0-cp311-none-linux_x86_64.whl"
    wheel.write_bytes(b"torch, rebuilt")
    seen.add(digest(inventory(wheelhouse)))
    os.utime(wheel, ns=(1, 1))
    seen.add(digest(inventory(wheelhouse)))
    assert len(seen) == 9


def test_the_roles_watch_lists_merge_into_one_sorted_spec():
    spec = converged.converged_spec(
        [
            {"packages": ["chrony"], "paths": ["/etc/chrony/chrony.conf"]},
            {"packages": ["ufw", "chrony"], "ufw": True},
            {"paths": ["/etc/default/chrony", ""], "services": ["chrony"]},
            # A templated flag may arrive as text: "False" is off, not a non-empty string.
            {"sshd": "False"},
        ]
    )
    assert spec == {
        "paths": ["/etc/chrony/chrony.conf", "/etc/default/chrony"],
        "listings": [],
        "services": ["chrony"],
        "packages": ["chrony", "ufw"],
        "users": [],
        "groups": [],
        "mounts": [],
        "ufw": True,
        "sshd": False,
    }
    with pytest.raises(ValueError, match="unknown kind 'commands'"):
        converged.converged_spec([{"commands": ["true"]}])


def test_the_cluster_digest_ties_every_node_to_every_other():
    one = converged.converged_cluster_digest({"head-1": "a", "worker-1": "b"}, "inputs")
    assert one == converged.converged_cluster_digest({"worker-1": "b", "head-1": "a"}, "inputs")
    assert one != converged.converged_cluster_digest({"head-1": "a", "worker-1": "c"}, "inputs")
    assert one != converged.converged_cluster_digest({"head-1": "a", "worker-1": "b"}, "other inputs")
