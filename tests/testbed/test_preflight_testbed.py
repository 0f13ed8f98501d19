"""Preflight on the Molecule test bed (3 podman containers): passes a healthy bed with no warning, and
names host, cause and fix when one real thing is broken: the master port blocked, one worker's data
changed or SSH key gone, the NFS server stopped, chronyd stopped, a missing NCCL interface and a
duplicate node rank, a stale DeepSpeed build lock, one link shaped with `tc`; and a preflight
stopped in the middle leaves nothing running on the nodes.

Each fault is put in with `podman exec` (or an inventory copy) and taken out again in `finally`,
pass or fail: the bed is shared with the other test-bed tests and is never destroyed here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import exitcodes

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "molecule" / "default" / "inventory"
STATUS = Path("/tmp/clustertrain-testbed.status")
ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "scripts" / "testbed" / "containers.conf")}
HEAD, WORKER1, WORKER2 = "ct-head", "ct-worker1", "ct-worker2"
HOSTS = (HEAD, WORKER1, WORKER2)
#: The checks that need nothing but the probe pass (the DeepSpeed job takes minutes).
FAST = ("--skip", "deepspeed")
EXTENSIONS = "/var/cache/clustertrain/torch_extensions"

pytestmark = [
    pytest.mark.skipif(
        not (STATUS.exists() and STATUS.read_text().startswith("up")),
        reason="the Molecule test bed is not up (/tmp/clustertrain-testbed.status)",
    ),
]


def on(container: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["podman", "exec", container, *command],
        capture_output=True,
        text=True,
        env=ENV,
        check=check,
        timeout=120,
    )


def preflight(inventory: Path, report: Path, *args: str, timeout: int = 1800) -> tuple[int, str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "preflight", "-i", str(inventory), "--report", str(report), *args],
        cwd=REPO, capture_output=True, text=True, env=ENV, timeout=timeout,
    )  # fmt: skip
    data = json.loads(report.read_text()) if report.exists() else {}
    return out.returncode, out.stdout + out.stderr, data


def failures(report: dict) -> set[tuple[str, str]]:
    return {(r["check"], r["subject"]) for r in report["results"] if r["status"] == "fail"}


def by_key(report: dict) -> dict[tuple[str, str], dict]:
    return {(r["check"], r["subject"]): r for r in report["results"]}


def assert_fix(result: dict, host: str, *needles: str) -> None:
    """The user can act on it: the fix names the host and the command or variable."""
    assert host in result["fix"], result
    for needle in needles:
        assert needle in result["fix"], result


def inventory_copy(tmp_path: Path, host_vars: dict[str, str]) -> Path:
    """The bed's inventory with host_vars added (a fault that lives in the inventory)."""
    inventory = tmp_path / "inventory"
    shutil.copytree(INVENTORY, inventory, symlinks=False)
    (inventory / "host_vars").mkdir(exist_ok=True)
    for host, text in host_vars.items():
        (inventory / "host_vars" / f"{host}.yml").write_text("---\n" + text)
    return inventory


def wait_for(what: str, ready, bound_s: float = 300) -> None:
    """Revert helper: wait until the bed is back (`ready()` true), so the next test finds it healthy."""
    deadline = time.monotonic() + bound_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"the test bed did not get back: {what}")
        time.sleep(2)


def chrony_synchronised(host: str) -> bool:
    out = on(host, "chronyc", "-n", "tracking", check=False)
    return out.returncode == 0 and "Not synchronised" not in out.stdout and "00000000" not in out.stdout


def nfs_answers(host: str) -> bool:
    # As the training uid: the share is 2770, so root (squashed to nobody) may not list it.
    url = "nfs://10.89.42.10/var/tmp/clustertrain-testbed/shared?version=4&uid=2000&gid=2000"
    return on(host, "nfs-ls", url, check=False).returncode == 0


def remote_leftovers(host: str) -> str:
    """Processes on `host` that a preflight or its DeepSpeed job started (their environment says so)."""
    script = (
        "for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ 2>/dev/null | "
        "grep -qE '^(CLUSTERTRAIN_PREFLIGHT|CLUSTERTRAIN_LAUNCH_ID=preflight-deepspeed)' && "
        "echo ${p#/proc/} $(tr '\\0' ' ' < $p/cmdline); done; true"
    )
    return on(host, "sh", "-c", script).stdout.strip()


