"""Copy a local file or directory to one inventory host with rsync, as that host's training account.

Why rsync itself and not Ansible's `ansible.posix.synchronize`: the module runs the same rsync with
the same `sudo -u USER rsync` on the far side (passwordless sudo only, as here), but Ansible reports a
task when it ends, so a copy of several GB would show nothing for minutes. Run directly, rsync's own
progress reaches the user as it goes; the connection is built from the host's inventory variables as
Ansible's ssh connection builds it (ansible_host, ansible_port, ansible_user, the private key, the
ssh args), so the same pinned host keys apply. Host key checking is never turned off here, and
BatchMode keeps ssh from stopping at a prompt.

Resumable: `--partial-dir` keeps a half-copied file in a hidden dir beside its destination (never
under its final name, where a trainer could load half a weights file); the next copy starts from it.
Checked: afterwards `rsync --checksum --dry-run` compares a checksum of every file's content on both
sides (xxh128 or MD5, as the two rsyncs agree) and must find nothing left to copy.
"""

from __future__ import annotations

import getpass
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from trainer.controller.inventory import Host

#: Where rsync keeps a file it did not finish, relative to the file's destination dir. rsync leaves
#: this dir out of what it copies and deletes by itself.
PARTIAL_DIR = ".push-partial"
#: Seconds between two progress lines when the output is not a terminal (a log, a test).
PROGRESS_EVERY_S = 5.0
#: How long an interrupted copy waits for the last rsync process (the one keeping the partial file).
GROUP_EXIT_TIMEOUT_S = 30.0
#: The connections this copy knows how to make; others are refused before anything runs.
SSH, LOCAL = "ssh", "local"

#: rsync's --info=progress2 line: bytes so far, percent, rate, time left.
PROGRESS = re.compile(r"^\s*([\d,.]+\w?)\s+(\d+)%\s+(\S+/s)\s+(\d+:\d\d:\d\d)")
#: The --stats lines read back (values in bytes or counts, with rsync's thousands separators).
STATS = {
    "files": re.compile(r"^Number of regular files transferred: ([\d,]+)", re.M),
    "total_size": re.compile(r"^Total file size: ([\d,]+)", re.M),
    "sent_size": re.compile(r"^Total transferred file size: ([\d,]+)", re.M),
    "literal": re.compile(r"^Literal data: ([\d,]+)", re.M),
    "matched": re.compile(r"^Matched data: ([\d,]+)", re.M),
}

#: What rsync or ssh says when something outside this tool is wrong -> the fix to print with it.
KNOWN_FAILURES = (
    (
        re.compile(r"Host key verification failed|REMOTE HOST IDENTIFICATION HAS CHANGED"),
        "the head's SSH host key is not the one this controller knows: pin it as for Ansible (the "
        "UserKnownHostsFile in ansible_ssh_common_args, or ~/.ssh/known_hosts after checking its "
        "fingerprint); host key checking is never turned off",
    ),
    (
        re.compile(r"Permission denied \((publickey|password)"),
        "the head refused the login: check ansible_user and ansible_ssh_private_key_file (the login "
        "Ansible uses)",
    ),
    (
        re.compile(r"a (terminal|password) is required|sudo: .*password"),
        "the login account needs passwordless sudo to the training account on the head (push runs rsync "
        "there as `sudo -n -u TRAINING_USER rsync`), or log in as the training account (ansible_user)",
    ),
    (
        re.compile(r"rsync: (command )?not found|rsync: No such file or directory"),
        "rsync is not installed on the head: install it there (apt-get install rsync)",
    ),
    (
        re.compile(r"(mkdir|open|rename|mkstemp) .*Permission denied"),
        "the training account cannot write there: the shared dir must belong to it (site.yml's users "
        "role sets that up); check cluster_shared_dir and cluster_training_user",
    ),
    (
        re.compile(r"Could not resolve hostname|Connection (refused|timed out)|No route to host"),
        "the head does not answer over SSH: check ansible_host and ansible_port, and that it is up",
    ),
)


class CopyError(Exception):
    """A copy that cannot be made or did not complete; the message names the cause and the fix."""


