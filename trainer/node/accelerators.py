"""Does this node's torch see the GPUs the inventory says it has?

A GPU node whose torch cannot use CUDA (the CPU wheel, a driver older than the wheel's CUDA, a
wrong CUDA_VISIBLE_DEVICES) would otherwise start GPUS_PER_NODE gloo processes on the CPU and
train, silently, a hundred times slower. The launcher passes the inventory's count as
CLUSTER_NODE_GPUS; a run started by hand without it is not checked.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping


class AcceleratorMismatch(Exception):
    """torch sees fewer GPUs than this node is meant to use; the message names the fix."""


def driver_version() -> str:
    """The NVIDIA driver's version, or why there is none (nvidia-smi, which ships with the driver)."""
    try:
        run = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except FileNotFoundError:
        return "no NVIDIA driver (nvidia-smi not found)"
    except subprocess.TimeoutExpired:
        return "unknown (nvidia-smi did not answer in 20 s)"
    lines = run.stdout.split()
    return lines[0] if run.returncode == 0 and lines else f"unknown (nvidia-smi exited {run.returncode})"


def torch_build() -> str:
    import torch

    cuda = torch.version.cuda
    return f"torch {torch.__version__} ({f'CUDA {cuda} build' if cuda else 'CPU build'})"


def check_visible_gpus(environ: Mapping[str, str] = os.environ) -> None:
    """Raise AcceleratorMismatch when the inventory gives this node GPUs and torch sees too few."""
    expected = int(environ.get("CLUSTER_NODE_GPUS", "0") or 0)
    if expected <= 0:
        return
    import torch

    # Processes on this node: torchrun's LOCAL_WORLD_SIZE, else the launch's GPUS_PER_NODE.
    needed = int(environ.get("LOCAL_WORLD_SIZE") or environ.get("GPUS_PER_NODE") or expected)
    visible = torch.cuda.device_count()
    if visible >= min(needed, expected):
        return
    masked = environ.get("CUDA_VISIBLE_DEVICES")
    raise AcceleratorMismatch(
        f"host {socket.gethostname()}: the inventory gives this node {expected} GPU(s) and the run "
        f"needs {needed} per node, but torch sees {visible}. {torch_build()}; NVIDIA driver "
        f"{driver_version()}"
        + (f"; CUDA_VISIBLE_DEVICES={masked!r}" if masked is not None else "")
        + ". Fix: install the CUDA build of torch that matches the driver (training_torch_index_url_cuda, "
        "then `ansible-playbook site.yml --tags trainer_env`), update the driver, or correct "
        "cluster_accelerators in the inventory. Nothing was started."
    )
