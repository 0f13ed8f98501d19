"""Sudo and vault passwords for trainer plan/launch/preflight, on this machine (inventory/local).

Real ansible-playbook runs through trainer.controller.runner, real ansible-vault files, a real HTTP
server receiving the trainer's webhook. What a user notices: a typed password answers the prompt and
lands in no file, command line or environment; a vaulted webhook URL reaches the trainer and is
never shown; a missing, wrong or loose password file is refused before anything runs, naming the
file or variable and the fix. The test bed (tests/testbed/test_access_testbed.py) adds a real password sudo.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers.health_webhook_server import WebhookServer

from trainer.controller.access import Access
from trainer.controller.runner import SUDO_PASSWORD_FIX, TaskResult, run_playbook

REPO = Path(__file__).resolve().parents[3]
LOCAL_INVENTORY = REPO / "inventory" / "local"
ANSIBLE_VAULT = Path(sys.executable).with_name("ansible-vault")
VAULT_PASSWORD = "vault-pw-7c1e0b"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def secret_file(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def vaulted(name: str, value: str, password_file: Path) -> str:
    """`name: !vault |...` as ansible-vault encrypt_string writes it."""
    done = subprocess.run(
        [str(ANSIBLE_VAULT), "encrypt_string", "--vault-password-file", str(password_file),
         value, "--name", name],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return done.stdout


def files_containing(root: Path, needle: str) -> list[str]:
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and needle.encode() in path.read_bytes():
                found.append(str(path))
        except OSError:
            continue
    return found


def processes_showing(needle: str) -> list[str]:
    """Processes whose command line or environment holds `needle`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        for part in ("cmdline", "environ"):
            try:
                if needle.encode() in (proc / part).read_bytes():
                    found.append(f"{proc.name}/{part}")
            except OSError:
                continue
    return found


@pytest.fixture
def local_copy(tmp_path) -> Path:
    """inventory/local under a root of its own (its paths derive from the inventory's location)."""
    root = tmp_path / "root"
    shutil.copytree(LOCAL_INVENTORY, root / "inventory" / "local")
    (root / ".venv").symlink_to(REPO / ".venv")
    network = root / "inventory" / "local" / "group_vars" / "cluster" / "network.yml"
    text = network.read_text()
    assert "cluster_master_port: 29500" in text
    network.write_text(text.replace("cluster_master_port: 29500", f"cluster_master_port: {free_port()}"))
    return root / "inventory" / "local"


def test_typed_become_password_answers_the_prompt_and_is_written_nowhere(tmp_path, monkeypatch):
    password = "typed-sudo-pw-93f2a"
    runner_tmp = tmp_path / "runner-tmp"
    runner_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runner_tmp))  # where the private dir is made
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        "---\n- name: A play that asks for the sudo password\n  hosts: cluster\n  gather_facts: false\n"
        "  tasks:\n    - name: Wait a moment\n      ansible.builtin.command: sleep 1\n"
        "      changed_when: false\n"
    )
    asked: list[str] = []
    seen_in_files: list[str] = []
    seen_in_processes: list[str] = []

    def inspect(event: dict) -> None:
        # While ansible-playbook runs: its private dir, its command line and its environment.
        if event.get("event") in ("playbook_on_task_start", "playbook_on_stats"):
            seen_in_files.extend(files_containing(runner_tmp, password))
            seen_in_processes.extend(processes_showing(password))

    access = Access(ask_become_pass=True, prompt=lambda prompt: asked.append(prompt) or password)
    result = run_playbook(playbook, LOCAL_INVENTORY, on_event=inspect, access=access, timeout_s=300)
    assert result.succeeded, result.output  # the prompt was answered: an unanswered one hangs
    assert asked == ["BECOME password: "], "asked once, before the run"
    assert list(runner_tmp.iterdir()) == [], "the private dir is removed after the run"
    assert not seen_in_files, seen_in_files
    assert not seen_in_processes, seen_in_processes
    # Asked once per command: a second playbook run of the same command reuses the answer.
    assert run_playbook(playbook, LOCAL_INVENTORY, access=access, timeout_s=300).succeeded
    assert len(asked) == 1


def test_sudo_password_failures_name_the_fix():
    for message in ("Missing sudo password", "Incorrect sudo password"):
        result = TaskResult("node1", "Start", "command", "failed", {"msg": message})
        assert SUDO_PASSWORD_FIX in result.message and result.message.startswith(message)
    assert "--ask-become-pass" in SUDO_PASSWORD_FIX


def plan(inventory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "plan", "-i", str(inventory), "--json", *args],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip


