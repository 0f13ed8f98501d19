"""The launcher at scale (issue 27): a controller that cannot follow every node refuses the launch and
says why; following costs the controller little per node (a ratio of 8 to 2 simulated nodes measured
in one run); a launch costs the controller little per node beyond its SSH logins (2 and 32 simulated
nodes, one run); no SSH master is left behind by a launch, `trainer status` or `trainer stop`.

Simulated nodes: scripts/testbed/netns_nodes.py (a network namespace and a real sshd per node,
Ansible logging in as root and becoming the training user). The refusal needs none of it: it comes
before any node is reached (loopback hosts)."""

from __future__ import annotations

import os
import resource
import subprocess
import time
from pathlib import Path

import pytest
from helpers import loopback
from helpers.simulated_nodes import NEEDS_NETNS, netns_nodes, scale

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python")


def trainer(*args: str) -> list[str]:
    return [PYTHON, "-m", "trainer", *args]


def test_a_controller_that_cannot_follow_every_node_refuses_the_launch_and_names_the_limit(tmp_path):
    inventory, shared = loopback.write_inventory(tmp_path, nodes=3)
    # 72 open files hold 2 nodes (64 kept for the run, 4 per node): the third would go unwatched.
    files = 72

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    done = subprocess.run(
        trainer("launch", "-i", str(inventory), "--run-name", "wide", "--", "true"),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=few_files,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "can follow 2 nodes at once and the job has 3" in done.stderr, done.stderr
    assert f"RLIMIT_NOFILE {files}" in done.stderr and "ulimit -n" in done.stderr, "the limit and its fix"
    assert not (shared / "runs" / "wide" / "launch" / "node-0" / "log").exists(), "nothing started anywhere"


def test_a_preflight_whose_bandwidth_rounds_cannot_run_on_every_node_at_once_is_refused(tmp_path):
    inventory, _ = loopback.write_inventory(tmp_path, nodes=3)
    files = 72  # 2 nodes at once, as above
    report = tmp_path / "report.json"
    done = subprocess.run(
        trainer("preflight", "-i", str(inventory), "--report", str(report)),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (files, files)),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "holds 2 nodes at once, the cluster has 3" in done.stderr, done.stderr
    assert "ulimit -n" in done.stderr and "--skip bandwidth" in done.stderr, "the fixes"
    assert "probing" not in done.stdout and not report.exists(), "refused before any probe"


def _started(shared: Path, run: str, nodes: int) -> bool:
    launch = shared / "runs" / run / "launch"
    return all((launch / f"node-{i}" / "log").exists() for i in range(nodes))


def _following_rate(cluster, root: Path, nodes: int, window_s: float = 6.0) -> float:
    """Controller CPU (share of a core) while `trainer launch -- sleep` follows `nodes` nodes."""
    group = scale.ControllerGroup(f"ct-launch-scale-{os.getpid()}-n{nodes}")
    assert group.path is not None, f"cannot make a cgroup under {root}"
    run = f"follow{nodes}"
    launch = subprocess.Popen(
        trainer("launch", "-i", str(cluster.inventory), "--run-name", run, "--", "sleep", "60"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=group.join,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _started(cluster.shared, run, nodes):
            assert launch.poll() is None and time.monotonic() < deadline, "the launch did not start"
            time.sleep(0.2)
        time.sleep(3)  # every watch has made its first polls
        cpu0, t0 = group.cpu_s(), time.monotonic()
        time.sleep(window_s)
        return (group.cpu_s() - cpu0) / (time.monotonic() - t0)
    finally:
        subprocess.run(trainer("stop", "-i", str(cluster.inventory), "--run-name", run), capture_output=True)
        launch.wait(timeout=60)
        group.remove()


def _cgroup_root() -> Path:
    root = netns_nodes._cgroup2_root()
    if root is None:
        pytest.skip("measures the controller's CPU in a cgroup v2 directory (none writable here)")
    return root


@NEEDS_NETNS
def test_following_eight_nodes_costs_the_controller_little_more_than_two(sim_workdir):
    root = _cgroup_root()
    rates = {}
    for n in (2, 8):
        with netns_nodes.nodes(n, sim_workdir / f"sim{n}") as cluster:
            rates[n] = _following_rate(cluster, root, n)
    per_node = (rates[8] - rates[2]) / 6
    # bench/scale.py (2 cores shared with the nodes): 1.3 % of a core at 2 nodes, 2.3 % at 8 (0.11 %
    # per added node); with a round trip to every node every 2 s it was 1.7 % and 5.2 % (0.66 %).
    assert rates[8] < 2.4 * rates[2], (
        f"following 8 nodes took {rates[8]:.1%} of a core, 2 nodes {rates[2]:.1%}: "
        f"{per_node:.2%} per added node"
    )


#: A launch's controller CPU per added node, less one SSH login (each node's SSH master: its key
#: exchange is most of that and is the SSH client's work, not the launcher's), as a share of a whole
#: 2-node launch (the fixed part: interpreters, imports, inventory), all measured in one run, so the
#: share holds on a loaded machine. Measured so on this 2-core machine at load 8 to 20, 2 and 32 nodes:
#: before (2683cdc: 37 and 53 templates compiled per node task) 0.083 to 0.135, median 0.098 (4
#: tries); after (one template per node task for its request) 0.050 to 0.082, median 0.060 (6 tries;
#: the same code's 32-node launch took 8.7 to 12.1 CPU-s). An SSH login (OpenSSH 9.2's default key
#: exchange, sntrup761x25519) cost 0.10 to 0.12 CPU-s. The bound, 1.5 times today's median, fails
#: work per node that grows by half (and a return to the level before in about half of the runs; the
#: benchmark, bench/scale.py, tells those apart). A launch over it is measured again once.
MAX_LAUNCH_WORK_PER_NODE_SHARE = 0.09
ATTEMPTS = 2
#: The larger cluster of that test (the smaller has 2 nodes).
MANY_NODES = 32

#: Logs in to each node once as the inventory does (same key, pinned host keys, same algorithms).
SSH_LOGINS = (
    'key=$1 known=$2; shift 2; for address; do ssh -i "$key" -o "UserKnownHostsFile=$known" '
    '-o StrictHostKeyChecking=yes -o IdentitiesOnly=yes -o BatchMode=yes "root@$address" true || exit 1; done'
)


def _launch_true_cpu(cluster, run: str) -> float:
    command = scale.Command(
        trainer("launch", "-i", str(cluster.inventory), "--run-name", run, "--", "true"),
        cluster,
        f"ct-launch-scale-{os.getpid()}-{run}",
    )
    measured = command.finish(timeout=600)
    assert measured.rc == 0, measured.output[-3000:]
    assert _started(cluster.shared, run, len(cluster.hosts)), "the command did not start on every node"
    return measured.controller_cpu_s


def _ssh_login_cpu(cluster) -> float:
    """The controller's CPU for one SSH login to a node (the mean over one to each node)."""
    logins = scale.Command(
        [
            "sh",
            "-c",
            SSH_LOGINS,
            "sh",
            str(cluster.ssh_dir / "controller_ed25519"),
            str(cluster.ssh_dir / "known_hosts"),
            *cluster.addresses.values(),
        ],
        cluster,
        f"ct-launch-scale-{os.getpid()}-logins",
    ).finish(timeout=300)
    assert logins.rc == 0, logins.output[-2000:]
    return logins.controller_cpu_s / len(cluster.hosts)


@NEEDS_NETNS
def test_a_launch_costs_the_controller_little_per_node_beyond_its_ssh_logins(sim_workdir):
    _cgroup_root()
    tries = []
    with (
        netns_nodes.nodes(2, sim_workdir / "sim2") as two_nodes,
        netns_nodes.nodes(MANY_NODES, sim_workdir / "many") as many_nodes,
    ):
        for attempt in range(ATTEMPTS):
            two = _launch_true_cpu(two_nodes, f"cost2-{attempt}")
            many = _launch_true_cpu(many_nodes, f"cost{MANY_NODES}-{attempt}")
            login = _ssh_login_cpu(many_nodes)
            per_node = (many - two) / (MANY_NODES - 2)
            tries.append(
                f"{per_node:.3f} CPU-s per added node, {per_node - login:.3f} beyond an SSH login "
                f"({login:.3f}); 2 nodes {two:.2f}, {MANY_NODES} nodes {many:.2f} CPU-s"
            )
            if per_node - login <= MAX_LAUNCH_WORK_PER_NODE_SHARE * two:
                return
    pytest.fail(
        f"a launch's controller CPU per added node beyond an SSH login was over "
        f"{MAX_LAUNCH_WORK_PER_NODE_SHARE} of a whole 2-node launch's, each try: " + "; ".join(tries)
    )


@NEEDS_NETNS
def test_no_ssh_master_is_left_after_a_launch_status_and_stop(sim_workdir):
    with netns_nodes.nodes(2, sim_workdir / "sim") as cluster:
        inventory = str(cluster.inventory)
        done = subprocess.run(
            trainer("launch", "-i", inventory, "--", "true"), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert not cluster.ssh_connections(), "an SSH master of the launch is still connected"
        launch = subprocess.Popen(
            trainer("launch", "-i", inventory, "--run-name", "long", "--", "sleep", "60"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while not _started(cluster.shared, "long", 2):
                assert launch.poll() is None and time.monotonic() < deadline, "the launch did not start"
                time.sleep(0.2)
            following = len(cluster.ssh_connections())
            status = subprocess.run(
                trainer("status", "-i", inventory, "--run-name", "long"), capture_output=True, text=True
            )
            assert status.returncode == 0 and "running" in status.stdout, status.stdout + status.stderr
            # The running launch holds a master per node; status's own ended with it.
            assert len(cluster.ssh_connections()) <= following, "trainer status left an SSH master"
            stop = subprocess.run(trainer("stop", "-i", inventory, "--run-name", "long"), capture_output=True)
            assert stop.returncode == 0, stop.stdout + stop.stderr
            assert launch.wait(timeout=60) == 130, "the launch saw its run stopped"
        finally:
            if launch.poll() is None:
                launch.kill()
        assert not cluster.ssh_connections(), (
            "an SSH master of trainer stop or the stopped launch is connected"
        )
