"""The access real clusters give, on the Molecule test bed: ct-worker2 is reached over SSH on port
2222 only, as `ops`, whose sudo asks for a password (molecule/default/prepare.yml).

The shared inventory reads that password from its file itself; these tests use a copy without it,
so the password comes the ways a user gives it: ANSIBLE_BECOME_PASSWORD_FILE, --become-password-file,
or typed at --ask-become-pass. What a user notices: provisioning and launching work with the
password given, and fail naming the host and the fix without it; the password is in no file of the
runner's private dir or the run dir and on no command line; a vaulted webhook URL reaches the
trainer (this test's HTTP server receives gpu.fault) and is shown nowhere; the firewall refuses to
lock the controller out, changing nothing.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import yaml
from helpers.bed_launch import group_vars
from helpers.health_webhook_server import WebhookServer
from helpers.testbed_nodes import BED_TEST

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "molecule" / "default" / "inventory"
ACCESS = Path("/var/tmp/clustertrain-testbed/access")
BECOME_PASSWORD_FILE = ACCESS / "become-password"
ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "scripts" / "testbed" / "containers.conf")}
ENV.pop("ANSIBLE_BECOME_PASSWORD_FILE", None)
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
WHEELHOUSE = REPO / ".cache" / "wheelhouse"
ANSIBLE_VAULT = Path(sys.executable).with_name("ansible-vault")
PASSWORD_HOST = "ct-worker2"
#: A master port of its own, inside the firewall's comm range (the launch and preflight tests use others).
MASTER_PORT = 29543
TEST_SETS = (
    "train.warmup_steps=1",
    "train.log_every=2",
    "checkpoint.save_steps=0",
    "distributed.timeout_s=120",
)

pytestmark = BED_TEST


@pytest.fixture
def inventory(tmp_path) -> Path:
    """The bed's inventory without the password lookup, one process per node, a master port of its own."""
    copy = tmp_path / "inventory"
    shutil.copytree(INVENTORY, copy)
    hosts = yaml.safe_load((copy / "hosts.yml").read_text())
    password_host = hosts["cluster"]["children"]["workers"]["hosts"][PASSWORD_HOST]
    assert password_host.pop("ansible_become_password")
    (copy / "hosts.yml").write_text(yaml.safe_dump(hosts))
    overrides = {
        "training_procs_per_node": 1,
        "cluster_master_port": MASTER_PORT,
        "training_engine": "ddp",
        # The bed's wheelhouse (its inventory finds it relative to its own location, not the copy's).
        "training_wheelhouse": os.environ.get("CLUSTERTRAIN_WHEELHOUSE") or str(WHEELHOUSE),
    }
    (copy / "group_vars" / "cluster" / "zz_access_test.yml").write_text(yaml.safe_dump(overrides))
    return copy


def password() -> str:
    return BECOME_PASSWORD_FILE.read_text().strip()


class SecretWatch:
    """Looks for a secret, while a command runs, in every file under `roots` and in every process's
    command line and environment; found places are kept in `.found`."""

    def __init__(self, secret: str, roots: list[Path]) -> None:
        self.secret, self.roots, self.found = secret.encode(), roots, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _scan(self) -> None:
        for root in self.roots:
            for path in root.rglob("*"):
                try:
                    if path.is_file() and not path.is_symlink() and self.secret in path.read_bytes():
                        self.found.add(str(path))
                except OSError:
                    continue
        for proc in Path("/proc").glob("[0-9]*"):
            for part in ("cmdline", "environ"):
                try:
                    if self.secret in (proc / part).read_bytes():
                        self.found.add(f"/proc/{proc.name}/{part}")
                except OSError:
                    continue

    def _watch(self) -> None:
        while not self._stop.wait(0.3):
            self._scan()

    def __enter__(self) -> SecretWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._scan()


def run(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    return done.returncode, done.stdout + done.stderr


def launch_cmd(inventory: Path, run_name: str, *args: str) -> list[str]:
    sets = [a for s in TEST_SETS for a in ("--set", s)]
    return [
        sys.executable,
        "-m",
        "trainer",
        "launch",
        "-i",
        str(inventory),
        "--run-name",
        run_name,
        *sets,
        *args,
    ]


def podman(*args: str) -> str:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, env=ENV, check=True, timeout=120
    ).stdout