@pytest.mark.slow
def test_healthy_test_bed_passes_every_check_with_no_warning(tmp_path):
    started = time.monotonic()
    rc, output, report = preflight(INVENTORY, tmp_path / "report.json")
    wall = time.monotonic() - started
    assert rc == exitcodes.OK, output
    warnings = [(r["check"], r["subject"], r["detail"]) for r in report["results"] if r["status"] == "warn"]
    assert warnings == [], output
    statuses = {(r["check"], r["subject"]): r["status"] for r in report["results"]}
    assert statuses[("ssh", f"{WORKER1} -> {WORKER2}")] == "pass"
    assert len([k for k in statuses if k[0] == "ssh"]) == 6  # every ordered pair
    for check in ("interface", "clock", "nfs", "deepspeed_ops", "space", "shared_dir"):
        assert [statuses[(check, host)] for host in HOSTS] == ["pass"] * 3, (check, output)
    assert statuses[("topology", "cluster")] == "pass"
    assert statuses[("master_port", WORKER2)] == "pass"
    assert statuses[("ufw", HEAD)] == "pass"
    assert statuses[("deepspeed", HEAD)] == "pass"
    ops = by_key(report)[("deepspeed_ops", WORKER1)]
    assert f"built ahead in {EXTENSIONS}" in ops["detail"]  # trainer_env built them at provisioning
    assert "deepspeed: step" in output  # its phases were shown as they came
    bandwidth = report["bandwidth"]
    assert len(bandwidth["rounds"]) == 3 and all(len(r) == 1 for r in bandwidth["rounds"])
    assert all(bandwidth["matrix"][i][j] is not None for i in range(3) for j in range(3) if i != j)
    print(
        f"\nhealthy bed: probe pass {report['probe_duration_s']:.1f} s, whole preflight "
        f"{report['duration_s']:.1f} s (wall {wall:.1f} s)"
    )


def test_blocked_master_port_is_named(tmp_path):
    on(HEAD, "ufw", "insert", "1", "deny", "29500/tcp")
    try:
        rc, output, report = preflight(
            INVENTORY, tmp_path / "report.json", "--skip", "deepspeed", "bandwidth"
        )
    finally:
        on(HEAD, "ufw", "delete", "deny", "29500/tcp")
    assert rc == exitcodes.PREFLIGHT_FAILED, output
    assert failures(report) == {("master_port", WORKER1), ("master_port", WORKER2), ("ufw", HEAD)}, output
    results = by_key(report)
    assert "cannot connect to ct-head 10.89.42.10:29500" in results[("master_port", WORKER1)]["detail"]
    assert "29500/tcp" in results[("ufw", HEAD)]["detail"] and "DENY" in results[("ufw", HEAD)]["detail"]
    assert_fix(results[("master_port", WORKER1)], HEAD, "ufw allow")
    assert_fix(results[("ufw", HEAD)], HEAD, "ufw delete")


def test_changed_data_file_on_one_worker_is_named(tmp_path):
    data_path = "/var/tmp/preflight-test-data.txt"
    inventory = inventory_copy(tmp_path, {})
    (inventory / "group_vars" / "cluster" / "zz_preflight_test.yml").write_text(
        f"---\ncluster_data_path: {data_path}\n"
    )
    text = "the same training text on every node\n" * 200
    try:
        for host in HOSTS:
            on(host, "sh", "-c", f"printf %s '{text}' > {data_path} && chmod 0644 {data_path}")
        on(WORKER2, "sh", "-c", f"echo 'one edited line' >> {data_path}")
        checks = [
            "--skip",
            "deepspeed",
            "bandwidth",
            "ssh",
            "ufw",
            "master_port",
            "clock",
            "shared_dir",
            "nfs",
        ]
        rc, output, report = preflight(inventory, tmp_path / "report.json", *checks)
    finally:
        for host in HOSTS:
            on(host, "rm", "-f", data_path, check=False)
    assert rc == exitcodes.PREFLIGHT_FAILED, output
    assert failures(report) == {("data", WORKER2)}, output
    assert f"{data_path} differs" in output and "FAIL  data          ct-worker2" in output
    assert_fix(by_key(report)[("data", WORKER2)], WORKER2, "shared dir")


def test_missing_ssh_key_on_one_worker_is_named(tmp_path):
    home = on(WORKER1, "getent", "passwd", "trainer").stdout.split(":")[5]
    keys = f"{home}/.ssh/authorized_keys"
    on(WORKER1, "mv", keys, f"{keys}.preflight-test")
    try:
        rc, output, report = preflight(
            INVENTORY, tmp_path / "report.json", "--skip", "deepspeed", "bandwidth"
        )
    finally:
        on(WORKER1, "mv", f"{keys}.preflight-test", keys)
    assert rc == exitcodes.PREFLIGHT_FAILED, output
    assert failures(report) == {("ssh", f"{HEAD} -> {WORKER1}"), ("ssh", f"{WORKER2} -> {WORKER1}")}, output
    result = by_key(report)[("ssh", f"{HEAD} -> {WORKER1}")]
    assert "ct-worker1 refuses trainer's key from ct-head" in result["detail"]
    assert_fix(result, WORKER1, "authorized_keys")


