"""Whole nodes of the Molecule test bed lost and brought back: a container killed (`podman kill`: every
process on the node gone at once, as when a spot instance is reclaimed or a machine loses power) and
started again, then waited on until it is a node the launcher can use.

Imported by the bed tests (`from helpers.testbed_nodes import ...`) and by bench/node_loss.py; it imports no
test module.

What a restart of a container needs, measured on the bed (podman 4.3, runc, the Debian 12 image, after
converge): nothing but `podman start`. The container keeps its filesystem, so everything the roles
wrote is still there (ct-worker2's sshd port in sshd_config.d, the host keys pinned on the controller
and in the nodes' known_hosts, ufw's rules, chrony's drop-in and sources, the training account, the
venv, the DeepSpeed ops built ahead), and every service the roles enable starts with systemd: ssh,
chrony, ufw, rpcbind (and nfs-ganesha on the head). It gets its address again, and the bind-mounted
shared dir. What takes a moment: systemd's boot, sshd's start, and chronyd's first exchange with the
head (synchronised again 2.9 to 4.9 s after `podman start`, load 4 to 12). `trainer preflight
--skip deepspeed bandwidth` passes on the restarted bed with no other step. `restore_node` checks each
of these rather than assuming them, and names what is missing. A killed node's processes are gone with
it, so no trainer of an earlier launch runs there afterwards; its node dir on the shared dir keeps
that launch's files.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "molecule" / "default" / "inventory"
#: The controller's key and the bed's pinned host keys (molecule/default/access.sh, prepare.yml).
ACCESS = Path("/var/tmp/clustertrain-testbed/access")
ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "scripts" / "testbed" / "containers.conf")}
HEAD = "ct-head"
STATUS = Path("/tmp/clustertrain-testbed.status")
PLAYBOOK = str(Path(sys.executable).parent / "ansible-playbook")
#: A host's line of ansible-playbook's recap.
RECAP = re.compile(r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)
#: The converged check's verdict when the roles run (its debug message, one line in the json format).
VERDICT = re.compile(r'"msg": "(Every role[^"]*)"')
#: The marks of a test-bed test module: `pytestmark = BED_TEST` (tests/testbed/conftest.py adds `testbed`).
BED_TEST = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (STATUS.exists() and STATUS.read_text().startswith("up")),
        reason="the Molecule test bed is not up (/tmp/clustertrain-testbed.status)",
    ),
]


def _inventory() -> tuple[dict[str, dict], dict]:
    """(every host's variables, the cluster group's variables) of the bed's inventory."""
    tree = yaml.safe_load((INVENTORY / "hosts.yml").read_text())["cluster"]
    hosts = {
        name: variables
        for group in tree["children"].values()
        for name, variables in (group.get("hosts") or {}).items()
    }
    return hosts, cluster_settings(INVENTORY)


def cluster_settings(inventory: Path) -> dict:
    """The cluster group's variables of an inventory dir: its group_vars/cluster files merged in name
    order, as Ansible reads them."""
    settings: dict = {}
    for path in sorted((inventory / "group_vars" / "cluster").glob("*.yml")):
        settings.update(yaml.safe_load(path.read_text()) or {})
    return settings


def bed_shared_dir() -> Path:
    """The bed's shared dir, as its inventory's cluster group_vars name it."""
    return Path(cluster_settings(INVENTORY)["cluster_shared_dir"])


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, env=ENV, timeout=timeout, check=check
    )


def running(host: str) -> bool:
    done = podman("inspect", "--format", "{{.State.Running}}", host, check=False)
    return done.returncode == 0 and done.stdout.strip() == "true"


# ---------------------------------------------------------------------------------------------
# A launcher's output, read as it comes


@dataclass(frozen=True)
class Line:
    text: str
    at: float  # time.monotonic() when it was read