def test_plan_reads_a_vaulted_webhook_url_and_shows_it_redacted(local_copy, tmp_path):
    url = "http://127.0.0.1:9/hooks/vaulted-s3cret-91a"
    password_file = secret_file(tmp_path / "vault-pass", VAULT_PASSWORD)
    secrets = local_copy / "group_vars" / "cluster" / "secrets.yml"
    secrets.write_text("---\n" + vaulted("training_health_webhook_url", url, password_file))
    assert url not in secrets.read_text()

    shown = plan(local_copy, "--vault-password-file", str(password_file))
    assert shown.returncode == 0, shown.stderr
    assert url not in shown.stdout + shown.stderr
    assert "health.webhook_url=<redacted>" in json.loads(shown.stdout)["overrides"]

    # Without the password: refused, naming the variable and the fix; nothing else is attempted.
    missing = plan(local_copy)
    assert missing.returncode == 2
    assert "variable training_health_webhook_url is vaulted" in missing.stderr
    assert "--vault-password-file" in missing.stderr and url not in missing.stderr

    wrong = plan(local_copy, "--vault-password-file", str(secret_file(tmp_path / "wrong", "not-it")))
    assert wrong.returncode == 2 and "training_health_webhook_url" in wrong.stderr

    # ansible-playbook's own setting works too.
    env = {**os.environ, "ANSIBLE_VAULT_PASSWORD_FILE": str(password_file)}
    by_env = subprocess.run(
        [sys.executable, "-m", "trainer", "plan", "-i", str(local_copy), "--json"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip
    assert by_env.returncode == 0, by_env.stderr


def test_password_files_others_can_read_or_that_are_missing_are_refused(local_copy, tmp_path):
    loose = secret_file(tmp_path / "loose", VAULT_PASSWORD)
    loose.chmod(0o644)
    refused = plan(local_copy, "--vault-password-file", str(loose))
    assert refused.returncode == 2
    assert f"--vault-password-file {loose} can be read by other accounts (mode 0644)" in refused.stderr
    assert f"chmod 0600 {loose}" in refused.stderr

    writable = secret_file(tmp_path / "writable", "pw")
    writable.chmod(0o620)
    refused = plan(local_copy, "--become-password-file", str(writable))
    assert refused.returncode == 2 and "can be changed by other accounts" in refused.stderr

    refused = plan(local_copy, "--become-password-file", str(tmp_path / "nope"))
    assert refused.returncode == 2
    assert f"--become-password-file {tmp_path / 'nope'}: No such file or directory" in refused.stderr

    both = plan(local_copy, "--ask-become-pass", "--become-password-file", str(writable))
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


@pytest.mark.slow
def test_vaulted_webhook_url_reaches_the_trainer_and_is_never_shown(local_copy, tmp_path):
    password_file = secret_file(tmp_path / "vault-pass", VAULT_PASSWORD)
    faults = tmp_path / "faults.jsonl"
    faults.write_text(json.dumps({"step": 3, "gpu": 0, "metrics": {"ecc_uncorrectable": 3}}) + "\n")
    with WebhookServer() as server:
        url = server.url("/hooks/vaulted-s3cret-5d2")
        secrets = local_copy / "group_vars" / "cluster" / "secrets.yml"
        secrets.write_text("---\n" + vaulted("training_health_webhook_url", url, password_file))
        sets = [
            "train.max_steps=40",
            "train.warmup_steps=1",
            "checkpoint.save_steps=0",
            f"health.fault_source=file:{faults}",
            "health.poll_interval_s=0.05",
        ]
        cmd = [sys.executable, "-m", "trainer", "launch", "-i", str(local_copy), "--run-name", "vaulted"]
        cmd += ["--vault-password-file", str(password_file), "--poll-interval", "1"]
        cmd += [arg for item in sets for arg in ("--set", item)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
        out = done.stdout + done.stderr
        assert done.returncode == 75, out
        events = server.wait_for(1, timeout_s=30)
    assert events and events[0]["json"]["event"] == "gpu.fault", out
    assert events[0]["path"] == "/hooks/vaulted-s3cret-5d2"
    assert "vaulted-s3cret" not in out
    run_dir = local_copy.parents[1] / "output" / "runs" / "vaulted"
    # Only the config the trainer reads holds it, readable by its owner alone.
    holders = files_containing(run_dir, "vaulted-s3cret")
    assert holders == [str(run_dir / "launch" / "config.yaml")], holders
    assert stat.S_IMODE((run_dir / "launch" / "config.yaml").stat().st_mode) == 0o600
    assert "<redacted>" in (run_dir / "run.json").read_text()
