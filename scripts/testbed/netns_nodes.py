"""Simulated cluster nodes on this machine: one network namespace per node, each with its own sshd.

For the scale benchmark (bench/scale.py) and the scale tests (tests/local/test_*_scale.py): N nodes
that the launcher and preflight reach exactly as they reach real ones, over SSH as root, becoming the
training user, with pinned host keys; only the filesystem is this machine's, shared by every node
(so the shared dir is just a directory, as in the loopback tests).

Layout of a cluster in slot S (several clusters can be up at once, one per slot, so two benchmarks
never tear down each other's nodes):

- a bridge `ctsimS` in the root namespace holding the controller's address 10.(77+S).0.1/16;
- node i: namespace `ctsimS-i`, a veth pair (`ctsSvi` on the bridge, `eth0` inside), address
  10.(77+S).(1 + i // 250).(1 + i % 250), loopback up, host name nII, its own sshd (a config of
  its own under DIR, ListenAddress its address; OpenSSH's defaults otherwise, MaxStartups
  included, so a benchmark meets the real limit). The sshd is the installed one, or unpacked into
  DIR/sshd from the openssh-server .deb in apt's cache, or what CLUSTERTRAIN_TEST_SSHD names
  (scripts/testbed/sshd_finder.py: openssh-server is not among the project's system packages);
- one host key (generated once per DIR) for every node, pinned in DIR/ssh/known_hosts for the
  controller; the controller's key authorized for root (AuthorizedKeysFile DIR/ssh/authorized/%u);
- the training user: a throwaway account `ctsimS` (useradd; userdel on down) with its home under
  DIR/home, its own key authorized on every node and every node's host key pinned in its
  known_hosts (preflight's SSH check logs in between nodes as that user);
- every node process (the sshds and all they start) in the cgroup v2 directory ctsim-S, so the
  nodes' CPU is that cgroup's cpu.stat usage_usec; where cgroup v2 is not writable, the sum of the
  sshds' and their descendants' /proc times (which misses processes that left the sshd's tree);
- DIR/inventory: group cluster, head n00, workers n01..; cluster_ip = ansible_host = the node's
  address; ansible_user root; the training user as cluster_training_user (Ansible becomes it);
  the shared dir DIR/shared; the project's venv as training_venv.

Each node's sshd runs in a mount namespace of its own (ip netns exec gives one). These things of this
machine are adjusted there, never outside: /etc is a copy of this machine's (DIR/etc, made once the
training user exists) with the node names in /etc/hosts and, when sshd's privilege separation user
is missing (a machine that never installed openssh-server), that user in /etc/passwd; when
/run/sshd (sshd's privilege separation dir) is missing, a fresh tmpfs on /run has it;
when the venv's interpreter lies under a directory others
cannot enter (/root, mode 0700, for a pyenv Python), a tmpfs of mode 0711 covers that directory
with only the interpreter's tree bound back in, so the training user can run it (root's home on a
node is then empty, as on a fresh machine).

API::

    with nodes(8, tmp_path) as cluster:       # up; down when the block ends, even on error
        cluster.inventory                     # DIR/inventory, for -i
        cluster.hosts                         # ["n00", "n01", ...]
        cluster.node_cpu_s()                  # CPU seconds of every node process so far

Command line (as root)::

    python scripts/testbed/netns_nodes.py up 64 /tmp/sim     # prints the inventory's path
    python scripts/testbed/netns_nodes.py down /tmp/sim

`up` first takes down what an earlier run of the same DIR left (a crashed benchmark). Needs root,
iproute2 with `ip netns`, OpenSSH's sshd (installed, or its .deb in apt's cache), ssh-keygen,
useradd and sudo (Ansible becomes the user with it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv"
#: Where each slot's owner (the DIR using it) is recorded, in the root namespace.
SLOTS_DIR = Path("/run/ctsim")
#: Clusters up at once at most (slot S uses 10.(77+S).0.0/16).
MAX_SLOTS = 8
#: Node addresses per /24-sized block (x.y.B.1 .. x.y.B.250).
PER_BLOCK = 250
#: How long every sshd gets to answer on port 22 after `up` started it.
SSHD_READY_S = 30.0
STATE = "cluster.json"


def _sibling(name: str) -> Any:
    """A module of this directory (loaded by path: scripts/testbed is not a package, and this file is
    itself loaded by path by bench/scale.py and the tests)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


