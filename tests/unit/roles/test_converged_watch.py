"""Every file, service, mount and account a role writes is named in the role's converged watch list.

site.yml skips the roles when every node still holds what the last full run recorded
(roles/converged). The record only covers what the roles name in their `<role>_converged_watch`
facts, so a role that starts writing a new file without naming it would let a run be skipped
while that file was changed by hand. This reads every task of every role and asks for the name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[3] / "roles"
#: Module -> the argument that names what it writes.
WRITERS = {
    "ansible.builtin.template": "dest",
    "ansible.builtin.copy": "dest",
    "ansible.builtin.file": "path",
    "ansible.builtin.blockinfile": "path",
    "ansible.builtin.lineinfile": "path",
    "ansible.posix.mount": "path",
    "ansible.builtin.service": "name",
    "ansible.builtin.systemd_service": "name",
    "ansible.builtin.user": "name",
    "ansible.builtin.group": "name",
}
#: What roles write that is not state to keep: scratch files of a check, removed in the same run.
NOT_STATE = {
    "nfs_client": {"nfs_client_export_path/nfs_client_check_file", "/var/tmp/clustertrain-nfs-check"},
    "trainer_env": {
        "trainer_env_node_wheelhouse.tar",  # unpacked, then removed
        "trainer_env_envs_dir/trainer_env_action.seed.tar.zst",  # the seed: unpacked, then the key's own pack
        # The controller's kept packs: the controller's files, not the node's.
        "trainer_env_controller_envs",
        "trainer_env_controller_envs/item.key.json",
        "trainer_env_controller_envs/item.0.keyitem.1",
    },
    "ssh_trust": {"ssh_trust_key_dir.path"},
    "users": {"users_home_probe.stdout"},
}
WATCHING_ROLES = ["users", "ssh_trust", "timesync", "firewall", "nfs_server", "nfs_client", "trainer_env"]


def normal(text: str) -> str:
    """A path or name as written in YAML, without Jinja's braces, quotes, spaces and joins."""
    return re.sub(r"[{}\s'\"()~]", "", str(text))


def tasks_of(role: str) -> list[dict]:
    found: list[dict] = []

    def walk(tasks):
        for task in tasks or []:
            for key in ("block", "rescue", "always"):
                walk(task.get(key))
            found.append(task)

    for path in sorted((ROLES / role / "tasks").glob("*.yml")):
        walk(yaml.safe_load(path.read_text()))
    return found


def written_by(role: str) -> set[str]:
    written = set()
    for task in tasks_of(role):
        for module, arg in WRITERS.items():
            args = task.get(module)
            if not isinstance(args, dict) or arg not in args:
                continue
            target = str(args[arg])
            loop = task.get("loop")
            if "{{ item" in target and isinstance(loop, list):
                written |= {
                    normal(
                        target.replace("{{ item | basename }}", f"{{{{ {item} | basename }}}}").replace(
                            "{{ item }}", str(item)
                        )
                    )
                    for item in loop
                }
            else:
                written.add(normal(target))
        if "ansible.posix.authorized_key" in task:
            written.add(
                normal(f"{task['ansible.posix.authorized_key']['user']}_home/.ssh/authorized_keys").replace(
                    "ssh_trust_user_home", "ssh_trust_home"
                )
            )
    return written - NOT_STATE.get(role, set())


def strings(value) -> list[str]:
    if isinstance(value, dict):
        return [text for item in value.items() for text in strings(list(item))]
    if isinstance(value, list):
        return [text for item in value for text in strings(item)]
    return [str(value)]


def watch_text(role: str) -> str:
    for task in tasks_of(role):
        facts = task.get("ansible.builtin.set_fact") or {}
        if f"{role}_converged_watch" in facts:
            return " ".join(normal(text) for text in strings(facts[f"{role}_converged_watch"]))
    raise AssertionError(f"{role}: no task sets {role}_converged_watch")


@pytest.mark.parametrize("role", WATCHING_ROLES)
def test_every_written_item_is_watched(role):
    watched = watch_text(role)
    unnamed = sorted(item for item in written_by(role) if item not in watched)
    assert not unnamed, f"{role} writes {unnamed} but does not name them in {role}_converged_watch"


def test_the_check_reads_what_the_roles_write():
    """The scan itself finds the files the roles are known to write (so it cannot pass by finding none)."""
    assert "/etc/chrony/chrony.conf" in written_by("timesync")
    assert "chrony" in written_by("timesync")
    assert "ssh_trust_home/.ssh/id_ed25519.pub" in written_by("ssh_trust")
    assert "ssh_trust_home/.ssh/authorized_keys" in written_by("ssh_trust")
    assert "trainer_env_node_cache/trainer_env_project.wheel|basename" in written_by("trainer_env")
    assert "nfs_client_mount_path" in written_by("nfs_client")


def test_ufw_and_the_packages_are_watched_where_they_are_changed():
    assert "ufw True" in watch_text("firewall")
    packages = (ROLES / "packages" / "tasks" / "main.yml").read_text()
    assert "packages_converged_watch" in packages and "+ packages_wanted" in packages


def test_the_plain_run_check_knows_every_plays_tag():
    """A run with --skip-tags naming any play's tag is partial: it must neither be skipped by the
    converged check nor write the record. The first play lists those tags by hand (Ansible does not
    tell a play the others' tags) and says whether the run is a plain one."""
    plays = yaml.safe_load((ROLES.parent / "playbooks" / "site.yml").read_text())
    first_play = plays[0]
    tagged = {tag for play in plays for tag in play.get("tags", [])}
    assert set(first_play["vars"]["site_play_tags"]) == tagged


def test_sshd_ports_are_watched_where_ssh_trust_derives_them():
    """ssh_trust writes each node's sshd port (sshd -T) into the others' known_hosts and ssh config."""
    assert "sshd ssh_trust_port|string==auto" in watch_text("ssh_trust"), "on wherever the port is derived"
    tasks = "".join(path.read_text() for path in sorted((ROLES / "ssh_trust" / "tasks").glob("*.yml")))
    assert "argv: [/usr/sbin/sshd, -T]" in tasks, "the module reads the ports with the same command"
