"""A node the inventory gives GPUs, whose torch sees none, refuses to train (exit 2) and says why.

Real runs of `trainer train` on this machine, whose torch is the CPU build and which has no NVIDIA
driver: exactly the state of a GPU node that got the wrong wheel.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from trainer import exitcodes

TRAIN = [sys.executable, "-m", "trainer", "train", "--set", "train.max_steps=2", "--set", "output_dir={out}"]


def run_trainer(tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    command = [part.format(out=tmp_path / "out") for part in TRAIN]
    clean = {k: v for k, v in os.environ.items() if k not in ("CLUSTER_NODE_GPUS", "GPUS_PER_NODE")}
    return subprocess.run(command, capture_output=True, text=True, env={**clean, **env}, timeout=300)


def test_gpu_node_with_cpu_torch_refuses_with_the_fix(tmp_path) -> None:
    run = run_trainer(tmp_path, CLUSTER_NODE_GPUS="8", GPUS_PER_NODE="8", CUDA_VISIBLE_DEVICES="")
    assert run.returncode == exitcodes.CONFIG_ERROR, run.stderr
    message = run.stderr
    assert f"host {socket.gethostname()}" in message
    assert "gives this node 8 GPU(s)" in message and "torch sees 0" in message
    assert "CPU build" in message  # the torch build is named
    assert "NVIDIA driver" in message  # and the driver (here: none)
    assert "CUDA_VISIBLE_DEVICES=''" in message
    assert "training_torch_index_url_cuda" in message  # the fix
    assert not (tmp_path / "out" / "run.json").exists()  # nothing started


def test_cpu_node_is_not_checked(tmp_path) -> None:
    run = run_trainer(tmp_path, CLUSTER_NODE_GPUS="0", GPUS_PER_NODE="1")
    assert run.returncode == exitcodes.OK, run.stderr[-2000:]
    assert (tmp_path / "out" / "run.json").exists()
