"""OpenSSH's sshd for throwaway servers on this machine (scripts/testbed/netns_nodes.py's simulated nodes,
tests/helpers/local_sshd.py), found or unpacked without installing anything.

openssh-server is deliberately not in scripts/system-packages.txt (a controller needs no SSH server),
so a fresh machine may have none installed. Where the sshd comes from, the first found:

1. CLUSTERTRAIN_TEST_SSHD: an sshd binary, or an openssh-server .deb to unpack it from (this also
   keeps the installed sshd out of the way, to prove the unpacked one works);
2. the installed one: sshd on /usr/sbin, /usr/local/sbin or PATH;
3. the newest openssh-server .deb in apt's cache (/var/cache/apt/archives;
   `apt-get install --download-only openssh-server` puts it there and installs nothing).

A .deb is unpacked with `dpkg-deb -x` into the caller's directory: no maintainer script runs, no
daemon starts, nothing of the machine changes. What an unpacked sshd lacks at run time, and what
this module gives for it:

- libraries: Debian 12's sshd links libwrap.so.0 (package libwrap0, installed with openssh-server):
  a libwrap0 .deb beside the server's or in apt's cache is unpacked alongside, and `Sshd.path` is a
  wrapper that sets LD_LIBRARY_PATH to the unpacked libraries before it execs sshd;
- helper binaries: from OpenSSH 9.8 sshd runs `sshd-session` for each connection (from 10.0 also
  `sshd-auth`), by default from /usr/lib/openssh: `Sshd.config_lines` names the unpacked ones
  (SshdSessionPath, SshdAuthPath). An older sshd (9.2 in Debian 12) refuses those keywords, so they
  are given only where the unpacked tree has the helper;
- sftp: sftp-server comes in openssh-sftp-server, another package: without an installed one the
  config says `Subsystem sftp internal-sftp` (built into sshd);
- its privilege separation user `sshd` and the directory /run/sshd, which the package's
  post-install script makes: callers run sshd in a mount namespace of their own, with
  `passwd_with_privsep_user()` bound over /etc/passwd where the user is missing and a fresh tmpfs
  on /run holding /run/sshd.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Names the sshd to use (a binary, or an openssh-server .deb to unpack it from).
SSHD_ENV = "CLUSTERTRAIN_TEST_SSHD"
#: Where apt keeps the packages it downloaded.
APT_ARCHIVES = Path("/var/cache/apt/archives")
#: Where an installed sshd is looked for, before PATH.
INSTALLED_DIRS = ("/usr/sbin", "/usr/local/sbin")
#: OpenSSH's installed helpers (package openssh-sftp-server for sftp-server).
INSTALLED_SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")
#: sshd's privilege separation user, and the entry given where the machine lacks it (its home is
#: /run/sshd, the chroot sshd wants; uid from the range no package allocates; group nogroup).
PRIVSEP_USER = "sshd"
PRIVSEP_ENTRY = "sshd:x:64999:65534::/run/sshd:/usr/sbin/nologin\n"
#: The helpers an unpacked newer sshd must be told about: sshd_config keyword, file name.
HELPERS = (("SshdSessionPath", "sshd-session"), ("SshdAuthPath", "sshd-auth"))
#: What to do where no sshd is found: for skip and error messages.
FIX = (
    "fix: `apt-get install --download-only openssh-server` (puts the package in apt's cache, from "
    f"where it is unpacked; nothing is installed), or {SSHD_ENV}=PATH (an sshd binary or an "
    "openssh-server .deb), or apt-get install openssh-server"
)


@dataclass(frozen=True)
class Sshd:
    """An sshd ready to run: what to exec, and the sshd_config lines it needs besides the caller's."""

    #: The binary, or a wrapper script that execs it with its unpacked libraries.
    path: str
    config_lines: tuple[str, ...]
    #: The sshd binary itself (what /proc/PID/exe of the running daemon shows).
    binary: str


