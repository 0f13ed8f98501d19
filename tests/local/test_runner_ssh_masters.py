"""A playbook run over SSH leaves no SSH connection behind: the runner ends the masters its run
started (ControlPersist would keep each up for 60 s after every launch, preflight and status, one
per node). Real ssh, real sshd (tests/helpers/local_sshd.py), real ansible-playbook through the runner."""

from __future__ import annotations

import os
import sys
import time

import yaml
from helpers.local_sshd import local_sshd, ssh_masters, sshd_sessions

from trainer.controller.runner import run_playbook

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

PLAYBOOK = [
    {
        "hosts": "cluster",
        "gather_facts": False,
        "tasks": [
            {"name": "Run a command on the node", "ansible.builtin.command": "id -un", "changed_when": False}
        ],
    }
]


def test_a_run_over_ssh_ends_its_ssh_masters(tmp_path):
    sshd = tmp_path / "sshd"
    host = {**local_sshd(sshd), "ansible_python_interpreter": sys.executable}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"cluster": {"hosts": {"node0": host}}}))
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump(PLAYBOOK, sort_keys=False))
    started = time.monotonic()
    result = run_playbook(playbook, inventory, env={"ANSIBLE_PIPELINING": "False"})
    assert result.succeeded, result.output
    assert result.task_result("node0", "Run a command on the node").result["stdout"] == "root"
    # Each task is several ssh calls over one master: the node saw one connection, now closed.
    assert len(os.listdir(sshd / "sessions")) == 1, "the run's ssh calls shared one master"
    left = sshd_sessions(sshd)
    assert not left, (
        f"{time.monotonic() - started:.0f} s after the run started, still connected: {ssh_masters()}"
    )
