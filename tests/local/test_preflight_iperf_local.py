"""The bandwidth check's iperf3 servers against another account on the same node, for real on this
machine (issue 26, item 1). The stop step used to signal whatever number a pidfile of a fixed name
in /tmp held, and that name came from the run's token, which any account reads in `ps`: a second
account planted a victim's pid (or `-<its process group>`) there and root killed it. Now the server
is started and verified by the run itself, and nothing in /tmp decides what gets signalled."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trainer import exitcodes

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

REPO = Path(__file__).resolve().parents[2]
TRAINER = [sys.executable, "-m", "trainer"]
HELPER = REPO / "trainer/controller/preflight/playbooks/files/iperf_pair.py"
ATTACKER = "ct-pidplanter"
#: Every check but the bandwidth one and shared_dir (whose node facts run first, with the token on
#: their command line, as in a default run).
SKIP = ("ssh", "ufw", "nfs", "clock", "deepspeed", "deepspeed_ops", "master_port", "accelerators",
        "versions", "interconnect", "data", "interface", "space")  # fmt: skip

# What the other account runs (PLANTER: its own command lines are skipped). It reads the run's token
# off the command lines `ps` shows, and writes the pidfile under the name the stop step read:
# "early", as soon as it has the token (before the iperf3 server starts), or "late", the moment the
# one-off server on the run's port has ended (iperf3 removed its own pidfile then), before the stop
# step. It fails when the step it had to beat had already started, so a plant that came too late
# fails the test instead of passing it. Prints the path and the planted file's owner.
PLANT = r"""
# PLANTER
import os, re, sys, time
when, content, port, deadline = sys.argv[1], sys.argv[2], sys.argv[3], time.monotonic() + 240
token = re.compile(rb'CLUSTERTRAIN_PREFLIGHT=([0-9a-f]{16})|"token": "([0-9a-f]{16})"')
step = b"iperf_pair.py server" if when == "early" else b"iperf_pair.py stop"
def command_lines():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                line = handle.read().replace(b"\0", b" ")
        except OSError:
            continue
        if line and b"PLANTER" not in line:
            yield pid, line
def wait_until(test, what, pause=0.02):
    while time.monotonic() < deadline:
        found = test(list(command_lines()))
        if found:
            return found
        time.sleep(pause)
    sys.exit(f"gave up waiting for {what} ({when} plant)")
def first(lines, match):
    return next((found for found in (match(pid, line) for pid, line in lines) if found), None)
got = wait_until(lambda lines: first(lines, lambda pid, line: token.search(line)), "the token")
path = f"/tmp/preflight-iperf3-{(got[1] or got[2]).decode()}.pid"
if when == "late":
    server = lambda pid, line: line.startswith(b"iperf3 -s") and f" -p {port} ".encode() in line
    wait_until(lambda lines: first(lines, server), "the iperf3 server", pause=0.005)
    # None left, `iperf3 -D`'s parent and its daemon alike (a zombie's command line is empty), in
    # three scans in a row: one scan can miss the daemon forked after it listed /proc.
    for _ in range(3):
        wait_until(lambda lines: not first(lines, server), "the iperf3 server's end", pause=0.002)
if first(command_lines(), lambda pid, line: step in line):
    sys.exit(f"too late: {step.decode()} had started")
with open(path, "w") as handle:
    handle.write(content)
print(path, os.stat(path).st_uid, flush=True)
# Until the step runs, or the rounds are over without it: the rounds end each of their servers
# themselves, and the stop step runs only for a server that outlived that (none, here).
def step_or_rounds_over(lines):
    rounds = first(lines, lambda pid, line: b"iperf_pair.py rounds" in line)
    return first(lines, lambda pid, line: step in line) or not rounds