@dataclass(frozen=True)
class Target:
    """How to reach a host's file system as its training account."""

    host: str
    connection: str
    address: str
    login_user: str
    training_user: str
    ssh_command: tuple[str, ...] = ()

    @property
    def as_training_user(self) -> tuple[str, ...]:
        """What runs rsync on the far side as the training account (nothing when already it)."""
        if self.login_user == self.training_user:
            return ()
        # -n: fail at once, never wait on a password prompt that nobody can answer.
        return ("sudo", "-n", "-u", self.training_user, "--")

    def destination(self, path: str) -> str:
        if self.connection == LOCAL:
            return path
        address = f"[{self.address}]" if ":" in self.address else self.address
        return f"{address}:{path}"

    def rsync_base(self) -> list[str]:
        """The rsync command line up to its options: local (maybe under sudo) or over ssh."""
        if self.connection == LOCAL:
            return [*self.as_training_user, "rsync"]
        # rsync splits -e and --rsync-path itself, honouring quotes: each part quoted.
        base = ["rsync", "-e", " ".join(shlex.quote(part) for part in self.ssh_command)]
        if self.as_training_user:
            remote = " ".join(shlex.quote(part) for part in (*self.as_training_user, "rsync"))
            base.append(f"--rsync-path={remote}")
        return base


def target_for(host: Host, training_user: str) -> Target:
    """The host's connection, read from its inventory variables; CopyError for one this copy cannot
    use (before anything runs)."""
    connection = str(host.get("ansible_connection") or SSH)
    if connection in ("smart", "paramiko", "ssh", "paramiko_ssh"):
        connection = SSH
    if connection not in (SSH, LOCAL):
        raise CopyError(
            f"host {host.name} is reached with ansible_connection={connection}; push copies over ssh (or "
            "locally with ansible_connection=local): give the head an ssh connection in the inventory"
        )
    if connection == LOCAL:
        return Target(host.name, LOCAL, "", getpass.getuser(), training_user)
    address = str(host.get("ansible_host") or host.name)
    user = str(host.get("ansible_user") or host.get("ansible_ssh_user") or getpass.getuser())
    ssh = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15", "-o", "ServerAliveInterval=15"]
    port = host.get("ansible_port") or host.get("ansible_ssh_port")
    if port:
        ssh += ["-p", str(port)]
    ssh += ["-l", user]
    key = host.get("ansible_ssh_private_key_file") or host.get("ansible_private_key_file")
    if key:
        ssh += ["-i", str(key)]
    for name in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        ssh += shlex.split(str(host.get(name) or ""))
    return Target(host.name, SSH, address, user, training_user, tuple(ssh))


@dataclass
class CopyStats:
    """What one rsync run moved (--stats), in bytes and files."""

    files: int = 0
    total_size: int = 0
    sent_size: int = 0
    literal: int = 0
    matched: int = 0

    @classmethod
    def parse(cls, text: str) -> CopyStats:
        values = {}
        for name, pattern in STATS.items():
            match = pattern.search(text)
            values[name] = int(match[1].replace(",", "")) if match else 0
        return cls(**values)


@dataclass
class Difference:
    """What the checksum pass found: files whose content differs or is missing there, and files
    there that the source has not."""

    differ: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)


def _options(delete: bool) -> list[str]:
    # -r and --links: the tree as it is; --copy-unsafe-links: a link that points outside it (a Hugging
    # Face cache snapshot's links into ../../blobs) becomes the file it points to, which the far side
    # could not reach. trainer push refuses every other link leading outside first
    # (push.links_leading_outside): the copy reads what a link points to as the operator.
    options = ["--recursive", "--links", "--copy-unsafe-links", f"--partial-dir={PARTIAL_DIR}"]
    return [*options, "--delete"] if delete else options


