"""`trainer launch` names the host and GPU of a GPU fault: a copy of inventory/local (this machine,
2 processes; only the master port changed so parallel tests do not collide), a fault injected on
GPU 1 through the documented fault file, real ansible-runner, torchrun and trainer."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def local_inventory(tmp_path) -> Path:
    # inventory/local renders training_venv and cluster_shared_dir from its own location
    # (<root>/.venv, <root>/output): the copy's root links the venv and gets its own output dir.
    root = tmp_path / "root"
    shutil.copytree(REPO / "inventory" / "local", root / "inventory" / "local")
    (root / ".venv").symlink_to(REPO / ".venv")
    network = root / "inventory" / "local" / "group_vars" / "cluster" / "network.yml"
    text = network.read_text()
    assert "cluster_master_port: 29500" in text
    network.write_text(text.replace("cluster_master_port: 29500", f"cluster_master_port: {free_port()}"))
    return root / "inventory" / "local"


def test_launch_reports_the_host_and_gpu_of_a_fault(local_inventory, tmp_path):
    faults = tmp_path / "faults.jsonl"
    faults.write_text(json.dumps({"step": 3, "gpu": 1, "metrics": {"ecc_uncorrectable": 3}}) + "\n")
    sets = [
        "train.max_steps=40",
        "train.warmup_steps=1",
        "train.log_every=5",
        "checkpoint.save_steps=0",
        f"health.fault_source=file:{faults}",
        "health.poll_interval_s=0.05",
    ]
    cmd = [sys.executable, "-m", "trainer", "launch", "-i", str(local_inventory), "--run-name", "gpu-fault"]
    cmd += ["--poll-interval", "1"] + [arg for item in sets for arg in ("--set", item)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 75, out
    host = socket.gethostname()
    # The launcher's own summary line (not the trainer's GPU_FAULT host=... line it parsed).
    [summary] = [line for line in out.splitlines() if "GPU_FAULT on " in line]
    for fact in (host, "GPU 1", f"GPU-test-{host}-1", "rank 1", "ecc_uncorrectable=3"):
        assert fact in summary, f"{fact!r} missing from: {summary}"
    assert not (local_inventory.parents[1] / "output" / "runs" / "gpu-fault" / "summary.json").exists()
