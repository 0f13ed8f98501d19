"""Simulated nodes (scripts/testbed/netns_nodes.py) on a machine without openssh-server installed: their
sshd is unpacked from the package in apt's cache (scripts/testbed/sshd_finder.py), and the launcher
reaches every node through it, becoming the training user, as on an installed one.

The fresh machine is this one seen from a private mount namespace: a copy of /etc without sshd's
privilege separation user bound over /etc, and /dev/null over the installed sshd (nothing of the
machine changes; the namespace ends with the test). Needs root, `ip netns`, unshare, and an
openssh-server .deb in apt's cache."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.local_sshd import sshd_finder
from helpers.simulated_nodes import NEEDS_NETNS, netns_nodes

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python")


def _cached_server_deb() -> Path:
    debs = sorted(sshd_finder.APT_ARCHIVES.glob("openssh-server_*.deb"))
    if not debs or shutil.which("dpkg-deb") is None or shutil.which("unshare") is None:
        pytest.skip(
            f"needs an openssh-server .deb in {sshd_finder.APT_ARCHIVES}, dpkg-deb and unshare; "
            "fix: `apt-get install --download-only openssh-server` (installs nothing)"
        )
    return debs[-1]


@NEEDS_NETNS
def test_nodes_run_an_sshd_unpacked_from_apt_s_cache_on_a_machine_without_one(sim_workdir):
    _cached_server_deb()
    etc = sim_workdir / "etc"
    shutil.copytree("/etc", etc, symlinks=True)
    for name in ("passwd", "shadow"):
        table = etc / name
        if table.exists():
            kept = [
                line for line in table.read_text().splitlines(keepends=True) if not line.startswith("sshd:")
            ]
            table.write_text("".join(kept))
    installed = [
        path
        for path in (shutil.which("sshd", path=d) for d in sshd_finder.INSTALLED_DIRS)
        if path is not None
    ]
    sim = sim_workdir / "sim"
    netns = [PYTHON, str(REPO / "scripts" / "testbed" / "netns_nodes.py")]
    q = shlex.quote
    script = "\n".join(
        [
            "set -e",
            f"trap {q(shlex.join([*netns, 'down', str(sim)]))} EXIT",
            f"mount --bind {q(str(etc))} /etc",
            *(f"mount --bind /dev/null {q(path)}" for path in installed),
            'echo "privsep user: $(getent passwd sshd || echo none)"',
            shlex.join([*netns, "up", "3", str(sim)]),
            f"for pid in $(cat {q(str(sim))}/nodes/*/sshd.pid); do",
            '  echo "sshd: $(readlink /proc/$pid/exe)"',
            "done",
            shlex.join(
                [PYTHON, "-m", "trainer", "launch", "-i", str(sim / "inventory"), "--", "sh", "-c", "id -un"]
            ),
        ]
    )
    env = {k: v for k, v in os.environ.items() if k != sshd_finder.SSHD_ENV}
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=REPO,
        )
    finally:
        netns_nodes.down(sim)  # a no-op unless the namespace's own clean-up was cut short
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "privsep user: none" in out, "the namespace showed a machine without sshd's user"
    running = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("sshd: ")]
    assert running == [str(sim / "sshd" / "unpacked" / "usr" / "sbin" / "sshd")] * 3, out[-3000:]
    assert "finished on all 3 node(s)" in out, out[-3000:]
    slot = out.split("(slot ", 1)[1].split(")", 1)[0]
    assert f"ctsim{slot}" in out.splitlines(), "rank 0's `id -un`: the node's training user"