sshd_finder = _sibling("sshd_finder")


class SetupError(RuntimeError):
    """The simulated nodes cannot be made on this machine; the message says why and what to do."""


def missing_requirements() -> str | None:
    """Why simulated nodes cannot run here, or None: for tests to skip with that reason."""
    if os.geteuid() != 0:
        return "simulated nodes need root (network namespaces, sshd, useradd)"
    for tool in ("ip", "ssh-keygen", "useradd", "userdel", "sudo", "ssh"):
        if shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin:" + os.environ.get("PATH", "")) is None:
            return f"simulated nodes need {tool} (not found)"
    no_sshd = sshd_finder.missing()
    if no_sshd:
        return f"simulated nodes {no_sshd}"
    probe = f"ctsim-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise SetupError(f"{shlex.join(command)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return done


def _copy_etc(target: Path, tries: int = 5) -> None:
    """A copy of this machine's /etc at `target`. Another process's useradd or groupadd (a test's
    temporary account) makes and removes lock and backup files there (`/etc/group+`, `group.lock`)
    while cp walks it; a file gone between cp's listing and its copy fails the copy, so it is made again
    a few times. Any other error fails at once."""
    for attempt in range(tries):
        shutil.rmtree(target, ignore_errors=True)
        done = subprocess.run(["cp", "-a", "/etc", str(target)], capture_output=True, text=True)
        if done.returncode == 0:
            return
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        vanished = all("cannot stat" in line and "No such file or directory" in line for line in errors)
        if not vanished or attempt == tries - 1:
            raise SetupError(f"cp -a /etc {target} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        time.sleep(0.5)


def _quiet(command: list[str], stdin: str | None = None) -> None:
    """Clean-up commands: whatever is already gone is fine."""
    subprocess.run(command, input=stdin, capture_output=True, text=True)


def node_name(i: int, n: int) -> str:
    return f"n{i:0{max(2, len(str(n - 1)))}d}"


def node_address(slot: int, i: int) -> str:
    return f"10.{77 + slot}.{1 + i // PER_BLOCK}.{1 + i % PER_BLOCK}"


def _cgroup2_root() -> Path | None:
    """Where cgroup v2 is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid systems)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


def _proc_times(pid: int) -> tuple[float, int] | None:
    """(utime + stime + cutime + cstime in seconds, parent pid) of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(value) for value in fields[11:15]) / ticks, int(fields[1])


@dataclass
class Cluster:
    """N simulated nodes of one slot; `up()` makes them, `down()` removes every trace."""

    root: Path
    n: int
    slot: int
    settings: dict[str, Any] = field(default_factory=dict)
    cgroup: Path | None = None
    #: The nodes' sshd (found or unpacked by `up`).
    sshd: Any = None

    @property
    def hosts(self) -> list[str]:
        return [node_name(i, self.n) for i in range(self.n)]

    @property
    def addresses(self) -> dict[str, str]:
        return {node_name(i, self.n): node_address(self.slot, i) for i in range(self.n)}

    @property
    def namespaces(self) -> list[str]:
        return [f"ctsim{self.slot}-{i}" for i in range(self.n)]

    @property
    def bridge(self) -> str:
        return f"ctsim{self.slot}"

    @property
    def controller_address(self) -> str:
        return f"10.{77 + self.slot}.0.1"

    @property
    def user(self) -> str:
        return f"ctsim{self.slot}"

    @property
    def inventory(self) -> Path:
        return self.root / "inventory"

    @property
    def shared(self) -> Path:
        return self.root / "shared"

    @property
    def ssh_dir(self) -> Path:
        return self.root / "ssh"

    @property
    def home(self) -> Path:
        return self.root / "home"

    def _pidfile(self, i: int) -> Path:
        return self.root / "nodes" / f"{i}" / "sshd.pid"

    # ---- up ------------------------------------------------------------------------------------

    def up(self) -> None:
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        # mkdtemp makes 0700 directories: the training user must reach its home and the shared dir.
        self.root.chmod(0o755)
        (self.root / STATE).write_text(json.dumps({"n": self.n, "slot": self.slot}))
        self._keys()
        self._user()
        self._find_sshd()
        self._network()
        self._cgroup()
        self._sshds()
        self._write_inventory()
        self._wait_for_sshds(started)

    def _keys(self) -> None:
        """One host key for every node, the controller's key and the training user's, made once per DIR."""
        self.ssh_dir.mkdir(exist_ok=True)
        for key in (self.ssh_dir / "host_ed25519_key", self.ssh_dir / "controller_ed25519"):
            if not key.exists():
                _run(
                    ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"ctsim {key.name}", "-f", str(key)]
                )

    def _user(self) -> None:
        """The throwaway training user, its home with its key and the nodes' pinned host key."""
        _quiet(["userdel", self.user])
        self.home.mkdir(exist_ok=True)
        # Password "*": none, but not locked ("!", useradd's default), which sshd without PAM refuses.
        useradd = ["useradd", "--no-create-home", "--home-dir", str(self.home), "--shell", "/bin/bash"]
        _run([*useradd, "--user-group", "--password", "*", self.user])
        dot_ssh = self.home / ".ssh"
        dot_ssh.mkdir(exist_ok=True)
        key = dot_ssh / "id_ed25519"
        if not key.exists():
            _run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.user} (ctsim)", "-f", str(key)]
            )
        host_key = (self.ssh_dir / "host_ed25519_key.pub").read_text().split()[:2]
        pinned = "".join(f"{address} {host_key[0]} {host_key[1]}\n" for address in self.addresses.values())
        (dot_ssh / "known_hosts").write_text(pinned)
        # The controller pins the same key under each node's address (what Ansible connects to).
        (self.ssh_dir / "known_hosts").write_text(pinned)
        authorized = self.ssh_dir / "authorized"
        authorized.mkdir(exist_ok=True)
        (authorized / "root").write_text((self.ssh_dir / "controller_ed25519.pub").read_text())
        (authorized / self.user).write_text((key.with_suffix(".pub")).read_text())
        self.shared.mkdir(exist_ok=True)
        _run(["chown", "-R", f"{self.user}:{self.user}", str(self.home), str(self.shared)])

    def _find_sshd(self) -> None:
        try:
            self.sshd = sshd_finder.find(self.root / "sshd")
        except OSError as error:
            raise SetupError(f"cannot unpack sshd: {error}; {sshd_finder.FIX}") from error
        if self.sshd is None:
            raise SetupError(f"simulated nodes {sshd_finder.missing()}")

    def _network(self) -> None:
        """The bridge, then every namespace with its veth pair, in two `ip -batch` calls and one per node."""
        lines = [
            f"link add {self.bridge} type bridge",
            f"addr add {self.controller_address}/16 dev {self.bridge}",
            f"link set {self.bridge} up",
        ]
        for i, namespace in enumerate(self.namespaces):
            lines += [
                f"netns add {namespace}",
                f"link add cts{self.slot}v{i} type veth peer name eth0 netns {namespace}",
                f"link set cts{self.slot}v{i} master {self.bridge} up",
            ]
        _run(["ip", "-batch", "-"], input="\n".join(lines) + "\n")
        for i, namespace in enumerate(self.namespaces):
            inside = f"addr add {node_address(self.slot, i)}/16 dev eth0\nlink set eth0 up\nlink set lo up\n"
            _run(["ip", "-n", namespace, "-batch", "-"], input=inside)

    def _cgroup(self) -> None:
        root = _cgroup2_root()
        if root is None:
            return
        cgroup = root / f"ctsim-{self.slot}"
        try:
            cgroup.mkdir(exist_ok=True)
            (cgroup / "cgroup.procs").stat()
        except OSError:
            return
        self.cgroup = cgroup

    def _node_script(self) -> Path:
        """The shell that starts one node's sshd inside its namespace (see the module's docstring)."""
        lines = [
            "#!/bin/sh",
            "# $1: host name, $2: sshd config. Runs in the node's own mount namespace.",
            "set -e",
        ]
        lines.append('hostname "$1"')
        # The nodes' /etc is a copy of this machine's, made after _user() (so it holds the training
        # user), bound over /etc in each node's namespace. A copy of a single file bound over
        # /etc/passwd was lost in the nodes of a cluster already up when another cluster's useradd
        # replaced /etc/passwd (a rename: the kernel detaches mounts on the old file in other
        # namespaces), and their sshd then refused every login for want of its privilege separation
        # user.
        etc = self.root / "etc"
        _copy_etc(etc)
        # Node names resolve on every node (sudo looks its own host name up), never through DNS.
        hosts = etc / "hosts"
        hosts.write_text(
            Path("/etc/hosts").read_text()
            + "".join(f"{address} {name}\n" for name, address in self.addresses.items())
        )
        passwd = sshd_finder.passwd_with_privsep_user()
        if passwd is not None:
            (etc / "passwd").write_text(passwd)
        lines.append(f"mount --bind {shlex.quote(str(etc))} /etc")
        if not Path("/run/sshd").is_dir():
            lines.append("mount -t tmpfs -o mode=0755 tmpfs /run && mkdir -m 0755 /run/sshd")
        hidden = self._hidden_interpreter_dir()
        if hidden is not None:
            closed, keep = hidden
            stash = self.root / "mnt" / "keep"
            stash.mkdir(parents=True, exist_ok=True)
            q = shlex.quote
            lines += [
                f"mount --bind {q(str(keep))} {q(str(stash))}",
                f"mount -t tmpfs -o mode=0711 tmpfs {q(str(closed))}",
                f"mkdir -p {q(str(keep))}",
                f"mount --bind {q(str(stash))} {q(str(keep))}",
                f"umount {q(str(stash))}",
            ]
        lines.append(f'exec {shlex.quote(self.sshd.path)} -f "$2" -E "${{2%/*}}/sshd.log"')
        script = self.root / "node.sh"
        script.write_text("\n".join(lines) + "\n")
        script.chmod(0o755)
        return script

    @staticmethod
    def _hidden_interpreter_dir() -> tuple[Path, Path] | None:
        """(a directory others cannot enter, its child on the way to the venv's interpreter) or None."""
        target = Path(os.path.realpath(VENV / "bin" / "python"))
        for directory in reversed(target.parents):
            if directory != Path("/") and not directory.stat().st_mode & 0o001:
                return directory, directory / target.relative_to(directory).parts[0]
        return None

    def _sshd_config(self, i: int) -> Path:
        node_dir = self.root / "nodes" / f"{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        config = node_dir / "sshd_config"
        lines = [
            f"ListenAddress {node_address(self.slot, i)}",
            f"HostKey {self.ssh_dir / 'host_ed25519_key'}",
            f"AuthorizedKeysFile {self.ssh_dir / 'authorized' / '%u'}",
            f"PidFile {self._pidfile(i)}",
            # The keys live in a test directory (under /tmp, world-writable): not root's own files.
            "StrictModes no",
            "UsePAM no",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            # sftp's server, and the helpers an unpacked sshd must be pointed at (sshd_finder).
            *self.sshd.config_lines,
        ]
        config.write_text("\n".join(lines) + "\n")
        return config

    def _sshds(self) -> None:
        script = self._node_script()
        procs_file = str(self.cgroup / "cgroup.procs") if self.cgroup else None

        def join_cgroup() -> None:
            if procs_file:
                with open(procs_file, "w") as procs:
                    procs.write(str(os.getpid()))

        starting = []
        for i, namespace in enumerate(self.namespaces):
            config = self._sshd_config(i)
            command = [
                "ip",
                "netns",
                "exec",
                namespace,
                "unshare",
                "--uts",
                str(script),
                node_name(i, self.n),
                str(config),
            ]
            starting.append(
                subprocess.Popen(
                    command,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    preexec_fn=join_cgroup,
                )
            )
        for i, proc in enumerate(starting):
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise SetupError(f"sshd of {node_name(i, self.n)} did not start: {err.strip()[-500:]}")

    def _wait_for_sshds(self, started: float) -> None:
        waiting = dict(self.addresses)
        while waiting:
            for name, address in list(waiting.items()):
                with contextlib.suppress(OSError), socket.create_connection((address, 22), timeout=1) as sock:
                    sock.recv(4)
                    del waiting[name]
            if waiting and time.monotonic() - started > SSHD_READY_S:
                logs = [self.root / "nodes" / f"{self.hosts.index(name)}" / "sshd.log" for name in waiting]
                raise SetupError(
                    f"sshd of {', '.join(waiting)} not answering after {SSHD_READY_S:.0f} s; see {logs[0]}"
                )
            if waiting:
                time.sleep(0.05)

    def _write_inventory(self) -> None:
        inventory = self.inventory
        (inventory / "group_vars" / "cluster").mkdir(parents=True, exist_ok=True)
        common = {
            "ansible_connection": "ssh",
            "ansible_user": "root",
            "ansible_python_interpreter": "/usr/bin/python3",
            "cluster_accelerators": 0,
            "cluster_accelerator_model": "cpu",
        }
        hosts = {
            name: dict(common, cluster_ip=address, ansible_host=address)
            for name, address in self.addresses.items()
        }
        head = self.hosts[0]
        tree = {
            "cluster": {
                "children": {
                    "head": {"hosts": {head: hosts.pop(head)}},
                    "workers": {"hosts": hosts},
                },
                "vars": {
                    "ansible_ssh_private_key_file": str(self.ssh_dir / "controller_ed25519"),
                    "ansible_ssh_common_args": (
                        f"-o UserKnownHostsFile={self.ssh_dir / 'known_hosts'} "
                        "-o StrictHostKeyChecking=yes -o IdentitiesOnly=yes"
                    ),
                },
            }
        }
        (inventory / "hosts.yml").write_text(yaml.safe_dump(tree, sort_keys=False))
        defaults = {
            "cluster_name": f"ctsim{self.slot}",
            "cluster_subnet": f"10.{77 + self.slot}.0.0/16",
            "cluster_training_user": self.user,
            "cluster_training_group": self.user,
            "cluster_master_port": 29500,
            "cluster_comm_port_range": "1024:65535",
            "cluster_nccl_socket_ifname": "eth0",
            "cluster_nccl_ib_disable": 1,
            "cluster_nccl_debug": "WARN",
            "cluster_nccl_timeout_s": 120,
            "cluster_shared_dir": str(self.shared),
            "cluster_data_path": "",
            "training_venv": str(VENV),
            "training_procs_per_node": 1,
            "training_engine": "ddp",
            "training_config": "",
            # veth pairs on a shared 2-core machine, not 10 Gbit/s NICs (preflight's bandwidth check).
            "preflight_bandwidth_threshold_gbit": 0.2,
        }
        # The nodes share this machine's cores: a rank alone on its node would take a thread per core
        # (torch's default), and their idle threads spin while the other nodes' ranks wait for the CPU
        # (3 nodes training the tiny GPT: 3.5 times the wall time, 4 times the CPU, of one thread each).
        # A setting's own training_env goes over this one.
        env = {"OMP_NUM_THREADS": "1", **(self.settings.get("training_env") or {})}
        (inventory / "group_vars" / "cluster" / "all.yml").write_text(
            yaml.safe_dump(defaults | self.settings | {"training_env": env})
        )

    # ---- use -----------------------------------------------------------------------------------

    def node_cpu_s(self) -> float:
        """CPU seconds (user + system) of every process of every node since `up`."""
        if self.cgroup is not None:
            for line in (self.cgroup / "cpu.stat").read_text().splitlines():
                key, value = line.split()
                if key == "usage_usec":
                    return int(value) / 1e6
        return self._proc_tree_cpu_s()

    def _proc_tree_cpu_s(self) -> float:
        """The fallback: the sshds' own and reaped children's times, plus their live descendants'."""
        parents: dict[int, int] = {}
        times: dict[int, float] = {}
        for entry in Path("/proc").glob("[0-9]*"):
            got = _proc_times(int(entry.name))
            if got is not None:
                times[int(entry.name)], parents[int(entry.name)] = got
        roots = set(self.sshd_pids())
        total = 0.0
        for pid in times:
            walk = pid
            while walk > 1 and walk not in roots:
                walk = parents.get(walk, 0)
            if walk in roots:
                total += times[pid]
        return total

    def sshd_pids(self) -> list[int]:
        pids = []
        for i in range(self.n):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(self._pidfile(i).read_text().split()[0]))
        return pids

    # ---- down ----------------------------------------------------------------------------------

    def ssh_connections(self) -> list[str]:
        """This machine's established TCP connections to the nodes' sshd (/proc/net/tcp): what an SSH
        master left behind holds, found by address (its title names no node; other runs have theirs)."""
        wanted = {
            "".join(f"{int(part):02X}" for part in reversed(a.split("."))) for a in self.addresses.values()
        }
        found = []
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            remote, state = line.split()[2:4]
            address, port = remote.split(":")
            if state == "01" and int(port, 16) == 22 and address in wanted:  # 01: ESTABLISHED
                found.append(remote)
        return found

    def down(self) -> None:
        """Every node process killed, the namespaces, veths, bridge, cgroup and user removed."""
        self._kill_nodes()
        _quiet(["ip", "-batch", "-", "-force"], "\n".join(f"netns del {ns}" for ns in self.namespaces) + "\n")
        _quiet(
            ["ip", "-batch", "-", "-force"], "".join(f"link del cts{self.slot}v{i}\n" for i in range(self.n))
        )
        _quiet(["ip", "link", "del", self.bridge])
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()
        _quiet(["userdel", self.user])
        # The nodes' copy of /etc holds this machine's /etc/shadow (modes kept): not left behind.
        shutil.rmtree(self.root / "etc", ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.root / STATE).unlink()

    def _kill_nodes(self) -> None:
        cgroup = self.cgroup
        if cgroup is None:
            root = _cgroup2_root()
            if root is not None and (root / f"ctsim-{self.slot}").is_dir():
                cgroup = self.cgroup = root / f"ctsim-{self.slot}"
        if cgroup is not None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
                except OSError:
                    return
                if not pids:
                    return
                try:
                    (cgroup / "cgroup.kill").write_text("1")
                except OSError:
                    for pid in pids:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
            return
        # No cgroup: the sshds and what still descends from them (by /proc parent links).
        roots = set(self.sshd_pids())
        parents = {}
        for entry in Path("/proc").glob("[0-9]*"):
            got = _proc_times(int(entry.name))
            if got is not None:
                parents[int(entry.name)] = got[1]
        for pid in parents:
            walk = pid
            while walk > 1 and walk not in roots:
                walk = parents.get(walk, 0)
            if walk in roots:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