def test_stopped_nfs_server_is_named_on_the_head_and_from_every_worker(tmp_path):
    on(HEAD, "systemctl", "stop", "nfs-ganesha")
    try:
        rc, output, report = preflight(INVENTORY, tmp_path / "report.json", *FAST, "bandwidth")
    finally:
        on(HEAD, "systemctl", "start", "nfs-ganesha")
        wait_for("ganesha answers again", lambda: nfs_answers(WORKER1))
    assert rc == exitcodes.PREFLIGHT_FAILED, output
    assert {("nfs", host) for host in HOSTS} <= failures(report), output
    results = by_key(report)
    assert "the NFS server nfs-ganesha is inactive on ct-head" in results[("nfs", HEAD)]["detail"]
    assert_fix(results[("nfs", HEAD)], HEAD, "systemctl restart nfs-ganesha")
    worker = results[("nfs", WORKER2)]
    assert "the NFS server on ct-head (10.89.42.10:2049) does not answer ct-worker2" in worker["detail"]
    assert_fix(worker, HEAD, "systemctl status nfs-ganesha")


def test_stopped_chronyd_is_named_though_the_clock_is_still_right(tmp_path):
    on(WORKER1, "systemctl", "stop", "chrony")
    try:
        rc, output, report = preflight(INVENTORY, tmp_path / "report.json", *FAST, "bandwidth")
    finally:
        on(WORKER1, "systemctl", "start", "chrony")
        wait_for("chronyd on ct-worker1 synchronised", lambda: chrony_synchronised(WORKER1))
    assert rc == exitcodes.PREFLIGHT_FAILED, output
    assert failures(report) == {("clock", WORKER1)}, output
    result = by_key(report)[("clock", WORKER1)]
    assert "chronyd is not running on ct-worker1" in result["detail"]
    assert abs(result["data"]["offset_s"]) < 1.0  # measured: fine today, nothing keeps it so
    assert_fix(result, WORKER1, "systemctl enable --now chrony")


def test_a_duplicate_rank_is_refused_before_any_host_and_a_missing_interface_named_in_the_probe_pass(
    tmp_path,
):
    # A duplicate rank lives in the inventory alone: the inventory rules (the same as plan's and
    # launch's) refuse it when it is loaded, naming both hosts and the fix; no host is contacted.
    (tmp_path / "duplicate").mkdir()
    duplicate = inventory_copy(
        tmp_path / "duplicate", {WORKER1: "cluster_node_rank: 1\n", WORKER2: "cluster_node_rank: 1\n"}
    )
    rc, output, report = preflight(duplicate, tmp_path / "duplicate-report.json")
    assert rc == exitcodes.CONFIG_ERROR, output
    refusal = f"host {WORKER2}: cluster_node_rank 1 is also the rank of {WORKER1}; fix: give each its own"
    assert refusal in output
    assert report == {}, "nothing written before the inventory is valid"
    # A missing interface is on the node: the probe pass names it, and the job is not started.
    (tmp_path / "interface").mkdir()
    inventory = inventory_copy(tmp_path / "interface", {WORKER1: "cluster_nccl_socket_ifname: eth9\n"})
    rc, output, report = preflight(inventory, tmp_path / "report.json", "--skip", "bandwidth")
    assert rc == exitcodes.PREFLIGHT_FAILED, output
    results = by_key(report)
    interface = results[("interface", WORKER1)]
    assert interface["status"] == "fail" and "NCCL_SOCKET_IFNAME=eth9" in interface["detail"]
    assert_fix(interface, WORKER1, "cluster_nccl_socket_ifname: =eth0")
    # The job would fail on it: it is not started (minutes saved, no hang).
    job = results[("deepspeed", "cluster")]
    assert job["status"] == "skip" and "interface (ct-worker1)" in job["detail"]


def test_stale_build_lock_is_named_and_the_deepspeed_job_not_started(tmp_path):
    lock = f"{EXTENSIONS}/deepspeed_shm_comm/lock"
    on(WORKER2, "runuser", "-u", "trainer", "--", "touch", lock)
    try:
        rc, output, report = preflight(INVENTORY, tmp_path / "report.json", "--skip", "bandwidth")
    finally:
        on(WORKER2, "rm", "-f", lock)
    assert rc == exitcodes.PREFLIGHT_FAILED, output
    assert failures(report) == {("deepspeed_ops", WORKER2)}, output
    result = by_key(report)[("deepspeed_ops", WORKER2)]
    assert f"stale build lock {lock}" in result["detail"]
    assert_fix(result, WORKER2, f"rm -rf {EXTENSIONS}/deepspeed_shm_comm", "--tags trainer_env")
    assert by_key(report)[("deepspeed", "cluster")]["status"] == "skip"


