"""trainer.controller.runner: real ansible-playbook runs against inventory/local (this machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from trainer.controller.runner import run_playbook

REPO = Path(__file__).resolve().parents[3]
LOCAL_INVENTORY = REPO / "inventory" / "local"


def write_playbook(directory: Path, tasks: str) -> Path:
    playbook = directory / "play.yml"
    playbook.write_text("---\n- name: Test play\n  hosts: cluster\n  gather_facts: false\n  tasks:\n" + tasks)
    return playbook


def test_module_results_and_events_per_host(tmp_path):
    playbook = write_playbook(
        tmp_path,
        "    - name: Say hello\n"
        "      ansible.builtin.command: echo hello {{ greeting }}\n"
        "      changed_when: false\n",
    )
    events = []
    result = run_playbook(
        playbook, LOCAL_INVENTORY, extravars={"greeting": "cluster"}, on_event=events.append
    )
    assert result.succeeded, result.output
    assert result.status == "successful" and result.rc == 0
    hello = result.task_result("localhost", "Say hello")
    assert hello is not None and hello.status == "ok"
    assert hello.result["stdout"] == "hello cluster"
    assert [r.task for r in result.ok["localhost"]] == ["Say hello"]
    assert result.first_failure is None
    uuids = [e["uuid"] for e in events if "uuid" in e]
    assert len(uuids) == len(set(uuids)), "events are handed on once each"
    assert any(e.get("event") == "runner_on_ok" for e in events)


def test_failure_names_host_task_and_message(tmp_path):
    playbook = write_playbook(
        tmp_path,
        "    - name: Break on purpose\n"
        "      ansible.builtin.command: sh -c 'echo disk full >&2; exit 3'\n"
        "      changed_when: false\n",
    )
    result = run_playbook(playbook, LOCAL_INVENTORY)
    assert not result.succeeded
    assert result.status == "failed" and result.rc != 0
    failure = result.first_failure
    assert failure is not None
    assert (failure.host, failure.task) == ("localhost", "Break on purpose")
    assert "disk full" in failure.message
    assert list(result.failed) == ["localhost"]


def test_environment_is_filtered_and_temp_dir_removed(tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("CLUSTERTRAIN_TEST_SECRET", "do-not-leak")
    monkeypatch.setenv("ANSIBLE_NOCOLOR", "1")
    playbook = write_playbook(
        tmp_path,
        "    - name: Show environment\n      ansible.builtin.command: env\n      changed_when: false\n",
    )
    result = run_playbook(playbook, LOCAL_INVENTORY)
    assert result.succeeded, result.output
    env = dict(
        line.split("=", 1)
        for line in result.task_result("localhost", "Show environment").result["stdout_lines"]
    )
    assert "CLUSTERTRAIN_TEST_SECRET" not in env
    assert env["ANSIBLE_NOCOLOR"] == "1"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["ANSIBLE_HOST_KEY_CHECKING"] == "True"
    assert list(scratch.iterdir()) == [], "the private data dir (with its command/env file) is removed"


@pytest.mark.skipif(Path("/etc/ansible/ansible.cfg").is_file(), reason="this machine has an Ansible config")
def test_ansible_main_loop_polls_gently_and_a_users_config_still_rules(tmp_path, monkeypatch):
    """Without any config file, Ansible's main process would check on a running task 1000 times a
    second for as long as `trainer launch`'s watch runs; the runner gives it 0.01 s. A user's own
    ~/.ansible.cfg is read as before, whole (the runner's setting is not added to it)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("ANSIBLE_CONFIG", raising=False)
    playbook = write_playbook(
        tmp_path,
        "    - name: Show the setting\n"
        "      ansible.builtin.debug:\n"
        "        msg: \"{{ lookup('ansible.builtin.config', 'DEFAULT_INTERNAL_POLL_INTERVAL') }}\"\n",
    )

    def interval() -> float:
        result = run_playbook(playbook, LOCAL_INVENTORY)
        assert result.succeeded, result.output
        return float(result.task_result("localhost", "Show the setting").result["msg"])

    assert interval() == 0.01
    (home / ".ansible.cfg").write_text("[defaults]\ninternal_poll_interval = 0.005\n")
    assert interval() == 0.005


def test_cancel_stops_a_running_playbook(tmp_path):
    playbook = write_playbook(
        tmp_path,
        "    - name: Sleep long\n      ansible.builtin.command: sleep 60\n      changed_when: false\n",
    )
    cancel = threading.Event()
    started = time.monotonic()

    def cancel_on_task_start(event):
        if event.get("event") == "playbook_on_task_start":
            threading.Timer(1.0, cancel.set).start()

    result = run_playbook(playbook, LOCAL_INVENTORY, on_event=cancel_on_task_start, cancel=cancel)
    assert result.status == "canceled"
    assert time.monotonic() - started < 20
    leftovers = subprocess.run(["pgrep", "-f", str(playbook)], capture_output=True, text=True).stdout.split()
    assert leftovers == [], "ansible-playbook and its workers are gone after a cancel"


def test_missing_playbook_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_playbook(tmp_path / "nope.yml", LOCAL_INVENTORY)


def test_every_host_at_once_and_no_event_files(tmp_path, monkeypatch):
    """Packaged playbooks get forks for a cluster (the current directory's ansible.cfg does not apply
    to them), and ansible-runner keeps no event or output files: a watch of days would write
    thousands otherwise."""
    monkeypatch.delenv("ANSIBLE_FORKS", raising=False)
    runner_tmp = tmp_path / "runner-tmp"
    runner_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runner_tmp))  # where the private dir is made
    tasks = "".join(
        f"    - name: Read the forks {i}\n"
        "      ansible.builtin.debug:\n"
        "        msg: \"{{ lookup('ansible.builtin.config', 'DEFAULT_FORKS') }}\"\n"
        for i in range(20)
    )
    playbook = write_playbook(tmp_path, tasks)
    kept: set[str] = set()

    def look(event: dict) -> None:
        kept.update(
            str(p.relative_to(runner_tmp))
            for p in runner_tmp.rglob("*")
            if p.is_file()
            and (("job_events" in p.parts and "partial.json" not in p.name) or p.name == "stdout")
        )

    result = run_playbook(playbook, LOCAL_INVENTORY, on_event=look)
    assert result.succeeded, result.output
    assert result.task_result("localhost", "Read the forks 0").result["msg"] == 50
    assert kept == set(), f"files ansible-runner kept per event: {sorted(kept)[:5]}"