def copy(
    target: Target,
    source: str,
    destination: str,
    *,
    delete: bool = False,
    bwlimit_kib: int = 0,
    progress: Callable[[str], None] | None = None,
) -> CopyStats:
    """rsync `source` (a dir ending in '/' copies its contents) to `destination` on the target, with
    progress lines to `progress`; the stats, or CopyError with the cause and the fix. On Ctrl-C (or TERM
    or HUP turned into KeyboardInterrupt by the caller) rsync is stopped, and KeyboardInterrupt raised
    once every local rsync process has ended (a local copy has kept its partial file by then; over ssh
    the far side keeps it when the connection closes)."""
    command = [
        *target.rsync_base(),
        *_options(delete),
        "--times",
        "--perms",
        # The shared dir's own policy (2770, the training group): the group reads, nobody else does;
        # setgid dirs keep new files in the training group.
        "--chmod=u+rwX,g+rX,g-w,o-rwx,Dg+s",
        # Missing dirs above the destination (models/, datasets/) are made, as the training account.
        "--mkpath",
        "--info=progress2",
        "--no-inc-recursive",  # the whole file list first: the percentage is of everything
        "--stats",
        *([f"--bwlimit={bwlimit_kib}"] if bwlimit_kib else []),
        source,
        target.destination(destination),
    ]
    show = progress or (lambda line: None)
    # rsync in a process group of its own: a Ctrl-C at the terminal reaches this process only, and
    # rsync is then asked to stop once, at its top (below). When every rsync process got the terminal's
    # SIGINT as well, their clean-ups raced; and its first process can end before the one that holds
    # the half-copied file has moved it to the partial dir, so the group is waited for as a whole.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0)
    assert process.stdout is not None and process.stderr is not None
    try:
        output = _follow(process.stdout, show)
        errors = process.stderr.read().decode(errors="replace")
        code = process.wait()
    except KeyboardInterrupt:
        # Ctrl-C, TERM or HUP to this process: rsync is asked to stop the way Ctrl-C asks, so that it
        # keeps the partial file for the next copy.
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        process.wait()
        _wait_for_group(process.pid)
        raise
    if code == 20:  # rsync: "received SIGUSR1 or SIGINT"
        _wait_for_group(process.pid)
        raise KeyboardInterrupt
    if code != 0:
        raise CopyError(describe_failure(code, errors))
    return CopyStats.parse(output)


def _wait_for_group(pgid: int, timeout_s: float = GROUP_EXIT_TIMEOUT_S) -> None:
    """Wait until no process is left in rsync's process group (its receiver moving the partial file
    into place), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:  # the training account's rsync under sudo: still there
            pass
        time.sleep(0.05)


def compare(target: Target, source: str, destination: str) -> Difference:
    """Checksum every file on both sides (rsync --checksum --dry-run): what would still be copied
    (content differs or missing there) and what is there but not here."""
    command = [
        *target.rsync_base(),
        *_options(delete=True),
        "--checksum",
        "--dry-run",
        "--itemize-changes",
        source,
        target.destination(destination),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise CopyError(f"the checksum check did not run: {describe_failure(done.returncode, done.stderr)}")
    found = Difference()
    for line in done.stdout.splitlines():
        flags, _, name = line.partition(" ")
        if flags == "*deleting":
            found.extra.append(name.strip())
        elif flags[:1] in ("<", ">", "c") and flags[1:2] in ("f", "L", "d"):
            found.differ.append(name.strip())
    return found


def describe_failure(code: int, errors: str) -> str:
    """rsync's own words (the last lines) and, where they name a known cause, the fix."""
    lines = [line.strip() for line in errors.splitlines() if line.strip()]
    said = "; ".join(lines[-4:]) or "no message"
    for pattern, fix in KNOWN_FAILURES:
        if pattern.search(errors):
            return f"rsync failed (exit {code}): {said}; fix: {fix}"
    return f"rsync failed (exit {code}): {said}"


def _follow(stream: IO[bytes], show: Callable[[str], None]) -> str:
    """Read rsync's stdout to its end: progress lines (ended by '\\r') go to `show`, rate-limited when
    the output is not a terminal; the rest (the stats) is returned."""
    kept: list[str] = []
    buffer = b""
    tty = sys.stderr.isatty()
    last_shown, last_percent = 0.0, ""
    while chunk := stream.read1(4096):  # type: ignore[attr-defined]
        buffer += chunk
        *parts, buffer = re.split(rb"[\r\n]", buffer)
        for raw in parts:
            line = raw.decode(errors="replace")
            match = PROGRESS.match(line)
            if not match:
                if line.strip():
                    kept.append(line)
                continue
            now = time.monotonic()
            if match[2] == last_percent and not tty:
                continue
            if tty or match[2] == "100" or now - last_shown >= PROGRESS_EVERY_S:
                last_shown, last_percent = now, match[2]
                show(f"{match[2]:>3}% copied, {match[3]}, {match[4]} left")
    kept.append(buffer.decode(errors="replace"))
    return "\n".join(kept)


def human_size(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size} B"  # unreachable


def describe(stats: CopyStats) -> str:
    """One line on what was copied: new bytes sent, bytes already there (a resumed or repeated copy)."""
    if not stats.files:
        return "nothing to copy: every file is already there"
    text = f"copied {stats.files} file{'s' if stats.files != 1 else ''} ({human_size(stats.sent_size)})"
    if stats.matched:
        text += (
            f": {human_size(stats.literal)} sent, {human_size(stats.matched)} already there (resumed from a "
            "partial or older copy)"
        )
    return text
