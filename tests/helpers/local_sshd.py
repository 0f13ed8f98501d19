"""A real OpenSSH server for one test, reached with no network at all: ssh's ProxyCommand starts
`sshd -i` (inetd mode: one connection on stdin/stdout) for each connection. As root, sshd wants its
privilege separation user and /run/sshd, which this machine may lack: it runs in a mount namespace
of its own (unshare) where /etc/passwd has that user and /run is a fresh tmpfs, so nothing of the
machine changes. Keys, config and known_hosts live in the test's directory.

The sshd is found by scripts/testbed/sshd_finder.py (shared with the simulated nodes of
scripts/testbed/netns_nodes.py): the one CLUSTERTRAIN_TEST_SSHD names, or OpenSSH's installed one,
or else unpacked from the openssh-server package apt keeps in its cache (dpkg-deb -x into the test's
dir: nothing installed, no daemon started). Without any, or without root, the tests that need it are
skipped, saying why and what to do."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _sshd_finder():
    """scripts/testbed/sshd_finder.py, loaded by path (scripts/ is no package) under the name
    netns_nodes gives it, so both use one module."""
    if "sshd_finder" not in sys.modules:
        path = REPO / "scripts" / "testbed" / "sshd_finder.py"
        spec = importlib.util.spec_from_file_location("sshd_finder", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["sshd_finder"] = module
        spec.loader.exec_module(module)
    return sys.modules["sshd_finder"]


sshd_finder = _sshd_finder()


def local_sshd(root: Path, alias: str = "node0") -> dict[str, str]:
    """Inventory host variables that reach a fresh sshd (as root) under the name `alias`."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("runs sshd as root in a mount namespace of its own (needs root and unshare)")
    root.mkdir(parents=True)
    missing = sshd_finder.missing()
    if missing:
        pytest.skip(missing)
    sshd = sshd_finder.find(root / "sshd")
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    host_key = (root / "host_key.pub").read_text().split()
    (root / "known_hosts").write_text(f"{alias} {host_key[0]} {host_key[1]}\n")
    (root / "sshd_config").write_text(
        f"HostKey {root / 'host_key'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\n"
        "StrictModes no\nUsePAM no\nPidFile none\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        + "".join(f"{line}\n" for line in sshd.config_lines)
    )
    config, sessions = (shlex.quote(str(root / name)) for name in ("sshd_config", "sessions"))
    inner = "mount -t tmpfs -o mode=0755 tmpfs /run && mkdir -m 0755 /run/sshd"
    passwd = sshd_finder.passwd_with_privsep_user()
    if passwd is not None:  # a machine that never installed openssh-server lacks sshd's user
        (root / "passwd").write_text(passwd)
        inner = f"mount --bind {shlex.quote(str(root / 'passwd'))} /etc/passwd && {inner}"
    inner += f" && exec {shlex.quote(sshd.path)} -i -f {config}"
    # Each connection's pid, kept through the execs: the sshd serving it (sshd_sessions).
    (root / "sessions").mkdir()
    proxy = root / "proxy.sh"
    proxy.write_text(f"#!/bin/sh\ntouch {sessions}/$$\nexec unshare --mount sh -c {shlex.quote(inner)}\n")
    proxy.chmod(0o755)
    return {
        "ansible_connection": "ssh",
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(root / "client_key"),
        "ansible_ssh_common_args": (
            f"-o ProxyCommand={proxy} -o UserKnownHostsFile={root / 'known_hosts'} -o IdentitiesOnly=yes"
        ),
    }


def sshd_sessions(root: Path) -> list[int]:
    """The connections to the sshd set up in `root` still open: the pids of the sshd serving them."""
    alive = []
    for entry in (root / "sessions").iterdir():
        try:
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(int(entry.name))
    return alive


def ssh_masters() -> dict[int, str]:
    """Every SSH master of this machine (`ssh: SOCKET [mux]`, the title ssh gives one): for messages."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ssh: ") and title.endswith("[mux]"):
            found[int(proc.name)] = title
    return found