def test_launch_with_the_sudo_password_from_a_file_and_a_vaulted_webhook(inventory, tmp_path):
    shared = Path(group_vars()["cluster_shared_dir"])
    run_name = f"access-{uuid.uuid4().hex[:8]}"
    output = shared / "runs" / run_name
    vault_file = tmp_path / "vault-pass"
    vault_file.write_text(f"vault-{uuid.uuid4().hex}\n")
    vault_file.chmod(0o600)
    faults = shared / f"{run_name}-faults.jsonl"
    faults.write_text(json.dumps({"step": 3, "gpu": 0, "metrics": {"ecc_uncorrectable": 3}}) + "\n")
    faults.chmod(0o644)
    # The nodes reach this machine at its address on the bed's network (the first of the subnet).
    controller = str(next(ipaddress.ip_network(group_vars()["cluster_subnet"]).hosts()))
    runner_tmp = tmp_path / "runner-tmp"
    runner_tmp.mkdir(mode=0o700)
    env = {**ENV, "ANSIBLE_BECOME_PASSWORD_FILE": str(BECOME_PASSWORD_FILE), "TMPDIR": str(runner_tmp)}
    try:
        with WebhookServer(host=controller) as server:
            url = server.url(f"/hooks/vaulted-{uuid.uuid4().hex}")
            vaulted = subprocess.run(
                [str(ANSIBLE_VAULT), "encrypt_string", "--vault-password-file", str(vault_file), url,
                 "--name", "training_health_webhook_url"],
                capture_output=True, text=True, check=True, timeout=120,
            )  # fmt: skip
            (inventory / "group_vars" / "cluster" / "secrets.yml").write_text("---\n" + vaulted.stdout)
            cmd = launch_cmd(
                inventory, run_name, "--vault-password-file", str(vault_file),
                "--set", "train.max_steps=40", "--set", f"health.fault_source=file:{faults}",
                "--set", "health.poll_interval_s=0.05",
            )  # fmt: skip
            with SecretWatch(password(), [runner_tmp, output]) as watch:
                rc, out = run(cmd, env, timeout=900)
            assert rc == 75, out
            events = server.wait_for(1, timeout_s=60)
        assert events and events[0]["json"]["event"] == "gpu.fault", out
        assert "GPU_FAULT on " in out
        assert not watch.found, f"the sudo password was found in {sorted(watch.found)}"
        assert url not in out and "vaulted-" not in out
        holders = [str(p) for p in output.rglob("*") if p.is_file() and url.encode() in p.read_bytes()]
        assert holders == [str(output / "launch" / "config.yaml")], holders
        assert list(runner_tmp.iterdir()) == [], "the runner's private dirs are removed"
    finally:
        shutil.rmtree(output, ignore_errors=True)
        faults.unlink(missing_ok=True)


def test_without_the_sudo_password_the_launch_names_the_host_and_the_fix(inventory):
    run_name = f"access-{uuid.uuid4().hex[:8]}"
    output = Path(group_vars()["cluster_shared_dir"]) / "runs" / run_name
    try:
        rc, out = run(launch_cmd(inventory, run_name, "--set", "train.max_steps=4"), ENV, timeout=600)
        assert rc == 1, out
        assert f"could not start on {PASSWORD_HOST}" in out, out
        assert "--ask-become-pass or --become-password-file FILE" in out, out
    finally:
        shutil.rmtree(output, ignore_errors=True)


def test_typed_sudo_password_at_a_terminal(inventory, tmp_path):
    """preflight's SSH checks (as the training user) and ufw check (as root) need sudo on ct-worker2."""
    import pexpect  # ansible-runner's dependency

    secret = password()
    from trainer.controller.preflight.checks import CHECKS

    skipped = [check for check in CHECKS if check not in ("topology", "ssh", "ufw")]
    child = pexpect.spawn(
        sys.executable,
        ["-m", "trainer", "preflight", "-i", str(inventory), "--report", str(tmp_path / "report.json"),
         "--ask-become-pass", "--skip", *skipped],
        env=ENV, cwd=str(REPO), encoding="utf-8", timeout=600,
    )  # fmt: skip
    child.expect_exact("BECOME password: ")
    child.sendline(secret)
    child.expect(pexpect.EOF)
    child.close()
    out = child.before
    assert child.exitstatus == 0, out
    assert f"PASS  ufw           {PASSWORD_HOST}" in out, out
    assert f"PASS  ssh           ct-head -> {PASSWORD_HOST}" in out, out  # port 2222, pinned host key
    assert f"PASS  ssh           {PASSWORD_HOST} -> ct-head" in out, out
    assert secret not in out, "the typed password is not echoed"


def test_provision_with_the_password_from_a_file_and_the_firewall_keeps_the_controller_in(inventory):
    # With the bed's own master port: the firewall role opens it on the head, and this module's port
    # left the head's rules unlike the bed's record, so the next checked site.yml (the converged-limits
    # test's, last of the bed) was a full run (~70 s of CI's bed) where a skip was due.
    overrides = inventory / "group_vars" / "cluster" / "zz_access_test.yml"
    settings = yaml.safe_load(overrides.read_text())
    settings["cluster_master_port"] = group_vars()["cluster_master_port"]
    overrides.write_text(yaml.safe_dump(settings))
    base = [str(ANSIBLE_PLAYBOOK), "playbooks/site.yml", "-i", str(inventory)]
    file_option = ["--become-password-file", str(BECOME_PASSWORD_FILE)]
    env = {**ENV, "ANSIBLE_NOCOLOR": "1"}
    # A re-run of the SSH and firewall parts (ct-worker2 over its port-2222 connection): it connects, and
    # changes nothing on any node.
    rc, out = run([*base, "--tags", "ssh_trust,firewall", *file_option], env, timeout=900)
    assert rc == 0, out[-4000:]
    recap = [line for line in out.splitlines() if line.startswith("ct-") and "changed=" in line]
    assert len(recap) == 3 and all("changed=0" in line and "unreachable=0" in line for line in recap), recap

    # SSH allowed only from an address that is not the controller's: refused before any rule changes.
    rules = {
        host: podman("exec", host, "ufw", "show", "added") for host in ("ct-head", "ct-worker1", "ct-worker2")
    }
    only_head = json.dumps({"firewall_ssh_sources": ["10.89.42.10"]})
    rc, out = run([*base, "--tags", "firewall", "-e", only_head, *file_option], env, timeout=900)
    assert rc != 0
    assert (
        f"host {PASSWORD_HOST}: Ansible reaches it over SSH from 10.89.42.1 on port 2222, but "
        "firewall_ssh_sources (10.89.42.10) does not include 10.89.42.1" in " ".join(out.split())
    ), out[-4000:]
    assert "Fix: add 10.89.42.1 (or its network) to firewall_ssh_sources" in " ".join(out.split())
    for host, before in rules.items():
        assert podman("exec", host, "ufw", "show", "added") == before, f"{host}'s rules changed"