@dataclass
class LauncherOutput:
    """The output of a `trainer launch` (stdout and stderr together), read on a thread so that a test
    can wait for a line with a timeout while the launcher runs. Each line keeps the time it was read."""

    proc: subprocess.Popen
    lines: list[Line] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _ended: bool = False

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def start(cls, command: list[str]) -> LauncherOutput:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        return cls(proc)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for text in self.proc.stdout:
            with self._changed:
                self.lines.append(Line(text.rstrip("\n"), time.monotonic()))
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float, since: int = 0) -> tuple[int, Line] | None:
        """The first line from index `since` on that matches `pattern` (re.search), with its index;
        None when the output ended, or `timeout` seconds passed, without one."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        start = since
        with self._changed:
            while True:
                for index in range(start, len(self.lines)):
                    if regex.search(self.lines[index].text):
                        return index, self.lines[index]
                start = max(start, len(self.lines))
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    return None
                self._changed.wait(min(left, 1.0))

    def finish(self, timeout: float) -> int | None:
        """The launcher's exit code; past `timeout` it gets TERM (it then stops the bed's trainers
        itself) and None is returned."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(180)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            code = None
        with self._changed:  # the reader thread has the last lines once the pipe closes
            self._changed.wait_for(lambda: self._ended, timeout=30)
        return code

    def text(self) -> str:
        with self._changed:
            return "\n".join(line.text for line in self.lines)


# ---------------------------------------------------------------------------------------------
# A node lost and brought back


def kill_node(host: str = "ct-worker2") -> float:
    """Kill the host's container (SIGKILL to every process in it, its network gone with it) and wait
    until podman says it has stopped. Returns the time.monotonic() at which the kill was issued: a
    launcher may see the node go before `podman kill` returns."""
    killed_at = time.monotonic()
    podman("kill", host, timeout=120)
    deadline = time.monotonic() + 60
    while running(host):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{host} still runs 60 s after podman kill")
        time.sleep(0.2)
    return killed_at


def wait_until_seen_lost(output: LauncherOutput, host: str, timeout: float = 180, since: int = 0) -> Line:
    """The launcher's first line that says the host is unreachable or lost (its state line, or the
    failure that names it), read after line `since`."""
    pattern = rf"\[{re.escape(host)}\] node \d+: (unreachable|lost)|{re.escape(host)}\b.* (was )?lost\b"
    found = output.wait_for(pattern, timeout, since=since)
    if found is None:
        raise AssertionError(f"the launcher never said {host} was lost:\n{output.text()[-4000:]}")
    return found[1]


