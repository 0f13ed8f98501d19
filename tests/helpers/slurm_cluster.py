"""A real Slurm on this machine for tests: slurmctld and one slurmd per node, each node in a network
namespace of its own, so a 2-node job really has two hosts' worth of addresses and routes.

    with SlurmCluster(tmp_dir, nodes=2) as slurm:
        job = slurm.submit(script_path)
        slurm.wait(job, timeout=600)      # -> the job's final state, e.g. "COMPLETED"

Everything is private to the cluster's directory and this machine: its own munge key and munged
socket, a slurm.conf read through SLURM_CONF (the machine's /etc/slurm is never read or changed),
its own ports, and a bridge with one veth pair per node namespace on a private /24 that no route of
this machine uses yet (never any other address). Nodes share this machine's file system, so a
directory under /tmp or /var/tmp stands in for the shared dir. Daemons run as root (slurmd must, to
start jobs): the fixture needs root, the Debian packages slurmctld, slurmd, slurm-client and munge,
and `ip netns`. `SlurmCluster.unavailable()` says why it cannot run, or None.

Slurm here: select/cons_tres on CPUs, proctrack/linuxproc and task/none (no cgroups: the test
machines have v1/hybrid cgroups), no accounting database; finished jobs stay visible to
`scontrol show job` for MinJobAge seconds.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

BINARIES = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "ip", "nsenter")
PACKAGES = "slurmctld slurmd slurm-client munge iproute2"
#: slurmd listens in its node's own namespace, so every cluster's slurmds can share this port; slurmctld
#: listens on this machine's, so each cluster takes a free one (two test files with a cluster each, in
#: CI's parallel workers, met as "slurmctld: fatal: ... Address already in use").
SLURMD_PORT = 26818
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _free_port() -> int:
    """A TCP port nothing on this machine listens on now (the kernel's pick for an ephemeral bind)."""
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        return probe.getsockname()[1]


def _free_subnet() -> ipaddress.IPv4Network:
    """A private /24 that no route of this machine covers yet."""
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    used = []
    for line in routes.split("\n"):
        with contextlib.suppress(ValueError, IndexError):
            used.append(ipaddress.ip_network(line.split()[0], strict=False))
    for third in range(200, 250):
        candidate = ipaddress.ip_network(f"10.213.{third}.0/24")
        if not any(candidate.overlaps(net) for net in used if net.prefixlen > 0):
            return candidate
    raise RuntimeError("no free 10.213.x.0/24 for the Slurm test network")


class SlurmCluster:
    def __init__(
        self,
        root: Path,
        nodes: int = 2,
        cpus_per_node: int = 2,
        slurmd_timeout_s: int | None = None,
        cred_expire_s: int | None = None,
    ) -> None:
        self.root = root
        # AuthInfo's cred_expire: also how long a requeued job waits before it may start again. None:
        # Slurm's default (120 s); a test that requeues a job sets it short.
        self.cred_expire_s = cred_expire_s
        # Slurm's SlurmdTimeout: how long a node's slurmd may not answer before the node is marked
        # DOWN. None: Slurm's default (300 s); a test that kills a node sets it short.
        self.slurmd_timeout_s = slurmd_timeout_s
        self.nodes = [f"sn{i}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"ctsl{tag}"
        self.namespaces = {name: f"ctslurm-{tag}-{name}" for name in self.nodes}
        self.veths = {name: f"ctsv{tag}{i}" for i, name in enumerate(self.nodes)}
        self.subnet = _free_subnet()
        hosts = list(self.subnet.hosts())
        self.controller_address = str(hosts[0])
        self.ctld_port = _free_port()
        self.addresses = {name: str(hosts[10 + i]) for i, name in enumerate(self.nodes)}
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self._daemons: list[subprocess.Popen] = []
        self._created_links: list[str] = []
        self._created_namespaces: list[str] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why a SlurmCluster cannot run on this machine (None if it can)."""
        if os.geteuid() != 0:
            return "Slurm's daemons need root (slurmd starts jobs as their users)"
        missing = [name for name in BINARIES if _which(name) is None]
        if missing:
            return f"missing {', '.join(missing)}: install the Debian packages {PACKAGES}"
        return None

    @property
    def env(self) -> dict[str, str]:
        """The environment for sbatch/scontrol/squeue against this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # --- start and stop ------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._make_network()
        self._write_conf()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait_for(lambda: self._scontrol("ping").returncode == 0, timeout_s, "slurmctld answering")
        for name in self.nodes:
            self._spawn(
                f"slurmd-{name}",
                # nsenter, not `ip netns exec`: that mounts a fresh /sys without the cgroup file
                # systems slurmd's cgroup plugin looks for.
                [
                    "nsenter",
                    f"--net=/run/netns/{self.namespaces[name]}",
                    _which("slurmd"),
                    "-D",
                    "-N",
                    name,
                    "-f",
                    str(self.conf),
                ],
            )
        self._wait_for(self._nodes_idle, timeout_s, "every node idle")

    def _start_munge(self) -> None:
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(mode=0o700, exist_ok=True)
        key = munge_dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self._spawn(
            "munged",
            [
                _which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={key}", f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}", f"--seed-file={munge_dir / 'munged.seed'}",
            ],
        )  # fmt: skip
        self._wait_for(self.munge_socket.exists, 20, "munged's socket")

    def _ip(self, *args: str, namespace: str | None = None) -> None:
        prefix = ["ip", "netns", "exec", namespace] if namespace else []
        subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, text=True)

    def _make_network(self) -> None:
        prefix = self.subnet.prefixlen
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._created_links.append(self.bridge)
        self._ip("addr", "add", f"{self.controller_address}/{prefix}", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for name in self.nodes:
            namespace, veth = self.namespaces[name], self.veths[name]
            self._ip("netns", "add", namespace)
            self._created_namespaces.append(namespace)
            self._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            self._created_links.append(veth)
            self._ip("link", "set", veth, "master", self.bridge, "up")
            self._ip("addr", "add", f"{self.addresses[name]}/{prefix}", "dev", "eth0", namespace=namespace)
            self._ip("link", "set", "eth0", "up", namespace=namespace)
            self._ip("link", "set", "lo", "up", namespace=namespace)

    def _write_conf(self) -> None:
        state = self.root / "state"
        state.mkdir(exist_ok=True)
        for name in self.nodes:
            (self.root / f"spool-{name}").mkdir(exist_ok=True)
        controller = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
        lines = [
            "ClusterName=clustertrain-test",
            f"SlurmctldHost={controller}({self.controller_address})",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={SLURMD_PORT}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}"
            + (f",cred_expire={self.cred_expire_s}" if self.cred_expire_s else ""),
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={self.root}/spool-%n",
            f"SlurmctldPidFile={self.root}/slurmctld.pid",
            f"SlurmdPidFile={self.root}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root}/slurmctld.log",
            f"SlurmdLogFile={self.root}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "MinJobAge=600",
            "KillWait=5",
            "InactiveLimit=0",
            *([f"SlurmdTimeout={self.slurmd_timeout_s}"] if self.slurmd_timeout_s else []),
            *(
                f"NodeName={name} NodeAddr={self.addresses[name]} CPUs={self.cpus_per_node} "
                "RealMemory=1000 State=UNKNOWN"
                for name in self.nodes
            ),
            f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")  # noqa: SIM115 (closed with the process)
        self._daemons.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )
        log.close()

    def _scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, env=self.env, timeout=30)

    def _nodes_idle(self) -> bool:
        shown = self._scontrol("show", "nodes", "--oneliner").stdout
        return shown.count("State=IDLE") == len(self.nodes)

    def _wait_for(self, condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"a Slurm test daemon exited ({daemon.args[0]}): {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: no {what} within {timeout_s:.0f} s: {self.logs()}")
            time.sleep(0.3)

    def stop(self) -> None:
        """End every daemon this cluster started (and its jobs' processes), remove its network."""
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(timeout=5)
        # Job steps run in slurmstepd processes of their own sessions: end those of our nodes.
        for namespace in self._created_namespaces:
            pids = subprocess.run(
                ["ip", "netns", "pids", namespace], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for link in reversed(self._created_links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for namespace in self._created_namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._daemons, self._created_links, self._created_namespaces = [], [], []

    def kill_node(self, name: str) -> int:
        """The node lost: SIGKILL to every process in its network namespace (its slurmd, the steps'
        slurmstepd and what they run); how many."""
        pids = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[name]], capture_output=True, text=True, check=True
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        return len(pids)

    # --- jobs ----------------------------------------------------------------------------------

    def submit(self, script: Path, *args: str, cwd: Path | None = None) -> str:
        done = subprocess.run(
            ["sbatch", "--parsable", *args, str(script)],
            capture_output=True, text=True, env=self.env, cwd=cwd or script.parent, timeout=60,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        shown = self._scontrol("show", "job", job_id, "--oneliner").stdout
        return dict(field.split("=", 1) for field in shown.split() if "=" in field)

    def node(self, name: str) -> dict[str, str]:
        """scontrol's fields of the node (State: IDLE, MIXED, DOWN+NOT_RESPONDING, ...)."""
        shown = self._scontrol("show", "node", name, "--oneliner").stdout
        return dict(field.split("=", 1) for field in shown.split() if "=" in field)

    def wait(self, job_id: str, timeout_s: float = 600) -> str:
        """The job's final state (COMPLETED, FAILED, ...) once it ends; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.job(job_id).get("JobState", "")
            if state in FINAL_STATES:
                return state
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env, capture_output=True)
                raise TimeoutError(f"job {job_id} still {state} after {timeout_s:.0f} s: {self.logs()}")
            time.sleep(1)

    def logs(self, tail: int = 30) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)


@contextlib.contextmanager
def slurm_for_test(root: Path, nodes: int, **options):
    """A test module's SlurmCluster (`options` as SlurmCluster takes them), or the test skipped saying
    why one cannot run on this machine."""
    why = SlurmCluster.unavailable()
    if why:
        pytest.skip(f"no Slurm test cluster: {why}")
    with SlurmCluster(root, nodes=nodes, **options) as cluster:
        yield cluster