# ---- slots ---------------------------------------------------------------------------------------


def _slot_owner(slot: int) -> str | None:
    try:
        return (SLOTS_DIR / f"slot{slot}").read_text().strip()
    except OSError:
        return None


def _previous(root: Path) -> Cluster | None:
    """What an earlier run of this DIR left (its state file names its size and slot)."""
    try:
        state = json.loads((root / STATE).read_text())
    except (OSError, ValueError):
        state = None
    for slot in range(MAX_SLOTS):
        if _slot_owner(slot) == str(root):
            return Cluster(root, int(state["n"]) if state else 0, slot)
    return Cluster(root, int(state["n"]), int(state["slot"])) if state else None


def _claim_slot(root: Path) -> int:
    """The first free slot (a slot whose owner's DIR is gone is free again), recorded as root's."""
    SLOTS_DIR.mkdir(mode=0o755, exist_ok=True)
    for slot in range(MAX_SLOTS):
        owner = _slot_owner(slot)
        if owner is not None and not Path(owner).exists():
            _release(Cluster(Path(owner), _state_n(Path(owner)), slot))
        try:
            fd = os.open(SLOTS_DIR / f"slot{slot}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as out:
            out.write(str(root))
        return slot
    owners = ", ".join(filter(None, (_slot_owner(s) for s in range(MAX_SLOTS))))
    raise SetupError(
        f"all {MAX_SLOTS} slots for simulated clusters are in use ({owners}); "
        "fix: `python scripts/testbed/netns_nodes.py down DIR` for one that is no longer needed"
    )


def _state_n(root: Path) -> int:
    """Node count of a DIR's cluster (the largest a leftover can have when its state file is gone)."""
    try:
        return int(json.loads((root / STATE).read_text())["n"])
    except (OSError, ValueError, KeyError):
        return 1024


def _release(cluster: Cluster) -> None:
    if cluster.n == 0:
        cluster.n = _state_n(cluster.root)
    cluster.down()
    with contextlib.suppress(OSError):
        (SLOTS_DIR / f"slot{cluster.slot}").unlink()


def up(n: int, root: Path, **settings: Any) -> Cluster:
    """N nodes up (leftovers of an earlier run of `root` removed first); `settings` go over the
    inventory's group_vars defaults."""
    if n < 1:
        raise SetupError(f"asked for {n} nodes; fix: ask for 1 or more")
    problem = missing_requirements()
    if problem:
        raise SetupError(problem)
    root = Path(root).resolve()
    for directory in root.parents:
        if directory.exists() and not directory.stat().st_mode & 0o001:
            raise SetupError(
                f"{directory} is closed to other users (mode {directory.stat().st_mode & 0o777:o}), and the "
                f"training user must reach {root}; fix: put DIR elsewhere or chmod o+x {directory}"
            )
    previous = _previous(root)
    if previous is not None:
        _release(previous)
    cluster = Cluster(root, n, _claim_slot(root), dict(settings))
    try:
        cluster.up()
    except BaseException:
        _release(cluster)
        raise
    return cluster


def down(root: Path) -> bool:
    """Take down the cluster of `root`; False when there was none."""
    previous = _previous(Path(root).resolve())
    if previous is None:
        return False
    _release(previous)
    return True


@contextlib.contextmanager
def nodes(n: int, root_dir: Path, **settings: Any) -> Iterator[Cluster]:
    """N simulated nodes for the block's length (see the module docstring)."""
    cluster = up(n, root_dir, **settings)
    try:
        yield cluster
    finally:
        _release(cluster)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser("up", help="start N nodes; prints the inventory's path")
    make.add_argument("n", type=int)
    make.add_argument("dir", type=Path)
    remove = sub.add_parser("down", help="stop the nodes of DIR and remove every trace")
    remove.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            started = time.monotonic()
            cluster = up(args.n, args.dir)
            print(cluster.inventory)
            print(
                f"{args.n} nodes up in {time.monotonic() - started:.1f} s (slot {cluster.slot})",
                file=sys.stderr,
            )
        elif not down(args.dir):
            print(f"no simulated cluster of {args.dir.resolve()}", file=sys.stderr)
    except SetupError as error:
        print(f"netns_nodes: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
