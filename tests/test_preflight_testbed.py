"""Preflight on the Molecule test bed (3 podman containers): passes when healthy, and names the cause
when the master port is blocked, one worker's data differs, or one worker lost the SSH key.

Each fault is put in with `podman exec` and taken out again in `finally`, pass or fail: the bed is
shared with the other test-bed tests and is never destroyed here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import exitcodes

REPO = Path(__file__).resolve().parents[1]
INVENTORY = REPO / "molecule" / "default" / "inventory"
STATUS = Path("/tmp/clustertrain-testbed.status")
ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "scripts" / "testbed" / "containers.conf")}
HEAD, WORKER1, WORKER2 = "ct-head", "ct-worker1", "ct-worker2"

pytestmark = [
    pytest.mark.testbed,
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
        timeout=60,
    )


def preflight(inventory: Path, report: Path, *args: str, timeout: int = 900) -> tuple[int, str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "preflight", "-i", str(inventory), "--report", str(report), *args],
        cwd=REPO, capture_output=True, text=True, env=ENV, timeout=timeout,
    )  # fmt: skip
    data = json.loads(report.read_text()) if report.exists() else {}
    return out.returncode, out.stdout + out.stderr, data


def failures(report: dict) -> set[tuple[str, str]]:
    return {(r["check"], r["subject"]) for r in report["results"] if r["status"] == "fail"}


@pytest.mark.slow
def test_healthy_test_bed_passes_every_check(tmp_path):
    rc, output, report = preflight(INVENTORY, tmp_path / "report.json")
    assert rc == exitcodes.OK, output
    statuses = {(r["check"], r["subject"]): r["status"] for r in report["results"]}
    assert statuses[("ssh", f"{WORKER1} -> {WORKER2}")] == "pass"
    assert len([k for k in statuses if k[0] == "ssh"]) == 6  # every ordered pair
    assert statuses[("master_port", WORKER2)] == "pass"
    assert statuses[("ufw", HEAD)] == "pass"
    assert statuses[("deepspeed", HEAD)] == "pass"
    bandwidth = report["bandwidth"]
    assert len(bandwidth["rounds"]) == 3 and all(len(r) == 1 for r in bandwidth["rounds"])
    assert all(bandwidth["matrix"][i][j] is not None for i in range(3) for j in range(3) if i != j)


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
    by_key = {(r["check"], r["subject"]): r for r in report["results"]}
    assert "cannot connect to ct-head 10.89.42.10:29500" in by_key[("master_port", WORKER1)]["detail"]
    assert "29500/tcp" in by_key[("ufw", HEAD)]["detail"] and "DENY" in by_key[("ufw", HEAD)]["detail"]
    assert "ufw allow" in by_key[("master_port", WORKER1)]["fix"]


def test_changed_data_file_on_one_worker_is_named(tmp_path):
    # The same inventory with a data file instead of the bundled text.
    inventory = tmp_path / "inventory"
    shutil.copytree(INVENTORY, inventory, symlinks=False)
    data_path = "/var/tmp/preflight-test-data.txt"
    (inventory / "group_vars" / "cluster" / "zz_preflight_test.yml").write_text(
        f"---\ncluster_data_path: {data_path}\n"
    )
    text = "the same training text on every node\n" * 200
    try:
        for host in (HEAD, WORKER1, WORKER2):
            on(host, "sh", "-c", f"printf %s '{text}' > {data_path} && chmod 0644 {data_path}")
        on(WORKER2, "sh", "-c", f"echo 'one edited line' >> {data_path}")
        checks = ["--skip", "deepspeed", "bandwidth", "ssh", "ufw", "master_port", "clock", "shared_dir"]
        rc, output, report = preflight(inventory, tmp_path / "report.json", *checks)
    finally:
        for host in (HEAD, WORKER1, WORKER2):
            on(host, "rm", "-f", data_path, check=False)
    assert rc == exitcodes.PREFLIGHT_FAILED, output
    assert failures(report) == {("data", WORKER2)}, output
    assert f"{data_path} differs" in output and "FAIL  data         ct-worker2" in output


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
    by_key = {(r["check"], r["subject"]): r for r in report["results"]}
    assert (
        "ct-worker1 refuses trainer's key from ct-head" in by_key[("ssh", f"{HEAD} -> {WORKER1}")]["detail"]
    )
    assert "authorized_keys on ct-worker1" in by_key[("ssh", f"{HEAD} -> {WORKER1}")]["fix"]
