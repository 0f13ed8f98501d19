"""`make provision` (site.yml on inventory/local) passes on this machine and leaves its firewall, NFS
exports, clock setup and accounts exactly as they were: the multi-host roles skip a one-host cluster
and say so, and trainer_env only checks the repo's own venv."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.accounts import TEST_ACCOUNT_PREFIX
from helpers.loopback import two_node_inventory

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
WATCHED = [
    "/etc/exports",
    "/etc/exports.d",
    "/etc/chrony",
    "/etc/default/chrony",
    "/etc/ufw",
    "/etc/default/ufw",
    "/etc/passwd",
    "/etc/group",
    "/etc/fstab",
    "/etc/ssh/ssh_known_hosts",
]


#: Account files: digested without the temporary accounts other tests make and remove meanwhile
#: (CI runs this beside them: an account there during one read and gone at the next failed this test).
ACCOUNT_FILES = ("/etc/passwd", "/etc/group")


def digest(path: Path) -> str:
    data = path.read_bytes()
    if str(path) in ACCOUNT_FILES:
        ours = TEST_ACCOUNT_PREFIX.encode()
        data = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(ours))
    return hashlib.sha256(data).hexdigest()


def machine_state() -> dict[str, str]:
    """A digest of every watched file (missing ones included) plus the live firewall rules."""
    state: dict[str, str] = {}
    for top in WATCHED:
        paths = sorted(Path(top).rglob("*")) if Path(top).is_dir() else [Path(top)]
        for path in paths:
            if path.is_file():
                state[str(path)] = digest(path)
            elif not path.exists():
                state[str(path)] = "missing"
    for tool in ("iptables", "nft"):
        if shutil.which(tool):
            args = [tool, "-S"] if tool == "iptables" else [tool, "list", "ruleset"]
            result = subprocess.run(args, capture_output=True, text=True)
            state[tool] = result.stdout if result.returncode == 0 else f"unreadable: {result.stderr}"
    return state


def files_state() -> dict[str, str]:
    """machine_state's files only: the live rules also change whenever the container test bed's
    network comes or goes, which a run elsewhere on this machine may do meanwhile."""
    return {key: value for key, value in machine_state().items() if key.startswith("/")}


def run_provision(*extra: str, inventory: str = "inventory/local") -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_NOCOLOR="1")
    if inventory != "inventory/local":  # made-up hosts: keep them out of the fact cache
        env["ANSIBLE_FACT_CACHING"] = "memory"
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "site.yml", "-i", inventory, *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_make_provision_passes_and_changes_nothing_on_this_machine():
    before = machine_state()
    result = run_provision()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert machine_state() == before
    recap = re.search(r"localhost\s+: ok=\d+\s+changed=(\d+)\s+unreachable=0\s+failed=0", output)
    assert recap and recap[1] == "0", output
    for role in ("users", "ssh_trust", "timesync", "firewall", "nfs_server"):
        assert f"{role}: skipped, single-host cluster" in output, role
    assert "trainer_env: single-host cluster: checking the existing venv" in output
    # The repo's venv really was checked: torch's version appears in the agreement message.
    assert re.search(r'"torch": "\d+\.\d+', output), output


def test_one_concern_by_tag_still_validates_first():
    result = run_provision("--tags", "firewall")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Inventory OK: head localhost" in output
    assert "firewall: skipped, single-host cluster" in output
    assert "users: skipped" not in output
    assert "trainer_env: single-host" not in output


@pytest.mark.slow
def test_check_diff_passes_and_changes_nothing_on_this_machine():
    """`ansible-playbook site.yml --check --diff`, what an Ansible user runs before touching a machine."""
    before = files_state()
    result = run_provision("--check", "--diff")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert files_state() == before
    for role in ("users", "ssh_trust", "timesync", "firewall", "nfs_server"):
        assert f"{role}: skipped, single-host cluster" in output, role
    # The venv's versions are read in check mode too (a read-only probe).
    assert re.search(r'"torch": "\d+\.\d+', output), output


@pytest.mark.slow
@pytest.mark.skipif(
    Path("/usr/sbin/chronyd").exists() or Path("/usr/sbin/ufw").exists(),
    reason="needs a machine without chrony and ufw (a node before its first provisioning)",
)
def test_check_diff_passes_on_new_nodes_and_says_what_it_cannot_compare(tmp_path):
    """Two "nodes" of this machine (127.0.0.1-2) that have neither chrony, ufw nor the trainer venv:
    --check cannot install them, so what needs them is skipped, and the output says so."""
    inventory = two_node_inventory(tmp_path, {})
    venv = tmp_path / "venv"
    before = files_state()
    result = run_provision(
        "--tags", "timesync,firewall,trainer_env", "-e", f"training_venv={venv}", "--check", "--diff",
        inventory=str(inventory),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert files_state() == before
    assert not venv.exists()
    flat = " ".join(output.split())
    assert "+server 127.0.0.1 iburst" in output, "the worker's chrony.conf is diffed"
    assert "TASK [timesync : Keep chrony running and enabled (skipped in check mode" in flat
    assert "firewall: check mode, ufw is not installed yet; it would be installed and enabled" in flat
    assert "22/tcp from any (firewall: SSH)" in flat
    assert f"trainer_env: check mode, {venv} does not exist yet" in flat
