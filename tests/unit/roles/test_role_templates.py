"""The NFS roles refuse values their export and fstab lines cannot hold, and quote what they write.

Each case runs the role's own input check (tasks_from check_inputs.yml) through ansible-playbook on
this machine, then, for accepted values, renders the role's real template. What a user notices: an
inventory value that would export the share to the world (or add options to the fstab line) stops
the run naming the host and the value, before anything is written; the accepted ones come out quoted,
for the cluster's addresses only, and the workers' mount carries nosuid,nodev.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
CLUSTER = {
    "cluster_training_user": "trainer",
    "cluster_training_group": "trainer",
    "cluster_training_uid": 2000,
    "cluster_training_gid": 2000,
    "cluster_name": "t",
}

pytestmark = pytest.mark.slow


def run_role_check(tmp_path: Path, role: str, extra: dict, render: str = "") -> subprocess.CompletedProcess:
    """The role's check_inputs.yml on localhost with `extra` as its variables, then `render` tasks."""
    play = f"""---
- name: Check the role's inputs
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: The role's own check
      ansible.builtin.include_role:
        name: {role}
        tasks_from: check_inputs.yml
{render}"""
    (tmp_path / "play.yml").write_text(play)
    (tmp_path / "vars.json").write_text(json.dumps({**CLUSTER, **extra}))
    env = {
        **os.environ,
        "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
    }
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), str(tmp_path / "play.yml"), "-e", f"@{tmp_path / 'vars.json'}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("nfs_server_export_path", "/srv/share *(rw,no_root_squash,insecure)"),
        ("nfs_server_export_path", "/srv/share\n/ *(rw)"),
        ("nfs_server_clients", ["10.0.0.1", "*"]),
        ("nfs_server_clients", ["10.0.0.1(rw,no_root_squash)"]),
        ("nfs_server_export_options", ["rw", "no_root_squash"]),
        ("nfs_server_export_options", ["rw) *(rw"]),
    ],
)
def test_a_value_that_would_widen_the_export_is_refused_before_anything_is_written(tmp_path, variable, value):
    good = {"nfs_server_export_path": "/srv/share", "nfs_server_clients": ["10.0.0.1", "10.0.0.2"]}
    done = run_role_check(tmp_path, "nfs_server", {**good, variable: value})
    out = " ".join(done.stdout.split())
    assert done.returncode != 0, done.stdout
    assert "host localhost: fix the value that does not fit (nothing was changed)" in out, done.stdout
    assert json.dumps(value) in out, f"the message names the value: {done.stdout}"


def test_accepted_export_values_are_written_quoted_for_the_cluster_only(tmp_path):
    render = f"""
    - name: Render the exports drop-in and ganesha.conf
      ansible.builtin.template:
        src: {REPO}/roles/nfs_server/templates/{{{{ item }}}}.j2
        dest: {tmp_path}/{{{{ item | basename }}}}
        mode: "0644"
      loop: [etc/exports.d/clustertrain.exports, etc/ganesha/ganesha.conf]
      vars:
        nfs_server_squash: root_squash
        nfs_server_sec: sys
        nfs_server_nfsv3: false
        nfs_server_ganesha_grace_period: 90
        nfs_server_ganesha_lease_lifetime: 60
"""
    values = {
        "nfs_server_export_path": "/srv/clustertrain/shared",
        "nfs_server_clients": ["10.0.0.1", "10.0.0.2"],
        "nfs_server_export_options": ["rw", "sync", "no_subtree_check"],
    }
    done = run_role_check(tmp_path, "nfs_server", values, render)
    assert done.returncode == 0, done.stdout + done.stderr
    exports = [line for line in (tmp_path / "clustertrain.exports").read_text().splitlines() if line]
    assert exports[-1] == (
        '"/srv/clustertrain/shared" 10.0.0.1(rw,sync,no_subtree_check,root_squash,sec=sys) '
        "10.0.0.2(rw,sync,no_subtree_check,root_squash,sec=sys)"
    )
    ganesha = (tmp_path / "ganesha.conf").read_text()
    assert 'Path = "/srv/clustertrain/shared";' in ganesha
    assert "Clients = 10.0.0.1, 10.0.0.2;" in ganesha


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("nfs_client_mount_options", "nfsvers=4,hard suid"),
        ("nfs_client_mount_options", "nfsvers=4\n10.0.0.9:/ /root nfs rw 0 0"),
        ("nfs_client_export_path", "/srv/share #"),
        ("nfs_client_server_address", "10.0.0.1 evil"),
    ],
)
def test_a_value_that_would_break_the_fstab_line_is_refused(tmp_path, variable, value):
    good = {
        "nfs_client_export_path": "/srv/share",
        "nfs_client_mount_path": "/srv/share",
        "nfs_client_server_address": "10.0.0.1",
        "nfs_client_mount_options": "nfsvers=4,hard,nosuid,nodev",
    }
    done = run_role_check(tmp_path, "nfs_client", {**good, variable: value})
    out = " ".join(done.stdout.split())
    assert done.returncode != 0, done.stdout
    assert "host localhost: fix the value that does not fit (nothing was changed)" in out, done.stdout
    assert json.dumps(value) in out, done.stdout