def _ssh(host: str, *command: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """The command on the host over SSH, as Ansible reaches it: the login account and port of the
    inventory, the controller's key, the host key pinned in the bed's known_hosts."""
    hosts, _ = _inventory()
    variables = hosts[host]
    return subprocess.run(
        [
            "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={ACCESS / 'known_hosts'}",
            "-o", "ControlMaster=no", "-o", "ControlPath=none",
            "-i", str(ACCESS / "id_ed25519"), "-p", str(variables.get("ansible_port", 22)),
            f"{variables.get('ansible_user', 'root')}@{variables['ansible_host']}", *command,
        ],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _until(what: str, check, timeout: float, interval: float = 1.0) -> None:
    """Call check() until it returns True; past the deadline raise, with the last thing it said."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            result = check()
        except (subprocess.SubprocessError, OSError) as error:
            result = error
        if result is True:
            return
        last = result
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s (last: {last})")
        time.sleep(interval)


def _systemd_up(host: str):
    done = podman("exec", host, "systemctl", "is-system-running", check=False, timeout=30)
    state = done.stdout.strip()
    if state == "running":
        return True
    if state == "degraded":
        failed = podman("exec", host, "systemctl", "--failed", "--no-legend", "--plain", check=False)
        return f"degraded: {failed.stdout.strip()}"
    return state or done.stderr.strip()


def _sshd_answers(host: str):
    done = _ssh(host, "true")
    return True if done.returncode == 0 else (done.stderr.strip() or f"ssh exit {done.returncode}")


def _shared_dir_seen(host: str, shared: str):
    """A file written on the controller's side of the bind mount is read back in the container."""
    marker = Path(shared) / f".node-check-{host}-{uuid.uuid4().hex[:8]}"
    marker.write_text(host)
    try:
        done = podman("exec", host, "cat", str(marker), check=False, timeout=30)
        return True if done.stdout == host else (done.stderr.strip() or "not visible")
    finally:
        marker.unlink(missing_ok=True)


#: Services the roles enable, per host: all nodes, and the head's NFS server (the bed's backend).
SERVICES = ("ssh", "chrony")
HEAD_SERVICES = ("nfs-ganesha",)


def _services_active(host: str):
    names = [*SERVICES, *(HEAD_SERVICES if host == HEAD else ())]
    done = podman("exec", host, "systemctl", "is-active", *names, check=False, timeout=30)
    states = dict(zip(names, done.stdout.split(), strict=False))
    inactive = [f"{name} {states.get(name, '?')}" for name in names if states.get(name) != "active"]
    return True if not inactive else ", ".join(inactive)


def _ufw_active(host: str):
    done = podman("exec", host, "ufw", "status", check=False, timeout=30)
    return True if "Status: active" in done.stdout else (done.stdout.strip() or done.stderr.strip())


def _clock_synced(host: str):
    """chronyd runs and follows a source (the head, for a worker): `chronyc -n tracking` says so."""
    done = podman("exec", host, "chronyc", "-n", "tracking", check=False, timeout=30)
    if done.returncode != 0:
        return done.stderr.strip() or f"chronyc exit {done.returncode}"
    fields = {}
    for line in done.stdout.splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    leap = fields.get("Leap status", "")
    return True if leap == "Normal" else f"leap status {leap or '?'}"


def restore_node(host: str = "ct-worker2", timeout: float = 300) -> dict[str, float]:
    """Start the host's container again (unless it runs) and wait until it is a usable node: systemd
    up (not degraded), the roles' services active, sshd answering the controller as the inventory
    reaches it, the shared dir visible, ufw enforcing, chronyd synchronised. Returns the seconds from
    `podman start` to each. Raises, naming what is missing, when a part is not back within `timeout`
    seconds in all."""
    _, settings = _inventory()
    started = time.monotonic()
    if not running(host):
        podman("start", host, timeout=120)
    seconds = {"podman start": time.monotonic() - started}
    checks = [
        ("systemd running", lambda: _systemd_up(host)),
        ("services active", lambda: _services_active(host)),
        ("sshd answers", lambda: _sshd_answers(host)),
        ("shared dir visible", lambda: _shared_dir_seen(host, settings["cluster_shared_dir"])),
        ("ufw active", lambda: _ufw_active(host)),
        ("clock synchronised", lambda: _clock_synced(host)),
    ]
    for what, check in checks:
        _until(f"{host}: {what}", check, timeout=max(1.0, started + timeout - time.monotonic()))
        seconds[what] = time.monotonic() - started
    return seconds


@contextlib.contextmanager
def lost_node(host: str = "ct-worker2", restore_timeout: float = 300) -> Iterator[float]:
    """Kill the host's container for the block (which gets the kill's time.monotonic()), and bring
    it back afterwards, whatever the block did, so that the bed is whole for the next test."""
    try:
        yield kill_node(host)
    finally:
        restore_node(host, timeout=restore_timeout)


def node_usable(host: str) -> bool:
    """Whether the host's container runs and every check of restore_node passes now."""
    if not running(host):
        return False
    try:
        restore_node(host, timeout=0)
    except RuntimeError:
        return False
    return True


def site(*args: str, inventories: tuple[Path, ...] = ()) -> tuple[str, dict[str, tuple[int, int]]]:
    """Run site.yml on the bed (its inventory, then `inventories` over it); its output and each host's
    (ok, changed) from the recap. A failing run fails the test with the output's end."""
    sources = [arg for path in (INVENTORY, *inventories) for arg in ("-i", str(path))]
    started = time.monotonic()
    run = subprocess.run(
        [PLAYBOOK, *sources, str(REPO / "site.yml"), *args],
        capture_output=True,
        text=True,
        # json: the debug line with the reasons is printed on one line, never folded
        env={
            **ENV,
            "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
        },
        cwd=REPO,
        timeout=900,
    )
    out = run.stdout + run.stderr
    # Each run's seconds and kind, in the bed log's captured output (-rP): where the bed's time goes.
    kind = "roles skipped (converged)" if "the roles are skipped" in out else "roles run"
    # Why the roles ran, as the converged check said it (a full run that should have been a skip
    # costs the bed about 2 min: this line is how CI's log shows which one and why).
    why = VERDICT.search(out)
    if why and kind == "roles run":
        kind += f" ({why.group(1)[:300]})"
    print(f"site.yml {' '.join(args)}: {time.monotonic() - started:.0f} s, {kind}, rc {run.returncode}")
    assert run.returncode == 0, out[-4000:]
    recap = {host: (int(ok), int(changed)) for host, ok, changed, _, _ in RECAP.findall(out)}
    return out, recap


def own_like(tree: Path, owner: Path) -> None:
    """Give `tree` (a dir the test wrote on the shared dir, as root) and everything in it to the
    account that owns `owner` (the shared dir, a run dir: the training account), so the nodes' trainer
    can read and write it as it would its own."""
    stat = owner.stat()
    for path in [tree, *tree.rglob("*")]:
        os.chown(path, stat.st_uid, stat.st_gid)