def test_messages_arrive_under_a_temp_dir_too_long_for_a_socket_path(tmp_path, monkeypatch):
    # A deep TMPDIR (pytest's own, a CI workspace) would put the channel's Unix socket past the 108
    # bytes Linux allows: the launcher then failed with "AF_UNIX path too long" before any node ran.
    scratch = tmp_path / ("deep-" + "d" * 60) / ("deeper-" + "e" * 60)
    scratch.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    send = (
        "import json, socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
        "s.sendall(json.dumps({'hello': 'from the node', 'at': sys.argv[1]}).encode() + b'\\n'); s.close()"
    )
    playbook = write_playbook(
        tmp_path,
        "    - name: Write to the channel\n"
        f"      ansible.builtin.command:\n        argv: [python3, -c, {send!r}, '{{{{ runner_channel }}}}']\n"
        "      changed_when: false\n",
    )
    messages = []
    result = run_playbook(playbook, LOCAL_INVENTORY, on_message=messages.append)
    assert result.succeeded, result.output
    assert [m["hello"] for m in messages] == ["from the node"]
    # Its own dir, not the set of every ct-ch-* dir: CI's other lanes open channels at the same time.
    own_dir = Path(messages[0]["at"]).parent
    assert own_dir.parent == Path("/tmp") and own_dir.name.startswith("ct-ch-"), own_dir
    assert not own_dir.exists(), "the socket's own dir is removed"


def test_a_message_is_answered_on_its_own_connection(tmp_path):
    # A node's launch (launch_node's `launch`) waits on the channel for the launcher's word to start
    # once every node's probe has passed: the answer must reach the connection that asked.
    ask = (
        "import json, socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
        "s.sendall(json.dumps({'type': 'probed', 'host': sys.argv[2]}).encode() + b'\\n'); "
        "s.settimeout(30); word = json.loads(s.makefile('rb').readline()); "
        "assert word == {'go': True, 'to': sys.argv[2]}, word; "
        "s.sendall(json.dumps({'type': 'started', 'host': sys.argv[2]}).encode() + b'\\n'); s.close()"
    )
    playbook = write_playbook(
        tmp_path,
        "    - name: Ask on the channel\n"
        "      ansible.builtin.command:\n"
        f"        argv: [python3, -c, {ask!r}, '{{{{ runner_channel }}}}', '{{{{ item }}}}']\n"
        "      loop: [first, second]\n"
        "      changed_when: false\n",
    )
    started = []

    def answer(message):
        if message.get("type") == "probed":
            assert message.reply({"go": True, "to": message["host"]})
        else:
            started.append(message["host"])

    result = run_playbook(playbook, LOCAL_INVENTORY, on_message=answer)
    assert result.succeeded, result.output
    assert started == ["first", "second"], "each asker got its own answer and went on"
