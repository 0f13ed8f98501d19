"""A real OpenSSH server for one test, reached with no network at all: ssh's ProxyCommand starts
`sshd -i` (inetd mode: one connection on stdin/stdout) for each connection. As root, sshd wants its
privilege separation user and /run/sshd, which this machine may lack: it runs in a mount namespace
of its own (unshare) where /etc/passwd has that user and /run is a fresh tmpfs, so nothing of the
machine changes. Keys, config and known_hosts live in the test's directory.

sshd is the one CLUSTERTRAIN_TEST_SSHD names, or OpenSSH's installed one (openssh-server), or else
unpacked from the openssh-server package apt keeps in its cache (dpkg-deb -x into the test's dir:
nothing installed, no daemon started; libwrap0's library alongside where that is missing too).
Without any, or without root, the tests that need it are skipped, saying why."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

#: Names the sshd to run where it is not on the usual paths.
SSHD_ENV = "CLUSTERTRAIN_TEST_SSHD"


#: Where apt keeps the packages it downloaded.
APT_ARCHIVES = Path("/var/cache/apt/archives")


def find_sshd(unpack_into: Path) -> str | None:
    given = os.environ.get(SSHD_ENV)
    if given:
        return given
    installed = shutil.which("sshd", path="/usr/sbin:/usr/local/sbin:" + os.environ.get("PATH", ""))
    if installed:
        return installed
    debs = sorted(APT_ARCHIVES.glob("openssh-server_*.deb"))
    if not debs or shutil.which("dpkg-deb") is None:
        return None
    root = unpack_into / "unpacked"
    for deb in [debs[-1], *sorted(APT_ARCHIVES.glob("libwrap0_*.deb"))[-1:]]:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    libraries = ":".join(sorted({str(lib.parent) for lib in root.rglob("lib*.so*")}))
    wrapper = unpack_into / "sshd"
    wrapper.write_text(
        f'#!/bin/sh\nexport LD_LIBRARY_PATH={shlex.quote(libraries)}\nexec {root / "usr/sbin/sshd"} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def local_sshd(root: Path, alias: str = "node0") -> dict[str, str]:
    """Inventory host variables that reach a fresh sshd (as root) under the name `alias`."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("runs sshd as root in a mount namespace of its own (needs root and unshare)")
    root.mkdir(parents=True)
    sshd = find_sshd(root)
    if sshd is None:
        pytest.skip(f"needs OpenSSH's sshd (openssh-server installed or in apt's cache, or {SSHD_ENV}=PATH)")
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
    )
    passwd = Path("/etc/passwd").read_text()
    if not any(line.startswith("sshd:") for line in passwd.splitlines()):
        passwd += "sshd:x:64999:65534::/run/sshd:/usr/sbin/nologin\n"
    (root / "passwd").write_text(passwd)
    passwd_file, config, sessions = (
        shlex.quote(str(root / name)) for name in ("passwd", "sshd_config", "sessions")
    )
    inner = (
        f"mount --bind {passwd_file} /etc/passwd && mount -t tmpfs -o mode=0755 tmpfs /run"
        f" && mkdir -m 0755 /run/sshd && exec {shlex.quote(sshd)} -i -f {config}"
    )
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
