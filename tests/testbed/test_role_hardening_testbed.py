"""Root never follows a path the training user controls, on the Molecule test bed.

The training user owns its home, so it can replace `~/.ssh` with a symbolic link to a directory only
root may write (here a fresh root-owned directory standing for /root/.ssh or a directory on sudo's
secure_path). The next provisioning must not chown that directory to the training user nor write
the cluster key into it. What a user notices: site.yml (from the users role) and `--tags ssh_trust`
alone (from ssh_trust's own check) stop naming the host and the link, and the target is as it was:
root's, mode 0755, empty. The link is planted with `podman exec` on ct-worker1 (the worker reached
as an unprivileged account with sudo) and the real `~/.ssh` is put back afterwards.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.bed_launch import BED_UP, ENV, INVENTORY, group_vars

REPO = Path(__file__).resolve().parents[2]
HOST = "ct-worker1"
TARGET = "/opt/clustertrain-planted-target"

pytestmark = [pytest.mark.slow, BED_UP]


def on_host(script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", "exec", HOST, "sh", "-euc", script],
        capture_output=True, text=True, env=ENV, check=check, timeout=120,
    )  # fmt: skip


@pytest.fixture
def planted_ssh_link():
    """~trainer/.ssh on HOST made a link to a root-owned directory; the real one restored after."""
    home = f"/home/{group_vars()['cluster_training_user']}"
    user = group_vars()["cluster_training_user"]
    on_host(
        f"test -d {home}/.ssh && test ! -L {home}/.ssh && test ! -e {home}/.ssh.bed-backup"
        f" && mkdir -m 0755 {TARGET} && mv {home}/.ssh {home}/.ssh.bed-backup"
        f" && ln -s {TARGET} {home}/.ssh && chown -h {user}:{user} {home}/.ssh"
    )
    try:
        yield f"{home}/.ssh"
    finally:
        on_host(f"rm -f {home}/.ssh && mv {home}/.ssh.bed-backup {home}/.ssh && rm -rf {TARGET}")


def target_state() -> str:
    return on_host(f"stat -c '%u:%g %a' {TARGET}; ls -A {TARGET}").stdout


def site(*args: str) -> str:
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            str(INVENTORY),
            str(REPO / "site.yml"),
            *args,
        ],
        capture_output=True,
        text=True,
        env={**ENV, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_NOCOLOR": "1"},
        cwd=REPO,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    return " ".join(out.split())


def test_a_symlinked_ssh_dir_is_refused_by_converge_and_by_ssh_trust_alone(planted_ssh_link):
    before = target_state()
    assert before.splitlines() == ["0:0 755"], before

    refusal = f'host {HOST}: {planted_ssh_link} is a symbolic link (to "{TARGET}")'
    # The users play stops the run; any_errors_fatal stops every host with it.
    out = site("--tags", "users,ssh_trust")
    assert refusal in out, out[-3000:]
    assert "Nothing was changed on this host" in out
    assert "PLAY [SSH trust" not in out, "the run stops in the users play"
    assert target_state() == before, "the link's target is still root's, 0755 and empty"

    # ssh_trust alone runs the same check before changing anything.
    out = site("--tags", "ssh_trust")
    assert refusal in out, out[-3000:]
    assert "Install the cluster key pair" not in out
    assert target_state() == before