def locate(
    env: Mapping[str, str] = os.environ,
    installed_dirs: Sequence[str] = INSTALLED_DIRS,
    archives: Path = APT_ARCHIVES,
) -> Path | None:
    """The sshd binary, or the openssh-server .deb to unpack it from, in the order of the module's
    docstring; None where neither is here. Cheap (nothing unpacked): for skip reasons."""
    given = env.get(SSHD_ENV)
    if given:
        return Path(given)
    search = ":".join([*installed_dirs, env.get("PATH", "")])
    installed = shutil.which("sshd", path=search)
    if installed:
        return Path(installed)
    debs = sorted(archives.glob("openssh-server_*.deb"))
    if debs and shutil.which("dpkg-deb"):
        return debs[-1]
    return None


def missing(
    env: Mapping[str, str] = os.environ,
    installed_dirs: Sequence[str] = INSTALLED_DIRS,
    archives: Path = APT_ARCHIVES,
) -> str | None:
    """Why no sshd can run here, naming the fix; None where one is found."""
    found = locate(env, installed_dirs, archives)
    if found is None:
        return (
            f"needs OpenSSH's sshd: none installed ({', '.join([*installed_dirs, 'PATH'])}) and no "
            f"openssh-server .deb in {archives}; {FIX}"
        )
    if found.suffix == ".deb" and shutil.which("dpkg-deb") is None:
        return f"needs dpkg-deb to unpack sshd from {found}; {FIX}"
    if found.suffix != ".deb" and not os.access(found, os.X_OK):
        return f"{SSHD_ENV}={found} is not an executable sshd; {FIX}"
    return None


def prepare(source: Path, unpack_into: Path, archives: Path = APT_ARCHIVES) -> Sshd:
    """An Sshd from `locate()`'s answer: a binary as it is; a .deb unpacked under `unpack_into`."""
    if source.suffix != ".deb":
        return Sshd(str(source), (f"Subsystem sftp {_sftp_server(None)}",), str(source))
    root = unpack_into / "unpacked"
    libwrap = sorted(source.parent.glob("libwrap0_*.deb")) or sorted(archives.glob("libwrap0_*.deb"))
    for deb in [source, *libwrap[-1:]]:
        done = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"dpkg-deb -x {deb} failed: {done.stderr.strip()[-300:]}")
    binary = root / "usr" / "sbin" / "sshd"
    if not binary.is_file():
        raise OSError(f"{source} holds no usr/sbin/sshd: not an openssh-server package")
    config = [
        f"{keyword} {root / 'usr/lib/openssh' / name}"
        for keyword, name in HELPERS
        if (root / "usr/lib/openssh" / name).is_file()
    ]
    config.append(f"Subsystem sftp {_sftp_server(root)}")
    libraries = ":".join(sorted({str(lib.parent) for lib in root.rglob("lib*.so*")}))
    if not libraries:
        return Sshd(str(binary), tuple(config), str(binary))
    wrapper = unpack_into / "sshd"
    wrapper.write_text(
        f'#!/bin/sh\nexport LD_LIBRARY_PATH={shlex.quote(libraries)}\nexec {shlex.quote(str(binary))} "$@"\n'
    )
    wrapper.chmod(0o755)
    return Sshd(str(wrapper), tuple(config), str(binary))


def find(unpack_into: Path, env: Mapping[str, str] = os.environ) -> Sshd | None:
    """The sshd to run (unpacked under `unpack_into` where it comes from a .deb), or None."""
    source = locate(env)
    if source is None:
        return None
    unpack_into.mkdir(parents=True, exist_ok=True)
    return prepare(source, unpack_into)


def _sftp_server(unpacked: Path | None) -> str:
    candidates = [INSTALLED_SFTP_SERVER] if unpacked is None else [unpacked / "usr/lib/openssh/sftp-server"]
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return "internal-sftp"


def passwd_with_privsep_user(passwd: str | None = None) -> str | None:
    """/etc/passwd's text with sshd's privilege separation user added, to bind over /etc/passwd in
    sshd's mount namespace; None where the machine has the user (nothing to bind)."""
    if passwd is None:
        passwd = Path("/etc/passwd").read_text()
    if any(line.split(":", 1)[0] == PRIVSEP_USER for line in passwd.splitlines()):
        return None
    return passwd + ("" if passwd.endswith("\n") or not passwd else "\n") + PRIVSEP_ENTRY