def test_one_slow_link_stands_out_from_the_others(tmp_path):
    """ct-worker2's egress shaped to 50 Mbit/s: both links from it are outliers, none to it."""
    on(WORKER2, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "50mbit", "burst", "32kbit",
       "latency", "400ms")  # fmt: skip
    try:
        rc, output, report = preflight(INVENTORY, tmp_path / "report.json", *FAST)
    finally:
        on(WORKER2, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
    assert rc == exitcodes.OK, output  # a slow link warns; it does not fail
    warned = {
        r["subject"]: r for r in report["results"] if r["check"] == "bandwidth" and r["status"] == "warn"
    }
    assert set(warned) == {f"{HEAD} <-> {WORKER2}", f"{WORKER1} <-> {WORKER2}"}, output
    for result in warned.values():
        assert (
            "ct-worker2 -> " in result["detail"] and "below the median of the other links" in result["detail"]
        )
        assert_fix(result, WORKER2, "tc qdisc show")
        assert "(measured twice: the faster of the two)" in result["detail"]  # slow both times
    assert report["bandwidth"]["matrix"][2][0] < 0.1  # ct-worker2 -> ct-head, Gbit/s
    retested = sorted(sorted(pair) for pair in report["bandwidth"]["retested"])
    assert retested == [sorted([HEAD, WORKER2]), sorted([WORKER1, WORKER2])], output


def test_a_link_slow_only_in_the_first_measurement_does_not_warn(tmp_path):
    """ct-worker2's egress shaped during the first iperf3 rounds only (a busy host, a burst of other
    traffic): its pairs are measured again, fast the second time, and nothing warns."""
    on(WORKER2, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "50mbit", "burst", "32kbit",
       "latency", "400ms")  # fmt: skip
    command = [sys.executable, "-m", "trainer", "preflight", "-i", str(INVENTORY),
               "--report", str(tmp_path / "report.json"), *FAST]  # fmt: skip
    child = subprocess.Popen(
        command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    try:
        for line in child.stdout:
            seen.append(line)
            # Printed before the second ansible-playbook starts; its iperf3 runs after the playbook's
            # start and two tasks on every node, far longer than this one podman exec.
            if "iperf3 again for" in line:
                on(WORKER2, "tc", "qdisc", "del", "dev", "eth0", "root")
                break
        rest, _ = child.communicate(timeout=900)
    finally:
        on(WORKER2, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if child.poll() is None:
            child.kill()
    output = "".join(seen) + rest
    assert child.returncode == exitcodes.OK, output
    report = json.loads((tmp_path / "report.json").read_text())
    assert sorted(sorted(pair) for pair in report["bandwidth"]["retested"]) == [
        sorted([HEAD, WORKER2]),
        sorted([WORKER1, WORKER2]),
    ], output
    bandwidth = {r["subject"]: r for r in report["results"] if r["check"] == "bandwidth"}
    assert bandwidth[f"{HEAD} <-> {WORKER1}"]["status"] == "pass", output  # measured once
    assert "fail" not in [r["status"] for r in bandwidth.values()], output
    # Every direction of the retested pairs is judged on the unshaped second test: 10x the 50 Mbit/s.
    matrix = report["bandwidth"]["matrix"]
    assert all(matrix[i][j] > 0.5 for i, j in ((2, 0), (2, 1), (0, 2), (1, 2))), output
    # On this 2-core bed under CI's load an unshaped link measures anywhere from about 3 to 22 Gbit/s,
    # so a retested direction can still land 6x below the median and warn, as a real link that slow
    # twice should (once: ct-head -> ct-worker2 2.9 Gbit/s against 18.1). Such a warning is about the
    # second, unshaped test, never the shaped first one.
    for result in bandwidth.values():
        if result["status"] == "warn":
            assert "measured twice: the faster of the two" in result["detail"], output


@pytest.mark.slow
def test_preflight_stopped_during_its_deepspeed_job_leaves_nothing_on_the_nodes(tmp_path):
    command = [sys.executable, "-m", "trainer", "preflight", "-i", str(INVENTORY),
               "--report", str(tmp_path / "report.json"), "--skip", "bandwidth"]  # fmt: skip
    child = subprocess.Popen(
        command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    try:
        for line in child.stdout:  # stop it once the job runs on every node
            seen.append(line)
            # The first phase line seen after the start: phases are shown as a poll finds them, and
            # with the ops prebuilt on a quiet machine the job can be in setup by the first poll.
            if any(f"deepspeed: {phase}" in line for phase in ("rendezvous", "compile", "setup", "step 1")):
                break
        child.send_signal(signal.SIGTERM)
        rest, _ = child.communicate(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
    output = "".join(seen) + rest
    assert child.returncode == 130, output
    for host in HOSTS:
        assert remote_leftovers(host) == "", host
        locks = on(host, "sh", "-c", f"find {EXTENSIONS} /home/trainer/.cache -name lock 2>/dev/null; true")
        assert locks.stdout.strip() == "", host