wait_until(step_or_rounds_over, step.decode())
"""


@pytest.fixture(scope="module")
def attacker() -> str:
    """A second, unprivileged account on this machine, made for the test and removed after it."""
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to make a second account")
    try:
        pwd.getpwnam(ATTACKER)
        made = False
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
                       check=True)  # fmt: skip
        made = True
    yield ATTACKER
    if made:
        subprocess.run(["userdel", ATTACKER], check=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loopback_inventory(tmp_path: Path, master_port: int, nodes: int = 2) -> Path:
    """Nodes on this machine at 127.0.0.1, .2, ...: sharing one /tmp, as containers on one host may.
    Two nodes make one iperf3 round with one server; four make rounds of two servers each."""
    shared = tmp_path / "shared"
    shared.mkdir()
    names = [f"node-{chr(ord('a') + i)}" for i in range(nodes)]
    inventory = {
        "cluster": {
            "children": {
                "head": {"hosts": {names[0]: {"cluster_ip": "127.0.0.1"}}},
                "workers": {
                    "hosts": {name: {"cluster_ip": f"127.0.0.{i}"} for i, name in enumerate(names[1:], 2)}
                },
            },
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "cluster_accelerators": 0,
                "cluster_accelerator_model": "cpu",
                "cluster_subnet": "127.0.0.0/8",
                "cluster_training_user": pwd.getpwuid(os.getuid()).pw_name,
                "cluster_shared_dir": str(shared),
                "cluster_master_port": master_port,
                "cluster_comm_port_range": f"{master_port}:{master_port + 20}",
                "cluster_nccl_socket_ifname": "lo",  # 127.0.0.2... are not assigned to lo by themselves
                "training_procs_per_node": 1,
                "training_venv": str(Path(sys.executable).parents[1]),
            },
        }
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inventory))
    return path


def preflight_bandwidth(
    tmp_path: Path, port: int, report_path: Path, nodes: int = 2
) -> subprocess.CompletedProcess:
    """`trainer preflight` on loopback nodes, 1 s iperf3 tests, any bandwidth passing."""
    inventory = loopback_inventory(tmp_path, port, nodes)
    return subprocess.run(
        [*TRAINER, "preflight", "-i", str(inventory), "--report", str(report_path),
         "--iperf-seconds", "1", "--bandwidth-threshold-gbit", "0.001", "--skip", *SKIP],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def iperf3_servers(port: int) -> list[int]:
    """Pids of iperf3 servers on this port still running (a zombie's command line is empty)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    found = (line.split(None, 1) for line in out.splitlines())
    return [int(pid) for pid, args in found if args.startswith("iperf3 -s") and f" -p {port} " in f"{args} "]


def helper(*args: str) -> dict:
    """iperf_pair.py as the playbook runs it (python3 SCRIPT ARGS), its one JSON line parsed."""
    out = subprocess.run([sys.executable, str(HELPER), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


#: Tries of the planted-pidfile test: the planter races the run (it must see the token and write the
#: file before the step it beats starts), and on a loaded machine it can lose; a lost race is tried
#: again with a fresh run, never counted as a pass.
PLANT_TRIES = 3


@pytest.mark.slow
@pytest.mark.parametrize(("when", "planted"), [("early", "pid"), ("late", "-pgid")])
def test_a_pidfile_planted_by_another_account_gets_no_process_killed(tmp_path, attacker, when, planted):
    lost = []
    for attempt in range(PLANT_TRIES):
        complaint = plant_and_check(tmp_path / f"try{attempt}", attacker, when, planted)
        if complaint is None:
            return
        lost.append(complaint)
    pytest.fail(f"the planter came too late in all {PLANT_TRIES} tries: {lost}")


def plant_and_check(tmp_path: Path, attacker: str, when: str, planted: str) -> str | None:
    """One run with the other account planting; None when the attack happened and failed, the
    planter's complaint when it came too late (the run proved nothing)."""
    tmp_path.mkdir()
    # The victim is root's, so the other account cannot signal it itself; a session of its own makes
    # its process group its pid, the `-<pgid>` form of the attack.
    victim = subprocess.Popen(["sleep", "600"], start_new_session=True)
    content = str(victim.pid) if planted == "pid" else f"-{os.getpgid(victim.pid)}"
    port = free_port()  # the master port; the iperf3 server gets the top of the comm range, port + 20
    planter = subprocess.Popen(
        ["runuser", "-u", attacker, "--", "/usr/bin/python3", "-I", "-c", PLANT, when, content,
         str(port + 20)], cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # runuser forks the planter: end the whole group (or userdel fails)
    )  # fmt: skip
    report_path = tmp_path / "report.json"
    planted_path = ""
    try:
        out = preflight_bandwidth(tmp_path, port, report_path)
        said, complaint = planter.communicate(timeout=30)
        if planter.returncode != 0 and "too late" in complaint:
            return complaint.strip()
        planted_path, _, owner = said.strip().partition(" ")
        # The attack happened as in the issue: the other account read the token and planted the file.
        assert planter.returncode == 0 and planted_path, complaint
        assert owner == str(pwd.getpwnam(attacker).pw_uid)
        assert victim.poll() is None, f"the victim was killed ({victim.returncode}): {out.stdout}{out.stderr}"
        # The check itself was not disturbed: both directions measured, and no server left running.
        assert out.returncode == exitcodes.OK, out.stdout + out.stderr
        bandwidth = [r for r in json.loads(report_path.read_text())["results"] if r["check"] == "bandwidth"]
        assert [r["status"] for r in bandwidth] == ["pass"], bandwidth
        assert "Gbit/s ->" in bandwidth[0]["detail"] and "Gbit/s <-" in bandwidth[0]["detail"]
        assert iperf3_servers(port + 20) == []
        return None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(planter.pid, signal.SIGKILL)
        planter.wait()
        victim.kill()
        victim.wait()
        if planted_path:
            Path(planted_path).unlink(missing_ok=True)
        for pid in iperf3_servers(port + 20):  # only when the test failed: leave nothing running
            os.kill(pid, signal.SIGKILL)


def test_stop_ends_the_server_it_started_and_only_that(tmp_path):
    # A round whose client never came: the server waits, and stop must end it, found by the pid and
    # start time the server step printed (as the playbook hands them over), not by any file.
    port = free_port()
    started = helper("server", "--round", "1", "--port", str(port), "--bind", "127.0.0.1")
    assert started["started"] is True and iperf3_servers(port), started
    # A pid that is not the server's (a root process the run did not start) is left alone, even
    # with the server's start time, and so is a process group.
    victim = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        server_start = str(started["start_time"])
        for pid in (victim.pid, -victim.pid):
            stopped = helper("stop", "--round", "1", "--pid", str(pid), "--start-time", server_start)
            assert stopped["stopped"] is False and victim.poll() is None
        stopped = helper("stop", "--round", "1", "--pid", str(started["pid"]), "--start-time", server_start)
        assert stopped["stopped"] is True
        assert iperf3_servers(port) == [], "the iperf3 server outlived its stop"
    finally:
        victim.kill()
        victim.wait()
        for pid in iperf3_servers(port):  # only when the test failed: leave nothing running
            os.kill(pid, signal.SIGKILL)


def test_a_server_that_cannot_listen_is_reported_not_started_with_the_cause():
    # `iperf3 -D` exits 0 before its daemon binds, so a busy port used to read as a started server.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = helper("server", "--round", "3", "--port", str(port), "--bind", "127.0.0.1")
    assert started["started"] is False and "pid" not in started
    assert "Address already in use" in started["error"] and started["round"] == 3
    time.sleep(0.2)
    assert iperf3_servers(port) == []


@pytest.mark.slow
def test_nodes_sharing_one_tmp_each_start_their_server(tmp_path):
    # Four nodes, two tests side by side in each round: the servers of one round used to share one
    # pidfile name, so the second refused to start and its pair failed.
    port = free_port()
    report_path = tmp_path / "report.json"
    out = preflight_bandwidth(tmp_path, port, report_path, nodes=4)
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr
    report = json.loads(report_path.read_text())
    assert [len(pairs) for pairs in report["bandwidth"]["rounds"]] == [2, 2, 2]
    pairs = [r for r in report["results"] if r["check"] == "bandwidth"]
    assert len(pairs) == 6 and all(r["status"] == "pass" for r in pairs), pairs
    assert iperf3_servers(port + 20) == []


@pytest.mark.slow
def test_preflight_names_why_the_iperf3_server_did_not_start(tmp_path):
    # The test port taken on both nodes' addresses (bound, not listening, so the client is refused
    # at once): the pair fails with the server's own words, not the client's "unable to connect".
    port = free_port()
    report_path = tmp_path / "report.json"
    with socket.socket() as taken_a, socket.socket() as taken_b:
        taken_a.bind(("127.0.0.1", port + 20))
        taken_b.bind(("127.0.0.2", port + 20))
        out = preflight_bandwidth(tmp_path, port, report_path)
    assert out.returncode == exitcodes.PREFLIGHT_FAILED, out.stdout + out.stderr
    (pair,) = [r for r in json.loads(report_path.read_text())["results"] if r["check"] == "bandwidth"]
    assert pair["status"] == "fail"
    server = pair["subject"].split(" <-> ")[1]
    assert pair["detail"].startswith(f"iperf3 test failed: {server}: the iperf3 server exited (1) before it")
    assert "Address already in use" in pair["detail"] and "Address already in use" in out.stdout
