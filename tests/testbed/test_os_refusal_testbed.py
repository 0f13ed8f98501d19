"""site.yml refuses a host that is not Debian or Ubuntu before any host is changed.

A fourth container joins the test bed's inventory as a worker. It is the bed's own Debian image
with the files Ansible reads an OS from made Rocky Linux 9's (no RHEL image can be had here: no
container registry is reachable). Ansible's own fact gathering then reports Rocky / RedHat family,
exactly as on a real Rocky host. The run must stop in the OS check, name that host and its OS,
and leave every host as it was: the training account is not created on the new host, and no task
of any later play runs on the three bed hosts.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.bed_launch import BED_UP, ENV, INVENTORY

REPO = Path(__file__).resolve().parents[2]
FAKE = "ct-rocky"
IMAGE = "localhost/clustertrain-base:bookworm"
ROCKY_OS_RELEASE = """NAME="Rocky Linux"
VERSION="9.4 (Blue Onyx)"
ID="rocky"
ID_LIKE="rhel centos fedora"
VERSION_ID="9.4"
PLATFORM_ID="platform:el9"
PRETTY_NAME="Rocky Linux 9.4 (Blue Onyx)"
"""

pytestmark = BED_UP


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, env=ENV, check=check, timeout=120
    )


@pytest.fixture
def rocky_host():
    podman("rm", "-f", FAKE, check=False)
    podman("run", "-d", "--name", FAKE, "--network", "clustertrain-testbed", "--ip", "10.89.42.20", IMAGE,
           "sleep", "infinity")  # fmt: skip
    script = (
        "rm -f /etc/debian_version /etc/lsb-release /usr/lib/os-release && "
        f"printf '%s' '{ROCKY_OS_RELEASE}' > /etc/os-release && "
        "echo 'Rocky Linux release 9.4 (Blue Onyx)' > /etc/redhat-release"
    )
    podman("exec", FAKE, "sh", "-c", script)
    yield FAKE
    podman("rm", "-f", FAKE, check=False)


def test_site_refuses_a_rhel_family_host_before_changing_any_host(rocky_host, tmp_path) -> None:
    inventory = tmp_path / "inventory"
    shutil.copytree(INVENTORY, inventory)
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    hosts["cluster"]["children"]["workers"]["hosts"][FAKE] = {
        "cluster_ip": "10.89.42.20",
        "cluster_accelerators": 0,
        "cluster_accelerator_model": "cpu",
        # No sshd in this stand-in OS: reached through podman (the bed's nodes are reached over SSH).
        "ansible_connection": "containers.podman.podman",
        "ansible_host": FAKE,
        "ansible_user": "root",
    }
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    # The bed's wheelhouse path is found relative to its own inventory dir; this copy has none, and
    # the run must stop before trainer_env anyway.
    (inventory / "group_vars" / "cluster" / "zz_os_test.yml").write_text("training_wheelhouse: ''\n")
    run = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), str(REPO / "site.yml")],
        capture_output=True,
        text=True,
        env={**ENV, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_FORCE_COLOR": "0"},
        cwd=REPO,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert f"host {FAKE}: Rocky 9.4 (RedHat family) is not supported" in out, out[-3000:]
    assert "Debian 12, Ubuntu 22.04 or Ubuntu 24.04" in out
    # The bed's own hosts pass the check and are not named.
    assert "host ct-head:" not in out and "host ct-worker1:" not in out
    # Nothing after the OS check ran: no later play started, no host changed.
    assert "PLAY [Training account" not in out, out[-3000:]
    assert "changed=0" in out and "changed=1" not in out
    assert podman("exec", FAKE, "getent", "passwd", "trainer", check=False).returncode != 0
